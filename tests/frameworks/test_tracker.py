"""The user's tracker through the frameworks' own logging: a change queued by a real client lands
at a save and reaches the TensorBoard event file the Trainer (``report_to="tensorboard"``) or the
Lightning ``TensorBoardLogger`` writes, at the step it landed, beside the run's own loss (read
back with the tensorboard package's reader)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.harness import PYTHON, paused_run
from tests.support.tbevents import read_events

pytest.importorskip("tensorboard")
HERE = Path(__file__).parent
REBUILT = "(the data loader is rebuilt at the next batch; warning: effective batch {} -> {}, the LR does not follow (rule none))"


def test_hf_trainer_logs_the_change_to_its_report_to(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    script = HERE / "hf_train.py"
    with paused_run(tmp_path, PYTHON, script, "--report-to", "tensorboard") as paused:
        paused.queue_and_go("batch_size=6")
        paused.finish(180)
    assert json.loads(paused.report.read_text())["restarts"] == 1
    logged = read_events(tmp_path / "out" / "runs")
    # the Trainer's TensorBoardCallback: a string as text, a number as a scalar, "train/" first
    assert logged.texts["train/memtui"] == [
        (4, f"batch_size 4 -> 6 at step 4 {REBUILT.format(8, 12)}")
    ]
    assert logged.scalars["train/memtui/batch_size"] == [(4, 6.0)]
    loss_steps = [step for step, _ in logged.scalars["train/loss"]]
    assert loss_steps == list(range(1, 13)), "the loss it is read against, on the same steps"


def test_lightning_logs_the_change_to_its_loggers(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    script = HERE / "lightning_train.py"
    with paused_run(tmp_path, PYTHON, script, "--tensorboard") as paused:
        paused.queue_and_go("batch_size=6", "grad_accum=3")
        paused.finish(180)
    assert json.loads(paused.report.read_text())["global_step"] == 12
    logged = read_events(tmp_path / "out" / "tb")
    assert logged.texts["memtui"] == [
        (4, f"batch_size 4 -> 6, grad_accum 2 -> 3 at step 4 {REBUILT.format(8, 18)}")
    ]
    assert logged.scalars["memtui/batch_size"] == [(4, 6.0)]
    assert logged.scalars["memtui/grad_accum"] == [(4, 3.0)]
    # Lightning logs the loss of optimizer step s + 1 at step s (the steps taken before it): the
    # first loss of the new settings is at the change's step 4
    loss_steps = [step for step, _ in logged.scalars["loss"]]
    assert loss_steps == list(range(12)), loss_steps
