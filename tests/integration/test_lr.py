"""The LR rule in one process: a real optimizer and LR scheduler follow a change of the effective
batch at the boundary, a rollback undoes it, and a restart keeps it from the tuned YAML."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from memtui.hooks import Options, Tuner
from memtui.hooks.persist import AUDIT_FILE, TUNED_FILE, read_audit
from memtui.wire import SetRequest

BASE_LR = 0.1


def training(tmp_path: Path, rule: str = "none", **kwargs: Any) -> tuple[Tuner, Any, Any]:
    """A tuner for batch 8 x accum 1, its optimizer (known at install) and a warm-up scheduler."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    config = SimpleNamespace(batch_size=8, grad_accum=1)
    tuner = Tuner(
        config,
        optimizer=optimizer,
        state_dir=tmp_path,
        options=Options(publish=False),
        lr_scale=rule,
        **kwargs,
    ).start()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    tuner.watch_scheduler(scheduler)
    for _ in range(3):  # past the warm-up: the LR is the base LR
        optimizer.step()
        scheduler.step()
    return tuner, optimizer, scheduler


def change(tuner: Tuner, lr_scale: str = "", **changes: Any) -> str:
    """Queue ``changes``; the reply's note."""
    reply = tuner.control.queue(SetRequest(changes=changes, lr_scale=lr_scale))
    assert reply.ok, reply.reason
    return reply.note


def test_linear_doubles_every_lr_the_scheduler_computes_from_and_the_audit_says_so(
    tmp_path: Path,
) -> None:
    tuner, optimizer, scheduler = training(tmp_path)
    assert "lr x2.0 (linear)" in change(tuner, "linear", batch_size=16)
    applied = tuner.checkpoint()
    assert applied is not None and applied.lr_factor == 2.0
    assert "lr x2.0 (linear)" in str(applied)
    group = optimizer.param_groups[0]
    assert group["lr"] == group["initial_lr"] == scheduler.base_lrs[0] == pytest.approx(0.2)
    assert scheduler.get_last_lr() == [pytest.approx(0.2)], "what a Trainer logs"
    optimizer.step()
    scheduler.step()  # the schedule computes from the new base
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    audited = [e for e in read_audit(tmp_path / AUDIT_FILE) if e["event"] == "applied"]
    assert audited[-1]["lr_factor"] == 2.0 and audited[-1]["lr_note"] == "lr x2.0 (linear)"
    tuned = yaml.safe_load((tmp_path / TUNED_FILE).read_text())
    assert tuned["lr"]["factor"] == 2.0
    assert tuned["lr"]["anchor"] == {"batch": 8, "factor": 1.0}, "the script's own LR at 8 x 1"
    assert tuned["lr"]["starts"] == [[pytest.approx(0.2)]], "what a resumed optimizer must carry"

    # 16 -> 4 under sqrt: the factor is sqrt(4 / 8) over the script's own LR at 8, whatever the
    # path; a rule other than the last one's is said
    note = change(tuner, "sqrt", grad_accum=4, batch_size=1)
    assert "the LR is then x0.7071 the script's own" in note
    assert "the change before followed linear" in note
    tuner.checkpoint()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**0.5)
    assert scheduler.base_lrs[0] == pytest.approx(0.1 * 0.5**0.5)
    tuner.close()


def test_rule_none_and_an_unknown_optimizer_leave_the_lr_and_warn(tmp_path: Path) -> None:
    tuner, optimizer, _ = training(tmp_path)  # the run's rule: none
    note = change(tuner, grad_accum=2)
    assert "effective batch 8 -> 16, the LR does not follow (rule none)" in note
    applied = tuner.checkpoint()
    assert applied is not None and applied.lr_factor is None
    assert "LR does not follow" in applied.lr_note
    assert optimizer.param_groups[0]["lr"] == pytest.approx(BASE_LR)
    tuner.close()

    blind = Tuner(
        SimpleNamespace(batch_size=8), options=Options(publish=False), lr_scale="linear"
    ).start()
    reply = blind.control.queue(SetRequest(changes={"batch_size": 4}))
    assert "no optimizer known to memtui" in reply.note
    blind.close()


def test_the_runs_rule_applies_and_keeping_the_effective_batch_moves_nothing(
    tmp_path: Path,
) -> None:
    tuner, optimizer, _ = training(tmp_path, rule="sqrt")
    assert change(tuner, batch_size=4, grad_accum=2) == ""  # 8 x 1 -> 4 x 2: the same
    tuner.checkpoint()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(BASE_LR)
    change(tuner, batch_size=16)  # 4 x 2 -> 16 x 2: x4, square root x2
    assert tuner.checkpoint().lr_factor == pytest.approx(2.0)  # type: ignore[union-attr]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    tuner.close()


