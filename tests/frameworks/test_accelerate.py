"""Accelerate with ``hooks.install(accelerator, ...)``: a change queued by a real client lands at
the next ``save_state``, in the loop itself; one process, and two under ``accelerate launch`` and
under torchrun."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.harness import ACCELERATE_CPU, PYTHON, accelerate_launch, paused_run, torchrun

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("accel_train.py")
SAMPLES = 96


def run_with_change(
    tmp_path: Path,
    launcher: list[str],
    world: int,
    env: dict[str, str] | None = None,
    more: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """Start the loop, queue batch 4 -> 6 and accumulation 2 -> 3 (and ``more``) at step 2, wait
    for the end."""
    args = ("--samples", str(SAMPLES))
    extra = dict(OMP_NUM_THREADS="1", **(env or {}))
    with paused_run(tmp_path, launcher, SCRIPT, *args, report="report", env=extra) as paused:
        paused.queue_and_go("batch_size=6", "grad_accum=3", *more)
        paused.finish(180)
    report = paused.report
    reports = [json.loads(Path(f"{report}.{rank}.json").read_text()) for rank in range(world)]
    return reports


def check_common(reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["steps"] == 12
        assert report["accum_per_step"] == [2] * 4 + [3] * 8, "accumulation 3 from step 5 on"
        assert report["gradient_accumulation_steps"] == report["config_accum"] == 3
        assert report["batch_size"] == 6
        expected = [0.1 * (1 - s / 12) for s in range(1, 13)]
        assert report["lrs"] == pytest.approx(expected), "one scheduler step per optimizer step"


def test_change_lands_in_the_loop_one_process(tmp_path: Path) -> None:
    more = ("num_workers=2", "pin_memory=true")
    (report,) = run_with_change(tmp_path, [sys.executable], 1, more=more)
    check_common([report])
    # the loader is rebuilt at the first batch after the save of step 4, with two worker
    # processes and pinning asked for (on a machine with no GPU torch then pins nothing)
    loaders = report["loaders"]
    assert loaders[:4] == [[0, False, 0]] * 4
    assert loaders[4:] == [[2, True, 2]] * 8, "two workers from step 5 on"
    seen = report["seen"]
    # 4 steps x 2 x 4 samples, then 24 micro-batches of 6 (one of 4 ends epoch 0)
    assert len(seen) == 32 + 64 + 13 * 6
    assert sorted(seen[:SAMPLES]) == list(range(SAMPLES)), "epoch 0: every sample once"
    assert len(set(seen[SAMPLES:])) == len(seen) - SAMPLES, "epoch 1: no sample twice"


@pytest.mark.parametrize("launcher", ["accelerate", "torchrun"])
def test_same_change_same_step_under_two_processes(tmp_path: Path, launcher: str) -> None:
    # on a machine with no GPU, Accelerate runs several CPU processes (MULTI_CPU, gloo) only with
    # ACCELERATE_USE_CPU; under torchrun without it each process would train alone
    prefix = accelerate_launch(2) if launcher == "accelerate" else torchrun(2)
    reports = run_with_change(tmp_path, prefix, 2, ACCELERATE_CPU)
    check_common(reports)
    # global batches of 4 x 2 ranks, then 6 x 2: epoch 0 is 32 + 64 samples split between ranks
    first = [i for r in reports for i in r["seen"][:16]]
    assert len(set(first)) == 32, "before the change: no sample on both ranks"
    after = [i for r in reports for i in r["seen"][16:48]]
    assert sorted(first + after) == list(range(SAMPLES)), "epoch 0: every sample once over ranks"


def test_epoch_bounded_loop_with_a_sized_schedule_gets_a_warning(tmp_path: Path) -> None:
    # 2 epochs of 24 batches of 4 in groups of 2: a OneCycleLR (prepared) sized 24 steps. The
    # loop is the script's: from accumulation 1 at step 4 on, its 2 epochs make 44 steps.
    # memtui says so at the change; Accelerate stops stepping the OneCycleLR at its end
    args = ("--samples", str(SAMPLES), "--epochs", "2", "--onecycle")
    env = {"OMP_NUM_THREADS": "1"}
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, report="report", env=env) as paused:
        paused.queue_and_go("grad_accum=1")
        paused.finish(180)
    assert "OneCycleLR total_steps=24" in paused.output()
    assert "bound the loop by optimizer steps (tuner.step_count)" in paused.output()
    report = json.loads(Path(f"{paused.report}.0.json").read_text())
    # epoch 0: 4 steps of 2, then its 16 batches left one a step; epoch 1: 24 steps of 1
    assert report["epochs"] == 2 and report["steps"] == 4 + 16 + 24
    assert report["accum_per_step"] == [2] * 4 + [1] * 40
    lrs = report["lrs"]
    assert max(lrs) == pytest.approx(0.1, rel=0.01), "the cycle's peak"
    assert lrs[24:] == [lrs[24]] * 20 and lrs[24] < 0.002, "the last 20 steps at the end's LR"
