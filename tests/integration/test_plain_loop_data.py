"""What a plain PyTorch loop learns from, with memtui's documented lines and under ``memtui run``,
read from outside memtui by the client corpus's witness (torch's global hooks: every optimizer
step's LR, every training forward's rows).

The loop is a script of its own here (not a client): token rows shuffled by a ``DataLoader``
(its own seeded generator on one process, a ``DistributedSampler`` on two under ``torchrun``),
dropout, AdamW with a linear LR decay (``LambdaLR``), gradient accumulation read from
its config at every micro-batch, a checkpoint of each rank's state every 4 optimizer steps, an
evaluation after each epoch, and ``--resume`` from its checkpoint. The documented lines are the
guide's: ``hooks.install`` with the config, the model, the optimizer and the checkpoint
directory, ``tuner.watch_scheduler``, the loader from a factory, ``tuner.step()``,
``tuner.checkpoint()`` right after the save and ``tuner.state_dict()`` in it.

* No change queued: the checkpoint files, every step's LR and every trained row are those of the
  same script with ``MEMTUI_DISABLE=1``, and those of the script without memtui's lines; under
  ``memtui run`` the script without the lines trains and saves as without memtui.
* A batch change keeping the effective batch (the accumulation follows), one doubling it with the
  LR scaled linearly and a workers change, queued with ``memtui set``; the run killed in the
  middle of an epoch and restarted from its checkpoint: every sample is trained on exactly once
  per epoch on the union of the ranks, over the killed run (up to its checkpoint) and the
  restart, at the script's LR times the factor memtui reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.clients.harness import (
    ClientRun,
    Job,
    client_home,
    coverage_over,
    factor_at,
    finished,
    forwards_by_rank,
    job_run_id,
    lr_factors,
    lr_mismatches,
    lrs_by_rank,
    memtui_run,
    play_job,
    python_or_torchrun,
    registered_runs,
    saved_without_run,
    start,
    steps_by_rank,
)
from tests.clients.witness import row_digest
from tests.support.processes import wait_for

pytestmark = pytest.mark.heavy

SCRIPT = '''"""A plain PyTorch loop: shuffled token rows, dropout, AdamW with a linear LR decay, gradient
accumulation, a checkpoint every few optimizer steps, an evaluation after each epoch, a
DistributedSampler under torchrun; --resume continues from the checkpoint."""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
parser.add_argument("--num_workers", type=int, default=0)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--save_every", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--decay_steps", type=int, default=32)
parser.add_argument("--out", default="out")
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
if distributed:
    torch.distributed.init_process_group("gloo")
rank = int(os.environ.get("RANK", "0"))
torch.manual_seed(0)
data = torch.load("data.pt")
dataset = TensorDataset(data["rows"], data["labels"])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.drop = torch.nn.Dropout(0.3)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.drop(self.embed(x).mean(1)))


net = Net()
model = torch.nn.parallel.DistributedDataParallel(net) if distributed else net
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / args.decay_steps)
order = torch.Generator().manual_seed(1)  # the shuffle's own: each run draws the same orders


def make_loader(batch_size, num_workers):
    sampler = DistributedSampler(dataset, shuffle=True, seed=1) if distributed else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        generator=None if distributed else order,
        num_workers=num_workers,
    )


loader = make_loader(args.batch_size, args.num_workers)

checkpoint = os.path.join(args.out, f"state-{rank}.pt")
epoch, step = 0, 0
if args.resume:
    state = torch.load(checkpoint)
    net.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    epoch, step = state["epoch"], state["step"]

micro = 0
while epoch < args.epochs:
    if distributed:
        loader.sampler.set_epoch(epoch)
    for x, y in loader:
        loss = F.cross_entropy(model(x), y) / args.gradient_accumulation_steps
        loss.backward()
        micro += 1
        if micro < args.gradient_accumulation_steps:  # read each time: it may change
            continue
        micro = 0
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        step += 1
        if step % args.save_every == 0:
            os.makedirs(args.out, exist_ok=True)
            state = {
                "model": net.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "step": step,
            }
            torch.save(state, checkpoint)
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(data["held_out"]), data["held_out_labels"]).item()
    print(f"epoch {epoch}: step {step}, held-out loss {loss:.4f}", flush=True)
    model.train()
    epoch += 1
'''

DOCUMENTED_LINES = [
    (
        "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n",
        "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\n\n"
        "from memtui import hooks\n",
    ),
    (
        "loader = make_loader(args.batch_size, args.num_workers)\n",
        "tuner = hooks.install(\n"
        "    args, model=model, optimizer=optimizer, state_dir=args.out, resume=args.resume\n"
        ")\n"
        "tuner.watch_scheduler(scheduler)\n"
        "loader = tuner.loader(make_loader)\n",
    ),
    (
        '    epoch, step = state["epoch"], state["step"]\n',
        '    epoch, step = state["epoch"], state["step"]\n'
        '    tuner.load_state_dict(state["memtui"])\n',
    ),
    ("        step += 1\n", "        step += 1\n        tuner.step()\n"),
    (
        '                "step": step,\n',
        '                "step": step,\n                "memtui": tuner.state_dict(),\n',
    ),
    (
        "            torch.save(state, checkpoint)\n",
        "            torch.save(state, checkpoint)\n            tuner.checkpoint()\n",
    ),
]
"""memtui's lines, as the plain-loop guide documents them: (the script's line, what replaces it)."""

ROWS_PER_RANK, ROW_LENGTH, EPOCHS, BATCH, EVERY, LR, DECAY = 80, 8, 4, 8, 4, 0.01, 32
"""Each rank's share of the data set, and the script's defaults."""


def documented(script: str) -> str:
    """The script with memtui's documented lines."""
    for line, replacement in DOCUMENTED_LINES:
        assert script.count(line) == 1, line
        script = script.replace(line, replacement)
    return script