def test_an_out_of_memory_rollback_reverts_the_lr_too(tmp_path: Path) -> None:
    tuner, optimizer, scheduler = training(tmp_path)
    change(tuner, "linear", batch_size=32)
    assert tuner.checkpoint() is not None
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)
    tuner.step()
    guard = tuner.guard()
    with guard:  # the bigger batch runs out of memory: memtui rolls it back
        raise MemoryError("out of memory")
    assert guard.rolled_back and tuner.knobs().batch_size == 8
    rollback = tuner.control.applied_changes()[-1]
    assert rollback.rollback and rollback.lr_note == "lr x0.25 (rollback)"
    assert optimizer.param_groups[0]["lr"] == scheduler.base_lrs[0] == pytest.approx(BASE_LR)
    tuned = yaml.safe_load((tmp_path / TUNED_FILE).read_text())
    assert "lr" not in tuned, "the factor is back to 1: the tuned YAML keeps none"
    tuner.close()


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_a_restart_keeps_the_scaled_lr_from_the_tuned_yaml(
    tmp_path: Path, scheduler_first: bool
) -> None:
    tuner, _, _ = training(tmp_path)
    change(tuner, "linear", batch_size=24)
    tuner.checkpoint()
    tuner.close()

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    config = SimpleNamespace(batch_size=8, grad_accum=1)
    scheduler = None
    if scheduler_first:  # built before memtui is given the optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    restarted = Tuner(
        config, optimizer=optimizer, state_dir=tmp_path, options=Options(publish=False), resume=True
    ).start()
    if scheduler is None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    restarted.watch_scheduler(scheduler)
    assert config.batch_size == 24
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3)
    assert scheduler.base_lrs == scheduler.get_last_lr() == [pytest.approx(0.3)]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.3)
    restarted.close()


def used_lrs(optimizer: Any) -> list[float]:
    """Record the LR each later ``optimizer.step()`` really uses (a step pre-hook of torch's
    registered after memtui's, so it reads what the step reads)."""
    seen: list[float] = []
    optimizer.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    return seen


def test_the_lr_is_a_function_of_the_effective_batch_not_of_the_path(tmp_path: Path) -> None:
    tuner, optimizer, scheduler = training(tmp_path)
    notes = []
    for _ in range(25):  # 8 <-> 12, up linear, down sqrt
        change(tuner, "linear", batch_size=12)
        tuner.checkpoint()
        notes.append(change(tuner, "sqrt", batch_size=8))
        tuner.checkpoint()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(BASE_LR), "the script's LR at 8"
    assert scheduler.base_lrs == [pytest.approx(BASE_LR)]
    assert tuner.lr.factor == pytest.approx(1.0)
    assert all("the change before followed linear" in n for n in notes)
    change(tuner, "linear", batch_size=16)
    tuner.checkpoint()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * BASE_LR)
    tuner.close()


def nanogpt_loop(tmp_path: Path, fields: tuple[str, ...] = (), **kwargs: Any) -> dict[str, Any]:
    """nanoGPT's shape: module-style globals, the loop sets ``param_group['lr'] = get_lr(it)``
    at the top of every iteration, the checkpoint after the eval's save."""
    config: dict[str, Any] = {
        "batch_size": 8,
        "gradient_accumulation_steps": 1,
        "learning_rate": 1e-3,
        "min_lr": 1e-4,
    }
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["learning_rate"])
    tuner = Tuner(
        config,
        optimizer=optimizer,
        state_dir=tmp_path,
        options=Options(publish=False),
        lr_fields=fields,
        **kwargs,
    ).start()

    def get_lr(it: int) -> float:
        decay = min(1.0, it / 100)
        return config["learning_rate"] - decay * (config["learning_rate"] - config["min_lr"])

    return {"config": config, "optimizer": optimizer, "tuner": tuner, "get_lr": get_lr}


def iterate(loop: dict[str, Any], start: int, stop: int, boundary_at: int = -1) -> None:
    """nanoGPT's iterations ``start`` to ``stop``: its LR first, the boundary, then the step."""
    optimizer, tuner = loop["optimizer"], loop["tuner"]
    for it in range(start, stop):
        for group in optimizer.param_groups:
            group["lr"] = loop["get_lr"](it)
        if it == boundary_at:
            tuner.checkpoint()
        optimizer.step()
        tuner.step()


