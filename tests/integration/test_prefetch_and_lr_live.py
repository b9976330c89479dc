"""prefetch_factor and the LR rule on a live demo run, driven by the real `memtui set`: the LR the
run's own checkpoint holds follows the effective batch, and a restart keeps it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml

from tests.support.cli import memtui_cli, status_json
from tests.support.processes import PLUMBING, DemoRun, wait_for

DEMO_LR = 3e-4
"""The demo's AdamW learning rate."""


def applied_count(run: str, count: int) -> list[dict[str, Any]]:
    """Wait until the run has applied ``count`` changes; them."""

    def applied() -> list[dict[str, Any]] | None:
        got = status_json(run)["applied"]
        return got if len(got) >= count else None

    return wait_for(applied, 60, 0.2, f"{count} applied changes")  # type: ignore[return-value]


def saved_after(out: Path, step: int) -> dict[str, Any]:
    """The demo's own checkpoint, once one was saved after ``step`` (its state, not memtui's)."""

    def load() -> dict[str, Any] | None:
        try:
            state = torch.load(out / "checkpoint.pt", weights_only=False)
        except (OSError, EOFError, RuntimeError):
            return None
        return state if state["memtui"]["step"] > step else None

    return wait_for(load, 60, 0.2, f"a checkpoint after step {step}")  # type: ignore[return-value]


def lrs(state: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The optimizer's param group LRs and the scheduler's base LRs in a demo checkpoint (past
    the demo's 10-step warm-up, the LR is the base)."""
    assert state["memtui"]["step"] >= 10, "past the warm-up"
    groups = state["optimizer"]["param_groups"]
    return [g["lr"] for g in groups], list(state["scheduler"]["base_lrs"])


DOUBLED = ([pytest.approx(2 * DEMO_LR)], [pytest.approx(2 * DEMO_LR)])


def test_prefetch_factor_and_the_lr_rule_on_a_live_run_and_across_a_restart(
    start_demo: Callable[..., DemoRun],
) -> None:
    args = ("--steps", "100000", "--checkpoint-every", "5", "--batch-size", "8", *PLUMBING)
    demo = start_demo(*args, "--grad-accum", "1")
    run = demo.run_id
    wait_for(lambda: status_json(run)["step"] >= 3, 30, 0.2, "steps")
    assert status_json(run)["config"]["prefetch_factor"] == 2

    refused = memtui_cli("set", "prefetch_factor=4")
    assert refused.returncode == 2 and "only used with num_workers > 0" in refused.stderr

    doubled = memtui_cli("set", "batch_size=16", "--allow-effective-batch", "--lr-scale", "linear")
    assert doubled.returncode == 0 and "lr x2.0 (linear)" in doubled.stderr, doubled.stderr
    first = applied_count(run, 1)[0]
    assert (first["lr_factor"], first["lr_note"]) == (2.0, "lr x2.0 (linear)")
    assert lrs(saved_after(demo.out, max(first["step"], 9))) == DOUBLED

    unscaled = memtui_cli("set", "grad_accum=2", "num_workers=1", "prefetch_factor=4")
    assert unscaled.returncode == 0, unscaled.stderr
    assert "effective batch 16 -> 32, the LR does not follow (rule none)" in unscaled.stderr
    second = applied_count(run, 2)[1]
    assert status_json(run)["config"] == {
        "batch_size": 16,
        "grad_accum": 2,
        "num_workers": 1,
        "pin_memory": False,
        "prefetch_factor": 4,
    }
    wait_for(lambda: len(psutil.Process(demo.proc.pid).children()) == 1, 30, what="the one worker")
    assert lrs(saved_after(demo.out, second["step"])) == DOUBLED
    audit = [
        json.loads(line) for line in (demo.out / "memtui-audit.jsonl").read_text().splitlines()
    ]
    notes = [e.get("lr_note", "") for e in audit if e["event"] == "applied"]
    assert notes[0] == "lr x2.0 (linear)" and "LR does not follow" in notes[1]
    tuned = yaml.safe_load((demo.out / "memtui-tuned.yaml").read_text())
    assert tuned["lr"]["factor"] == 2.0 and tuned["config"]["prefetch_factor"] == 4
    demo.stop()

    (demo.out / "checkpoint.pt").unlink()  # only the tuned YAML carries the LR now
    resumed = start_demo(*args, "--grad-accum", "1", "--resume", out=demo.out)
    assert "resumed tuned config: batch_size=16, grad_accum=2" in resumed.output()
    assert lrs(saved_after(demo.out, 9)) == DOUBLED
