"""Lightning's ``examples/pytorch/basics/transformer.py``, unchanged but for the documented lines,
with the Trainer's defaults (Rich progress bar when Rich is installed, as memtui's own
dependencies make it, TensorBoard logger, ModelCheckpoint), on a local WikiText2 file: what it
really trains on, with how many loader workers and which LR, as torch's global hooks see it.

The script has no resume of its own (``fit`` without ``ckpt_path``): there is no restart to test.
Its Trainer is kept short with Lightning's own ``PL_TRAINER_*`` defaults from the environment
(``max_steps``, ``limit_val_batches``, ``limit_test_batches``), which leave its arguments as
written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.clients import local_data
from tests.clients.harness import (
    Plan,
    Scenario,
    applied_changes,
    client_home,
    client_script,
    lr_mismatches,
    play,
    steps_of,
)

pytest.importorskip("lightning")
pytest.importorskip("requests")  # WikiText2 requires it, even for a file already there

EVERY = 4
"""80 training samples in batches of 20: an epoch is 4 steps, ModelCheckpoint saves at its end."""
MAX_STEPS = 14
PLAN = Plan(
    args=[],
    every=EVERY,
    # 20 x 1 -> 10 x 2, two loader workers: 4 steps an epoch again (the checkpoint at step 8)
    first_change=["batch_size=10", "--keep-effective-batch", "num_workers=2"],
    # 10 x 2 -> 20 x 2 (effective 20 -> 40): 2 steps an epoch, the LR x2
    second_change=["batch_size=20", "--allow-effective-batch", "--lr-scale", "linear"],
    restart_args=None,
    kill_at=2 * EVERY + 2,
)


def expected_lr(step: int) -> float:
    """The script's SGD LR (0.1), x2 after the second change."""
    return 0.1 * (2.0 if step > 2 * EVERY else 1.0)


def short_trainer(
    env: dict[str, str], max_steps: int = MAX_STEPS, bar: bool = True
) -> dict[str, str]:
    """``env`` with Lightning's own ``PL_TRAINER_*`` defaults keeping the Trainer short, and (with
    ``bar``) Rich drawing its live bar as on a terminal (into the log)."""
    short = dict(
        env,
        PL_TRAINER_MAX_STEPS=str(max_steps),
        PL_TRAINER_LIMIT_VAL_BATCHES="2",
        PL_TRAINER_LIMIT_TEST_BATCHES="2",
    )
    return dict(short, TTY_COMPATIBLE="1", TTY_INTERACTIVE="1") if bar else short


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=20 * EVERY)
        yield play(script, short_trainer(env), PLAN)


def test_the_run_registers(scenario: Scenario) -> None:
    assert scenario.listed["cwd"] == str(scenario.first.workdir)
    assert "transformer.py" in str(scenario.listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_accumulation_and_workers_land_at_the_next_checkpoint(scenario: Scenario) -> None:
    """20 x 1 with no worker until the checkpoint at the end of epoch 0 (step 4); 10 x 2 with two
    loader worker processes after it; 20 x 2 after the one at step 8; the run ends at 14."""
    steps = {s.number: s for s in steps_of(scenario.first)}
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert [steps[n].batches for n in range(1, 5)] == [[20]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[10, 10]] * 4
    assert [steps[n].batches for n in range(9, MAX_STEPS + 1)] == [[20, 20]] * (MAX_STEPS - 8)
    assert [steps[n].workers for n in range(1, 5)] == [0] * 4
    assert [steps[n].workers for n in range(5, MAX_STEPS + 1)] == [2] * (MAX_STEPS - 4)


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_the_scripts_own_progress_bar_logging_validation_test_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    """The run survives its validations after the changes with the default (Rich) progress bar,
    and its own outputs are there: the bar, the logged losses, the test table, the checkpoint
    and the TensorBoard events."""
    output = scenario.first.output()
    for epoch in range(5):  # 4 steps an epoch, 4 again, then 2: the last at step 14
        assert f"Epoch {epoch}/19" in output, f"the progress bar of epoch {epoch}"
    assert "Validation" in output and "val_loss" in output and "train_loss" in output
    assert "Test metric" in output and "test_loss" in output
    version = Path(scenario.first.workdir) / "lightning_logs" / "version_0"
    assert list((version / "checkpoints").glob("*.ckpt")), "ModelCheckpoint's file"
    assert list(version.glob("events.out.tfevents.*")), "the TensorBoard logger's events"
