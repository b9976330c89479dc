"""The effect a live demo run reports for a change: measured once the rebuilt loader's workers
run, with an interval that holds the speed the run then keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from memtui.storage import registry
from memtui.transport.client import ControlClient
from memtui.wire import StepRecord
from tests.support.cli import memtui_here, status_json
from tests.support.processes import DemoRun, wait_for

pytestmark = pytest.mark.heavy

LATER = 200
"""Steps after the change where the steady window starts."""
WINDOW = 150
"""Steps of the steady windows (after the change, and before it at the old config)."""


def test_more_workers_on_a_slow_loader_report_an_effect_whose_interval_holds_the_steady_state(
    start_demo: Callable[..., DemoRun],
) -> None:
    """The demo's slow loader going 0 -> 2 workers: the steps the new workers spend starting
    and making their first batches are left out (and said), and the stated interval holds the
    samples/s the run keeps 200 steps later against the 150 steps before the change."""
    demo = start_demo(
        "--steps", "100000", "--checkpoint-every", "25", "--slow-data-ms", "4",
        "--batch-size", "8", "--grad-accum", "1", "--seq-len", "16", "--width", "32",
        "--layers", "1", "--vocab", "64",
    )  # fmt: skip
    run = demo.run_id
    client = ControlClient(registry.find_run(run).control, timeout_s=10.0)
    steps: dict[int, StepRecord] = {}

    def reached(step: int) -> bool:
        for record in client.hello(history=2048).steps:
            steps[record.step] = record
        return bool(steps) and max(steps) >= step

    wait_for(lambda: reached(WINDOW + 10), 120, 0.5, f"step {WINDOW + 10}")
    assert memtui_here("set", run, "num_workers=2").exit_code == 0

    def measured() -> dict[str, Any] | None:
        applied = status_json(run)["applied"]
        return applied[0] if applied and applied[0]["effect"] else None

    change = wait_for(measured, 120, 0.5, "the measured effect")
    assert isinstance(change, dict)
    effect, at = change["effect"], change["step"]
    assert effect["warmup_steps"] >= 3, effect["summary"]
    assert "2 new workers starting" in effect["warmup_why"], effect["warmup_why"]
    assert "steps after the change left out" in effect["summary"], effect["summary"]
    wait_for(lambda: reached(at + LATER + WINDOW), 240, 0.5, "the steady window")

    def rate(first: int, last: int) -> float:
        window = [steps[s] for s in range(first + 1, last + 1)]
        return sum(r.samples for r in window) / sum(r.step_time_s for r in window)

    steady = rate(at + LATER, at + LATER + WINDOW) / rate(at - WINDOW, at) - 1
    low, high = effect["speedup_low"], effect["speedup_high"]
    assert low <= steady <= high, f"steady {steady:+.0%} outside {effect['summary']}"
    assert steady > 0, f"two workers feed a starving loader: steady {steady:+.0%}"
