"""Accelerate's ``examples/by_feature/megatron_lm_gpt_pretraining.py`` (transformers'
``run_clm_no_trainer.py`` loop: ``accelerator.accumulate``, a prepared linear LR scheduler,
``save_state`` every N steps, its own resume, tqdm, trackers), unchanged but for the documented
lines and one compatibility line (it imports ``send_example_telemetry``, which transformers 5
removed), training a 2-layer GPT-2 from a local config with a tokenizer trained here, on local
text files, offline: what it really trains on, with how many loader workers and which LR, as
torch's global hooks see it."""

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

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

EVERY = 4
"""``--checkpointing_steps``: ``accelerator.save_state`` is memtui's boundary."""
MAX_STEPS = 20
LR = 1e-3
ARGS = [
    "--config_name", "config",
    "--tokenizer_name", "tokenizer",
    "--train_file", "train.txt",
    "--validation_file", "val.txt",
    "--block_size", "32",
    "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "4",
    "--gradient_accumulation_steps", "1",
    "--learning_rate", str(LR),
    "--max_train_steps", str(MAX_STEPS),
    "--checkpointing_steps", str(EVERY),
    "--output_dir", "out",
    "--seed", "0",
    "--with_tracking",
    "--report_to", "tensorboard",
]  # fmt: skip
PLAN = Plan(
    args=ARGS,
    every=EVERY,
    first_change=["batch_size=2", "--keep-effective-batch", "num_workers=2"],  # 4 x 1 -> 2 x 2
    second_change=["batch_size=4", "--allow-effective-batch", "--lr-scale", "linear"],  # 4 -> 8
    restart_args=[*ARGS, "--resume_from_checkpoint", f"out/step_{3 * EVERY}"],
    kill_at=3 * EVERY + 2,
)


def expected_lr(step: int) -> float:
    """The script's linear schedule at optimizer step ``step``, x2 after the second change."""
    return LR * (MAX_STEPS - (step - 1)) / MAX_STEPS * (2.0 if step > 2 * EVERY else 1.0)


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("accelerate_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        yield play(script, env, PLAN)


def test_the_run_registers(scenario: Scenario) -> None:
    assert scenario.listed["cwd"] == str(scenario.first.workdir)
    assert "megatron_lm_gpt_pretraining.py" in str(scenario.listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_accumulation_and_workers_land_at_the_next_save_state(scenario: Scenario) -> None:
    """4 x 1 with no worker until ``save_state`` at step 4; 2 x 2 with two loader worker
    processes after it; 4 x 2 after the one at step 8."""
    steps = {s.number: s for s in steps_of(scenario.first)}
    assert [steps[n].batches for n in range(1, 5)] == [[4]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[2, 2]] * 4
    assert [steps[n].batches for n in range(9, PLAN.kill_at)] == [[4, 4]] * (PLAN.kill_at - 9)
    assert [steps[n].workers for n in range(1, 5)] == [0] * 4
    assert [steps[n].workers for n in range(5, PLAN.kill_at)] == [2] * (PLAN.kill_at - 5)


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    """memtui says x2 for the change at step 8, and the optimizer uses the schedule x2 on every
    step after it (the prepared scheduler sets the LR at every step)."""
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_a_restart_from_the_scripts_checkpoint_resumes_the_tuned_knobs(scenario: Scenario) -> None:
    """Killed after ``step_12`` and restarted with ``--resume_from_checkpoint``: micro-batches of
    4 in groups of 2 with two workers from its first step (13, Adam's count restored by
    ``load_state``), the LR x2."""
    assert scenario.restart is not None
    steps = steps_of(scenario.restart)
    assert [s.number for s in steps] == list(range(13, MAX_STEPS + 1))
    # the script checks `completed_steps % checkpointing_steps` at every micro-batch: with
    # accumulation 2 it saves step_12 again one micro-batch into step 13 (the accelerator's
    # micro-batch count, not that micro-batch's gradients), and its own resume finishes that
    # group with one micro-batch (the script's doing, with or without memtui)
    assert steps[0].batches == [4], "the rest of the group the second save cut"
    assert all(s.batches == [4, 4] for s in steps[1:]), [s.batches for s in steps]
    assert all(s.workers == 2 for s in steps), [s.workers for s in steps]
    wrong = lr_mismatches(steps, expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"
    config = scenario.status_after_restart["config"]
    assert (config["batch_size"], config["grad_accum"], config["num_workers"]) == (4, 2, 2)


def test_after_the_restart_memtui_counts_the_scripts_steps(scenario: Scenario) -> None:
    """Paused before the restarted process's second step (the script's 14th): memtui's step is
    the 13 the script and its optimizer count, not the 1 this process ran."""
    assert scenario.restart_paused["opt_step"] == 14
    assert scenario.status_after_restart["step"] == 13


def test_the_scripts_own_progress_bar_logging_evaluation_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    first = scenario.first.output()
    assert f"/{MAX_STEPS} [" in first, "the script's tqdm progress bar"
    assert "Saving current state to out/step_12" in first
    assert scenario.restart is not None
    restart = scenario.restart.output()
    assert "Resumed from checkpoint: out/step_12" in restart
    assert "epoch 0: perplexity:" in restart, "the script's evaluation"
    out = Path(scenario.restart.workdir) / "out"
    for n in (4, 8, 12, 16, 20):
        assert (out / f"step_{n}" / "optimizer.bin").exists(), n
    assert (out / "all_results.json").exists() and (out / "model.safetensors").exists()
    assert list((out / "clm_no_trainer").rglob("events.out.tfevents.*")), "the tracker's events"