def write_inputs(workdir: Path, ranks: int, with_lines: bool) -> tuple[Path, list[str]]:
    """The script (with memtui's lines or without) and its data set (``ROWS_PER_RANK`` distinct
    token rows per rank) in ``workdir``; returns the script and the digest of each row."""
    import torch

    generator = torch.Generator().manual_seed(7)
    rows: dict[tuple[int, ...], None] = {}
    while len(rows) < ROWS_PER_RANK * ranks:
        rows[tuple(torch.randint(0, 64, (ROW_LENGTH,), generator=generator).tolist())] = None
    table = torch.tensor(list(rows))
    workdir.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "rows": table,
            "labels": (table.sum(1) % 2),
            "held_out": torch.randint(0, 64, (16, ROW_LENGTH), generator=generator),
            "held_out_labels": torch.randint(0, 2, (16,), generator=generator),
        },
        workdir / "data.pt",
    )
    script = workdir / "train.py"
    script.write_text(documented(SCRIPT) if with_lines else SCRIPT)
    return script, [row_digest(row) for row in table.tolist()]


def scheduled_lr(step: int) -> float:
    """The script's LR at optimizer step ``step`` (``LambdaLR`` steps after each)."""
    return LR * (1 - (step - 1) / DECAY)


def state_files(out: Path) -> dict[str, bytes]:
    """Each rank's checkpoint file, by name."""
    return {p.name: p.read_bytes() for p in sorted(out.glob("state-*.pt"))}


# ------------------------------------------------ no change queued: the documented lines


@dataclass
class Unchanged:
    """The script with the documented lines run to its end with memtui, then with
    ``MEMTUI_DISABLE=1``; the script without them as its users run it (``bare``), then under
    ``memtui run`` (``watched``); each in a directory of its own, with the same data."""

    ranks: int
    runs: dict[str, ClientRun]
    out: dict[str, Path]
    """Each run's checkpoint directory, by the run's label."""
    dataset: list[str]
    registered: list[dict[str, Any]]
    """``memtui ls --json``'s entries of the run under ``memtui run``, read while it waited."""
    listed: str
    """The run ``memtui ls`` listed with every rank of the run with the documented lines."""


LISTED_AT = 6
"""The step before which the runs with memtui wait until every rank is listed."""


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def unchanged(request: pytest.FixtureRequest) -> Iterator[Unchanged]:
    ranks = int(request.param)
    with client_home() as (base, env):
        runs, out, dataset, listed = {}, {}, [], ""
        for label, lines, extra in (
            ("tuned", True, {}),
            ("disabled", True, {"MEMTUI_DISABLE": "1"}),
            ("bare", False, {}),
        ):
            script, dataset = write_inputs(base / label, ranks, with_lines=lines)
            pause = [LISTED_AT] if label == "tuned" else []
            run = start(script, [], {**env, **extra}, pause, label, forked=ranks)
            if pause:
                try:
                    run.wait_paused(LISTED_AT, 120, ranks=ranks)
                    listed = job_run_id(run, ranks)
                finally:
                    run.go(LISTED_AT)
            runs[label] = finished(run, 120)
            out[label] = script.parent / "out"
        script, _ = write_inputs(base / "watched", ranks, with_lines=False)
        watched = start(
            script,
            [],
            env,
            [LISTED_AT],
            "watched",
            memtui_run("loop"),
            interpreter=python_or_torchrun(ranks),
        )
        try:
            watched.wait_paused(LISTED_AT, 120, ranks=ranks)

            def every_rank() -> list[dict[str, Any]] | None:
                found = registered_runs(watched, "loop")
                return found if found and all(r["ranks"] == ranks for r in found) else None

            registered = list(wait_for(every_rank, 60, what=f"{ranks} ranks listed"))  # type: ignore[call-overload]
        finally:
            watched.go(LISTED_AT)
        runs["watched"] = finished(watched, 120)
        out["watched"] = script.parent / "out"
        yield Unchanged(ranks, runs, out, dataset, registered, listed)


