"""A plain DataLoader loop under ``memtui run`` takes loader-knob changes at its next epoch: real
scripts that import nothing of memtui, launched with the real ``memtui run``, checked from what
the script itself sees (its loader's attributes, the worker processes its batches came from)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtui.hooks import auto
from tests.support.cli import memtui_here, status_json
from tests.support.clock import patience
from tests.support.processes import ROOT, logged_subprocess, wait_for

SCRIPT = """
import json, os, sys, time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset


class Numbers(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, index):
        time.sleep(0.002)
        info = torch.utils.data.get_worker_info()
        return torch.randn(4), torch.tensor(index % 2), torch.tensor(os.getpid() if info else 0)


def main(gate, mode, epochs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset, sampler = Numbers(), None
    if "loader-before-init" in mode:  # the watch starts before the process group is up
        for _ in DataLoader(Numbers(), batch_size=8):
            pass
    if "ddp" in mode:
        import torch.distributed as dist
        from torch.utils.data import DistributedSampler

        dist.init_process_group("gloo")
        sampler = DistributedSampler(dataset)
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    persistent = "persistent" in mode

    def make():
        return DataLoader(
            dataset,
            batch_size=4,
            shuffle=sampler is None,
            sampler=sampler,
            num_workers=1 if persistent else 0,
            persistent_workers=persistent,
        )

    loader = make()
    if "eval-first" in mode:  # an evaluation pass before training, over another loader
        for _ in DataLoader(Numbers(), batch_size=8):
            pass
    steps = 0
    for epoch in range(epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        if "new-loader" in mode:  # a new DataLoader over the same dataset every epoch
            loader = make()
        pids, first_step = set(), steps + 1
        for x, y, pid in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            pids.update(int(p) for p in pid)
        seen = {
            "rank": int(os.environ.get("RANK", 0)),
            "epoch": epoch,
            "first_step": first_step,
            "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor,
            "worker_pids": len(pids - {0}),
            "in_main": 0 in pids,
        }
        # one write per line: two ranks share the log, and an unbuffered print writes the
        # line and its newline apart
        sys.stdout.write("EPOCH " + json.dumps(seen) + "\\n")
        sys.stdout.flush()
        deadline = time.monotonic() + 60
        while (gate / f"hold-{epoch}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    sys.stdout.write("DONE\\n")
    sys.stdout.flush()


def rank(index, port, gate, mode, epochs):
    os.environ.update(RANK=str(index), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    main(gate, mode, epochs)


if __name__ == "__main__":
    gate, mode, epochs = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    if "mp-spawn" in mode:  # the ranks started by torch.multiprocessing.spawn
        import socket

        import torch.multiprocessing

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
        torch.multiprocessing.spawn(rank, args=(port, gate, mode, epochs), nprocs=2)
    else:
        main(gate, mode, epochs)
"""


class Training:
    """The script launched with ``memtui run``, held after its first epoch until released."""

    def __init__(self, base: Path, mode: str, ranks: int = 1) -> None:
        self.base = base
        (base / "train.py").write_text(SCRIPT)
        self.hold = base / "hold-0"
        self.hold.touch()
        self.log = base / "train.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("MEMTUI_DISABLE", None)
        python = [sys.executable]
        if ranks > 1:
            python += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        command = [sys.executable, "-m", "memtui.cli", "run", "--name", "loop", "--state-dir"]
        command += [str(base / "state"), "--", *python, "train.py", str(base), mode, "3"]
        self.proc = logged_subprocess(command, env, base, self.log)

    def epochs(self, count: int) -> list[dict[str, Any]]:
        """The first ``count`` epoch lines the script printed (what its loader really was)."""

        def printed() -> list[dict[str, Any]] | None:
            if self.proc.poll() is not None and self.proc.returncode != 0:
                pytest.fail(f"the script failed:\n{self.log.read_text()}")
            lines = [ln[6:] for ln in self.log.read_text().splitlines() if ln.startswith("EPOCH ")]
            return [json.loads(line) for line in lines] if len(lines) >= count else None

        found = wait_for(printed, 60, 0.05, f"{count} epochs")
        assert isinstance(found, list)
        return found

    def run_id(self) -> str:
        """The run it registered (after its first optimizer step)."""

        def listed() -> str | None:
            runs = json.loads(memtui_here("ls", "--json").stdout)
            return str(runs[0]["run"]) if runs else None

        run = wait_for(listed, 30, 0.05, "the run to register")
        assert isinstance(run, str)
        return run

    def finish(self) -> int:
        """Release the script; its exit status."""
        self.hold.unlink(missing_ok=True)
        try:
            return self.proc.wait(patience(60))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(patience(10))


def _audit(base: Path) -> list[dict[str, Any]]:
    lines = (base / "state" / "memtui-audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("mode", ["plain", "eval-first-new-loader-persistent"])
def test_a_workers_change_lands_when_the_training_loader_starts_its_next_epoch(
    tmp_path: Path, mode: str
) -> None:
    training = Training(tmp_path, mode)
    try:
        first = training.epochs(1)[0]
        run = training.run_id()
        assert first["num_workers"] == (1 if "persistent" in mode else 0)
        queued = memtui_here("set", run, "num_workers=2", "prefetch_factor=3")
        assert queued.exit_code == 0, queued.output
        assert f"applies at {auto.WHEN_SAVED}" in queued.output
        assert training.finish() == 0
        later = training.epochs(3)[1:]
    finally:
        training.finish()
    # what the script's own loader was and where its batches came from, epoch by epoch
    for epoch in later:
        assert (epoch["num_workers"], epoch["prefetch_factor"]) == (2, 3)
        assert (epoch["worker_pids"], epoch["in_main"]) == (2, False)
    applied = [e for e in _audit(tmp_path) if e["event"] == "applied"]
    assert [(e["step"], e["changes"]["num_workers"][1]) for e in applied] == [(6, 2)]
    assert later[0]["first_step"] == 7  # the epoch after the boundary ran with it from its start


def test_a_watched_loop_says_which_knobs_it_takes_where_and_why_not(tmp_path: Path) -> None:
    training = Training(tmp_path, "plain")
    try:
        training.epochs(1)
        run = training.run_id()
        status = status_json(run)
        assert status["tunable"] == ["num_workers", "pin_memory", "prefetch_factor"]
        assert status["boundary"] == auto.WHEN_SAVED
        why = status["untunable"]["batch_size"]
        assert why == status["untunable"]["grad_accum"]
        assert "the loop's own code sets them" in why
        text = memtui_here("status", run).stdout
        assert f"not tunable: batch_size, grad_accum: {why}" in text
        assert f"changes apply at {auto.WHEN_SAVED}" in text
        refused = memtui_here("set", run, "batch_size=8")
        assert refused.exit_code == 2
        assert f"batch_size is not tunable in this run ({why})" in refused.output
    finally:
        assert training.finish() == 0


def test_a_change_pending_when_the_run_ends_is_recorded_and_said(tmp_path: Path) -> None:
    """Queued after the last epoch began: no boundary comes, and the run's end says so (its last
    log line, the audit log), rather than the change vanishing."""
    training = Training(tmp_path, "plain")
    last = tmp_path / "hold-2"
    last.touch()  # the script waits after its last epoch
    try:
        training.epochs(1)
        run = training.run_id()
        training.hold.unlink()
        training.epochs(3)
        queued = memtui_here("set", run, "num_workers=2")
        assert queued.exit_code == 0, queued.output
        last.unlink()
        assert training.finish() == 0
    finally:
        last.unlink(missing_ok=True)
        training.finish()
    said = training.log.read_text()
    assert "with changes queued and never applied (#1 num_workers=2)" in said, said
    (unapplied,) = [e for e in _audit(tmp_path) if e["event"] == "unapplied"]
    assert unapplied["reason"] == "pending at exit"
    assert (unapplied["ids"], unapplied["changes"]) == ([1], {"num_workers": 2})
    assert not [e for e in _audit(tmp_path) if e["event"] == "applied"]


@pytest.mark.parametrize("launcher", ["torchrun", "mp-spawn"])
def test_every_rank_takes_the_workers_change_at_the_same_step(
    tmp_path: Path, launcher: str
) -> None:
    torchrun = launcher == "torchrun"
    # the spawned ranks also iterate a loader before ``init_process_group``
    mode = "ddp" if torchrun else "ddp-mp-spawn-loader-before-init"
    training = Training(tmp_path, mode, ranks=2 if torchrun else 1)
    try:
        training.epochs(2)  # both ranks' first epoch
        run = training.run_id()
        wait_for(lambda: status_json(run)["world_size"] == 2, 30, 0.1, "both ranks")
        queued = memtui_here("set", run, "num_workers=1")
        assert queued.exit_code == 0, queued.output
        assert training.finish() == 0
        epochs = training.epochs(6)
    finally:
        training.finish()
    by_rank = {r: [e for e in epochs if e["rank"] == r] for r in (0, 1)}
    for seen in by_rank.values():
        assert [e["num_workers"] for e in seen] == [0, 1, 1]
        assert [e["worker_pids"] for e in seen] == [0, 1, 1]
    assert by_rank[0][1]["first_step"] == by_rank[1][1]["first_step"] == 4
    applied = [e for e in _audit(tmp_path) if e["event"] == "applied"]
    assert [e["step"] for e in applied] == [3]


# ---------------------------------------------------------------------------- in this process


@pytest.fixture
def tuner() -> Iterator[Any]:
    """A watch-only Tuner that publishes nothing, as ``memtui run`` makes before the first step."""
    from memtui import hooks

    made = hooks.install({}, options=hooks.Options(publish=False))
    saved = (auto._watch.last_started, auto._watch.train, auto._watch.train_dataset)
    try:
        yield made
    finally:
        auto._watch.last_started, auto._watch.train, auto._watch.train_dataset = saved
        made.close()


def test_a_loader_over_an_iterable_dataset_keeps_its_workers(tuner: Any) -> None:
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.zeros(8, 2))

    loader = DataLoader(Stream(), batch_size=2)
    auto._watch.last_started = auto._weak(loader)
    auto._find_training_loader(tuner)
    assert tuner.tunable() == ["pin_memory"]
    assert "IterableDataset" in tuner.control.untunable["num_workers"]


def test_a_loop_without_a_dataloader_takes_no_knobs_and_says_why(tuner: Any) -> None:
    auto._watch.last_started = auto._nothing
    auto._find_training_loader(tuner)
    assert tuner.tunable() == []
    assert set(tuner.control.untunable) == {
        "batch_size",
        "grad_accum",
        "num_workers",
        "pin_memory",
        "prefetch_factor",
    }
    assert "saw no DataLoader" in tuner.control.untunable["num_workers"]
