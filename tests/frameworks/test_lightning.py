"""Lightning with ``hooks.install(trainer)`` (``lightning.pytorch`` and ``pytorch_lightning``): a
change queued by a real client lands right after the next checkpoint, inside ``fit``."""

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
    # epoch 0 ends with 2 micro-batches of a group: Lightning carries them into the next step
    assert accum[7] == 5 and accum[8:] == [3] * 4
    assert report["accumulate_grad_batches"] == 3 and report["batch_size"] == 6
    assert report["lrs"] == pytest.approx([0.1 * (1 - s / 12) for s in range(12)])
    seen = report["seen"]
    # 8 batches of 4, one more of 4 that Lightning had prefetched, then batches of 6
    assert sorted(seen[:SAMPLES]) == list(range(SAMPLES)), "epoch 0: every sample once"
    assert len(set(seen[SAMPLES:])) == len(seen) - SAMPLES, "epoch 1: no sample twice"
