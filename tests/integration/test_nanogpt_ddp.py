"""nanoGPT's own shape under torchrun: the master rank saves, every rank calls the boundary.

nanoGPT's ``train.py`` evaluates and saves on the master rank only (``if iter_num %
eval_interval == 0 and master_process:``), and with ``always_save_checkpoint=False`` only when the
validation loss improved; it sets ``param_group['lr'] = get_lr(iter_num)`` at the top of every
iteration. Two ranks over gloo on the CPU, under real torchrun, with the boundary's default wait
(half of gloo's 30 minutes): ``tuner.checkpoint()`` placed where the guide says (at every eval
interval, outside the master-only block) applies a change on both ranks at the same step, also
when rank 1 is seconds slower to get there; placed inside the master's save it aborts every
change within seconds, naming the rank that went past the step without calling it (it is
blocked in DDP's gradient all-reduce meanwhile); ``lr_fields`` makes nanoGPT's own schedule
follow the LR rule on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.clock import patience

pytestmark = pytest.mark.heavy

SCRIPT = textwrap.dedent(
    """
    import json, math, os, sys, time
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch_size = 4
    gradient_accumulation_steps = 2
    block_size = 16
    learning_rate = 6e-4
    min_lr = 6e-5
    warmup_iters = 5
    lr_decay_iters = 60
    max_iters = 36
    eval_interval = 10
    always_save_checkpoint = True
    placement = "every rank"
    slow_rank_s = 0.0  # rank 1 takes this long to reach its first boundary (a long save)
    out_dir = "out"
    for arg in sys.argv[1:]:  # nanoGPT's configurator, in short
        key, value = arg.removeprefix("--").split("=")
        globals()[key] = value if isinstance(globals()[key], str) else type(globals()[key])(eval(value))

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    master_process = rank == 0
    torch.manual_seed(1337 + rank)
    data = torch.randint(0, 64, (4096,))

    def get_batch(split):
        ix = torch.randint(len(data) - block_size - 1, (batch_size,))
        x = torch.stack([data[i : i + block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
        return x, y

    def get_lr(it):  # nanoGPT's: linear warm-up, cosine decay to min_lr
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        if it > lr_decay_iters:
            return min_lr
        ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

    model = DDP(nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)

    from memtui import hooks
    from memtui.wire import SetRequest

    tuner = hooks.install(
        globals(), model=model, optimizer=optimizer, state_dir=out_dir,
        lr_fields=("learning_rate", "min_lr"),
    )
    timed_get_batch = tuner.timed_batches(get_batch)
    if master_process:
        print("run", tuner.run_id, flush=True)
    used = []  # the LR each optimizer step really uses, and the micro-batch it was fed
    optimizer.register_step_pre_hook(lambda o, *_: used.append([o.param_groups[0]["lr"], batch_size]))

    best_val_loss = 1e9
    X, Y = timed_get_batch("train")
    iter_num = 0
    while iter_num < max_iters:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0 and master_process:
            val_loss = 10.0 - iter_num if iter_num != 20 else 99.0  # no improvement at 20
            if val_loss < best_val_loss or always_save_checkpoint:
                best_val_loss = min(best_val_loss, val_loss)
                if iter_num > 0:
                    torch.save({"iter_num": iter_num}, os.path.join(out_dir, "ckpt.pt"))
                    if placement == "master only":
                        tuner.checkpoint()
        if iter_num % eval_interval == 0 and iter_num > 0 and placement == "every rank":
            if rank == 1 and iter_num == eval_interval:
                time.sleep(slow_rank_s)
            tuner.checkpoint()  # every rank, after the master's save
        if master_process and iter_num == 1:
            assert tuner.control.queue(
                SetRequest(changes={"batch_size": 8}, lr_scale="linear")
            ).ok
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            loss = F.cross_entropy(model(X).view(-1, 64), Y.view(-1)) / gradient_accumulation_steps
            X, Y = timed_get_batch("train")
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tuner.step()
        iter_num += 1
    if placement == "master only":  # rank 1 never reached a boundary: it learns of the abort
        deadline = time.monotonic() + 10
        while not tuner.control.state().disabled and time.monotonic() < deadline:
            time.sleep(0.1)
    report = {
        "used": used,
        "applied": [[a.step, sorted(a.changes)] for a in tuner.control.applied],
        "rejected": [r.reason for r in tuner.control.state().rejected],
        "disabled": tuner.control.state().disabled,
        "factor": tuner.control.state().lr.factor,
        "learning_rate": learning_rate,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    tuner.close()
    dist.destroy_process_group()
    """
)


def get_lr(it: int) -> float:
    """nanoGPT's schedule at the script's own values (the one above)."""
    import math

    learning_rate, min_lr, warmup, decay = 6e-4, 6e-5, 5, 60
    if it < warmup:
        return learning_rate * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@dataclass
class Job:
    """A finished job: each rank's report, what the ranks printed, its wall time."""

    ranks: dict[int, dict[str, Any]]
    output: str
    took_s: float


def run_job(tmp_path: Path, *config: str) -> Job:
    """The job on two ranks under torchrun, with the boundary's default wait (asserted exit 0)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "MEMTUI_BOUNDARY_TIMEOUT"}
    env["OMP_NUM_THREADS"] = "1"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    started = time.monotonic()
    result = subprocess.run(
        [*launcher, str(script), *config],
        capture_output=True,
        text=True,
        timeout=patience(180),
        cwd=tmp_path,
        env=env,
    )
    took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    ranks = {r: json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)}
    return Job(ranks, output, took)


@pytest.mark.parametrize("always_save", ["True", "False"])
def test_the_boundary_on_every_rank_applies_the_change_and_the_schedule_follows(
    tmp_path: Path, always_save: str
) -> None:
    ranks = run_job(tmp_path, f"--always_save_checkpoint={always_save}").ranks
    for rank, report in ranks.items():
        assert report["applied"] == [[10, ["batch_size"]]], (rank, report)
        assert not report["disabled"]
        used = report["used"]
        assert [b for _, b in used] == [4] * 10 + [8] * 26, "batch 8 from step 11 on every rank"
        # the boundary's own iteration (10) already set its LR; memtui doubled it, and nanoGPT's
        # schedule reads the doubled learning_rate and min_lr from then on
        expected = [get_lr(it) * (2 if it >= 10 else 1) for it in range(36)]
        assert [lr for lr, _ in used] == pytest.approx(expected), rank
        assert report["factor"] == 2.0 and report["learning_rate"] == pytest.approx(1.2e-3)


def test_a_boundary_on_the_master_rank_only_names_the_rank_that_went_past_in_seconds(
    tmp_path: Path,
) -> None:
    """Rank 1 goes on into step 11 and waits in DDP's gradient all-reduce: its progress says so,
    and rank 0 gives up at once instead of waiting half of gloo's 30 minutes."""
    job = run_job(tmp_path, "--placement=master only")
    assert job.took_s < patience(45), f"{job.took_s:.0f} s: the boundary waited\n{job.output}"
    past = "rank 1 went past step 10 without calling tuner.checkpoint()"
    assert f"changes are OFF for this run (rank 0, checkpoint #1 at step 10): {past}" in (
        job.output
    ), job.output
    assert "outside any `if rank == 0:` block" in job.output
    for rank, report in job.ranks.items():
        assert report["applied"] == [], rank
        assert [b for _, b in report["used"]] == [4] * 36, "nothing applied on one rank alone"
        assert report["disabled"].startswith(past), (rank, report["disabled"])
    rejected = job.ranks[0]["rejected"]
    assert len(rejected) == 1 and rejected[0].startswith(f"changes are off for this run: {past}")


def test_a_rank_slow_to_reach_the_boundary_is_waited_for(tmp_path: Path) -> None:
    """Rank 1 takes 4 s longer to get to its boundary (a long save), at the step it closed."""
    job = run_job(tmp_path, "--slow_rank_s=4")
    for rank, report in job.ranks.items():
        assert report["applied"] == [[10, ["batch_size"]]], (rank, report, job.output)
        assert not report["disabled"], rank
        assert [b for _, b in report["used"]] == [4] * 10 + [8] * 26, rank
    assert "went past" not in job.output and job.took_s < patience(60), job.output
