"""Start the demo training by forking a process that has already imported torch.

A fresh ``python -m memtui.demo`` spends about 7 s of CPU before its first step (importing
torch, then torch._dynamo, which every torch optimizer imports on first use), most of a short
test's cost: the suite started ~30 of them. The fork server pays that once per test worker; each
demo is then a real process running the real ``memtui.demo`` module (its own pid, environment,
working directory, output file, signals, sockets and exit status, its hook installed after the
fork), as ``python -m memtui.demo`` would run it. Tests that assert memory numbers start the
demo with ``subprocess`` instead (a forked child shares its parent's pages until it writes them).

The server reads one JSON request per line on stdin and answers on stdout: ``{"pid": N}`` for a
start, ``{"exit": N, "code": C}`` when a child ends (C as ``Popen.returncode``: -signal when
killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class ForkedDemo:
    """A demo started by the fork server, with the part of ``subprocess.Popen`` tests use."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status if the demo ended, else None."""
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the demo to end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        if self.returncode is None:
            code = self.server.exit_code(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the demo (nothing if it has ended)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM, as ``Popen.terminate``."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, as ``Popen.kill``."""
        self.send_signal(signal.SIGKILL)


class ForkedJob:
    """The ranks of one job, each forked with the environment a launcher gives its ranks, with the
    part of ``subprocess.Popen`` tests use (``pid``: rank 0's; the job runs while a rank runs, and
    ends with the first failing rank's status). Unlike torchrun, nothing stops the other ranks
    when one dies."""

    def __init__(self, ranks: list[ForkedDemo]) -> None:
        self.ranks = ranks
        self.pid = ranks[0].pid
        self.args = ranks[0].args

    def poll(self) -> int | None:
        """The job's exit status if every rank ended, else None."""
        codes = [rank.poll() for rank in self.ranks]
        if None in codes:
            return None
        return next((code for code in codes if code), 0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every rank to end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank in self.ranks:
            rank.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return next((rank.returncode for rank in self.ranks if rank.returncode), 0)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every rank still running."""
        for rank in self.ranks:
            rank.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM to every rank."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to every rank."""
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: one server process, the exit statuses it reports."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-u", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self.children_cpu_s = 0.0
        """CPU seconds of the children that have ended (the suite's CPU log adds it)."""
        ready = self._stdout.readline()
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"the fork server did not start: {ready!r}")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._stdout:
            message = json.loads(line)
            with self._changed:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                    self.children_cpu_s += message["cpu"]
                else:
                    self._started.append(message["pid"])
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        log: Path,
        path: str = "",
        module: str = "memtui.demo",
    ) -> ForkedDemo:
        """Fork ``python -m MODULE ARGV`` (or ``python PATH ARGV``) with ``env`` in ``cwd``, its
        output to ``log``."""
        request = {
            "argv": argv,
            "env": env,
            "cwd": str(cwd),
            "log": str(log),
            "path": path,
            "module": module,
        }
        with self._lock, self._changed:
            seen = len(self._started)
            self._stdin.write(json.dumps(request) + "\n")
            self._stdin.flush()
            if not self._changed.wait_for(lambda: len(self._started) > seen, 30):
                raise RuntimeError("the fork server did not answer")
            pid = self._started[seen]
        command = [path] if path else ["-m", module]
        return ForkedDemo(self, pid, [sys.executable, *command, *argv])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit status once reported, waiting up to ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the server; any child still running is killed."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------------------- the server


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m memtui.demo ARGV`` and never return."""
    code: Any = 0
    try:
        os.setpgid(0, 0)  # its own process group, as a process a test starts is signalled alone
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import runpy

        if request.get("path"):  # python PATH ARGV
            sys.argv = [request["path"], *request["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["path"]))
            runpy.run_path(request["path"], run_name="__main__")
        else:  # python -m MODULE ARGV (alter_sys: argv[0] becomes the module's file)
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as done:
        code = done.code
    except BaseException:  # as the interpreter: the exception kept as the last one, the
        kind, error, trace = sys.exc_info()  # excepthook (the hook may have set it), 1
        sys.last_type, sys.last_value, sys.last_traceback = kind, error, trace
        sys.excepthook(kind, error, trace)  # type: ignore[arg-type]
        code = 1
    finally:
        import atexit

        threading._shutdown()  # as at a normal interpreter exit: join the non-daemon threads
        atexit._run_exitfuncs()  # then the exit functions (the hook's own cleanup)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        os._exit(code)


def _serve() -> None:
    """Import what every demo imports, then fork one child per request."""
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # imports torch._dynamo
    import memtui.demo.train
    import memtui.hooks  # noqa: F401

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    children: set[int] = set()
    stdin = sys.stdin.fileno()
    buffer = b""
    open_input = True
    while open_input or children:
        readable = []
        if open_input:
            readable, _, _ = select.select([stdin], [], [], 0.05)
        else:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            select.select([], [], [], 0.05)
        if readable:
            chunk = os.read(stdin, 65536)
            if not chunk:
                open_input = False
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                out.write(json.dumps({"pid": pid}) + "\n")
                out.flush()
        while children:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            code, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
            out.write(json.dumps({"exit": pid, "code": code, "cpu": cpu}) + "\n")
            out.flush()


if __name__ == "__main__":
    _serve()
