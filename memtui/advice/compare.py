"""Two runs side by side, figure by figure, and the bounds a CI job holds a run to.

Each figure of time is judged from the steps the summaries keep (a uniform sample of each run's
steps, ``advice.summary.KEPT_STEPS`` at most), never from two means: the Mann-Whitney rank test
says whether one run's steps tend to be slower than the other's, the medians say by how much,
with a 95% interval from each median's order statistics. A peak of memory is one number per run:
its noise is how much the run's own stretches' peaks spread. Pure: no file, no socket.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memtui.core.stats import format_bytes, format_duration, mann_whitney, quantile
from memtui.wire import KeptStep, RunSummary

SIGNIFICANCE = 0.05
"""A difference whose two-sided p-value is under this is not called noise."""
MIN_KEPT = 8
"""Fewer steps kept on either side than this: too few to compare."""
MEMORY_NOISE_FLOOR = 0.02
"""Peaks closer than this share are within the noise, however still the runs' memory was."""


@dataclass(frozen=True)
class Spread:
    """One run's figure: its median, the 10th and 90th percentiles, over ``n`` values."""

    median: float
    p10: float
    p90: float
    n: int
    low: float
    """The 95% interval of the median, low end (order statistics)."""
    high: float


def spread_of(values: Sequence[float]) -> Spread | None:
    """The spread of ``values`` (None when there are none)."""
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return None
    half_width = 1.96 * math.sqrt(n) / 2
    low = ordered[max(0, math.floor(n / 2 - half_width) - 1)] if n > 1 else ordered[0]
    high = ordered[min(n - 1, math.ceil(n / 2 + half_width))] if n > 1 else ordered[0]
    return Spread(
        quantile(ordered, 0.5), quantile(ordered, 0.1), quantile(ordered, 0.9), n, low, high
    )


@dataclass(frozen=True)
class Figure:
    """One figure of two runs: each one's spread, the change and the verdict."""

    key: str
    """``step_time_s``, ``data_wait_s``, ``samples_per_s``, ``device_peak_bytes``, ``host_peak_bytes``."""
    name: str
    unit: str
    """``s``, ``samples/s`` or ``bytes``."""
    first: Spread | None
    second: Spread | None
    change: float | None
    """The second's median over the first's, minus one (None: not comparable)."""
    change_low: float | None
    """The change's 95% interval (from the medians' intervals; None for a peak)."""
    change_high: float | None
    p_value: float | None
    """The rank test's two-sided p-value (None for a peak)."""
    verdict: str
    """``faster``, ``slower`` (step time, samples/s), ``less``, ``more`` (data wait, peaks),
    ``within the noise``, ``no clear change`` (the steps' spread differs, their median does not),
    or why it is not judged."""
    note: str = ""

    @property
    def judged(self) -> bool:
        """Whether both runs had the figure and enough of it to judge."""
        return self.change is not None and self.verdict not in NOT_JUDGED


SPREAD_ONLY = "no clear change"
"""The rank test tells the two runs' steps apart, but the medians' 95% interval holds no change:
neither is called faster or slower."""
NOT_MEASURED = "not measured"
TOO_FEW = "too few steps"
NOT_JUDGED = (NOT_MEASURED, TOO_FEW)


def _per_step(
    key: str,
    name: str,
    first: RunSummary,
    second: RunSummary,
    value: Callable[[KeptStep], float | None],
    higher_is_faster: bool = False,
    words: tuple[str, str] = ("faster", "slower"),
) -> Figure:
    """A figure judged from the kept steps' values (None: a step without it); ``words``: the
    verdict for the second run better, then worse."""
    a = [v for v in map(value, first.kept) if v is not None]
    b = [v for v in map(value, second.kept) if v is not None]
    one, two = spread_of(a), spread_of(b)
    unit = "samples/s" if higher_is_faster else "s"
    if one is None or two is None:
        return Figure(key, name, unit, one, two, None, None, None, None, NOT_MEASURED)
    if len(a) < MIN_KEPT or len(b) < MIN_KEPT:
        note = f"{len(a)} and {len(b)} steps kept, {MIN_KEPT} needed on each side"
        return Figure(key, name, unit, one, two, None, None, None, None, TOO_FEW, note)
    test = mann_whitney(a, b)
    change = _ratio(two.median, one.median)
    low = _ratio(two.low, one.high)
    high = _ratio(two.high, one.low)
    note = ""
    if test.p_value >= SIGNIFICANCE:
        verdict = "within the noise"
    else:
        larger = test.superiority > 0.5
        bound = low if larger else high
        if bound is not None and (bound <= 0 if larger else bound >= 0):
            # the steps differ in shape (a run that changed speed halfway, one spread wider)
            # while the medians' interval holds no change: neither run is the faster
            verdict = SPREAD_ONLY
            note = f"the steps' spread differs, p={test.p_value:.2g}; their median does not"
        else:
            better, worse = words
            verdict = better if larger == higher_is_faster else worse
    return Figure(key, name, unit, one, two, change, low, high, test.p_value, verdict, note)