def test_a_loop_that_sets_its_own_lr_gets_the_factor_withdrawn_and_said(tmp_path: Path) -> None:
    loop = nanogpt_loop(tmp_path)
    tuner, optimizer = loop["tuner"], loop["optimizer"]
    events: list[Any] = []
    tuner.on_event(lambda event, step: events.append(event))
    iterate(loop, 0, 10)
    assert "lr x2.0 (linear)" in change(tuner, "linear", batch_size=16)
    used = used_lrs(optimizer)
    iterate(loop, 10, 14, boundary_at=10)
    assert used[0] == pytest.approx(2 * loop["get_lr"](10)), "the boundary's own iteration"
    assert used[1:] == [pytest.approx(loop["get_lr"](it)) for it in (11, 12, 13)]
    state = tuner.control.state().lr
    assert state is not None and state.factor == 1.0, "never a factor the optimizer does not use"
    assert "the script sets the optimizer's LR itself" in state.script_schedule
    audited = [e for e in read_audit(tmp_path / AUDIT_FILE) if e["event"] == "lr_withdrawn"]
    assert len(audited) == 1 and audited[0]["factor"] == 2.0
    assert [type(e).__name__ for e in events] == ["Applied", "LrWithdrawn"]
    tuned = yaml.safe_load((tmp_path / TUNED_FILE).read_text())
    assert "factor" not in tuned["lr"] and tuned["lr"]["script_schedule"]
    refused = tuner.control.queue(SetRequest(changes={"batch_size": 32}, lr_scale="linear"))
    assert not refused.ok and "cannot hold" in refused.reason
    kept = tuner.control.queue(SetRequest(changes={"batch_size": 32}, lr_scale="none"))
    assert kept.ok
    tuner.close()

    restarted = nanogpt_loop(tmp_path, resume=True)
    assert restarted["config"]["batch_size"] == 16
    assert restarted["tuner"].lr.factor == 1.0 and restarted["tuner"].lr.owner
    restarted["tuner"].close()


def test_lr_fields_scale_what_the_loops_own_schedule_reads(tmp_path: Path) -> None:
    loop = nanogpt_loop(tmp_path, fields=("learning_rate", "min_lr"))
    tuner, optimizer = loop["tuner"], loop["optimizer"]
    iterate(loop, 0, 10)
    change(tuner, "linear", batch_size=16)
    used = used_lrs(optimizer)
    iterate(loop, 10, 20, boundary_at=10)
    assert loop["config"]["learning_rate"] == pytest.approx(2e-3)
    assert loop["config"]["min_lr"] == pytest.approx(2e-4)
    own = nanogpt_loop(tmp_path / "unscaled")["get_lr"]  # the schedule at the script's values
    assert used == [pytest.approx(2 * own(it)) for it in range(10, 20)]
    assert tuner.control.state().lr.factor == 2.0  # type: ignore[union-attr]
    tuner.close()

    restarted = nanogpt_loop(tmp_path, fields=("learning_rate", "min_lr"), resume=True)
    assert restarted["config"]["learning_rate"] == pytest.approx(2e-3), "from the script's 1e-3"
    used = used_lrs(restarted["optimizer"])
    iterate(restarted, 20, 23)
    assert used == [pytest.approx(2 * own(it)) for it in range(20, 23)]
    restarted["tuner"].close()


def test_a_scheduler_memtui_was_not_given_is_found_and_followed(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    tuner = Tuner(
        SimpleNamespace(batch_size=8),
        optimizer=optimizer,
        state_dir=tmp_path,
        options=Options(publish=False),
    ).start()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    change(tuner, "linear", batch_size=16)
    tuner.checkpoint()
    used = used_lrs(optimizer)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert used == [pytest.approx(2 * BASE_LR / (1 + s)) for s in (3, 4, 5)]
    assert tuner.lr.factor == 2.0 and not tuner.lr.owner
    tuner.close()


@pytest.mark.parametrize("saved", ["after the change", "before the change"])
@pytest.mark.parametrize("loaded", ["after install", "before install"])
def test_a_restart_carries_the_factor_once_whatever_its_checkpoint_holds(
    tmp_path: Path, saved: str, loaded: str
) -> None:
    tuner, optimizer, scheduler = training(tmp_path)
    before = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    change(tuner, "linear", batch_size=16)
    tuner.checkpoint()
    after = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    tuner.close()
    checkpoint = after if saved == "after the change" else before

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
    if loaded == "before install":  # as a Trainer does inside train()
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    restarted = Tuner(
        SimpleNamespace(batch_size=8, grad_accum=1),
        optimizer=optimizer,
        state_dir=tmp_path,
        options=Options(publish=False),
        resume=True,
    ).start()
    restarted.watch_scheduler(scheduler)
    if loaded == "after install":
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    used = used_lrs(optimizer)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert used == [pytest.approx(2 * BASE_LR)] * 3, "x2 at batch 16: never x4, never x1"
    assert scheduler.get_last_lr() == [pytest.approx(2 * BASE_LR)]
    restarted.close()


def test_a_rollback_restores_the_factor_and_its_anchor(tmp_path: Path) -> None:
    tuner, optimizer, _ = training(tmp_path)
    change(tuner, batch_size=16)  # rule none: the LR stays, right at 16 from now on
    tuner.checkpoint()
    change(tuner, "linear", batch_size=32)
    tuner.checkpoint()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2 * BASE_LR), "x2 from 16, not x4"
    tuner.step()
    with tuner.guard():
        raise MemoryError("out of memory")
    assert optimizer.param_groups[0]["lr"] == pytest.approx(BASE_LR)
    assert tuner.lr.anchor == (16, 1.0)
    tuner.close()
