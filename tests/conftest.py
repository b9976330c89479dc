"""Fixtures every test gets: a private runtime directory; the demo training, started on demand;
the heaviest files handed out first."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.clock import patience
from tests.support.cuda import skip_gpu_tests_without_cuda
from tests.support.processes import (
    DemoRun,
    close_fork_servers,
    demo_run_id,
    fork_servers,
    launch_demo,
    stop_all,
)

pytest_plugins = ["tests.support.accounts"]
"""The two real accounts (``accounts``, ``home``, ``shared``): one pair for the whole session."""

# the suite's trainings run torch on one thread (a session-wide default; a test may still ask for
# more): on 2 busy cores torch's intra-op pool spins against the other workers, and the documented
# plain loop's small MLP took 15 ms of CPU a step on two threads, 1.2 ms on one (torchrun sets the same)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def private_session_runtime() -> Iterator[Path]:
    """The session's own runtime dir and state home, for the runs a module's or the session's
    fixtures start before a test's own (``private_runtime``): none lands among the user's runs,
    and none of theirs in a test's registry."""
    base = Path(tempfile.mkdtemp(prefix="mts", dir="/tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MEMTUI_RUNTIME_DIR", str(base / "rt"))
        patch.setenv("XDG_STATE_HOME", str(base / "state"))
        yield base / "rt"
    shutil.rmtree(base, ignore_errors=True)


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


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
    """The per-test hang guard (pytest-timeout's ``timeout``, or the test's own mark) stretched
    by the load as the test starts: on a busy machine a slow pass is not a hang."""
    marker = item.get_closest_marker("timeout")
    given = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    if given and float(given) > 0:
        item.add_marker(pytest.mark.timeout(patience(float(given))), append=False)
    yield


def pytest_sessionfinish() -> None:
    """Stop the fork server (and any demo it still runs)."""
    close_fork_servers()


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


if os.environ.get("MEMTUI_TEST_CPU_LOG"):  # where the suite's CPU goes: one line per test
    import resource

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: object) -> Iterator[None]:
        """Log the test's wall time and the CPU time it and its subprocesses used."""

        def cpu() -> tuple[float, float]:
            own = resource.getrusage(resource.RUSAGE_SELF)
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            forked = sum(server.children_cpu_s for server in fork_servers())  # not our children
            return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + forked

        wall, (own, children) = time.monotonic(), cpu()
        yield
        own_after, children_after = cpu()
        with open(os.environ["MEMTUI_TEST_CPU_LOG"], "a") as log:
            log.write(
                f"{time.monotonic() - wall:.2f}\t{own_after - own:.2f}\t"
                f"{children_after - children:.2f}\t{item.nodeid}\n"
            )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the files marked ``heavy`` first (stable: every file's own order is kept): ``make test``
    hands whole files to its workers in collection order, and a long file handed out last keeps
    one worker busy alone; skip the gpu tests where there is no CUDA device."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
    skip_gpu_tests_without_cuda(items)
