"""A rank started as a child process of another rank is a rank, never that rank's loader worker:
two CPU ranks under ``memtui run`` (Lightning Fabric's own launcher, and rank 0 spawning rank 1
with ``torch.multiprocessing.spawn``), each rank's workers and memory in ``memtui status --json``
checked against the processes psutil finds; the memory parts come from the optimizer the watch
counts, and the rest of the process is never called activations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from memtui.core.stats import format_bytes
from memtui.runs.receiver import Inbox, Receiver
from memtui.runs.state import RunState
from memtui.transport.sources import LiveSource
from memtui.tui.widgets.ranks import rank_row
from tests.support.cli import memtui_here, status_json
from tests.support.processes import ROOT, logged_subprocess, wait_for

SCRIPT = Path(__file__).with_name("rank_tree_train.py")
MIB = 1 << 20


class Job:
    """The two-rank script under ``memtui run``, training until released."""

    def __init__(self, base: Path, launcher: str) -> None:
        self.hold = base / "hold"
        self.hold.touch()
        self.report = base / "report"
        self.log = base / "train.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("MEMTUI_DISABLE", None)
        command = [sys.executable, "-m", "memtui.cli", "run", "--name", "trees", "--state-dir"]
        command += [str(base / "state"), "--", sys.executable, str(SCRIPT)]
        command += [str(self.hold), str(self.report), launcher]
        self.proc = logged_subprocess(command, env, base, self.log)

    def reports(self) -> dict[int, dict[str, Any]]:
        """What each rank said of itself after its fifth step."""

        def written() -> dict[int, dict[str, Any]] | None:
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended:\n{self.log.read_text()}")
            paths = [Path(f"{self.report}.rank{rank}") for rank in (0, 1)]
            if not all(p.exists() and p.read_text() for p in paths):
                return None
            return {rank: json.loads(p.read_text()) for rank, p in enumerate(paths)}

        found = wait_for(written, 120, 0.1, "both ranks' fifth step")
        assert isinstance(found, dict)
        return found

    def run_id(self) -> str:
        """The run both ranks joined."""

        def listed() -> str | None:
            runs = json.loads(memtui_here("ls", "--json").stdout)
            return str(runs[0]["run"]) if runs else None

        run = wait_for(listed, 60, 0.1, "the run to register")
        assert isinstance(run, str)
        return run

    def finish(self) -> int:
        """Release the job; its exit status."""
        self.hold.unlink(missing_ok=True)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def own_workers(pids: dict[int, int]) -> dict[int, list[psutil.Process]]:
    """Each rank's descendants that are not another rank or one of its descendants."""
    ranks = set(pids.values())
    found: dict[int, list[psutil.Process]] = {}
    for rank, pid in pids.items():
        mine: list[psutil.Process] = []
        parents = [psutil.Process(pid)]
        while parents:
            for child in parents.pop().children():
                if child.pid not in ranks:
                    mine.append(child)
                    parents.append(child)
        found[rank] = mine
    return found


def tree_bytes(pid: int, workers: list[psutil.Process]) -> int:
    """The rank's RSS plus its workers' own memory (USS), as psutil reads them now."""
    return int(psutil.Process(pid).memory_info().rss) + sum(
        int(w.memory_full_info().uss) for w in workers
    )


def counted(status: dict[str, Any]) -> dict[int, int | None]:
    """The loader workers ``memtui status --json`` gives each rank."""
    return {
        r["rank"]: (r.get("host_memory") or {}).get("workers") if r.get("reachable") else None
        for r in status["ranks"]
    }


@contextmanager
def viewer_state(run: str) -> Iterator[RunState]:
    """The viewer's state of the live run, as its receiver thread feeds it (no terminal)."""
    state, inbox, lock = RunState(), Inbox(), threading.Lock()

    def fold() -> None:
        with lock:
            for batch in inbox.drain():
                state.apply(batch)

    receiver = Receiver(LiveSource(run), inbox, fold, readonly=True)
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        receiver.stop()
        thread.join(10)


@pytest.mark.parametrize("launcher", ["fabric", "spawn"])
def test_each_rank_counts_its_own_workers_and_a_child_rank_is_none_of_them(
    tmp_path: Path, launcher: str
) -> None:
    job = Job(tmp_path, launcher)
    try:
        said = job.reports()
        run = job.run_id()
        pids = {rank: int(seen["pid"]) for rank, seen in said.items()}
        assert psutil.Process(pids[1]).ppid() == pids[0], "rank 1 is a child of rank 0"
        truth = {rank: len(workers) for rank, workers in own_workers(pids).items()}
        assert truth[0] >= 2 and truth[1] == 2, truth
        deadline = time.monotonic() + 60
        status = status_json(run)
        while counted(status) != truth and time.monotonic() < deadline:
            time.sleep(0.5)
            status = status_json(run)
        assert counted(status) == truth, f"status counts {counted(status)}, psutil {truth}"
        assert {r["rank"]: r["pid"] for r in status["ranks"]} == pids
        # what each rank's tree holds: its RSS and its own workers' USS, as psutil reads them
        workers = own_workers(pids)
        for entry in status["ranks"]:
            rank = entry["rank"]
            tree = entry["process_tree"]
            assert (tree["workers"], tree["workers_measure"]) == (truth[rank], "USS")
            real = tree_bytes(pids[rank], workers[rank])
            assert abs(tree["total_bytes"] - real) < 32 * MIB + 0.1 * real, (rank, tree, real)
        other = psutil.Process(pids[1]).memory_info().rss
        assert (
            status["ranks"][0]["process_tree"]["total_bytes"]
            < tree_bytes(pids[0], workers[0]) + other / 2
        ), "rank 1 is not in rank 0's memory"
        # the parts: the optimizer's tensors exactly, the rest of the process as what it is
        parts = status["breakdown"]
        parameters = said[0]["parameters"]
        assert (parts["parameters"], parts["gradients"]) == (parameters, parameters)
        assert parts["optimizer"] == pytest.approx(2 * parameters, abs=64), "AdamW's two moments"
        assert status["static_memory"]["optimizer_note"] == "measured"
        assert "activations" not in parts and "not known yet" not in parts, parts
        split = sum(v for k, v in parts.items() if k not in ("capacity_bytes", "free"))
        assert split == status["memory"]["peak_allocated_bytes"]
        # what the process holds between steps (Python, torch, the data) is most of its RSS
        main_rss = psutil.Process(pids[0]).memory_info().rss
        assert parts["runtime and workers"] > 0.75 * main_rss, parts
        assert parts["in-step"] >= 0 and parts["malloc free"] >= 0
        # the viewer's per-rank table counts each rank's tree as status does
        with viewer_state(run) as state:

            def both_ranks() -> bool:
                trees = [r.tree for r in state.refresh_summary().ranks]
                return len(trees) == 2 and all(t is not None and t.measure for t in trees)

            wait_for(both_ranks, 30, 0.2, "the viewer's host samples of both ranks")
            status = status_json(run)
            for summary, entry in zip(state.refresh_summary().ranks, status["ranks"], strict=True):
                tree, said_tree = summary.tree, entry["process_tree"]
                assert tree is not None and summary.rank == entry["rank"]
                assert (tree.workers, tree.measure) == (truth[summary.rank], "USS")
                assert (tree.workers, tree.measure) == (
                    said_tree["workers"],
                    said_tree["workers_measure"],
                )
                assert abs(tree.total_bytes - said_tree["total_bytes"]) < 0.1 * tree.total_bytes
                assert format_bytes(tree.total_bytes) in rank_row(summary, 0).plain
        assert job.finish() == 0, job.log.read_text()
    finally:
        job.finish()
