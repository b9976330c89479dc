"""Shared fixtures: a private runtime directory per test, and the demo training in a subprocess."""

from __future__ import annotations

import contextlib
import json
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
from tests.forkserver import ForkedDemo, ForkedJob, ForkServer

ROOT = Path(__file__).resolve().parent.parent

# the suite's trainings run torch on one thread (a session-wide default; a test may still ask for
# more): on 2 busy cores torch's intra-op pool spins against the other workers, and the documented
# plain loop's small MLP took 15 ms of CPU a step on two threads, 1.2 ms on one (torchrun sets the same)
os.environ.setdefault("OMP_NUM_THREADS", "1")

LIGHT = ("--seq-len", "16", "--width", "32", "--layers", "1", "--vocab", "64")
"""A demo model a third of the default's compute per step, for tests of plumbing (control,
boundaries, registry, faults) rather than of memory or advice."""
PLUMBING = (*LIGHT, "--slow-data-ms", "1")
"""The light model with its loader sleeping a little per sample: about as many steps per second
as the default demo at a quarter of its CPU (tests that need a run alive and stepping)."""


@pytest.fixture(autouse=True)
def private_runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own short runtime dir (ipc paths must stay short) and state home."""
    base = Path(tempfile.mkdtemp(prefix="mt", dir="/tmp"))
    runtime = base / "rt"
    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("XDG_STATE_HOME", str(base / "state"))
    before = {k: v for k, v in os.environ.items() if k.startswith("MEMTUI_")}
    yield runtime
    # a command run in this process (click's runner) may set memtui's variables for its children:
    # the next test's trainings must not inherit them (plain TCP, say)
    for name in [k for k in os.environ if k.startswith("MEMTUI_") and k not in before]:
        del os.environ[name]
    os.environ.update(before)
    shutil.rmtree(base, ignore_errors=True)


def skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, each with the reason, where torch sees no CUDA device
    (kept in the run as skips, not deselected: the report says what did not run)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = no_cuda_reason() if gpu else None
    for item in gpu if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


def no_cuda_reason() -> str | None:
    """Why the gpu tests cannot run here (None: a CUDA device is available)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.is_available():
        return None
    build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    return (
        f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {build}); "
        "the gpu tests run the real CUDA paths on a machine with one (make test-gpu)"
    )


def wait_for(
    predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> object:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what or predicate}")


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
        """Wait for the training to finish; return its exit status."""
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Terminate the training if it still runs."""
        stop_all([self])


def stop_all(runs: list[DemoRun]) -> None:
    """Terminate every training still running, all at once, then wait for each (a demo takes a
    second or two to end: one after the other, a test of three demos waited for each in turn)."""
    live = [run for run in runs if run.proc.poll() is None]
    for run in live:
        run.proc.terminate()
    deadline = time.monotonic() + 30
    for run in live:
        try:
            run.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait(10)


_FORK_SERVER: list[ForkServer] = []


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
        code = job.wait(timeout)
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


def pytest_sessionfinish() -> None:
    """Stop the fork server (and any demo it still runs)."""
    while _FORK_SERVER:
        _FORK_SERVER.pop().close()


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[Callable[..., DemoRun]]:
    """Start the demo training (``python -m memtui.demo``) and wait for its run id."""
    runs: list[DemoRun] = []

    def start(
        *args: str,
        out: Path | None = None,
        wait: bool = True,
        env: dict[str, str] | None = None,
        ranks: int = 1,
        fork: bool = True,
    ) -> DemoRun:
        """``fork``: from the fork server (False: a subprocess of its own, paying its 7 s of imports)."""
        out_dir = out or tmp_path / f"demo{len(runs)}"
        out_dir.mkdir(parents=True, exist_ok=True)
        log = out_dir / f"stdout{len(runs)}.log"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        proc = launch_demo(
            ["--out", str(out_dir), "--progress-every", "1", *args], full_env, log, ranks, fork
        )
        run = DemoRun(proc, out_dir, log)
        runs.append(run)
        if wait:
            run.run_id = demo_run_id(log, proc)
        return run

    yield start
    stop_all(runs)


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


def memtui_cli(
    *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``memtui`` command line in a subprocess (``env``: instead of this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "memtui.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def memtui_here(*args: str) -> Any:
    """``memtui ARGS`` run by click in this process (its ``Result``): the command's own code,
    for tests that poll it (a subprocess per poll cost ~0.27 CPU seconds, 100 times this; the
    suite's ``memtui_cli`` calls keep the real command line covered)."""
    from click.testing import CliRunner

    from memtui.cli import main

    return CliRunner().invoke(main, list(args))


def status_json(run: str | None = None) -> dict[str, Any]:
    """``memtui status [RUN] --json``, run in this process (``memtui_here``)."""
    result = memtui_here("status", *([run] if run else []), "--json")
    assert result.exit_code == 0, result.stderr or result.output
    return dict(json.loads(result.stdout))


if os.environ.get("MEMTUI_TEST_CPU_LOG"):  # where the suite's CPU goes: one line per test
    import resource

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
        """Log the test's wall time and the CPU time it and its subprocesses used."""

        def cpu() -> tuple[float, float]:
            own = resource.getrusage(resource.RUSAGE_SELF)
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            forked = sum(server.children_cpu_s for server in _FORK_SERVER)  # not our children
            return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + forked

        wall, (own, children) = time.monotonic(), cpu()
        yield
        own_after, children_after = cpu()
        with open(os.environ["MEMTUI_TEST_CPU_LOG"], "a") as log:
            log.write(
                f"{time.monotonic() - wall:.2f}\t{own_after - own:.2f}\t"
                f"{children_after - children:.2f}\t{item.nodeid}\n"
            )


HEAVY_FIRST = (
    "tests/tui/test_hostile_text.py",
    "tests/test_advice_live.py",
    "tests/test_ddp.py",
    "tests/tui/test_app_live_keys.py",
    "tests/test_rank_faults.py",
    "tests/test_readme.py",
    "tests/test_security.py",
    "tests/test_e2e.py",
    "tests/tui/test_demo_viewer.py",
    "tests/tui/test_advice.py",
    "tests/tui/test_side_pane.py",
    "tests/tui/test_app_ranks_live.py",
    "tests/test_control_bounds.py",
    "tests/tui/test_app_replay.py",
    "tests/test_benchmarks.py",
    "tests/test_autopilot_live.py",
    "tests/tui/test_app_live.py",
    "tests/test_faults.py",
    "tests/tui/test_follow.py",
    "tests/tui/test_snapshots.py",
    "tests/test_export.py",
)
"""The files with the most training to do, run first: ``make test`` hands whole files to its
workers in collection order, and a long file handed out last keeps one worker busy alone
(ordered by their wall time in a suite run with ``MEMTUI_TEST_CPU_LOG`` set)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the heaviest files first (stable: every file's own order is kept); skip the gpu tests
    where there is no CUDA device."""
    rank = {path: index for index, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    skip_gpu_tests_without_cuda(items)
