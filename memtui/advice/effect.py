"""Measured effect of an applied change: the steps before it against the steps after it (pure).

The steps after a change are compared once it has settled: ``warmup`` finds the end of the
warm-up (2 settling steps; after a loader rebuild, until each new worker delivered its first
batches and the steps stopped getting faster), and the effect says how many steps it left out
and why. The 95% interval of the change of samples/s counts three things: the spread of the
steps on each side, taken over blocks of ``BLOCK_STEPS`` consecutive steps (a step is like the
one before it: the machine's load holds for a while); and how much the run's speed moved at an
unchanged config between windows up to ``DRIFT_HORIZON`` steps apart (``drift_of``, over the run's
history: the load other programs put on the machine comes and goes, and a before/after comparison
cannot tell that from the change). The interval is on the ratio of the two speeds, so it is not
symmetric: ``+133% (+46% to +533%)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memtui.core.stats import format_bytes, format_duration, t975
from memtui.wire import STEP_LOADER_REBUILT, Effect, StepRecord

SETTLE_STEPS = 2
"""Steps right after a change always left out of the "after" side (allocator warm-up)."""
WARMUP_LIMIT = 40
"""The most steps after a change left out as its warm-up: past it, the steps are compared as
they are, and the effect says the warm-up did not end."""
SETTLED_AHEAD = 5
"""A step after a loader rebuild slower than the median of the next this many by more than their
range is still warming up."""
DEFAULT_PREFETCH = 2
"""Batches each loader worker prefetches where the config does not say (torch's default)."""
BLOCK_STEPS = 4
"""Consecutive steps taken as one block for the spread of a side's mean: steps next to each
other run under the same load, so their spread alone understates how much a mean can be off."""
DRIFT_HORIZON = 400
"""The farthest apart two windows at an unchanged config are compared for the run's drift: the
speed a change is credited with is the one its config keeps for the next few hundred steps."""
DRIFT_NEAREST = 100
"""The nearest two windows are compared for the run's drift where windows farther apart exist:
the drift that matters is the one over the few hundred steps the config then runs."""
DRIFT_WINDOWS = 3
"""Windows at an unchanged config (in the history kept) before the run's drift is counted: with
fewer, the effect's interval is the spread of the steps compared alone, and it says so."""


@dataclass(frozen=True)
class Warmup:
    """The steps after a change left out of its effect: through ``last``, and why."""

    last: int
    """The last step left out (the steps compared begin after it)."""
    steps: int
    """How many steps after the change were left out."""
    why: str


def warmup(
    change_step: int,
    after: Sequence[StepRecord],
    workers: int | None = None,
    prefetch: int | None = None,
    *,
    final: bool = False,
    started: bool = False,
) -> Warmup | None:
    """The warm-up after the change at ``change_step`` from the steps after it (oldest first):
    ``SETTLE_STEPS``; after a loader rebuild (a step flagged ``STEP_LOADER_REBUILT``) until each
    of its ``workers`` delivered its ``prefetch`` first batches (the batches the new workers
    made at once, while they started: a process start, imports, a first prefetch), then while
    a step is slower than the median of the ``SETTLED_AHEAD`` after it by more than their range
    (a step of a run that only varies is no warm-up); at most ``WARMUP_LIMIT``
    steps; ``started``: the run's start (``change_step`` 0), whose loader starts like a rebuilt
    one. None while the steps so far cannot tell yet (unless ``final``: then what ran says)."""
    timed = [r for r in after if r.step > change_step]
    last = change_step + SETTLE_STEPS
    limit = change_step + WARMUP_LIMIT
    rebuilt = next(
        (r for r in timed if (r.flags & STEP_LOADER_REBUILT or started) and r.step <= last + 1),
        None,
    )
    if rebuilt is None:
        if not final and (not timed or timed[-1].step <= last):
            return None  # the rebuild's step may not have come yet
        return Warmup(last, SETTLE_STEPS, f"{SETTLE_STEPS} settling steps")
    new = workers or 0
    batches = new * (prefetch or DEFAULT_PREFETCH) if new else 1
    delivered = 0
    first_batches: int | None = None
    for record in timed:
        if record.step < rebuilt.step:
            continue
        delivered += record.micro_batches
        if delivered >= batches:
            first_batches = record.step
            break
    if first_batches is None and not final and (not timed or timed[-1].step < limit):
        return None
    if first_batches is None or first_batches >= limit:
        return Warmup(limit, WARMUP_LIMIT, _unended(new))
    last = max(last, first_batches)
    slower = 0
    by_step = {r.step: r for r in timed if r.step_time_s > 0}
    while last < limit:
        step = by_step.get(last + 1)
        ahead = [by_step[s] for s in range(last + 2, last + 2 + SETTLED_AHEAD) if s in by_step]
        if step is None:
            break
        if len(ahead) < SETTLED_AHEAD and timed[-1].step < last + 1 + SETTLED_AHEAD:
            if not final:
                return None
            break
        times = sorted(_per_sample(r) for r in ahead)
        if not times or _per_sample(step) <= times[len(times) // 2] + times[-1] - times[0]:
            break  # within the spread of the steps after it: settled
        last += 1
        slower += 1
    if last >= limit:
        return Warmup(limit, WARMUP_LIMIT, _unended(new))
    why = _rebuild_words(new, batches)
    if slower:
        plural = "s" if slower > 1 else ""
        why += f", then {slower} step{plural} still slower than the {SETTLED_AHEAD} after beyond their spread"
    return Warmup(last, last - change_step, why)


def _per_sample(record: StepRecord) -> float:
    """Seconds a sample in ``record`` (its step time where it counted none)."""
    return record.step_time_s / record.samples if record.samples > 0 else record.step_time_s


def _rebuild_words(workers: int, batches: int) -> str:
    """``the rebuilt loader's 2 new workers starting and making their first 4 batches``."""
    if not workers:
        return "the loader's rebuild"
    plural = "s" if workers > 1 else ""
    return (
        f"the rebuilt loader's {workers} new worker{plural} starting and making their first "
        f"{batches} batches"
    )


def _unended(workers: int) -> str:
    """Why a warm-up was cut at ``WARMUP_LIMIT``."""
    what = f"the rebuilt loader's {workers} new workers" if workers else "the rebuilt loader"
    return f"{what} still warming up after {WARMUP_LIMIT} steps: compared from there"


@dataclass(frozen=True)
class Drift:
    """How much the run's speed moved at an unchanged config: the variance of the log of a
    window's samples/s between windows up to ``DRIFT_HORIZON`` steps apart, beyond what the
    spread of their own steps explains."""

    variance: float
    dof: int
    """Degrees of freedom: the windows, less one per config they were at."""
    pairs: int

    @property
    def margin(self) -> float:
        """The half-width of its 95% interval, on the log of samples/s."""
        return t975(max(self.dof, 1)) * math.sqrt(self.variance)


def drift_of(
    segments: Iterable[Sequence[StepRecord]],
    window: int,
    horizon: int = DRIFT_HORIZON,
    *,
    opening: bool = False,
) -> Drift | None:
    """The run's drift from ``segments`` (each the settled steps of one config, oldest first):
    every two windows of ``window`` steps in one segment from ``DRIFT_NEAREST`` to ``horizon``
    steps apart (all up to ``horizon`` where none are that far apart; None: fewer than
    ``DRIFT_WINDOWS`` windows, or no two in one segment). ``opening``: the first segment is
    the run's start, whose windows slower than its median one before it are left out (a run
    gets faster for its first hundred steps or so: caches, the allocator, a framework's first
    passes; the benchmark's transformer went 20 -> 121 samples/s over its first 160)."""
    near: list[float] = []
    far: list[float] = []
    windows = groups = 0
    for index, segment in enumerate(segments):
        timed = [r for r in segment if r.step_time_s > 0]
        found = (_side(timed[i : i + window]) for i in range(0, len(timed) - window + 1, window))
        sides = [s for s in found if s is not None and math.isfinite(s.variance)]
        if opening and index == 0 and sides:
            middle = sorted(s.log_rate for s in sides)[len(sides) // 2]
            sides = sides[next(i for i, s in enumerate(sides) if s.log_rate >= middle) :]
        if len(sides) < 2:
            continue
        windows += len(sides)
        groups += 1
        for i, first in enumerate(sides):
            for j in range(i + 1, len(sides)):
                apart = (j - i) * window
                if apart > horizon:
                    break
                gap = (sides[j].log_rate - first.log_rate) ** 2  # beyond the windows' own noise:
                (far if apart >= DRIFT_NEAREST else near).append(
                    gap - first.variance - sides[j].variance
                )
    pairs = far or near
    if windows < DRIFT_WINDOWS or not pairs:
        return None
    return Drift(max(0.0, math.fsum(pairs) / len(pairs)), windows - groups, len(pairs))


@dataclass(frozen=True)
class _Side:
    """One side's speed: the log of its samples/s, the variance of that log, its dof."""

    log_rate: float
    variance: float
    dof: int


def _blocks(values: Sequence[float], weights: Sequence[float], size: int) -> list[float]:
    """The weighted means of ``values`` in consecutive blocks of ``size`` (a short block left at
    the end is left out)."""
    out = []
    for i in range(0, len(values) - size + 1, size):
        weight = math.fsum(weights[i : i + size])
        if weight > 0:
            out.append(
                math.fsum(
                    v * w for v, w in zip(values[i : i + size], weights[i : i + size], strict=True)
                )
                / weight
            )
    return out


def _mean_variance(values: Sequence[float], weights: Sequence[float]) -> tuple[float, int]:
    """The variance of the weighted mean of ``values`` and its dof: from the spread of blocks
    of ``BLOCK_STEPS`` values, or of the values one by one where that is larger (steps that
    alternate slow and fast make blocks alike, and two or three blocks can agree by chance);
    inf with fewer than two values."""
    estimates: list[tuple[float, int]] = []
    for size in (1, BLOCK_STEPS):
        blocks = _blocks(values, weights, size)
        if len(blocks) < 2:
            continue
        mean = math.fsum(blocks) / len(blocks)
        spread = math.fsum((b - mean) ** 2 for b in blocks) / (len(blocks) - 1)
        estimates.append((spread / len(blocks), len(blocks) - 1))
    if not estimates:
        return math.inf, 0
    return max(estimates)


def _side(records: Sequence[StepRecord]) -> _Side | None:
    """A side's speed and the variance of its log (None: nothing timed)."""
    time_s = sum(r.step_time_s for r in records)
    samples = sum(r.samples for r in records)
    if time_s <= 0 or samples <= 0:
        return None
    per_sample = [r.step_time_s / r.samples if r.samples > 0 else 0.0 for r in records]
    variance, dof = _mean_variance(per_sample, [float(r.samples) for r in records])
    mean = time_s / samples
    return _Side(math.log(samples / time_s), variance / mean**2, dof)


def _welch(first: _Side, second: _Side) -> float:
    """The 95% half-width of the difference of two sides' log speeds (Welch's dof)."""
    variance = first.variance + second.variance
    if not math.isfinite(variance) or min(first.dof, second.dof) < 1:
        return math.inf
    if variance <= 0:
        return 0.0
    dof = variance**2 / (first.variance**2 / first.dof + second.variance**2 / second.dof)
    return t975(dof) * math.sqrt(variance)


def measure(
    before: Sequence[StepRecord],
    after: Sequence[StepRecord],
    peak_before: int | None = None,
    peak_after: int | None = None,
    *,
    drift: Drift | None = None,
    warm: Warmup | None = None,
) -> Effect | None:
    """Compare two sets of step records (None if either side has no timed step); ``drift``:
    the run's drift at an unchanged config (None: not known); ``warm``: the steps left out
    after the change."""
    sides = [[r for r in side if r.step_time_s > 0] for side in (before, after)]
    was, now = (_summary(side) for side in sides)
    if was is None or now is None:
        return None
    low, high, speed_margin = _speed_interval(sides[0], sides[1], drift)
    time_margin, wait_margin = _step_margins(sides[0], sides[1])
    return Effect(
        steps_before=len(sides[0]),
        steps_after=len(sides[1]),
        samples_per_s_before=was[0],
        samples_per_s_after=now[0],
        step_time_s_before=was[1],
        step_time_s_after=now[1],
        data_wait_s_before=was[2],
        data_wait_s_after=now[2],
        peak_bytes_before=peak_before,
        peak_bytes_after=peak_after,
        speedup_margin=speed_margin,
        step_time_margin_s=time_margin,
        data_wait_margin_s=wait_margin,
        warmup_steps=warm.steps if warm is not None else None,
        warmup_why=warm.why if warm is not None else "",
        speedup_low=low,
        speedup_high=high,
        speed_drift=math.expm1(drift.margin) if drift is not None else None,
    )


def _summary(records: Sequence[StepRecord]) -> tuple[float, float, float] | None:
    """Samples/s, mean step time and mean data wait of timed ``records`` (None: none)."""
    if not records:
        return None
    total = sum(r.step_time_s for r in records)
    wait = sum(min(r.data_wait_s, r.step_time_s) for r in records)
    n = len(records)
    return sum(r.samples for r in records) / total, total / n, wait / n


def _speed_interval(
    before: Sequence[StepRecord], after: Sequence[StepRecord], drift: Drift | None
) -> tuple[float | None, float | None, float | None]:
    """The 95% interval of the relative change of samples/s (low, high) and its half-width
    toward the farther end (None with fewer than three steps a side)."""
    if min(len(before), len(after)) < 3:
        return None, None, None
    was, now = _side(before), _side(after)
    if was is None or now is None:
        return None, None, None
    margin = _welch(was, now)
    if drift is not None:
        margin = math.hypot(margin, drift.margin)
    if not math.isfinite(margin):
        return None, None, None
    change = now.log_rate - was.log_rate
    low, high = math.expm1(change - margin), math.expm1(change + margin)
    return low, high, high - math.expm1(change)


def _step_margins(
    before: Sequence[StepRecord], after: Sequence[StepRecord]
) -> tuple[float | None, float | None]:
    """Half-widths of the 95% intervals of the changes of the mean step time and data wait
    (None with fewer than three steps a side)."""
    if min(len(before), len(after)) < 3:
        return None, None
    margins: list[float | None] = []
    for value in (lambda r: r.step_time_s, lambda r: min(r.data_wait_s, r.step_time_s)):
        sides = [
            _mean_variance([value(r) for r in side], [1.0] * len(side)) for side in (before, after)
        ]
        margin = _welch(*(_Side(0.0, variance, dof) for variance, dof in sides))
        margins.append(margin if math.isfinite(margin) else None)
    return margins[0], margins[1]


def speedup(effect: Effect) -> float:
    """Relative change of samples/s (+0.41 is 41% faster)."""
    if effect.samples_per_s_before <= 0:
        return 0.0
    return effect.samples_per_s_after / effect.samples_per_s_before - 1.0


def interval(effect: Effect) -> tuple[float, float] | None:
    """The 95% interval of the relative change of samples/s (an older hook's: the change plus
    and minus its margin; None: no interval)."""
    if effect.speedup_low is not None and effect.speedup_high is not None:
        return effect.speedup_low, effect.speedup_high
    if effect.speedup_margin is None:
        return None
    change = speedup(effect)
    return change - effect.speedup_margin, change + effect.speedup_margin


def measurable(effect: Effect) -> bool:
    """Whether the change of samples/s is outside its 95% interval's noise: the interval holds
    no zero (True when the effect carries no interval: an older hook's)."""
    bounds = interval(effect)
    return bounds is None or bounds[0] > 0 or bounds[1] < 0


def steps_margin(effect: Effect) -> float | None:
    """The relative half-width of the change's interval from the spread of its steps alone,
    the run's drift at an unchanged config left out (None: no interval)."""
    bounds = interval(effect)
    if bounds is None:
        return None
    if effect.speed_drift is None or effect.speedup_high is None:
        return effect.speedup_margin
    change = speedup(effect)
    if change <= -1 or bounds[1] <= -1:
        return effect.speedup_margin
    total = math.log1p(bounds[1]) - math.log1p(change)
    drift = math.log1p(effect.speed_drift)
    return math.expm1(math.sqrt(max(0.0, total**2 - drift**2)))


def interval_width(effect: Effect) -> float | None:
    """The width of the change's 95% interval on the log of the ratio of the two speeds, so
    that a large change and a small one compare by their noise alone (None: no interval; inf:
    an older hook's interval that reaches -100%)."""
    bounds = interval(effect)
    if bounds is None:
        return None
    if bounds[0] <= -1:
        return math.inf
    return math.log1p(bounds[1]) - math.log1p(bounds[0])


def lowest_gain(effect: Effect) -> float:
    """The low end of the change of samples/s (the change itself where there is no interval)."""
    bounds = interval(effect)
    return bounds[0] if bounds is not None else speedup(effect)


def speed_words(effect: Effect) -> str:
    """``+41% +-6% samples/s``, ``+133% (+46% to +533%) samples/s`` where the interval is not
    symmetric, or ``no measurable change (-3% +-8% samples/s)``."""
    change = speedup(effect)
    words = f"{change:+.0%}"
    bounds = interval(effect)
    if bounds is not None:
        below, above = round((change - bounds[0]) * 100), round((bounds[1] - change) * 100)
        if below == above and above > 0:
            words += f" +-{above}%"
        elif below != above:
            words += f" ({bounds[0]:+.0%} to {bounds[1]:+.0%})"
    if measurable(effect):
        return f"{words} samples/s"
    return f"no measurable change ({words} samples/s)"


def warmup_words(effect: Effect) -> str:
    """``6 steps after the change left out (the rebuilt loader's 2 new workers starting ...)``
    ('' for an older hook's effect, or only the settling steps left out)."""
    if effect.warmup_steps is None or effect.warmup_steps <= SETTLE_STEPS:
        return ""
    return f"{effect.warmup_steps} steps after the change left out ({effect.warmup_why})"


def describe(effect: Effect) -> str:
    """One line: ``+41% +-6% samples/s, step 85.0 ms -> 47.1 ms, data wait 62% -> 4%, peak ...``,
    with the warm-up steps left out where they were more than the settling steps."""
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
    if words := warmup_words(effect):
        parts.append(words)
    return ", ".join(parts)
