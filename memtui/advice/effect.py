"""Measured effect of an applied change: the steps before it against the steps after it (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from memtui.stats import format_bytes, format_duration, summarize_steps
from memtui.wire import Effect, StepRecord

SETTLE_STEPS = 2
"""Steps right after a change left out of the "after" side (loader restart, allocator warm-up)."""


def measure(
    before: Sequence[StepRecord],
    after: Sequence[StepRecord],
    peak_before: int | None = None,
    peak_after: int | None = None,
) -> Effect | None:
    """Compare two sets of step records (None if either side has no timed step)."""
    was = summarize_steps(before, window=len(before) or 1)
    now = summarize_steps(after, window=len(after) or 1)
    if was is None or now is None:
        return None
    return Effect(
        steps_before=was.steps,
        steps_after=now.steps,
        samples_per_s_before=was.samples_per_s,
        samples_per_s_after=now.samples_per_s,
        step_time_s_before=was.step_time_s,
        step_time_s_after=now.step_time_s,
        data_wait_s_before=was.data_wait_s,
        data_wait_s_after=now.data_wait_s,
        peak_bytes_before=peak_before,
        peak_bytes_after=peak_after,
    )


def speedup(effect: Effect) -> float:
    """Relative change of samples/s (+0.41 is 41% faster)."""
    if effect.samples_per_s_before <= 0:
        return 0.0
    return effect.samples_per_s_after / effect.samples_per_s_before - 1.0


def describe(effect: Effect) -> str:
    """One line: ``+41% samples/s, step 85.0 ms -> 47.1 ms, data wait 62% -> 4%, peak ...``."""
    wait_before = (
        effect.data_wait_s_before / effect.step_time_s_before if effect.step_time_s_before else 0.0
    )
    wait_after = (
        effect.data_wait_s_after / effect.step_time_s_after if effect.step_time_s_after else 0.0
    )
    parts = [
        f"{speedup(effect):+.0%} samples/s",
        f"step {format_duration(effect.step_time_s_before)} -> {format_duration(effect.step_time_s_after)}",
        f"data wait {wait_before:.0%} -> {wait_after:.0%}",
    ]
    if effect.peak_bytes_before is not None and effect.peak_bytes_after is not None:
        parts.append(
            f"peak {format_bytes(effect.peak_bytes_before)} -> {format_bytes(effect.peak_bytes_after)}"
        )
    return ", ".join(parts)
