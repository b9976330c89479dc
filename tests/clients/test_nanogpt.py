"""karpathy/nanoGPT's ``train.py``, unchanged but for the documented lines (a loop without a
DataLoader: ``get_batch``, module globals, its own LR schedule assigned every iteration), on CPU
with a 2-layer model and local token files: what the script really trains on and with which LR,
as torch's global hooks see it."""

from __future__ import annotations

import math
import subprocess
import sys
import time
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
from tests.clients.upstream import CLIENTS, apply_patch

pytest.importorskip("numpy")

EVERY = 4
"""nanoGPT evaluates, saves ``ckpt.pt`` and reaches memtui's boundary every ``eval_interval``."""
MAX_ITERS = 20
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2
CONFIG = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--dataset=tiny",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--dropout=0.0",
    "--batch_size=4",
    "--gradient_accumulation_steps=2",
    f"--max_iters={MAX_ITERS}",
    f"--lr_decay_iters={MAX_ITERS}",
    f"--eval_interval={EVERY}",
    "--eval_iters=2",
    f"--warmup_iters={WARMUP}",
    f"--learning_rate={LR}",
    f"--min_lr={MIN_LR}",
]
PLAN = Plan(
    args=CONFIG,
    every=EVERY,
    first_change=["batch_size=2", "--keep-effective-batch"],  # 4 x 2 -> 2 x 4
    second_change=["batch_size=4", "--allow-effective-batch", "--lr-scale", "linear"],  # 8 -> 16
    restart_args=[*CONFIG, "--init_from=resume"],
    kill_at=3 * EVERY + 2,
)


def get_lr(it: int) -> float:
    """nanoGPT's schedule (cosine with warmup) for iteration ``it``, with this config."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > MAX_ITERS:
        return MIN_LR
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (MAX_ITERS - WARMUP)))
    return MIN_LR + coeff * (LR - MIN_LR)


def expected_lr(step: int) -> float:
    """The LR optimizer step ``step`` (iteration ``step - 1``) must use: the schedule, x2 from
    the second checkpoint's change on (``learning_rate`` and ``min_lr`` doubled)."""
    return get_lr(step - 1) * (2.0 if step > 2 * EVERY else 1.0)


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("nanogpt", base / "run")
        local_data.nanogpt_dataset(script.parent, "tiny")
        yield play(script, env, PLAN)