def test_no_change_trains_every_sample_once_per_epoch_on_the_union_of_ranks(
    unchanged: Unchanged,
) -> None:
    found = coverage_over(unchanged.dataset, unchanged.runs["tuned"], None, None)
    assert len(found) == EPOCHS, found
    assert all(c.exact for c in found), found


def test_no_change_saves_the_checkpoints_memtui_disabled_saves(unchanged: Unchanged) -> None:
    """Every rank's checkpoint file, byte for byte once saved again, but for the id of the run
    in memtui's entry."""
    assert unchanged.listed, "memtui listed the run"
    tuned, disabled = unchanged.out["tuned"], unchanged.out["disabled"]
    names = sorted(state_files(disabled))
    assert names == [f"state-{r}.pt" for r in range(unchanged.ranks)]
    assert sorted(state_files(tuned)) == names
    differ = [n for n in names if saved_without_run(tuned / n) != saved_without_run(disabled / n)]
    assert not differ, f"checkpoints that differ from MEMTUI_DISABLE=1's: {differ}"


def test_no_change_trains_every_row_at_every_lr_as_memtui_disabled(unchanged: Unchanged) -> None:
    """Every rank's optimizer steps, LRs and forwards (the rows of each), in order."""
    tuned, disabled = unchanged.runs["tuned"], unchanged.runs["disabled"]
    assert sorted(forwards_by_rank(tuned)) == list(range(unchanged.ranks))
    assert lrs_by_rank(tuned) == lrs_by_rank(disabled)
    assert steps_by_rank(tuned) == steps_by_rank(disabled)
    assert forwards_by_rank(tuned) == forwards_by_rank(disabled)
    for rank, steps in steps_by_rank(tuned).items():
        assert len(steps) == EPOCHS * ROWS_PER_RANK // BATCH, rank
        wrong = lr_mismatches(steps, scheduled_lr)
        assert not wrong, f"rank {rank}: (step, LR used, LR expected): {wrong}"


def test_no_change_trains_every_row_at_every_lr_as_the_script_without_memtui(
    unchanged: Unchanged,
) -> None:
    """The loader from the factory draws the orders the script's own ``DataLoader`` draws: the
    same rows in the same batches, the same LRs, the same model, optimizer and scheduler in each
    checkpoint (the documented lines add the ``memtui`` entry)."""
    import io

    import torch

    def saved_again(state: dict[str, Any]) -> bytes:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return buffer.getvalue()

    tuned, bare = unchanged.runs["tuned"], unchanged.runs["bare"]
    assert lrs_by_rank(tuned) == lrs_by_rank(bare)
    assert forwards_by_rank(tuned) == forwards_by_rank(bare)
    for rank in range(unchanged.ranks):
        saved = torch.load(unchanged.out["tuned"] / f"state-{rank}.pt")
        plain = torch.load(unchanged.out["bare"] / f"state-{rank}.pt")
        assert saved.pop("memtui")["step"] == plain["step"]
        assert saved_again(saved) == saved_again(plain), f"rank {rank}: the checkpoint's entries"


def test_under_memtui_run_the_loop_trains_every_row_at_every_lr_and_saves_as_without_memtui(
    unchanged: Unchanged,
) -> None:
    """The script without the lines under ``memtui run``: one run listed with every rank;
    every rank's steps, LRs, forwards and rows, and every checkpoint file byte for byte, as
    without memtui."""
    assert len(unchanged.registered) == 1, unchanged.registered
    plain, watched = unchanged.runs["bare"], unchanged.runs["watched"]
    assert sorted(forwards_by_rank(watched)) == list(range(unchanged.ranks))
    assert lrs_by_rank(watched) == lrs_by_rank(plain)
    assert steps_by_rank(watched) == steps_by_rank(plain)
    assert forwards_by_rank(watched) == forwards_by_rank(plain)
    expected = state_files(unchanged.out["bare"])
    assert len(expected) == unchanged.ranks
    assert state_files(unchanged.out["watched"]) == expected


# ------------------------------------- changes queued, a kill in the middle of an epoch, a restart


