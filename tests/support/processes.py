"""Trainings the integration tests start: the demo, a script, a command line, a job of ranks,
forked from the test worker's fork server (``MEMTUI_TEST_FORK=0``: as subprocesses)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from memtui.demo.launcher import demo_command_line
from tests.support.clock import Deadline, patience
from tests.support.forkserver import ForkedDemo, ForkedJob, ForkServer

ROOT = Path(__file__).resolve().parents[2]

LIGHT = ("--seq-len", "16", "--width", "32", "--layers", "1", "--vocab", "64")
"""A demo model a third of the default's compute per step, for tests of plumbing (control,
boundaries, registry, faults) rather than of memory or advice."""
PLUMBING = (*LIGHT, "--slow-data-ms", "1")
"""The light model with its loader sleeping a little per sample: about as many steps per second
as the default demo at a quarter of its CPU (tests that need a run alive and stepping)."""


def wait_for(
    predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``
    seconds of an idle machine (stretched by the load: ``clock.Deadline``)."""
    deadline = Deadline(timeout)
    while not deadline.passed():
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {deadline.waited} waiting for {what or predicate}")


@dataclass
class DemoRun:
    """The demo training running in a subprocess."""

    proc: subprocess.Popen[str] | ForkedDemo | ForkedJob
    out: Path
    log: Path
    run_id: str = ""
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        """Everything the demo printed so far."""
        return self.log.read_text() if self.log.exists() else ""

    def wait_exit(self, timeout: float = 120.0) -> int:
        """Wait for the training to finish (``timeout``: seconds of an idle machine, stretched
        by the load now); return its exit status."""
        return self.proc.wait(patience(timeout))

    def stop(self) -> None:
        """Terminate the training if it still runs."""
        stop_all([self])


def stop_all(runs: list[DemoRun]) -> None:
    """Terminate every training still running, all at once, then wait for each (a demo takes a
    second or two to end: one after the other, a test of three demos waited for each in turn)."""
    live = [run for run in runs if run.proc.poll() is None]
    for run in live:
        run.proc.terminate()
    deadline = time.monotonic() + patience(30)
    for run in live:
        try:
            run.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait(10)


_FORK_SERVER: list[ForkServer] = []
"""This test worker's fork server, once started."""


def launch_demo(
    argv: list[str], env: dict[str, str], log: Path, ranks: int = 1, fork: bool = True
) -> subprocess.Popen[str] | ForkedDemo | ForkedJob:
    """Start the demo training with ``argv``, its output to ``log``: forked from this worker's
    fork server (several ranks: each forked, as ``launch_ranks``; ``MEMTUI_TEST_FORK=0`` turns
    it off), else as a subprocess (under torchrun with several ranks)."""
    if fork and forking():
        if ranks > 1:
            return launch_ranks(argv, env, ROOT, log, ranks)
        log.touch()
        return fork_server().start(argv, env, ROOT, log)
    return logged_subprocess(demo_command_line(argv, ranks), env, ROOT, log)


def launch_script(
    script: Path, argv: list[str], env: dict[str, str], cwd: Path, log: Path
) -> subprocess.Popen[str] | ForkedDemo:
    """``python SCRIPT ARGV`` in ``cwd``, its output to ``log``: forked from this worker's fork
    server (``MEMTUI_TEST_FORK=0`` turns it off), else as a subprocess."""
    if forking():
        log.touch()
        return fork_server().start(argv, env, cwd, log, path=str(script))
    return logged_subprocess([sys.executable, str(script), *argv], env, cwd, log)


def logged_subprocess(
    command: list[str], env: dict[str, str], cwd: Path, log: Path
) -> subprocess.Popen[str]:
    """Start ``command`` with ``env`` in ``cwd``, its output (stdout and stderr) to ``log``."""
    with open(log, "w") as handle:
        return subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
        )


