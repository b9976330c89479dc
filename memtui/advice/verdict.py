"""The verdict: is the run starving for data, balanced, or at risk of running out of memory?

Pure: the inputs are summaries (data-wait fraction, peak-memory fraction, host RAM and swap), the
output is a state, a severity, a position on the STARVED..OOM RISK gauge and the numbers behind
it. Every threshold lives in :class:`Thresholds` (one documented place, shown in the viewer's
help screen). The memory bands are the seeds': under 85% of capacity is safe, 85-90% is the
edge, over 90% is danger. On a run of several ranks the inputs are the worst rank's numbers
(``wait_rank``, ``memory_rank``) and the headline and reasons name that rank.

Rules, in order:

1. OOM RISK when the peak device memory is at or over ``memory_edge_fraction`` of capacity
   (severity 1 in the edge band, 2 at or over ``memory_danger_fraction``), or when host RAM
   is at or over ``host_ram_fraction``, or swap is in use and grew by ``swap_growth_bytes`` or
   more over the host window (severity 1). Memory wins over starvation: it can kill the run.
2. STARVED when the loader wait is at or over ``starved_wait_fraction`` of the step time.
3. BALANCED otherwise; NO DATA until a timed step has been seen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from memtui.stats import format_bytes, format_duration


class State(enum.Enum):
    """Where the run stands; the value is the word shown to the user."""

    NO_DATA = "NO DATA"
    STARVED = "STARVED"
    BALANCED = "BALANCED"
    OOM_RISK = "OOM RISK"


@dataclass(frozen=True)
class Thresholds:
    """Every threshold of the verdict, in one place."""

    starved_wait_fraction: float = 0.30
    """STARVED at or over this share of step time spent waiting for the data loader."""
    memory_edge_fraction: float = 0.85
    """OOM RISK (edge) at or over this share of device capacity at peak."""
    memory_danger_fraction: float = 0.90
    """OOM RISK (danger) at or over this share of device capacity at peak."""
    host_ram_fraction: float = 0.90
    """OOM RISK (host) at or over this share of host RAM in use."""
    swap_growth_bytes: int = 64 << 20
    """OOM RISK (host) when swap is in use and grew at least this much over the host window."""


THRESHOLDS = Thresholds()
"""The thresholds memtui uses."""


@dataclass(frozen=True)
class Inputs:
    """The summaries the verdict is made from (None: not measured yet)."""

    data_wait_fraction: float | None = None
    """Mean data-loader wait over mean step time, on the worst rank."""
    step_time_s: float | None = None
    """Mean step time the wait fraction is taken over."""
    data_wait_s: float | None = None
    """Mean data-loader wait per step."""
    peak_memory_fraction: float | None = None
    """Peak device memory in use over capacity, on the worst rank."""
    peak_memory_bytes: int | None = None
    capacity_bytes: int | None = None
    device_kind: str = "cuda"
    """``"cuda"`` or ``"cpu"`` (on CPU runs the memory is the process tree's RSS)."""
    host_ram_fraction: float | None = None
    """Host RAM in use over total host RAM."""
    swap_used_bytes: int = 0
    swap_growth_bytes: int = 0
    """Growth of swap in use over the host window (negative when it shrank)."""
    wait_rank: int | None = None
    """The rank the data wait is from, named in the verdict (None: a single-rank run)."""
    memory_rank: int | None = None
    """The rank the peak memory is from, named in the verdict (None: a single-rank run)."""


@dataclass(frozen=True)
class Reason:
    """One number behind the verdict."""

    label: str
    """What the number is, e.g. ``data wait``."""
    value: str
    """The number in words, e.g. ``62% (68.0 ms of 110 ms/step)``."""
    severity: int = 0
    """0 fine, 1 at a threshold's edge, 2 over it."""


@dataclass(frozen=True)
class Verdict:
    """The state, how bad, where on the gauge, and why."""

    state: State
    severity: int
    """0 fine, 1 warning (starved, edge band, host pressure), 2 danger (over 90%)."""
    headline: str
    """One sentence for the user."""
    position: float
    """Where the gauge's marker sits: -1 fully starved, 0 balanced, +1 out of memory."""
    reasons: tuple[Reason, ...]


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def _of_rank(rank: int | None, text: str) -> str:
    """``text`` prefixed with the rank it is about (``rank 3: ...``) on a multi-rank run."""
    return text if rank is None else f"rank {rank}: {text}"


def _memory_reason(inputs: Inputs, t: Thresholds) -> Reason | None:
    fraction = inputs.peak_memory_fraction
    if fraction is None:
        return None
    severity = (
        2 if fraction >= t.memory_danger_fraction else int(fraction >= t.memory_edge_fraction)
    )
    label = _of_rank(
        inputs.memory_rank, "peak memory" if inputs.device_kind != "cpu" else "peak RSS"
    )
    value = f"{fraction:.0%}"
    if inputs.peak_memory_bytes is not None and inputs.capacity_bytes:
        value += (
            f" ({format_bytes(inputs.peak_memory_bytes)} of {format_bytes(inputs.capacity_bytes)})"
        )
    return Reason(label, value, severity)


def _wait_reason(inputs: Inputs, t: Thresholds) -> Reason | None:
    fraction = inputs.data_wait_fraction
    if fraction is None:
        return None
    value = f"{fraction:.0%}"
    if inputs.data_wait_s is not None and inputs.step_time_s:
        value += (
            f" ({format_duration(inputs.data_wait_s)} of {format_duration(inputs.step_time_s)}"
            "/step)"
        )
    severity = int(fraction >= t.starved_wait_fraction)
    return Reason(_of_rank(inputs.wait_rank, "data wait"), value, severity)


def _host_reason(inputs: Inputs, t: Thresholds) -> Reason | None:
    if inputs.host_ram_fraction is None:
        return None
    swap_growing = _swap_growing(inputs, t)
    value = f"{inputs.host_ram_fraction:.0%}"
    if inputs.swap_used_bytes:
        value += f", swap {format_bytes(inputs.swap_used_bytes)}"
        if inputs.swap_growth_bytes > 0:
            value += f" (+{format_bytes(inputs.swap_growth_bytes)})"
    severity = int(inputs.host_ram_fraction >= t.host_ram_fraction or swap_growing)
    return Reason("host RAM", value, severity)


def _swap_growing(inputs: Inputs, t: Thresholds) -> bool:
    return inputs.swap_used_bytes > 0 and inputs.swap_growth_bytes >= t.swap_growth_bytes


def decide(inputs: Inputs, thresholds: Thresholds = THRESHOLDS) -> Verdict:
    """The verdict for ``inputs`` under ``thresholds`` (see the module's rules)."""
    t = thresholds
    reasons = tuple(
        r
        for r in (_wait_reason(inputs, t), _memory_reason(inputs, t), _host_reason(inputs, t))
        if r is not None
    )
    wait = inputs.data_wait_fraction
    memory = inputs.peak_memory_fraction
    ram = inputs.host_ram_fraction

    if memory is not None and memory >= t.memory_edge_fraction:
        danger = memory >= t.memory_danger_fraction
        band = "over 90%, danger" if danger else "85-90% edge band"
        span = max(1e-9, 1.0 - t.memory_edge_fraction)
        position = 0.5 + 0.5 * _clamp((memory - t.memory_edge_fraction) / span, 0.0, 1.0)
        what = "device memory" if inputs.device_kind != "cpu" else "the memory limit"
        headline = f"peak {memory:.0%} of {what}: {band}"
        if inputs.memory_rank is not None:  # shorter, to fit a side pane with the rank's name
            headline = f"rank {inputs.memory_rank}: peak {memory:.0%}, {band}"
        return Verdict(State.OOM_RISK, 2 if danger else 1, headline, position, reasons)
    if ram is not None and (ram >= t.host_ram_fraction or _swap_growing(inputs, t)):
        span = max(1e-9, 1.0 - t.host_ram_fraction)
        position = 0.5 + 0.5 * _clamp((ram - t.host_ram_fraction) / span, 0.0, 1.0)
        if ram >= t.host_ram_fraction:
            headline = f"host RAM {ram:.0%} used"
        else:
            headline = f"swap in use and growing ({format_bytes(inputs.swap_used_bytes)})"
        return Verdict(State.OOM_RISK, 1, headline, position, reasons)
    if wait is None:
        return Verdict(State.NO_DATA, 0, "waiting for timed steps", 0.0, reasons)
    if wait >= t.starved_wait_fraction:
        span = max(1e-9, 1.0 - t.starved_wait_fraction)
        position = -(0.5 + 0.5 * _clamp((wait - t.starved_wait_fraction) / span, 0.0, 1.0))
        headline = f"{wait:.0%} of each step waits on the data loader"
        if inputs.wait_rank is not None:
            headline = f"rank {inputs.wait_rank}: {wait:.0%} of each step waits on data"
        return Verdict(State.STARVED, 1, headline, position, reasons)
    pull_right = 0.5 * (memory or 0.0) / t.memory_edge_fraction
    pull_left = 0.5 * wait / t.starved_wait_fraction
    position = _clamp(pull_right - pull_left, -0.49, 0.49)
    headline = "the loader keeps up"
    if memory is not None:
        headline += " and memory has headroom"
    return Verdict(State.BALANCED, 0, headline, position, reasons)


def describe_thresholds(thresholds: Thresholds = THRESHOLDS) -> list[str]:
    """The rules in words, for the help screen."""
    t = thresholds
    return [
        f"STARVED   data wait >= {t.starved_wait_fraction:.0%} of step time",
        f"OOM RISK  peak memory >= {t.memory_edge_fraction:.0%} of capacity "
        f"(edge {t.memory_edge_fraction:.0%}-{t.memory_danger_fraction:.0%}, "
        f"danger >= {t.memory_danger_fraction:.0%})",
        f"OOM RISK  host RAM >= {t.host_ram_fraction:.0%}, or swap in use and grown "
        f">= {format_bytes(t.swap_growth_bytes)} over the host window",
        "BALANCED  otherwise (memory risk wins when both apply)",
        "peak memory: torch's peak reserve plus what NVML sees beyond it "
        "(CUDA context, NCCL, other processes); on CPU runs, process-tree RSS over the limit",
    ]
