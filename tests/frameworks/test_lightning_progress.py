"""Lightning's progress bars through a batch-size change (Rich, Lightning's default where rich is
installed; tqdm; a user's own reading ``trainer.num_training_batches``): the run keeps training,
every count a callback reads is the epoch's real, finite number of batches, the epoch ends with
memtui's loader and its end-of-epoch validation runs there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.harness import PYTHON, paused_run

SCRIPT = Path(__file__).with_name("lightning_train.py")
SAMPLES = 96


@pytest.mark.parametrize("bar", ["default", "tqdm", "custom"])
def test_a_batch_size_change_keeps_every_progress_bar_counting(tmp_path: Path, bar: str) -> None:
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("rich")
    args = ("--samples", str(SAMPLES), "--max-epochs", "2", "--constant-lr", "--validate")
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, "--progress-bar", bar) as paused:
        paused.queue_and_go("batch_size=6")
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    expected_bar = {"default": "RichProgressBar", "tqdm": "TQDMProgressBar"}.get(bar, "CountingBar")
    assert report["progress_bar"] == expected_bar
    # epoch 0: 8 batches of 4 to the change at step 4, then its 64 samples left in 10 batches of
    # 6 and one of 4 (19 batches); epoch 1: 16 batches of 6
    assert report["epoch_batches"] == [19, 16]
    assert report["counts_at_epoch_start"] == [[24, 24], [16, 16]], "finite and real"
    assert report["bars"] == [[19, 19], [16, 16]], "the bar's total follows the change"
    assert report["validations"] == [[0, 19], [1, 16]], "at each epoch's end, once"
    # groups of 2; epoch 0's last group is its last batch alone, stepped at the epoch's end
    assert report["accum_per_step"] == [2] * 9 + [1] + [2] * 8
    assert report["global_step"] == report["tuner_step"] == 18
    seen, starts = report["seen"], report["epoch_starts"]
    assert starts == [0, SAMPLES] and len(seen) == 2 * SAMPLES
    for epoch in (0, 1):
        part = seen[epoch * SAMPLES : (epoch + 1) * SAMPLES]
        assert sorted(part) == list(range(SAMPLES)), f"epoch {epoch}: every sample once"
    assert list((tmp_path / "out" / "lightning_logs").glob("version_0/events.out.*")), (
        "the default logger wrote"
    )