def test_the_run_registers(scenario: Scenario) -> None:
    listed = scenario.listed
    assert listed["cwd"] == str(scenario.first.workdir)
    assert "train.py" in str(listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_and_accumulation_land_at_the_next_checkpoint(scenario: Scenario) -> None:
    """4 x 2 until the checkpoint at step 4, 2 x 4 after it (the first micro-batch of step 5
    is the one the script prefetched during step 4), 4 x 4 after the one at step 8."""
    steps = steps_of(scenario.first)
    batches = {s.number: s.batches for s in steps}
    assert [batches[n] for n in range(1, 5)] == [[4, 4]] * 4
    assert batches[5] == [4, 2, 2, 2], "prefetched before the boundary, then the new size"
    assert [batches[n] for n in range(6, 9)] == [[2, 2, 2, 2]] * 3
    assert batches[9] == [2, 4, 4, 4]
    assert [batches[n] for n in range(10, PLAN.kill_at)] == [[4, 4, 4, 4]] * (PLAN.kill_at - 10)


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    """memtui says x2 for the change at step 8, and the optimizer uses the schedule x2 on every
    step after it, not only the first (the script assigns ``get_lr(iter_num)`` each iteration)."""
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    assert "x2" in scenario.replies[1].stdout + scenario.replies[1].stderr
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_a_restart_from_the_scripts_checkpoint_resumes_the_tuned_knobs(scenario: Scenario) -> None:
    """Killed after the checkpoint at step 12 and restarted with ``init_from=resume``: 4 x 4
    from its first step (13), the LR of the schedule x2 (``learning_rate`` and ``min_lr`` scaled
    again from the tuned config)."""
    assert scenario.restart is not None
    steps = steps_of(scenario.restart)
    assert steps[0].number == 3 * EVERY + 1
    assert [s.number for s in steps] == list(range(13, MAX_ITERS + 2))
    assert all(s.batches == [4, 4, 4, 4] for s in steps), [s.batches for s in steps]
    wrong = lr_mismatches(steps, expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"
    config = scenario.status_after_restart["config"]
    assert (config["batch_size"], config["grad_accum"]) == (4, 4)


def test_the_scripts_checkpoint_keeps_the_tuned_config_beside_its_startup_config(
    scenario: Scenario,
) -> None:
    """nanoGPT's ``ckpt.pt`` keeps the config it started with; memtui's entry in it keeps what
    memtui set (4 x 4 over the script's 4 x 2, the LR x2), loadable as nanoGPT loads it."""
    import torch

    assert scenario.restart is not None
    saved = torch.load(Path(scenario.restart.workdir) / "out" / "ckpt.pt", weights_only=True)
    assert (saved["config"]["batch_size"], saved["config"]["gradient_accumulation_steps"]) == (4, 2)
    entry = saved["memtui"]
    assert entry["step"] == MAX_ITERS and entry["config"] == {"grad_accum": 4}, entry
    assert entry["lr"]["factor"] == pytest.approx(2.0), entry
    assert entry["lr"]["fields"] == ["learning_rate", "min_lr"], entry


def test_after_the_restart_memtui_counts_the_scripts_steps(scenario: Scenario) -> None:
    """Paused before the restarted process's second step (nanoGPT's 14th): memtui's step is the
    13 nanoGPT counts (``tuner.load_state_dict({"step": iter_num})``), not this process's 1."""
    assert scenario.restart_paused["opt_step"] == 14
    assert scenario.status_after_restart["step"] == 13


def test_the_scripts_own_logging_evaluation_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    import torch

    first = scenario.first.output()
    for line in ("step 4: train loss", "step 12: train loss", "saving checkpoint to out"):
        assert line in first
    assert "iter 12: loss" in first
    assert scenario.restart is not None
    restart = scenario.restart.output()
    assert "Resuming training from out" in restart
    assert f"iter {MAX_ITERS}: loss" in restart and f"step {MAX_ITERS}: train loss" in restart
    saved = torch.load(Path(scenario.restart.workdir) / "out" / "ckpt.pt", weights_only=False)
    assert saved["iter_num"] == MAX_ITERS


def test_a_boundary_inside_the_master_s_save_gives_up_in_seconds_under_torchrun() -> None:
    """nanoGPT's natural spot for ``tuner.checkpoint()`` is inside its master-only save, where it
    must not be. Under torchrun (two ranks, gloo) rank 1 goes on into the next step and waits in
    DDP's gradient all-reduce; rank 0 names it within seconds (the boundary's bound is half of
    gloo's 30 minutes), and the job trains to its end."""
    with client_home() as (base, env):
        script = client_script("nanogpt", base / "run")
        # on top of the documented lines: CPU ranks under torchrun (upstream sets a CUDA device)
        # and the boundary moved into the master's save
        patch = CLIENTS / "nanogpt" / "checkpoint_on_master.patch"
        apply_patch(patch.read_text(), script.parent)
        local_data.nanogpt_dataset(script.parent, "tiny")
        env.pop("MEMTUI_BOUNDARY_TIMEOUT", None)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        started = time.monotonic()
        result = subprocess.run(
            [*launcher, "--nproc_per_node=2", str(script), *CONFIG, "--backend=gloo"],
            cwd=script.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"iter {MAX_ITERS}: loss" in output, "trained to its end\n" + output
    assert (
        f"rank 1 went past step {EVERY} without calling tuner.checkpoint() "
        f"(it is in the backward pass of step {EVERY + 1})"
    ) in output, output
    assert took < 90, f"{took:.0f} s: the boundary waited\n{output}"
