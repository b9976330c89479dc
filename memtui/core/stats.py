"""Summaries of step records and samples, shared by the CLI and the TUI (pure, no I/O)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from memtui.wire import DeviceSample, HostSample, StepRecord


@dataclass(frozen=True)
class StepStats:
    """Speed over the most recent steps."""

    steps: int
    """How many step records the summary covers."""
    step_time_s: float
    """Mean wall time per step."""
    data_wait_s: float
    """Mean data-loader wait per step."""
    samples_per_s: float
    """This rank's samples over the steps' time: the samples of its own training batches (a
    batch's rows, the first dimension of its first tensor), summed, over the steps' summed wall
    time."""
    steps_per_s: float
    data_wait_measured: bool = True
    """Whether any of the steps drew a batch memtui timed (a DataLoader or a batch function it
    wraps); False: the loop's data wait and samples are not measured, and their 0 says nothing."""
    micro_batches_per_step: float = 0.0
    """Mean training micro-batches a step drew (what one optimizer step is made of)."""
    samples_per_step: float = 0.0
    """Mean samples a step trained on this rank."""
    samples_counted: bool = True
    """Whether any of the steps counted a sample (False: a batch memtui could find no tensor in,
    or a loop whose batches it does not see: ``samples_per_s`` is not known, not 0)."""
    micro_batch: int | None = None
    """The samples of one micro-batch the steps drew, their median (None: no batch timed)."""
    micro_batches: int | None = None
    """The micro-batches one step drew, their median: the accumulation the loop ran (None: no
    batch timed)."""

    @property
    def data_wait_fraction(self) -> float:
        """The share of step time spent waiting for data (0..1)."""
        return self.data_wait_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def compute_s(self) -> float:
        """Mean time per step not spent waiting for data."""
        return max(0.0, self.step_time_s - self.data_wait_s)


def summarize_steps(records: Sequence[StepRecord], window: int = 50) -> StepStats | None:
    """Speed over the last ``window`` steps (None without records with a measured time)."""
    recent = [r for r in list(records)[-window:] if r.step_time_s > 0]
    if not recent:
        return None
    total = sum(r.step_time_s for r in recent)
    wait = sum(min(r.data_wait_s, r.step_time_s) for r in recent)
    samples = sum(r.samples for r in recent)
    micro = sum(r.micro_batches for r in recent)
    n = len(recent)
    drawn = [r for r in recent if r.micro_batches > 0]
    # the micro-batch and the accumulation are medians: a step that also drew an evaluation
    # loader's batches, or an epoch's last short batch, moves neither
    middle = len(drawn) // 2
    return StepStats(
        steps=n,
        step_time_s=total / n,
        data_wait_s=wait / n,
        samples_per_s=samples / total if total > 0 else 0.0,
        steps_per_s=n / total if total > 0 else 0.0,
        data_wait_measured=micro > 0,
        micro_batches_per_step=micro / n,
        samples_per_step=samples / n,
        samples_counted=samples > 0,
        micro_batch=sorted([r.samples // r.micro_batches for r in drawn])[middle] or None
        if drawn
        else None,
        micro_batches=sorted([r.micro_batches for r in drawn])[middle] if drawn else None,
    )


@dataclass(frozen=True)
class MemoryStats:
    """Device memory over the most recent samples."""

    kind: str
    capacity_bytes: int
    current_bytes: int
    """Allocated now (CUDA: torch allocator; CPU: process-tree RSS)."""
    reserved_bytes: int
    peak_bytes: int
    """Highest peak (reserved on CUDA, RSS on CPU) over the window."""
    peak_allocated_bytes: int
    fragmentation_bytes: int
    nvml_used_bytes: int | None
    ooms: int
    alloc_retries: int

    @property
    def peak_fraction(self) -> float:
        """Peak over capacity (0..1+)."""
        return self.peak_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def beyond_torch_bytes(self) -> int | None:
        """What NVML sees used beyond torch's reserve: CUDA context, NCCL, other processes."""
        if self.nvml_used_bytes is None:
            return None
        return max(0, self.nvml_used_bytes - self.reserved_bytes)

    @property
    def peak_used_bytes(self) -> int:
        """The peak as the device holds it: torch's peak reserve plus what NVML sees beyond it."""
        return self.peak_bytes + (self.beyond_torch_bytes or 0)

    @property
    def peak_used_fraction(self) -> float:
        """``peak_used_bytes`` over capacity (0..1+): the number the memory bands apply to."""
        return self.peak_used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


def summarize_device(samples: Sequence[DeviceSample], window: int = 25) -> MemoryStats | None:
    """Memory over the last ``window`` device samples."""
    recent = list(samples)[-window:]
    if not recent:
        return None
    last = recent[-1]
    return MemoryStats(
        kind=last.kind,
        capacity_bytes=last.capacity_bytes,
        current_bytes=last.allocated_bytes,
        reserved_bytes=last.reserved_bytes,
        peak_bytes=max(max(s.peak_reserved_bytes, s.reserved_bytes) for s in recent),
        peak_allocated_bytes=max(max(s.peak_allocated_bytes, s.allocated_bytes) for s in recent),
        fragmentation_bytes=last.inactive_split_bytes,
        nvml_used_bytes=last.nvml_used_bytes,
        ooms=last.ooms,
        alloc_retries=last.alloc_retries,
    )


@dataclass(frozen=True)
class ProcessTree:
    """What one rank's process tree holds in host memory: the main process's RSS and its loader
    workers' own memory (USS where the hook read it, else their RSS, which counts the pages
    they share with the main process once more for each worker)."""

    main_rss_bytes: int
    workers: int
    """The rank's loader workers (its descendants, the job's other ranks left out)."""
    workers_bytes: int
    """The workers' memory as ``measure`` counts it (0 without workers)."""
    measure: str
    """``USS`` or ``RSS``: how the workers were counted ("" without workers)."""

    @property
    def total_bytes(self) -> int:
        """The main process's RSS plus the workers' memory."""
        return self.main_rss_bytes + self.workers_bytes

    def workers_words(self) -> str:
        """``2 loader workers (18 MiB USS)``, ``2 loader workers (590 MiB RSS, USS not measured
        yet)`` or ``no loader workers``."""
        if not self.workers:
            return "no loader workers"
        plural = "s" if self.workers > 1 else ""
        amount = f"{format_bytes(self.workers_bytes)} {self.measure}"
        unread = ", USS not measured yet" if self.measure == "RSS" else ""
        return f"{self.workers} loader worker{plural} ({amount}{unread})"


def process_tree(host: HostSample) -> ProcessTree:
    """One rank's process tree from its host sample, its workers counted by their own memory
    (USS) where it was read, else by their RSS: the one count of the viewer's per-rank table,
    ``memtui status`` and the advice."""
    if not host.workers:
        return ProcessTree(host.main_rss_bytes, 0, 0, "")
    if host.workers_uss_bytes:
        return ProcessTree(host.main_rss_bytes, host.workers, host.workers_uss_bytes, "USS")
    return ProcessTree(host.main_rss_bytes, host.workers, host.workers_rss_bytes, "RSS")


def ram_fraction(sample: HostSample) -> float:
    """Used host RAM over total RAM (0..1)."""
    return sample.ram_used_bytes / sample.ram_total_bytes if sample.ram_total_bytes else 0.0


STRAGGLER_STEP_FACTOR = 1.25
"""A rank straggles when its mean step time is at least this many times the ranks' median."""
STRAGGLER_WAIT_SHARE = 0.25
"""A rank straggles when it waits for data longer than the median rank by this share of the
median step time (in synchronous data parallel every other rank then waits for it)."""
STRAGGLER_LAG_S = 2.0
"""A rank straggles when its newest step is this many seconds (at the median rate) behind."""


_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(dof: float) -> float:
    """The two-sided 95% quantile of Student's t with ``dof`` degrees of freedom (1.96 past 30)."""
    index = int(dof) - 1
    if index < 0:
        return math.inf
    return _T975[index] if index < len(_T975) else 1.96


def mean_and_margin(values: Sequence[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% t-interval (inf with fewer than two values)."""
    n = len(values)
    if n == 0:
        return math.nan, math.inf
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.inf
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, t975(n - 1) * math.sqrt(variance / n)


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (0.0 when there are none)."""
    ordered = sorted(values)
    count = len(ordered)
    if not count:
        return 0.0
    middle = count // 2
    return ordered[middle] if count % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of already sorted values, interpolated (0.0 when none)."""
    if not ordered:
        return 0.0
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class RankTest:
    """The Mann-Whitney rank test of two samples: does the second tend to be larger?"""

    superiority: float
    """The chance that a value drawn from the second sample is larger than one from the first
    (ties count half): 0.5 when neither tends to be larger."""
    p_value: float
    """Two-sided, from the normal approximation with the ties' correction (1.0: no test)."""


def mann_whitney(first: Sequence[float], second: Sequence[float]) -> RankTest:
    """The Mann-Whitney U test of ``second`` against ``first`` (normal approximation with tie
    and continuity corrections; fine from about 8 values on each side)."""
    n1, n2 = len(first), len(second)
    if not n1 or not n2:
        return RankTest(0.5, 1.0)
    pooled = sorted([(v, 0) for v in first] + [(v, 1) for v in second])
    rank_sum_second = 0.0
    ties = 0.0
    index = 0
    n = n1 + n2
    while index < n:
        end = index
        while end + 1 < n and pooled[end + 1][0] == pooled[index][0]:
            end += 1
        size = end - index + 1
        average = (index + end) / 2 + 1
        rank_sum_second += average * sum(1 for _, side in pooled[index : end + 1] if side)
        ties += size**3 - size
        index = end + 1
    u_second = rank_sum_second - n2 * (n2 + 1) / 2
    mean = n1 * n2 / 2
    variance = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    superiority = u_second / (n1 * n2)
    if variance <= 0:
        return RankTest(superiority, 1.0)
    z = (abs(u_second - mean) - 0.5) / math.sqrt(variance)
    return RankTest(superiority, min(1.0, math.erfc(max(0.0, z) / math.sqrt(2))))


@dataclass(frozen=True)
class RankSpread:
    """The ranks' medians, against which one rank is called a straggler."""

    step_time_s: float
    """The median of the ranks' mean step times."""
    data_wait_s: float
    """The median of the ranks' mean data waits."""
    lead_step: int
    """The newest step of the rank furthest ahead."""

    @classmethod
    def of(cls, stats: Sequence[StepStats], last_steps: Sequence[int]) -> RankSpread:
        """The medians over the ranks' step summaries, and the leading step."""
        return cls(
            median([s.step_time_s for s in stats]),
            median([s.data_wait_s for s in stats]),
            max(last_steps, default=0),
        )

    def straggler(self, stats: StepStats, last_step: int) -> str:
        """Why a rank with these numbers straggles, in a few words ("" when it does not)."""
        if self.step_time_s <= 0:
            return ""
        ratio = stats.step_time_s / self.step_time_s
        if ratio >= STRAGGLER_STEP_FACTOR:
            return f"straggler {ratio:.1f}x"
        if stats.data_wait_s - self.data_wait_s >= STRAGGLER_WAIT_SHARE * self.step_time_s:
            return "straggler: data"
        behind = self.lead_step - last_step
        if behind > 1 and behind * self.step_time_s >= STRAGGLER_LAG_S:
            return f"{behind} steps behind"
        return ""


def format_bytes(value: float | None) -> str:
    """Bytes in binary units: ``812 MiB``, ``18.5 GiB`` (``-`` for None, infinity or NaN)."""
    if value is None or not math.isfinite(value):
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            if unit in ("B", "KiB", "MiB"):
                return f"{size:.0f} {unit}"
            return f"{size:.1f} {unit}" if abs(size) < 100_000 else f"{size:.2g} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def format_rate(value: float) -> str:
    """A rate with sensible precision: ``0.42``, ``9.4``, ``1,024`` (``-`` for infinity or NaN)."""
    if not math.isfinite(value):
        return "-"
    if value < 1:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"


def format_duration(seconds: float) -> str:
    """A short duration: ``45.1 ms``, ``3.2 s``, ``4m05s``, ``2h13m``, ``9d04h`` (``-`` for
    infinity or NaN)."""
    if not math.isfinite(seconds):
        return "-"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds >= 100 * 86400:
        return f"{seconds / 86400:.2g}d"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


_SIZE_UNITS = {
    "": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
    "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
    "tib": 1 << 40,
}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"1500 MB"``, ``"512M"`` or ``"1048576"`` -> bytes; ValueError otherwise."""
    import re

    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 2GiB, 1500MB or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


_PICTURES = {code: 0x2400 + code for code in range(0x20) if code != 0x0A}
"""C0 control characters but the newline: their Unicode control pictures (``␛``, ``␀``)."""
_PICTURES[0x7F] = 0x2421  # DEL: ␡
_REPLACED = [*range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
"""C1 control characters (0x9B is a terminal's CSI) and the bidirectional overrides, embeddings
and isolates (they reorder what follows them on the line): the replacement character."""
CONTROL_TABLE = {**_PICTURES, **dict.fromkeys(_REPLACED, 0xFFFD)}
"""Every character a terminal would obey rather than show, to the one character shown instead."""
CONTROL = re.compile("[" + "".join(re.escape(chr(code)) for code in sorted(CONTROL_TABLE)) + "]")


def printable(text: object) -> str:
    """``text`` with every control character a visible symbol, one for one: text from a file, a
    run or a peer never reaches a terminal as an escape sequence."""
    value = text if isinstance(text, str) else str(text)
    return value.translate(CONTROL_TABLE) if CONTROL.search(value) else value


def one_line(text: object, limit: int = 300) -> str:
    """``text`` on one line (whitespace runs made one space, control characters visible
    symbols), cut to ``limit`` characters."""
    flat = printable(" ".join(str(text).split()))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def shown(value: object, limit: int = 40) -> str:
    """A value as a message may echo it: a container by its kind and size, a scalar cut short."""
    if isinstance(value, dict):
        return f"a mapping of {len(value)} keys"
    if isinstance(value, (list, tuple, set)):
        return f"a list of {len(value)} items"
    return one_line(repr(value), limit)
