"""The LR factor against restored state and the schedulers that move the LR: a real optimizer
and torch LR scheduler, the LR each step uses read by a global step pre-hook (which runs before
any hook of memtui's, as a witness outside memtui does)."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memtui.hooks.lr import LearningRate
from memtui.wire import Knobs

BASE = 0.1
SMALL, DOUBLE, TRIPLE = Knobs(batch_size=8), Knobs(batch_size=16), Knobs(batch_size=24)


def schedule(step: int) -> float:
    """transformers' ``get_linear_schedule_with_warmup``: 4 steps up, then down to 0 at 40."""
    return step / 4 if step < 4 else max(0.0, (40 - step) / 36)


def training() -> tuple[torch.optim.Optimizer, LambdaLR]:
    """A fresh optimizer at the script's own LR and its warm-up schedule."""
    optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=BASE)
    return optimizer, LambdaLR(optimizer, schedule)


def steps(optimizer: torch.optim.Optimizer, scheduler: Any, count: int) -> None:
    """``count`` optimizer steps, each followed by the scheduler's."""
    for _ in range(count):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def saved(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> dict[str, Any]:
    """A checkpoint of both, as a script saves it."""
    return copy.deepcopy({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()})


@pytest.fixture
def used() -> Iterator[list[float]]:
    """The LR every optimizer step uses, read before any per-optimizer hook runs."""
    seen: list[float] = []
    handle = register_optimizer_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    yield seen
    handle.remove()


def first_run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """6 steps at the script's LR, x2 (linear, batch 8 -> 16; the scheduler found through its
    optimizer), 4 more: the tuned config's LR section and the checkpoints saved at the change's
    boundary (before it) and 4 steps after it."""
    lr = LearningRate("linear")
    optimizer, scheduler = training()
    lr.watch_optimizer(optimizer)
    steps(optimizer, scheduler, 6)
    before = saved(optimizer, scheduler)
    lr.changed(2.0, "linear", SMALL, DOUBLE)
    steps(optimizer, scheduler, 4)
    return lr.persisted()["lr"], before, saved(optimizer, scheduler)


ORDERS = ["optimizer, then scheduler", "scheduler, then optimizer", "both before memtui"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("checkpoint", ["after the change", "at the change"])
def test_a_restored_optimizer_and_scheduler_run_the_schedule_times_the_factor_once(
    used: list[float], order: str, checkpoint: str
) -> None:
    section, at_change, after_change = first_run()
    state, step = (after_change, 10) if checkpoint == "after the change" else (at_change, 6)
    restarted = LearningRate("linear")
    restarted.resume(section)
    optimizer, scheduler = training()
    if order == "both before memtui":  # a Trainer loads both before the hook sees them
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    restarted.watch_optimizer(optimizer)  # the scheduler is never given
    if order == "optimizer, then scheduler":  # accelerate's load_state, a script's own
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    elif order == "scheduler, then optimizer":
        scheduler.load_state_dict(state["scheduler"])
        optimizer.load_state_dict(state["optimizer"])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * BASE * schedule(step)), (
        "before any step: a hook that reads the LR first sees the one the step uses"
    )
    used.clear()
    steps(optimizer, scheduler, 8)
    assert used == [pytest.approx(2 * BASE * schedule(s)) for s in range(step, step + 8)]
    assert restarted.factor == 2.0 and not restarted.owner, "never withdrawn: the LR is x2"
    assert scheduler.base_lrs == [pytest.approx(2 * BASE)]
    assert scheduler.get_last_lr() == [pytest.approx(2 * BASE * schedule(step + 8))]
    assert restarted.persisted()["lr"]["starts"] == [[pytest.approx(2 * BASE)]]


def test_a_checkpoint_saved_at_an_earlier_factor_of_the_run_is_brought_to_the_factor(
    used: list[float],
) -> None:
    lr = LearningRate("linear")
    optimizer, scheduler = training()
    lr.watch_optimizer(optimizer)
    steps(optimizer, scheduler, 4)
    lr.changed(2.0, "linear", SMALL, DOUBLE)
    steps(optimizer, scheduler, 4)
    at_second = saved(optimizer, scheduler)  # the second change's boundary saves x2
    lr.changed(1.5, "linear", DOUBLE, TRIPLE)
    section = lr.persisted()["lr"]
    assert section["factor"] == pytest.approx(3.0)
    assert section["carried"] == [pytest.approx(2.0), pytest.approx(3.0)]

    restarted = LearningRate("linear")
    restarted.resume(section)
    optimizer, scheduler = training()
    restarted.watch_optimizer(optimizer)
    optimizer.load_state_dict(at_second["optimizer"])
    scheduler.load_state_dict(at_second["scheduler"])
    used.clear()
    steps(optimizer, scheduler, 4)
    assert used == [pytest.approx(3 * BASE * schedule(s)) for s in range(8, 12)], "x3, not x6"
    assert restarted.factor == pytest.approx(3.0) and not restarted.owner


def test_a_fresh_optimizer_whose_lr_the_script_changed_gets_the_factor_and_a_report() -> None:
    section, _, _ = first_run()
    reports: list[str] = []
    restarted = LearningRate("linear", report=lambda exc, where: reports.append(str(exc)))
    restarted.resume(section)
    optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.05)  # not 0.1 now
    restarted.watch_optimizer(optimizer)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert len(reports) == 1 and "the script's LR changed" in reports[0]


