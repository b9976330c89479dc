"""Measured effect of an applied change: the steps before it against the steps after it (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from memtui.core.stats import format_bytes, format_duration, mean_and_margin, summarize_steps
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
    speed_margin, time_margin, wait_margin = _margins(before, after)
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
        speedup_margin=speed_margin,
        step_time_margin_s=time_margin,
        data_wait_margin_s=wait_margin,
    )


def _margins(
    before: Sequence[StepRecord], after: Sequence[StepRecord]
) -> tuple[float | None, float | None, float | None]:
    """Half-widths of the 95% intervals of the changes of samples/s (relative), step time and
    data wait, from the spread of the steps on each side (None with fewer than three a side)."""
    sides = [[r for r in side if r.step_time_s > 0] for side in (before, after)]
    if min(len(side) for side in sides) < 3:
        return None, None, None
    (rate_b, m_rate_b), (rate_a, m_rate_a) = (
        mean_and_margin([r.samples / r.step_time_s for r in side]) for side in sides
    )
    (_, m_time_b), (_, m_time_a) = (
        mean_and_margin([r.step_time_s for r in side]) for side in sides
    )
    (_, m_wait_b), (_, m_wait_a) = (
        mean_and_margin([r.data_wait_s for r in side]) for side in sides
    )
    speed = None
    if rate_b > 0 and rate_a > 0:  # the delta method on the ratio of the two means
        speed = rate_a / rate_b * math.hypot(m_rate_a / rate_a, m_rate_b / rate_b)
    return speed, math.hypot(m_time_a, m_time_b), math.hypot(m_wait_a, m_wait_b)


def speedup(effect: Effect) -> float:
    """Relative change of samples/s (+0.41 is 41% faster)."""
    if effect.samples_per_s_before <= 0:
        return 0.0
    return effect.samples_per_s_after / effect.samples_per_s_before - 1.0


def measurable(effect: Effect) -> bool:
    """Whether the change of samples/s is outside its 95% interval's noise (True when the
    effect carries no interval: an older hook's)."""
    if effect.speedup_margin is None:
        return True
    return abs(speedup(effect)) > effect.speedup_margin


def speed_words(effect: Effect) -> str:
    """``+41% +-6% samples/s``, or ``no measurable change (-3% +-8% samples/s)``."""
    margin = effect.speedup_margin
    shown = margin is not None and round(margin * 100) > 0
    change = f"{speedup(effect):+.0%}" + (f" +-{margin:.0%}" if shown else "")
    if measurable(effect):
        return f"{change} samples/s"
    return f"no measurable change ({change} samples/s)"


def describe(effect: Effect) -> str:
    """One line: ``+41% +-6% samples/s, step 85.0 ms -> 47.1 ms, data wait 62% -> 4%, peak ...``."""
    wait_before = (
        effect.data_wait_s_before / effect.step_time_s_before if effect.step_time_s_before else 0.0
    )
    wait_after = (
        effect.data_wait_s_after / effect.step_time_s_after if effect.step_time_s_after else 0.0
    )
    parts = [
        speed_words(effect),
        f"step {format_duration(effect.step_time_s_before)} -> {format_duration(effect.step_time_s_after)}",
        f"data wait {wait_before:.0%} -> {wait_after:.0%}",
    ]
    if effect.peak_bytes_before is not None and effect.peak_bytes_after is not None:
        parts.append(
            f"peak {format_bytes(effect.peak_bytes_before)} -> {format_bytes(effect.peak_bytes_after)}"
        )
    return ", ".join(parts)
