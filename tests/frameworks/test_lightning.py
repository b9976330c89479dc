"""Lightning with ``hooks.install(trainer)`` (``lightning.pytorch`` and ``pytorch_lightning``): a
change queued by a real client lands right after the next checkpoint, inside ``fit``; a run
bounded by epochs whose LR schedule was sized from the step estimate keeps its step count; a
smaller batch trains whole epochs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.harness import PYTHON, paused_run

SCRIPT = Path(__file__).with_name("lightning_train.py")
SAMPLES = 96


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_change_lands_after_the_next_checkpoint(tmp_path: Path, package: str) -> None:
    pytest.importorskip(package)
    args = ("--samples", str(SAMPLES), "--package", package)
    with paused_run(tmp_path, PYTHON, SCRIPT, *args) as paused:
        paused.queue_and_go("batch_size=6", "grad_accum=3")
        paused.finish(180)
    report_path = paused.report
    report = json.loads(report_path.read_text())
    assert report["global_step"] == report["tuner_step"] == 12
    accum = report["accum_per_step"]
    assert accum[:7] == [2] * 4 + [3] * 3, "whole groups of 3 from step 5 on"
    # 8 batches of 4, then the 64 samples left in 11 batches of 6 (the last of 4): epoch 0 ends
    # with 2 batches of a group, stepped at the loader's last batch (not at Lightning's count of
    # 24 batches, made at the epoch's start)
    assert accum[7] == 2 and accum[8:] == [3] * 4
    assert report["accumulate_grad_batches"] == 3 and report["batch_size"] == 6
    assert report["lrs"] == pytest.approx([0.1 * (1 - s / 12) for s in range(12)])
    seen = report["seen"]
    assert report["epoch_starts"] == [0, SAMPLES] and len(seen) == SAMPLES + 4 * 3 * 6
    assert sorted(seen[:SAMPLES]) == list(range(SAMPLES)), "epoch 0: every sample once"
    assert len(set(seen[SAMPLES:])) == len(seen) - SAMPLES, "epoch 1: no sample twice"


def test_the_lr_follows_the_effective_batch_with_the_sqrt_rule(tmp_path: Path) -> None:
    """4 x 2 -> 6 x 3 (8 -> 18 samples a step) with the square-root rule: Lightning's optimizer
    and its step-interval scheduler both follow, x1.5 from the step after the checkpoint on."""
    pytest.importorskip("lightning.pytorch")
    args = ("--samples", str(SAMPLES), "--package", "lightning.pytorch")
    with paused_run(tmp_path, PYTHON, SCRIPT, *args) as paused:
        paused.queue_and_go(
            "batch_size=6", "grad_accum=3", "--allow-effective-batch", "--lr-scale", "sqrt"
        )
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    assert report["accum_per_step"][:7] == [2] * 4 + [3] * 3
    expected = [0.1 * (1 - s / 12) * (1.5 if s >= 4 else 1.0) for s in range(12)]
    assert report["lrs"] == pytest.approx(expected)


def one_cycle(total: int) -> list[float]:
    """The learning rate of each of ``total`` steps of a OneCycleLR (max_lr 0.1) sized ``total``."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return lrs


@pytest.mark.parametrize("accum", [1, 3])
def test_schedule_sized_from_the_step_estimate_stays_whole(tmp_path: Path, accum: int) -> None:
    pytest.importorskip("lightning.pytorch")
    # 2 epochs of 24 batches of 4 in groups of 2: estimated_stepping_batches = 24, and the
    # OneCycleLR is sized so. Accumulation 1 from step 4 on would make 44 steps (OneCycleLR raises
    # at the 25th), 3 would make 18 (the schedule never ends): the run keeps its 24 steps
    args = ("--samples", str(SAMPLES), "--max-epochs", "2", "--onecycle")
    with paused_run(tmp_path, PYTHON, SCRIPT, *args) as paused:
        paused.queue_and_go(f"grad_accum={accum}")
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    assert report["total_steps"] == 24
    assert report["global_step"] == report["tuner_step"] == 24
    assert report["lrs"] == pytest.approx(one_cycle(24)), "the whole schedule, once"
    accum_per_step = report["accum_per_step"]
    if accum == 1:
        # epoch 0 ends at step 20 (16 more batches, one a step); step 24 ends the run in epoch 1
        assert accum_per_step == [2] * 4 + [1] * 20
        assert len(report["epoch_starts"]) == 2
    else:
        # epoch 0: 16 more batches, 5 groups of 3 and its last batch alone; 8 groups in epoch 1,
        # and the run goes on into a third epoch for its last 6 steps
        assert accum_per_step == [2] * 4 + [3] * 5 + [1] + [3] * 14
        assert len(report["epoch_starts"]) == 3


def test_smaller_batch_trains_the_whole_epoch(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    # Lightning counted 24 batches an epoch at the start; 4 -> 2 at step 4 makes epoch 0 40
    args = ("--samples", str(SAMPLES), "--max-epochs", "2")
    with paused_run(tmp_path, PYTHON, SCRIPT, *args) as paused:
        paused.queue_and_go("batch_size=2")
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    seen, starts = report["seen"], report["epoch_starts"]
    assert starts == [0, SAMPLES]
    assert sorted(seen[:SAMPLES]) == list(range(SAMPLES)), "epoch 0: every sample once"
    # 8 batches of 4, then 32 of 2: 16 steps to the epoch's end (Lightning's count would have
    # ended it after 16 of them); the linear schedule was sized for 24 steps, so the run ends
    # there, 4 steps into epoch 1
    assert report["accum_per_step"] == [2] * 24
    assert report["global_step"] == report["tuner_step"] == report["total_steps"] == 24
    assert len(seen) == SAMPLES + 4 * 2 * 2
    assert report["lrs"] == pytest.approx([0.1 * (1 - s / 24) for s in range(24)])