def test_a_scheduler_made_after_the_change_moves_the_lr_and_the_factor_holds(
    used: list[float],
) -> None:
    # a cosine near its top moves the LR by about 1e-8 a step: more than a float rounding, and
    # what the scheduler set
    lost: list[tuple[str, float]] = []
    lr = LearningRate("linear", on_lost=lambda why, undo: lost.append((why, undo)))
    optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.003)
    lr.watch_optimizer(optimizer)
    steps(optimizer, None, 3)
    lr.changed(2.0, "linear", SMALL, DOUBLE)
    cosine = CosineAnnealingLR(optimizer, T_max=10_000)  # never given to memtui
    steps(optimizer, cosine, 100)
    top = [0.006 * (1 + math.cos(math.pi * s / 10_000)) / 2 for s in range(100)]
    assert used[3:] == [pytest.approx(lr, rel=1e-12) for lr in top]
    assert 0 < used[40] - used[41] < 1e-7
    assert not lost and lr.factor == 2.0 and not lr.owner
    assert lr.persisted()["lr"]["factor"] == 2.0


def test_a_loop_that_sets_its_own_lr_from_its_unscaled_config_withdraws_the_factor(
    used: list[float],
) -> None:
    lost: list[tuple[str, float]] = []
    lr = LearningRate("linear", on_lost=lambda why, undo: lost.append((why, undo)))
    optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=BASE)
    lr.watch_optimizer(optimizer)
    lr.changed(2.0, "linear", SMALL, DOUBLE)
    for step in range(3):
        optimizer.param_groups[0]["lr"] = BASE * (1 - step / 100)  # the script's own value
        optimizer.step()
    ((why, undo),) = lost
    assert why.startswith(
        "the script sets the optimizer's LR itself: a step used 0.1 where memtui had 0.2 ("
    )
    assert "give the scheduler to tuner.watch_scheduler" in why
    assert undo == 0.5 and lr.factor == 1.0 and lr.owner == why
    assert lr.persisted()["lr"] == {"script_schedule": why}


def test_a_scheduler_that_does_not_set_the_lr_used_does_not_explain_it() -> None:
    lost: list[tuple[str, float]] = []
    lr = LearningRate("linear", on_lost=lambda why, undo: lost.append((why, undo)))
    optimizer, scheduler = training()
    lr.watch_optimizer(optimizer)
    steps(optimizer, scheduler, 6)
    lr.changed(2.0, "linear", SMALL, DOUBLE)
    steps(optimizer, scheduler, 2)
    optimizer.param_groups[0]["lr"] = BASE  # the loop overwrites what its scheduler set
    optimizer.step()
    assert len(lost) == 1 and lr.factor == 1.0
    assert "a step used 0.1 where memtui had" in lost[0][0]


@pytest.mark.parametrize("same", [True, False], ids=["the same optimizer", "new objects"])
@pytest.mark.parametrize("multipliers", [(2.0,), (2.0, 0.5)], ids=["x2", "x2 then back to x1"])
def test_an_in_process_resume_from_the_changes_checkpoint_carries_the_factor_once(
    used: list[float], same: bool, multipliers: tuple[float, ...]
) -> None:
    # a Trainer resuming in-process loads the checkpoint saved at the boundary (before its
    # change) into new objects, or into the same ones when the script gave them
    lr = LearningRate("linear")
    optimizer, scheduler = training()
    lr.watch_optimizer(optimizer)
    lr.watch_scheduler(scheduler)
    knobs = [SMALL, DOUBLE, SMALL]
    for n, multiplier in enumerate(multipliers):
        steps(optimizer, scheduler, 3)
        at_change = saved(optimizer, scheduler)
        lr.changed(multiplier, "linear", knobs[n], knobs[n + 1])
    if not same:
        optimizer, scheduler = training()
    optimizer.load_state_dict(at_change["optimizer"])
    scheduler.load_state_dict(at_change["scheduler"])
    lr.replace(optimizer, scheduler, multipliers[-1])
    factor = math.prod(multipliers)
    assert lr.factor == factor
    used.clear()
    steps(optimizer, scheduler, 4)
    done = 3 * len(multipliers)
    assert used == [pytest.approx(factor * BASE * schedule(s)) for s in range(done, done + 4)]
    assert scheduler.base_lrs == [pytest.approx(factor * BASE)] and not lr.owner