def _ratio(new: float, old: float) -> float | None:
    """``new / old - 1`` (None when ``old`` is 0)."""
    return new / old - 1 if old > 0 else (0.0 if new == 0 else None)


def _peak(key: str, name: str, first: RunSummary, second: RunSummary, device: bool) -> Figure:
    """A peak of memory: one number per run; the noise is the spread of each run's stretches'
    peaks (the later half of each run, where it holds its config)."""

    def of(summary: RunSummary) -> tuple[float | None, list[float]]:
        memory = summary.memory
        if memory is None:
            return None, []
        peak = memory.device_peak_bytes if device else memory.host_peak_bytes
        windows = [
            float(w.device_peak_bytes if device else w.host_peak_bytes) for w in summary.windows
        ]
        windows = [w for w in windows if w > 0]
        return (float(peak) if peak else None), windows[len(windows) // 2 :]

    (a, wa), (b, wb) = of(first), of(second)
    one = Spread(a, min(wa, default=a), max(wa, default=a), len(wa), a, a) if a else None
    two = Spread(b, min(wb, default=b), max(wb, default=b), len(wb), b, b) if b else None
    if a is None or b is None:
        return Figure(key, name, "bytes", one, two, None, None, None, None, NOT_MEASURED)
    noise = max(MEMORY_NOISE_FLOOR, _relative_spread(wa), _relative_spread(wb))
    change = b / a - 1
    verdict = "within the noise" if abs(change) <= noise else ("more" if change > 0 else "less")
    note = f"noise {noise:.0%}"
    return Figure(key, name, "bytes", one, two, change, None, None, None, verdict, note)


def _relative_spread(values: Sequence[float]) -> float:
    """(p90 - p10) over the median of ``values`` (0 with fewer than two)."""
    ordered = sorted(values)
    if len(ordered) < 2:
        return 0.0
    middle = quantile(ordered, 0.5)
    return (quantile(ordered, 0.9) - quantile(ordered, 0.1)) / middle if middle > 0 else 0.0


def compare(first: RunSummary, second: RunSummary) -> list[Figure]:
    """Every figure of ``second`` against ``first``."""
    waits = first.data_wait_measured and second.data_wait_measured
    counted = first.samples > 0 and second.samples > 0
    return [
        _per_step("step_time_s", "step time", first, second, lambda k: k.step_time_s),
        _per_step(
            "data_wait_s",
            "data wait",
            first,
            second,
            lambda k: k.data_wait_s if waits else None,
            words=("less", "more"),
        ),
        _per_step(
            "samples_per_s",
            "samples/s",
            first,
            second,
            lambda k: k.samples / k.step_time_s if counted and k.step_time_s > 0 else None,
            higher_is_faster=True,
        ),
        _peak("device_peak_bytes", "peak memory", first, second, device=True),
        _peak("host_peak_bytes", "host memory", first, second, device=False),
    ]


def value_words(unit: str, value: float) -> str:
    """A figure's value in its unit: ``41.2 ms``, ``1,654 samples/s``, ``2.1 GiB``."""
    if unit == "bytes":
        return format_bytes(value)
    if unit == "s":
        return format_duration(value)
    return f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


# ---------------------------------------------------------------------------- the CI gate


@dataclass(frozen=True)
class Bounds:
    """What ``memtui check`` holds a run to (None: not checked); every bound a fraction."""

    step_time_regression: float | None = None
    """The most the median step time may grow over the reference's (0.1: 10%)."""
    peak_memory: float | None = None
    """The most of the device's capacity (the CPU's memory limit) the peak may take."""
    peak_memory_regression: float | None = None
    """The most the device peak may grow over the reference's."""
    data_wait: float | None = None
    """The most of the step time the run may spend waiting for data."""

    @property
    def needs_reference(self) -> bool:
        """Whether a bound is against a reference run."""
        return self.step_time_regression is not None or self.peak_memory_regression is not None


@dataclass(frozen=True)
class Checked:
    """One bound checked: whether it held, and the line that says so."""

    bound: str
    passed: bool
    line: str


def check(summary: RunSummary, bounds: Bounds, reference: RunSummary | None) -> list[Checked]:
    """Every bound asked for, checked on ``summary`` (against ``reference`` where it is one)."""
    results: list[Checked] = []
    figures = {f.key: f for f in compare(reference, summary)} if reference is not None else {}
    if bounds.step_time_regression is not None:
        results.append(_step_time(figures.get("step_time_s"), bounds.step_time_regression))
    if bounds.peak_memory is not None:
        results.append(_peak_share(summary, bounds.peak_memory))
    if bounds.peak_memory_regression is not None:
        results.append(
            _peak_growth(figures.get("device_peak_bytes"), bounds.peak_memory_regression)
        )
    if bounds.data_wait is not None:
        results.append(_data_wait(summary, bounds.data_wait))
    return results


def _step_time(figure: Figure | None, allowed: float) -> Checked:
    name = "step time"
    if figure is None or figure.change is None or not figure.judged:
        why = "no reference"
        if figure is not None:
            why = f"{figure.verdict}: {figure.note}" if figure.note else figure.verdict
        return Checked(name, False, f"step time: not compared ({why})")
    assert figure.first is not None and figure.second is not None
    words = (
        f"step time: median {value_words('s', figure.second.median)} against "
        f"{value_words('s', figure.first.median)} in the reference: {figure.change:+.1%}"
        f" (95% interval {_signed(figure.change_low)} to {_signed(figure.change_high)}, "
        f"p={figure.p_value:.2g}, {figure.verdict})"
    )
    failed = figure.verdict == "slower" and figure.change > allowed
    limit = f"the +{allowed:.0%} allowed"
    return Checked(name, not failed, f"{words}: {'over' if failed else 'within'} {limit}")


def _signed(value: float | None) -> str:
    return "?" if value is None else f"{value:+.1%}"


def _peak_share(summary: RunSummary, allowed: float) -> Checked:
    name = "peak memory"
    memory = summary.memory
    if memory is None or not memory.device_peak_bytes or not memory.capacity_bytes:
        return Checked(name, False, "peak memory: not measured (no device sample)")
    share = memory.device_peak_bytes / memory.capacity_bytes
    failed = share > allowed
    return Checked(
        name,
        not failed,
        f"peak memory: {format_bytes(memory.device_peak_bytes)}, {share:.0%} of "
        f"{format_bytes(memory.capacity_bytes)}: {'over' if failed else 'within'} the "
        f"{allowed:.0%} allowed",
    )


def _peak_growth(figure: Figure | None, allowed: float) -> Checked:
    name = "peak memory growth"
    if figure is None or figure.change is None:
        why = figure.verdict if figure is not None else "no reference"
        return Checked(name, False, f"peak memory: not compared ({why})")
    assert figure.first is not None and figure.second is not None
    failed = figure.verdict == "more" and figure.change > allowed
    return Checked(
        name,
        not failed,
        f"peak memory: {format_bytes(figure.second.median)} against "
        f"{format_bytes(figure.first.median)} in the reference: {figure.change:+.1%} "
        f"({figure.verdict}, {figure.note}): {'over' if failed else 'within'} the "
        f"+{allowed:.0%} allowed",
    )


def _data_wait(summary: RunSummary, allowed: float) -> Checked:
    name = "data wait"
    if not summary.data_wait_measured or summary.step_time_s <= 0:
        return Checked(name, False, "data wait: not measured (no DataLoader seen)")
    share = summary.data_wait_s / summary.step_time_s
    failed = share > allowed
    return Checked(
        name,
        not failed,
        f"data wait: {share:.1%} of the step time over {summary.steps} steps: "
        f"{'over' if failed else 'within'} the {allowed:.0%} allowed",
    )
