"""The verdict: is the run starving for data, balanced, underusing its memory, or at risk?

Pure: the inputs are summaries (data-wait fraction, peak-memory fraction, host RAM and swap), the
output is a state, a severity, a position on the STARVED..OOM RISK gauge and the numbers behind
it. Every threshold lives in :class:`Thresholds` (one documented place, shown in the viewer's
help screen, overridable in a YAML file read by ``memtui.storage.userconfig.load_thresholds``). The memory bands are those
operators size a batch by after an out-of-memory error: under 85% of capacity is safe, 85-90% is
the edge, over 90% is danger. On a run of
several ranks the inputs are the worst rank's numbers (``wait_rank``, ``memory_rank``) and the
headline and reasons name that rank.

Rules, in order:

1. OOM RISK when the peak device memory is at or over ``memory_edge_fraction`` of capacity
   (severity 1 in the edge band, 2 at or over ``memory_danger_fraction``). Memory wins over
   starvation: it can kill the run.
2. HOST PRESSURE when host RAM is at or over ``host_ram_fraction``, or swap is in use and grew
   by ``swap_growth_bytes`` or more over the host window (severity 1): too many loader workers
   or pinned memory, most often (a run starving for data was seen at 94% host RAM, in swap).
3. NO DATA until a timed step has been seen.
4. STARVED when the loader wait is at or over ``starved_wait_fraction`` of the step time.
5. UNDERUSED when the peak is under ``underused_memory_fraction`` of a capacity that is a real
   bound: a device's memory, or on a CPU run a memory limit (a cgroup's or the demo's budget),
   never the host's whole RAM, which other processes share. Room for a bigger micro-batch.
6. BALANCED otherwise.

Hysteresis: :func:`decide` takes the previous state; leaving it needs the number to cross back
by ``hysteresis`` (a share of capacity or of the step: 0.03 is three points), so the verdict
does not flicker at a threshold. :class:`VerdictTracker` keeps the previous state for a viewer;
one-shot callers (``memtui status``) pass none.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from memtui.core.stats import format_bytes, format_duration, one_line, shown


class State(enum.Enum):
    """Where the run stands; the value is the word shown to the user."""

    NO_DATA = "NO DATA"
    STARVED = "STARVED"
    BALANCED = "BALANCED"
    UNDERUSED = "UNDERUSED"
    OOM_RISK = "OOM RISK"
    HOST_PRESSURE = "HOST PRESSURE"


@dataclass(frozen=True)
class Thresholds:
    """Every threshold of the verdict, in one place."""

    starved_wait_fraction: float = 0.30
    """STARVED at or over this share of step time spent waiting for the data loader."""
    underused_memory_fraction: float = 0.60
    """UNDERUSED under this share of capacity at peak (not starved, capacity a real bound)."""
    memory_edge_fraction: float = 0.85
    """OOM RISK (edge) at or over this share of device capacity at peak."""
    memory_danger_fraction: float = 0.90
    """OOM RISK (danger) at or over this share of device capacity at peak."""
    host_ram_fraction: float = 0.90
    """HOST PRESSURE at or over this share of host RAM in use."""
    swap_growth_bytes: int = 64 << 20
    """HOST PRESSURE when swap is in use and grew at least this much over the host window."""
    hysteresis: float = 0.03
    """Leaving a state needs its number to cross back by this much (shares: 0.03 = 3 points)."""


THRESHOLDS = Thresholds()
"""The built-in thresholds."""

FRACTION_FIELDS = frozenset(
    {
        "starved_wait_fraction",
        "underused_memory_fraction",
        "memory_edge_fraction",
        "memory_danger_fraction",
        "host_ram_fraction",
    }
)
"""Thresholds that are shares (0 < x <= 1)."""


@dataclass(frozen=True)
class Inputs:
    """The summaries the verdict is made from (None: not measured yet)."""

    data_wait_fraction: float | None = None
    """Mean data-loader wait over mean step time, on the worst rank."""
    step_time_s: float | None = None
    """Mean step time the wait fraction is taken over."""
    data_wait_s: float | None = None
    """Mean data-loader wait per step."""
    data_wait_measured: bool = True
    """False where the steps drew no batch memtui timed: the wait is unknown, never STARVED."""
    peak_memory_fraction: float | None = None
    """Peak device memory in use over capacity, on the worst rank."""
    peak_memory_bytes: int | None = None
    capacity_bytes: int | None = None
    device_kind: str = "cuda"
    """``"cuda"`` or ``"cpu"`` (on CPU runs the memory is the process tree's RSS)."""
    capacity_is_limit: bool = True
    """The capacity bounds the run (a device, a memory limit); False on a CPU run measured
    against the host's whole RAM, where "room for a bigger batch" would not be honest."""
    host_ram_fraction: float | None = None
    """Host RAM in use over total host RAM."""
    swap_used_bytes: int = 0
    swap_growth_bytes: int = 0
    """Growth of swap in use over the host window (negative when it shrank)."""
    workers: int | None = None
    """Loader workers of the run (named in the host-pressure reasons)."""
    workers_bytes: int | None = None
    """Memory the loader workers hold (USS where measured, else RSS)."""
    pin_memory: bool | None = None
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
    held: bool = False
    """The state is kept by hysteresis: its number is back under the threshold, not yet by
    the margin."""


# gauge zones: STARVED [-1, -0.5), UNDERUSED [-0.5, -0.15), BALANCED [-0.15, 0.5), risk [0.5, 1]
UNDERUSED_END = -0.15
"""Where the gauge's UNDERUSED zone ends and BALANCED begins."""


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
    if not inputs.data_wait_measured:
        return Reason("data wait", "not measured (no DataLoader seen)", 0)
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


def _loader_reasons(inputs: Inputs) -> tuple[Reason, ...]:
    """What the loader holds in host memory: the usual cause of host pressure."""
    out = []
    if inputs.workers is not None:
        value = str(inputs.workers)
        if inputs.workers_bytes:
            value += f" holding {format_bytes(inputs.workers_bytes)}"
        out.append(Reason("loader workers", value, 1 if inputs.workers else 0))
    if inputs.pin_memory and inputs.device_kind == "cuda":  # torch pins nothing without one
        out.append(Reason("pin_memory", "on (page-locked, never swapped)", 1))
    return tuple(out)


def _swap_growing(inputs: Inputs, t: Thresholds) -> bool:
    return inputs.swap_used_bytes > 0 and inputs.swap_growth_bytes >= t.swap_growth_bytes


def sticky(thresholds: Thresholds, previous: State | None) -> Thresholds:
    """The thresholds that apply while in ``previous``: its own moved back by the hysteresis
    margin, so that leaving it takes a clear change (entering any state takes the plain ones)."""
    t, margin = thresholds, thresholds.hysteresis
    if previous is State.OOM_RISK:
        return dataclasses.replace(t, memory_edge_fraction=t.memory_edge_fraction - margin)
    if previous is State.HOST_PRESSURE:
        return dataclasses.replace(t, host_ram_fraction=t.host_ram_fraction - margin)
    if previous is State.STARVED:
        return dataclasses.replace(t, starved_wait_fraction=t.starved_wait_fraction - margin)
    if previous is State.UNDERUSED:
        return dataclasses.replace(
            t, underused_memory_fraction=t.underused_memory_fraction + margin
        )
    return t


def _held(state: str, way: str, until: float) -> str:
    """`` (still STARVED until it falls under 27%)``: a state kept by the hysteresis, in words (its
    number is back past the threshold, not yet by the margin)."""
    verb = "falls" if way == "under" else "rises"
    return f" (still {state} until it {verb} {way} {until:.0%})"


def decide(
    inputs: Inputs, thresholds: Thresholds | None = None, previous: State | None = None
) -> Verdict:
    """The verdict for ``inputs`` under ``thresholds`` (see the module's rules), with hysteresis
    against the ``previous`` state when given."""
    base = thresholds if thresholds is not None else THRESHOLDS
    t = sticky(base, previous)
    reasons = tuple(
        r
        for r in (
            _wait_reason(inputs, base),
            _memory_reason(inputs, base),
            _host_reason(inputs, base),
        )
        if r is not None
    )
    wait = inputs.data_wait_fraction
    memory = inputs.peak_memory_fraction
    ram = inputs.host_ram_fraction

    if memory is not None and memory >= t.memory_edge_fraction:
        danger = memory >= base.memory_danger_fraction
        held = memory < base.memory_edge_fraction
        band = (
            f"over {base.memory_danger_fraction:.0%}, danger"
            if danger
            else f"{base.memory_edge_fraction * 100:.0f}-{base.memory_danger_fraction:.0%} edge band"
        )
        if held:
            band = f"just under the {base.memory_edge_fraction:.0%} edge" + _held(
                "OOM RISK", "under", t.memory_edge_fraction
            )
        span = max(1e-9, 1.0 - base.memory_edge_fraction)
        position = 0.5 + 0.5 * _clamp((memory - base.memory_edge_fraction) / span, 0.0, 1.0)
        what = "device memory" if inputs.device_kind != "cpu" else "the memory limit"
        headline = f"peak {memory:.0%} of {what}: {band}"
        if inputs.memory_rank is not None:  # shorter, to fit a side pane with the rank's name
            headline = f"rank {inputs.memory_rank}: peak {memory:.0%}, {band}"
        return Verdict(State.OOM_RISK, 2 if danger else 1, headline, position, reasons, held)
    if ram is not None and (ram >= t.host_ram_fraction or _swap_growing(inputs, t)):
        span = max(1e-9, 1.0 - base.host_ram_fraction)
        position = 0.5 + 0.5 * _clamp((ram - base.host_ram_fraction) / span, 0.0, 1.0)
        held = ram < base.host_ram_fraction and not _swap_growing(inputs, t)
        if _swap_growing(inputs, t):
            headline = f"swap in use and growing ({format_bytes(inputs.swap_used_bytes)})"
        else:
            headline = f"host RAM {ram:.0%} used"
            if held:
                headline += _held("HOST PRESSURE", "under", t.host_ram_fraction)
        if inputs.workers or (inputs.pin_memory and inputs.device_kind == "cuda"):
            headline += ": loader workers / pin_memory"
        return Verdict(
            State.HOST_PRESSURE,
            1,
            headline,
            position,
            reasons + _loader_reasons(inputs),
            held,
        )
    if wait is None:
        return Verdict(State.NO_DATA, 0, "waiting for timed steps", 0.0, reasons)
    if not inputs.data_wait_measured:
        wait = 0.0  # unknown: no STARVED, and the headline says so
    if inputs.data_wait_measured and wait >= t.starved_wait_fraction:
        span = max(1e-9, 1.0 - base.starved_wait_fraction)
        position = -(0.5 + 0.5 * _clamp((wait - base.starved_wait_fraction) / span, 0.0, 1.0))
        held = wait < base.starved_wait_fraction
        headline = f"{wait:.0%} of each step waits on the data loader"
        if inputs.wait_rank is not None:
            headline = f"rank {inputs.wait_rank}: {wait:.0%} of each step waits on data"
        if held:
            headline += _held("STARVED", "under", t.starved_wait_fraction)
        return Verdict(State.STARVED, 1, headline, position, reasons, held)
    bounded = memory is not None and inputs.capacity_is_limit
    if bounded and memory is not None and memory < t.underused_memory_fraction:
        share = _clamp(memory / max(1e-9, base.underused_memory_fraction), 0.0, 1.0)
        position = _clamp(-0.5 + (UNDERUSED_END + 0.5) * share, -0.49, UNDERUSED_END - 0.01)
        held = memory >= base.underused_memory_fraction
        headline = f"peak {memory:.0%} of capacity: room for a bigger micro-batch"
        if inputs.memory_rank is not None:
            headline = f"rank {inputs.memory_rank}: peak {memory:.0%}, room for a bigger batch"
        if held:
            headline += _held("UNDERUSED", "over", t.underused_memory_fraction)
        return Verdict(State.UNDERUSED, 0, headline, position, reasons, held)
    pull_left = 0.3 * wait / max(1e-9, base.starved_wait_fraction)
    if bounded and memory is not None:
        span = max(1e-9, base.memory_edge_fraction - base.underused_memory_fraction)
        share = (memory - base.underused_memory_fraction) / span
        position = _clamp(UNDERUSED_END + 0.65 * share - pull_left, UNDERUSED_END + 0.01, 0.49)
    else:
        position = _clamp(0.3 - pull_left, UNDERUSED_END + 0.01, 0.49)
    headline = "the loader keeps up" if inputs.data_wait_measured else "data wait not measured"
    if memory is not None:
        headline += " and memory has headroom"
    if memory is not None and not inputs.capacity_is_limit:
        headline += " (no memory limit known)"
    return Verdict(State.BALANCED, 0, headline, position, reasons)


class VerdictTracker:
    """Keeps the previous state, so that each verdict is decided with hysteresis (a viewer)."""

    def __init__(self, thresholds: Thresholds | None = None) -> None:
        self.thresholds = thresholds if thresholds is not None else THRESHOLDS
        self.state: State | None = None
        """The state of the latest verdict (None before the first)."""

    def update(self, inputs: Inputs) -> Verdict:
        """The verdict for ``inputs``, leaving the previous state only by the margin."""
        verdict = decide(inputs, self.thresholds, self.state)
        self.state = verdict.state
        return verdict


def describe_thresholds(thresholds: Thresholds | None = None) -> list[str]:
    """The rules in words, for the help screen."""
    t = thresholds if thresholds is not None else THRESHOLDS
    return [
        f"OOM RISK       peak memory >= {t.memory_edge_fraction:.0%} of capacity "
        f"(edge {t.memory_edge_fraction:.0%}-{t.memory_danger_fraction:.0%}, "
        f"danger >= {t.memory_danger_fraction:.0%})",
        f"HOST PRESSURE  host RAM >= {t.host_ram_fraction:.0%}, or swap in use and grown "
        f">= {format_bytes(t.swap_growth_bytes)} over the host window (workers, pin_memory)",
        f"STARVED        data wait >= {t.starved_wait_fraction:.0%} of step time",
        f"UNDERUSED      peak memory < {t.underused_memory_fraction:.0%} of capacity, not "
        "starved (on CPU only under a memory limit): room for a bigger batch",
        "BALANCED       otherwise (checked in this order: memory risk wins)",
        f"hysteresis     leaving a state takes its number back by {t.hysteresis:.0%} "
        f'(until then: "still STARVED until it falls under '
        f'{t.starved_wait_fraction - t.hysteresis:.0%}")',
        "peak memory: torch's peak reserve plus what NVML sees beyond it "
        "(CUDA context, NCCL, other processes); on CPU runs, main RSS + loader workers' own memory (USS) over the limit",
    ]


# --------------------------------------------------------------------------- the config file


@dataclass(frozen=True)
class ThresholdConfig:
    """The thresholds in force, where they came from, and what was wrong with the file."""

    thresholds: Thresholds
    source: str
    """The file they were read from, or ``built-in defaults``."""
    problems: tuple[str, ...] = field(default=())
    """One line per thing ignored (unknown key, bad value, unreadable file)."""


def _check_value(name: str, value: Any) -> float | int | str:
    """The value as the field's type, or a one-line reason it is not valid (a str)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"verdict.{name}: {shown(value)} is not a number"
    if not math.isfinite(value):
        return f"verdict.{name}: {shown(value)} is not a finite number"
    if name in FRACTION_FIELDS and not 0 < value <= 1:
        return f"verdict.{name}: {shown(value)} is not a share in (0, 1] (e.g. 0.85 for 85%)"
    if name == "hysteresis" and not 0 <= value < 0.5:
        return f"verdict.hysteresis: {shown(value)} is not in [0, 0.5)"
    if name == "swap_growth_bytes":
        if value < 0:
            return f"verdict.swap_growth_bytes: {shown(value)} is negative"
        return int(value)
    return float(value)


SECTION = "verdict"
"""The config file's one section: everything memtui reads from the file is under it."""


def unused_top_level(data: dict[Any, Any], known: list[str]) -> list[str]:
    """One line for each top-level key of the config file but ``verdict``, which memtui does not
    read: a threshold put at the top level, a misspelled section or an unknown key, each with
    the nearest known key (``known``: the thresholds' names)."""
    lines = []
    for key, value in data.items():
        if key == SECTION:
            continue
        name = one_line(key, 40)
        if key in known:
            lines.append(
                f"{name} is at the top level, where memtui reads nothing: it belongs under "
                f"{SECTION}: (verdict.{key}); ignored"
            )
            continue
        nearest = nearest_key(key, [SECTION, *known], SECTION)
        where = f"{SECTION}:" if nearest == SECTION else f"verdict.{nearest}"
        lines.append(f"unknown key {name} ignored{keys_under(value)} (nearest known key: {where})")
    return lines


def nearest_key(key: object, known: list[str], otherwise: str = "") -> str:
    """The known key spelled most like ``key`` (the first of equals); ``otherwise`` where none
    is spelled even half alike (given)."""
    import difflib

    word = str(key).lower()
    ratios = {k: difflib.SequenceMatcher(None, word, k).ratio() for k in known}
    nearest = max(known, key=ratios.__getitem__)
    return otherwise if otherwise and ratios[nearest] < 0.5 else nearest


def keys_under(value: object) -> str:
    """ ", with the keys under it (a, b)" for a mapping ignored whole ("" for anything else)."""
    if not isinstance(value, dict) or not value:
        return ""
    names = ", ".join(one_line(k, 40) for k in list(value)[:4])
    if len(value) == 1:
        return f", with the key under it ({names})"
    more = f" and {len(value) - 4} more" if len(value) > 4 else ""
    return f", with the {len(value)} keys under it ({names}{more})"


def parse_thresholds(data: Any, source: str = "") -> ThresholdConfig:
    """Thresholds from a parsed config file's contents (its ``verdict:`` section)."""
    if data is None:
        return ThresholdConfig(THRESHOLDS, source)
    if not isinstance(data, dict):
        return ThresholdConfig(
            THRESHOLDS, source, (f"{source}: not a mapping of sections; defaults used",)
        )
    known = [f.name for f in dataclasses.fields(Thresholds)]
    problems = [f"{source}: {line}" for line in unused_top_level(data, known)]
    section = data.get("verdict")
    if section is None:
        return ThresholdConfig(THRESHOLDS, source, tuple(problems))
    if not isinstance(section, dict):
        problems.append(f"{source}: verdict: is not a mapping; defaults used")
        return ThresholdConfig(THRESHOLDS, source, tuple(problems))
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key not in known:
            nearest = nearest_key(key, known)
            problems.append(
                f"{source}: unknown key verdict.{one_line(key, 40)} ignored{keys_under(value)} "
                f"(nearest known key: verdict.{nearest})"
            )
            continue
        checked = _check_value(str(key), value)
        if isinstance(checked, str):
            problems.append(f"{source}: {checked}; the default is used")
        else:
            values[str(key)] = checked
    thresholds = dataclasses.replace(THRESHOLDS, **values)
    if thresholds.memory_edge_fraction >= thresholds.memory_danger_fraction:
        problems.append(
            f"{source}: verdict.memory_edge_fraction must be under memory_danger_fraction; "
            "both defaults used"
        )
        thresholds = dataclasses.replace(
            thresholds,
            memory_edge_fraction=THRESHOLDS.memory_edge_fraction,
            memory_danger_fraction=THRESHOLDS.memory_danger_fraction,
        )
    if thresholds.underused_memory_fraction >= thresholds.memory_edge_fraction:
        problems.append(
            f"{source}: verdict.underused_memory_fraction must be under memory_edge_fraction; "
            "the default is used"
        )
        thresholds = dataclasses.replace(
            thresholds,
            underused_memory_fraction=min(
                THRESHOLDS.underused_memory_fraction, thresholds.memory_edge_fraction - 0.05
            ),
        )
    return ThresholdConfig(thresholds, source, tuple(problems))
