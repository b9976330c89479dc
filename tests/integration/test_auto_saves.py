"""A plain DataLoader loop under ``memtui run`` that saves its training state with ``torch.save``:
each save is a checkpoint listed by ``memtui status``, and a loader-knob change queued before it
lands there, in the middle of the epoch, the rest of the epoch's samples in the order and number
the same script trains on without memtui; with several ranks, where every rank saves (from its
second save) and not where only rank 0 does (its changes wait for the next epoch, and status
says why). Real scripts that import nothing of memtui, launched with the real ``memtui run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from memtui.hooks import auto
from tests.support.cli import memtui_here, status_json
from tests.support.processes import ROOT, logged_subprocess, wait_for

SCRIPT = """
import json, os, sys, time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Numbers(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        return torch.full((4,), index / 48), torch.tensor(index), torch.tensor(os.getpid() if info else 0)


def say(kind, **what):
    # one write per line: the ranks of a job share the log
    sys.stdout.write(kind + " " + json.dumps(what) + "\\n")
    sys.stdout.flush()


def main(gate, mode, epochs, every):
    rank, ddp = 0, "ddp" in mode
    if ddp:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = Numbers()
    sampler = DistributedSampler(dataset, seed=0) if ddp else None
    persistent = "persistent" in mode
    loader = DataLoader(
        dataset,
        batch_size=2 if ddp else 4,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=1 if persistent else 0,
        persistent_workers=persistent,
    )
    steps = 0
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, index, pid in loader:
            hold = gate / f"hold-{steps + 1}"
            if hold.exists():
                say("HELD", rank=rank, step=steps + 1)
                deadline = time.monotonic() + 60
                while hold.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            loss = torch.nn.functional.mse_loss(model(x), torch.zeros(len(x), 2))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            say("BATCH", rank=rank, epoch=epoch, step=steps, indices=index.tolist(),
                pids=sorted(set(pid.tolist())), num_workers=loader.num_workers)
            if steps % every == 0 and (rank == 0 or "master-saves" not in mode):
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": steps}, gate / f"ckpt-{rank}.pt")
    say("DONE", rank=rank, weight=model.state_dict()["module.weight" if ddp else "weight"].tolist())


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
"""

EPOCHS, EVERY = 2, 3


class Script:
    """The script in ``base``, run once as its users run it and once under ``memtui run``."""

    def __init__(self, base: Path, mode: str, ranks: int = 1, every: int = EVERY) -> None:
        self.base, self.mode, self.ranks, self.every = base, mode, ranks, every
        (base / "train.py").write_text(SCRIPT)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.env.pop("MEMTUI_DISABLE", None)
        self.proc: subprocess.Popen[str] | None = None
        self.log = base / "watched.log"

    def command(self) -> list[str]:
        python = [sys.executable]
        if self.ranks > 1:
            python += ["-m", "torch.distributed.run", "--standalone"]
            python += [f"--nproc_per_node={self.ranks}"]
        return [*python, "train.py", str(self.base), self.mode, str(EPOCHS), str(self.every)]

    def plain(self) -> list[dict[str, Any]]:
        """Run to its end without memtui: what it printed."""
        done = subprocess.run(
            self.command(), cwd=self.base, env=self.env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return lines(done.stdout)

    def start(self, held_at: int) -> None:
        """Start under ``memtui run``, every rank held before step ``held_at``."""
        (self.base / f"hold-{held_at}").touch()
        memtui = [sys.executable, "-m", "memtui.cli", "run", "--name", "saves", "--state-dir"]
        command = [*memtui, str(self.base / "state"), "--", *self.command()]
        self.proc = logged_subprocess(command, self.env, self.base, self.log)

        def held() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"the script ended early:\n{self.log.read_text()}")
            return len([r for r in self.printed() if r["kind"] == "HELD"]) == self.ranks

        wait_for(held, 60, 0.05, "every rank held")

    def printed(self) -> list[dict[str, Any]]:
        return lines(self.log.read_text())

    def run_id(self) -> str:
        def listed() -> str | None:
            runs = json.loads(memtui_here("ls", "--json").stdout)
            return str(runs[0]["run"]) if runs and runs[0]["ranks"] == self.ranks else None

        return str(wait_for(listed, 30, 0.05, "the run to register"))

    def release(self, held_at: int) -> list[dict[str, Any]]:
        (self.base / f"hold-{held_at}").unlink()
        assert self.proc is not None
        assert self.proc.wait(120) == 0, self.log.read_text()
        return self.printed()

    def stop(self) -> None:
        for hold in self.base.glob("hold-*"):
            hold.unlink()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def audit(self) -> list[dict[str, Any]]:
        text = (self.base / "state" / "memtui-audit.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


def lines(text: str) -> list[dict[str, Any]]:
    """The script's BATCH, HELD and DONE lines, as dicts with their ``kind``."""
    found = []
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("BATCH", "HELD", "DONE"):
            found.append({"kind": kind, **json.loads(rest)})
    return found


def batches(printed: list[dict[str, Any]], rank: int = 0) -> list[dict[str, Any]]:
    return [r for r in printed if r["kind"] == "BATCH" and r["rank"] == rank]


def indices(printed: list[dict[str, Any]], rank: int = 0) -> list[list[int]]:
    """What each of the rank's steps trained on, in order."""
    return [b["indices"] for b in batches(printed, rank)]


def done(printed: list[dict[str, Any]], rank: int = 0) -> list[Any]:
    return [r["weight"] for r in printed if r["kind"] == "DONE" and r["rank"] == rank]


@pytest.mark.parametrize("mode", ["plain", "persistent"])
def test_a_workers_change_lands_at_the_next_save_in_the_middle_of_the_epoch(
    tmp_path: Path, mode: str
) -> None:
    """Queued before step 2, ``num_workers=2`` lands at the save after step 3 (an epoch is 12
    steps): the steps after it train on batches of the two new workers (with persistent workers,
    the old worker's two prefetched batches first), every step on the samples, in the order, the
    script trains on without memtui, to the same final weights; each save is a checkpoint."""
    script = Script(tmp_path, mode)
    expected = script.plain()
    try:
        script.start(held_at=2)
        run = script.run_id()
        queued = memtui_here("set", run, "num_workers=2")
        assert queued.exit_code == 0, queued.output
        assert f"applies at {auto.WHEN_SAVED}" in queued.output
        printed = script.release(held_at=2)
    finally:
        script.stop()
    assert indices(printed) == indices(expected)
    assert done(printed) == done(expected)
    steps = batches(printed)
    assert [b["num_workers"] for b in steps] == [1 if mode == "persistent" else 0] * 3 + [2] * 21
    old = 2 if mode == "persistent" else 0  # the batches the old worker had been given
    new_workers = {p for b in steps[3 + old : 12] for p in b["pids"]}
    assert len(new_workers) == 2 and 0 not in new_workers, steps
    assert len({p for b in steps[12:] for p in b["pids"]} - {0}) == 2
    applied = [e for e in script.audit() if e["event"] == "applied"]
    assert [(e["step"], e["changes"]["num_workers"][1]) for e in applied] == [(3, 2)]
    assert applied[0]["note"] == auto.CONTINUED


def test_each_save_is_a_checkpoint_status_lists(tmp_path: Path) -> None:
    script = Script(tmp_path, "plain")
    try:
        script.start(held_at=8)
        run = script.run_id()
        status = status_json(run)
        assert [c["step"] for c in status["checkpoints"]] == [3, 6]
        assert status["boundary"] == auto.WHEN_SAVED
    finally:
        script.stop()


def test_a_change_pending_when_the_run_ends_is_said_and_audited(tmp_path: Path) -> None:
    """Saves every 5 steps: queued before step 22, no save or epoch start comes after it."""
    script = Script(tmp_path, "plain", every=5)
    try:
        script.start(held_at=22)
        run = script.run_id()
        assert memtui_here("set", run, "pin_memory=true").exit_code == 0
        script.release(held_at=22)
    finally:
        script.stop()
    said = "ended at step 24 with changes queued and never applied (#1 pin_memory=true)"
    assert said in script.log.read_text()
    (unapplied,) = [e for e in script.audit() if e["event"] == "unapplied"]
    assert unapplied["ids"] == [1] and unapplied["reason"] == "pending at exit"


@pytest.mark.slow
def test_every_rank_takes_the_change_at_the_second_save_all_ranks_make(tmp_path: Path) -> None:
    """Two ranks that both save every 3 steps (an epoch is 12 steps a rank): the first save tells
    them that every rank saves, the second (step 6) takes the change on both, each rank's samples
    as without memtui."""
    script = Script(tmp_path, "ddp", ranks=2)
    expected = script.plain()
    try:
        script.start(held_at=2)
        run = script.run_id()
        assert memtui_here("set", run, "num_workers=1").exit_code == 0
        printed = script.release(held_at=2)
    finally:
        script.stop()
    for rank in (0, 1):
        assert indices(printed, rank) == indices(expected, rank)
        workers = [b["num_workers"] for b in batches(printed, rank)]
        assert workers == [0] * 6 + [1] * 18, (rank, workers)
    applied = [e for e in script.audit() if e["event"] == "applied"]
    assert [e["step"] for e in applied] == [6]


@pytest.mark.slow
def test_a_save_of_rank_0_alone_is_no_boundary_and_status_says_why(tmp_path: Path) -> None:
    script = Script(tmp_path, "ddp-master-saves", ranks=2)
    try:
        script.start(held_at=8)
        run = script.run_id()
        assert memtui_here("set", run, "num_workers=1").exit_code == 0
        status = status_json(run)
        assert status["boundary"] == auto.ONE_RANK_SAVES.format(ranks="0"), status["boundary"]
        printed = script.release(held_at=8)
    finally:
        script.stop()
    for rank in (0, 1):
        workers = [b["num_workers"] for b in batches(printed, rank)]
        assert workers == [0] * 12 + [1] * 12, (rank, workers)
    applied = [e for e in script.audit() if e["event"] == "applied"]
    assert [e["step"] for e in applied] == [12]
