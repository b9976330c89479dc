"""transformers' ``examples/pytorch/language-modeling/run_clm.py`` (the HF ``Trainer``), unchanged
but for the documented two lines, training a 2-layer GPT-2 from a local config with a tokenizer
trained here, on local text files, offline: what the Trainer really trains on, with how many
loader workers and which LR, as torch's global hooks see it."""

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

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("evaluate")

EVERY = 4
"""``--save_steps``: the Trainer's save is memtui's boundary."""
MAX_STEPS = 20
LR = 1e-3
ARGS = [
    "--config_name", "config",
    "--tokenizer_name", "tokenizer",
    "--train_file", "train.txt",
    "--validation_file", "val.txt",
    "--block_size", "32",
    "--do_train",
    "--do_eval",
    "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "4",
    "--max_eval_samples", "8",
    "--gradient_accumulation_steps", "1",
    "--max_steps", str(MAX_STEPS),
    "--save_steps", str(EVERY),
    "--eval_strategy", "steps",
    "--eval_steps", str(EVERY),
    "--logging_steps", "1",
    "--learning_rate", str(LR),
    "--output_dir", "out",
    "--use_cpu",
    "--seed", "0",
]  # fmt: skip
PLAN = Plan(
    args=ARGS,
    every=EVERY,
    first_change=["batch_size=2", "--keep-effective-batch", "num_workers=2"],  # 4 x 1 -> 2 x 2
    second_change=["batch_size=4", "--allow-effective-batch", "--lr-scale", "linear"],  # 4 -> 8
    restart_args=[*ARGS, "--resume_from_checkpoint", f"out/checkpoint-{3 * EVERY}"],
    kill_at=3 * EVERY + 2,
)


def expected_lr(step: int) -> float:
    """The Trainer's linear schedule at optimizer step ``step``, x2 after the second change."""
    return LR * (MAX_STEPS - (step - 1)) / MAX_STEPS * (2.0 if step > 2 * EVERY else 1.0)


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("hf_run_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        local_data.accuracy_metric(script.parent)
        yield play(script, env, PLAN)


def test_the_run_registers(scenario: Scenario) -> None:
    assert scenario.listed["cwd"] == str(scenario.first.workdir)
    assert "run_clm.py" in str(scenario.listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_accumulation_and_workers_land_at_the_next_save(scenario: Scenario) -> None:
    """4 x 1 with no worker until the save at step 4; 2 x 2 with two loader worker processes
    after it; 4 x 2 after the save at step 8."""
    steps = {s.number: s for s in steps_of(scenario.first)}
    assert [steps[n].batches for n in range(1, 5)] == [[4]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[2, 2]] * 4
    assert [steps[n].batches for n in range(9, PLAN.kill_at)] == [[4, 4]] * (PLAN.kill_at - 9)
    assert [steps[n].workers for n in range(1, 5)] == [0] * 4
    assert [steps[n].workers for n in range(5, PLAN.kill_at)] == [2] * (PLAN.kill_at - 5)


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_a_restart_from_the_scripts_checkpoint_resumes_the_tuned_knobs(scenario: Scenario) -> None:
    """Killed after checkpoint-12 and restarted with ``--resume_from_checkpoint``: 4 x 2 with
    two workers from its first step (13), the schedule's LR x2 (the checkpoint's optimizer and
    scheduler state already carry the factor: not x4)."""
    assert scenario.restart is not None
    steps = steps_of(scenario.restart)
    assert [s.number for s in steps] == list(range(13, MAX_STEPS + 1))
    assert all(s.batches == [4, 4] for s in steps), [s.batches for s in steps]
    assert all(s.workers == 2 for s in steps), [s.workers for s in steps]
    wrong = lr_mismatches(steps, expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"
    config = scenario.status_after_restart["config"]
    assert (config["batch_size"], config["grad_accum"], config["num_workers"]) == (4, 2, 2)


def test_after_the_restart_memtui_counts_the_scripts_steps(scenario: Scenario) -> None:
    """Paused before the restarted process's second step (the Trainer's 14th): memtui's step is
    the Trainer's global step, 13."""
    assert scenario.restart_paused["opt_step"] == 14
    assert scenario.status_after_restart["step"] == 13


def test_the_scripts_own_progress_bar_logging_evaluation_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    first = scenario.first.output()
    assert f"/{MAX_STEPS} [" in first, "the Trainer's tqdm progress bar"
    assert "{'loss': " in first and "'learning_rate': " in first
    assert "'eval_accuracy': " in first, "evaluation with the script's metric"
    assert scenario.restart is not None
    restart = scenario.restart.output()
    for line in ("***** train metrics *****", "***** eval metrics *****", "perplexity"):
        assert line in restart
    out = Path(scenario.restart.workdir) / "out"
    for name in (*(f"checkpoint-{n}" for n in (4, 8, 12, 16, 20)), "model.safetensors"):
        assert (out / name).exists(), name
    assert (out / "checkpoint-20" / "trainer_state.json").exists()
    assert (out / "eval_results.json").exists() and (out / "train_results.json").exists()