CHANGES = {
    EVERY: ["batch_size=4", "--keep-effective-batch"],
    2 * EVERY: ["batch_size=8", "--allow-effective-batch", "--lr-scale", "linear"],
    3 * EVERY: ["num_workers=2"],
}
"""Queued while every rank waits before that optimizer step, each lands at the checkpoint after
it: 8 x 1 until step 4, 4 x 2 until step 8, then 8 x 2 (the LR x2); two loader workers after
step 12. Each rank's 80 rows: epoch 0 ends at step 9, epoch 1 at 14, epoch 2 at 19."""
RESUME_FROM = 4 * EVERY
"""The last checkpoint before the kill: step 16, the second of epoch 2."""
KILL_AT = RESUME_FROM + 2
"""Every rank is killed before this step (step 17 trained: in the middle of epoch 2)."""
LAST_STEP = 24
"""Epoch 0 in 9 steps, each of the 3 others in 5."""


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def restarted(request: pytest.FixtureRequest) -> Iterator[tuple[Job, list[str], int]]:
    ranks = int(request.param)
    with client_home() as (base, env):
        script, dataset = write_inputs(base / "run", ranks, with_lines=True)
        job = play_job(
            script,
            [],
            env,
            CHANGES,
            KILL_AT,
            ["--resume"],
            ranks,
            forked=ranks,
            audit=script.parent / "out" / "memtui-audit.jsonl",
            timeout=120,
        )
        yield job, dataset, ranks


def test_changes_are_taken_and_land_at_the_next_checkpoint_on_every_rank(
    restarted: tuple[Job, list[str], int],
) -> None:
    """8 x 1 until the checkpoint at step 4, 4 x 2 until the one at 8, 8 x 2 after it; two
    loader workers after the one at 12; the restart trains 8 x 2 with two workers."""
    job, _, ranks = restarted
    for at, reply in job.replies.items():
        assert reply.returncode == 0, f"before step {at}: {reply.stderr}{reply.stdout}"
    assert [a["step"] for a in job.status_before_kill["applied"]] == list(CHANGES)
    first = steps_by_rank(job.first)
    assert sorted(first) == list(range(ranks))
    for rank, steps in first.items():
        shapes = [(s.number, s.batches, s.workers) for s in steps]
        expected = [(n, [8] if n <= 4 else [4, 4] if n <= 8 else [8, 8], 0) for n in range(1, 13)]
        expected += [(n, [8, 8], 2) for n in range(13, KILL_AT)]
        assert shapes == expected, f"rank {rank}"
    assert job.restart is not None
    for rank, steps in steps_by_rank(job.restart).items():
        assert {(tuple(s.batches), s.workers) for s in steps} == {((8, 8), 2)}, f"rank {rank}"


def test_every_sample_once_per_epoch_over_the_killed_run_and_its_restart(
    restarted: tuple[Job, list[str], int],
) -> None:
    """The killed run's rows up to its checkpoint at step 16, then the restart's: each of the
    4 epochs trains each sample exactly once on the union of the ranks."""
    job, dataset, _ = restarted
    found = coverage_over(dataset, job.first, RESUME_FROM, job.restart)
    assert len(found) == EPOCHS, found
    wrong = [c for c in found if not c.exact]
    assert not wrong, f"epochs not trained on each sample exactly once: {wrong}"


def test_every_step_trains_at_the_scripts_lr_times_the_factor_memtui_reports(
    restarted: tuple[Job, list[str], int],
) -> None:
    """The schedule's LR times the product of the factors memtui reports for the changes
    applied before each step (x2 from step 9), on every rank, in the killed run and the
    restart; the audit log reports the same factors."""
    job, _, _ = restarted
    factors = lr_factors(job.status_before_kill)
    assert [f for _, f in factors] == [1.0, 2.0, 1.0], factors
    audit = [
        (int(e["step"]), float(e.get("lr_factor") or 1.0))
        for e in job.audit
        if e.get("event") == "applied"
    ]
    assert audit == factors, (audit, factors)
    for run in job.runs():
        for rank, steps in steps_by_rank(run).items():
            assert steps, f"rank {rank} made no optimizer step"
            wrong = lr_mismatches(steps, lambda n: scheduled_lr(n) * factor_at(factors, n))
            assert not wrong, f"{run.log.stem}, rank {rank}: (step, LR used, LR expected): {wrong}"


def test_the_restart_counts_the_scripts_steps(restarted: tuple[Job, list[str], int]) -> None:
    """The restart's optimizer steps continue from the checkpoint: 17 to 24 on every rank."""
    job, _, ranks = restarted
    assert job.restart is not None
    assert job.status_before_kill["step"] == KILL_AT - 1
    numbers = {r: [s.number for s in steps] for r, steps in steps_by_rank(job.restart).items()}
    assert numbers == {r: list(range(RESUME_FROM + 1, LAST_STEP + 1)) for r in range(ranks)}
