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
    assert tuned["lr"] == {"factor": 2.0}

    assert "lr x0.5 (sqrt)" in change(tuner, "sqrt", grad_accum=4, batch_size=1)  # 16 -> 4
    tuner.checkpoint()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert scheduler.base_lrs[0] == pytest.approx(0.1)
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