def launch_memtui(
    argv: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[str] | ForkedDemo:
    """The ``memtui ARGV`` command line (``python -m memtui``), its output to ``log``: forked
    from this worker's fork server (``memtui demo --no-tui`` trains in the command's own process,
    which has then imported torch already; ``MEMTUI_TEST_FORK=0`` turns it off), else as a
    subprocess."""
    if forking():
        log.touch()
        return fork_server().start(argv, env, ROOT, log, module="memtui")
    return logged_subprocess([sys.executable, "-m", "memtui", *argv], env, ROOT, log)


def launch_ranks(
    argv: list[str], env: dict[str, str], cwd: Path, log: Path, ranks: int, script: str = ""
) -> subprocess.Popen[str] | ForkedJob:
    """The ``ranks`` processes of one job (``python -m memtui.demo ARGV``, or ``python SCRIPT
    ARGV`` in ``cwd``), their output to ``log``: each forked from this worker's fork server with
    the environment torchrun gives its ranks (rank 0 hosts the job's store; a job costs its
    training, not a launcher and an import of torch per rank), or under torchrun itself with
    ``MEMTUI_TEST_FORK=0``."""
    if not forking():
        target = [script] if script else ["-m", "memtui.demo"]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return logged_subprocess(
            [*launcher, f"--nproc_per_node={ranks}", *target, *argv], env, cwd, log
        )
    log.touch()
    port = str(free_port())
    return ForkedJob(
        [
            fork_server().start(
                argv,
                {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                 "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                cwd,
                log,
                path=script,
            )
            for rank in range(ranks)
        ]
    )  # fmt: skip


def run_ranks(
    script: Path, env: dict[str, str], cwd: Path, log: Path, ranks: int = 2, timeout: float = 120.0
) -> tuple[int, str]:
    """Run a job of ``ranks`` ranks of ``python SCRIPT`` to its end (``launch_ranks``): its exit
    status and output (``subprocess.TimeoutExpired`` after ``timeout`` seconds, the job stopped)."""
    job = launch_ranks([], env, cwd, log, ranks, script=str(script))
    try:
        code = job.wait(patience(timeout))
    finally:
        stop_all([DemoRun(job, log.parent, log)])
    return code, log.read_text()


def free_port() -> int:
    """A TCP port free on the loopback address now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def forking() -> bool:
    """Whether trainings start from the fork server (``MEMTUI_TEST_FORK=0``: as subprocesses)."""
    return os.environ.get("MEMTUI_TEST_FORK", "1") != "0"


def fork_server() -> ForkServer:
    """This test worker's fork server, started on first use."""
    if not _FORK_SERVER:
        _FORK_SERVER.append(ForkServer())
    return _FORK_SERVER[0]


def fork_servers() -> list[ForkServer]:
    """The fork servers this test worker started (none or one)."""
    return list(_FORK_SERVER)


def close_fork_servers() -> None:
    """Stop this worker's fork server (and any training it still runs)."""
    while _FORK_SERVER:
        _FORK_SERVER.pop().close()


@dataclass
class SharedDemo:
    """A demo training shared by the tests of one module, in a runtime directory of its own."""

    run: DemoRun
    env: dict[str, str]
    """``MEMTUI_RUNTIME_DIR`` and ``XDG_STATE_HOME`` of the shared run."""

    def adopt(self, monkeypatch: pytest.MonkeyPatch) -> DemoRun:
        """Point this test's ``memtui`` calls (in process and in subprocesses) at the run."""
        for name, value in self.env.items():
            monkeypatch.setenv(name, value)
        return self.run


@contextlib.contextmanager
def shared_demo(
    *args: str, ranks: int = 1, extra_env: dict[str, str] | None = None
) -> Iterator[SharedDemo]:
    """Start a demo training for a module's tests (one start instead of one per test: a start
    costs about 7 s of CPU, most of it importing torch), with ``extra_env`` in its environment;
    stopped when the module is done."""
    base = Path(tempfile.mkdtemp(prefix="mts", dir="/tmp"))  # ipc paths must stay short
    env = {"MEMTUI_RUNTIME_DIR": str(base / "rt"), "XDG_STATE_HOME": str(base / "state")}
    env |= extra_env or {}
    out = base / "out"
    out.mkdir()
    log = out / "stdout.log"
    proc = launch_demo(
        ["--out", str(out), "--progress-every", "1", *args],
        dict(os.environ, PYTHONUNBUFFERED="1", **env),
        log,
        ranks,
    )
    run = DemoRun(proc, out, log)
    try:
        run.run_id = demo_run_id(log, proc)
        yield SharedDemo(run, env)
    finally:
        stop_all([run])
        shutil.rmtree(base, ignore_errors=True)


def demo_run_id(
    log: Path, proc: subprocess.Popen[Any] | ForkedDemo | ForkedJob, timeout: float = 60.0
) -> str:
    """Wait for the ``run <id>`` line a demo prints to ``log``; fail the test if it exits first."""

    def found() -> str | None:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if line.startswith("run "):
                return line.split()[1]
        if proc.poll() is not None:
            pytest.fail(f"the demo exited early:\n{text}")
        return None

    return str(wait_for(found, timeout, what="the demo's run id"))
