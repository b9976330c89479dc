"""Starting the demo training for ``memtui demo``: in the foreground (``--no-tui``) or in a
subprocess with the viewer attached to its run, found in the registry by its state directory.

Nothing here exits the process: a failure is a :class:`DemoFailed` with its message, which the
command says.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from memtui.core.stats import one_line
from memtui.storage import ownfiles

REGISTER_TIMEOUT_S = 60.0
"""How long the demo training has to register its run (it imports torch first)."""


class DemoFailed(RuntimeError):
    """The demo could not start, or its training ended before it registered."""


NO_NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"
"""A ``PYTHONWARNINGS`` filter for torch's warning at import where NumPy is not installed: the
demo's processes (torchrun's launcher too) need no NumPy, and it was the demo's first line."""


def quiet_numpy_warning(filters: str) -> str:
    """``PYTHONWARNINGS`` for the demo's processes: the user's filters, and torch's NumPy warning
    left out (the user's own filters come last and win: a later filter takes precedence)."""
    return ",".join(f for f in (NO_NUMPY_WARNING, filters) if f)


def run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` in the foreground; SIGTERM and SIGHUP sent to us reach it too.

    torchrun passes them on to its ranks, so stopping ``memtui demo --ranks N --no-tui`` stops
    the whole job instead of leaving the ranks running.
    """
    import signal

    proc = subprocess.Popen(command)

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to the child too: wait for it
            continue


SAFE_PATH = sys.version_info >= (3, 11)
"""Whether this Python keeps the working directory off ``sys.path`` when asked (``-P``,
``PYTHONSAFEPATH``)."""
RUN_MODULE = (
    "import runpy, sys; del sys.path[0]; sys.argv.pop(0); "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)
"""Where ``-P`` is missing: ``python -c RUN_MODULE MODULE ARGS`` runs ``MODULE`` as ``-m`` does,
the working directory taken off ``sys.path`` before anything is imported."""


def module_command(module: str, args: list[str]) -> list[str]:
    """``python -m MODULE ARGS`` with the working directory kept off the module search path:
    a ``torch.py`` or ``yaml.py`` another account left in the directory the command is run from
    is never imported."""
    if SAFE_PATH:
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", RUN_MODULE, module, *args]


def demo_environment() -> dict[str, str]:
    """What the demo's processes add to the environment: ``PYTHONSAFEPATH`` for the interpreters
    they start themselves (torchrun's ranks), which then keep the working directory off their
    module search path too."""
    return {"PYTHONSAFEPATH": "1"} if SAFE_PATH else {}


def demo_command_line(argv: list[str], ranks: int = 1) -> list[str]:
    """The command that runs the demo training, under torchrun when ``ranks`` > 1; no process of
    it imports a module from the working directory (``module_command``, ``demo_environment``)."""
    if ranks == 1:
        return module_command("memtui.demo", argv)
    launch = ["--standalone", f"--nproc_per_node={ranks}"]
    if SAFE_PATH:  # the ranks run `python -u -m memtui.demo`, with PYTHONSAFEPATH from the demo
        return module_command("torch.distributed.run", [*launch, "-m", "memtui.demo", *argv])
    rank = [sys.executable, "-c", RUN_MODULE, "memtui.demo", *argv]
    return module_command("torch.distributed.run", [*launch, "--no-python", *rank])


def run_with_viewer(command: list[str], out: Path) -> int:
    """Start the demo training in a subprocess and attach the viewer to its run (its output goes
    to ``demo.log`` in ``out``), saying on stderr what happens before the viewer shows and after
    it closes; the exit status: non-zero if the training died."""
    try:
        from memtui.tui.app import run_app
    except ImportError:
        raise DemoFailed("the viewer is not available in this build; use --no-tui") from None
    log_path = out / "demo.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **demo_environment())
    try:
        out_dir(out)
        log = open(ownfiles.open_write(log_path), "wb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise DemoFailed(one_line(exc)) from None
    say(f"starting the demo training (its output: {log_path})...")
    with log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        say("waiting for the run to register (the training imports torch first)...")
        run_id = wait_for_run(out, proc, log_path)
        say(f"attaching to run {run_id}...")
        try:
            code = run_app(run_id, demo_process=proc)
            died = f"exit status {code}" if code else ""
        except Exception as exc:  # the viewer's failure, not the training's: it goes on
            code, died = 1, f"{type(exc).__name__}: {exc}"
        if died and proc.poll() is None:  # only a normal quit (q) stops the demo's training
            viewer_died(died, run_id, log_path)
            proc.wait()  # until the training ends; Ctrl-C stops it (below), as before
        training = proc.poll()
        if training:  # it ended on its own, with an error or killed: the demo failed
            say(f"the demo training died ({exit_words(training)}); see {log_path}")
            code = code or (training if training > 0 else 128 - training)  # as a shell says it
    finally:
        if proc.poll() is None:
            say("stopping the demo training...")
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return code


def out_dir(out: Path) -> Path:
    """The demo's checkpoint and state directory, created 0700 when missing; refuse (an OSError
    in one line) a symbolic link another account owns there, or what is not a directory: every
    file the demo writes there is then the user's own (``memtui.storage.ownfiles``)."""
    try:
        info = os.lstat(out)
    except FileNotFoundError:
        os.makedirs(out, 0o700, exist_ok=True)
        info = os.lstat(out)
    if stat.S_ISLNK(info.st_mode) and info.st_uid not in (os.geteuid(), 0):
        raise ownfiles.UnsafeFile(
            f"{out} is a symbolic link owned by {ownfiles.user_name(info.st_uid)}, not by you: "
            "refused (give the demo an --out DIR of your own)"
        )
    if not os.path.isdir(out):
        raise ownfiles.UnsafeFile(f"{out} is not a directory: refused")
    return out


def wait_for_run(
    out: Path, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = REGISTER_TIMEOUT_S
) -> str:
    """The run id of the demo training writing to ``out``, once it registered (the registry's
    run whose state directory it is: the demo installs with ``state_dir=out``, on rank 0 too)."""
    from memtui.storage import registry

    wanted = out.resolve()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            records = registry.list_runs(clean=False)
        except registry.RegistryError as exc:  # the viewer could not reach the run there
            raise DemoFailed(str(exc)) from None
        for record in records:
            if record.state_dir and Path(record.state_dir).resolve() == wanted:
                return record.run
        if proc.poll() is not None:
            raise DemoFailed(f"the demo training exited early; see {log_path}")
        time.sleep(0.1)
    raise DemoFailed(f"the demo training did not start within {timeout:.0f} s; see {log_path}")


def say(message: str) -> None:
    """One line on stderr about what ``memtui demo`` is doing."""
    print(f"memtui demo: {message}", file=sys.stderr, flush=True)


def exit_words(status: int) -> str:
    """A child's ``returncode`` in words: ``exit status 1``, ``killed by SIGKILL``."""
    import signal

    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def viewer_died(why: str, run_id: str, log_path: Path) -> None:
    """Tell the operator that the demo's viewer died and that its training goes on."""
    from memtui.runs.text import clean

    print(f"memtui demo: the viewer died ({clean(why, 300)})", file=sys.stderr)
    print(f"memtui demo: the training goes on; its output: {log_path}", file=sys.stderr)
    print(
        f"memtui demo: reattach with `memtui attach {run_id}`; Ctrl-C stops the training",
        file=sys.stderr,
        flush=True,
    )
