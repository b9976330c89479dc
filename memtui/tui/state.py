"""The viewer's state: plain dataclasses folded from the receiver's batches (no Textual here).

The receiver thread turns frames into :class:`ReceivedBatch` objects; the app folds each one into
a :class:`RunState` with :meth:`RunState.apply`, and widgets render from the state. Everything is
bounded: recent raw records for the summaries (the same windows as ``memtui status``), and
one-second buckets for the charts (an hour of them), whatever the step rate.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeAlias, TypeVar

from memtui.advice.verdict import Inputs, Verdict, decide
from memtui.knobs import KNOBS, effective_batch
from memtui.stats import MemoryStats, StepStats, ram_fraction, summarize_device, summarize_steps
from memtui.wire import (
    CheckpointRecord,
    ControlState,
    DeviceSample,
    HookCounters,
    HostSample,
    KnobValue,
    Message,
    RankInfo,
    RunInfo,
    Snapshot,
    StepRecord,
    Telemetry,
)

BUCKET_S = 1.0
"""The charts' resolution: one bucket per second of wall time."""
MAX_BUCKETS = 3600
"""Buckets kept per series: an hour."""
RECENT_STEPS = 512
"""Raw step records kept per rank for the summaries."""
RECENT_DEVICE = 150
"""Raw device samples kept per rank for the summaries."""
RECENT_HOST = 600
"""Host samples kept (about ten minutes at the hook's 1 Hz)."""
HOST_WINDOW_S = 30.0
"""How far back swap growth is measured."""
NOTICES = 20
"""Request outcomes and receiver notes kept for the change log."""


class Status(enum.Enum):
    """The connection to the run, as the receiver sees it; the value is shown to the user."""

    CONNECTING = "connecting"
    LIVE = "live"
    QUIET = "quiet"
    ENDED = "ended"
    DISCONNECTED = "disconnected"


@dataclass(frozen=True)
class ConnectionEvent:
    """The receiver's connection changed."""

    status: Status
    detail: str = ""
    """Why, in words: ``no data for 3.0 s``, ``run ended at step 400``..."""
    label: str = ""
    """What the receiver is attached to: a run id, endpoint or recording."""


@dataclass(frozen=True)
class Notice:
    """A line for the operator: a request's outcome (queued, rejected, no answer) or trouble."""

    ok: bool
    """False for refusals and failures (shown in red)."""
    text: str


Event: TypeAlias = Message | ConnectionEvent | Notice
"""One thing the receiver reports, in the order it happened."""


@dataclass
class ReceivedBatch:
    """Everything the receiver got since its previous batch, in order."""

    events: list[Event]
    clock: float
    """The source's clock when the batch was made (the recording's time in a replay)."""
    bad_frames: int = 0
    """Frames the receiver could not decode, since it started."""
    last_bad_frame: str = ""


@dataclass(frozen=True)
class ViewOptions:
    """The viewer's own switches, which the widgets show."""

    paused: bool = False
    """The view is frozen (data is still received and folded)."""
    readonly: bool = False
    """Nothing is sent to the run."""
    keep_effective_batch: bool = False
    """A batch_size change recomputes grad_accum to keep micro x accum."""


# --------------------------------------------------------------------------- buckets


class _Bucket(Protocol):
    start: float


B = TypeVar("B", bound=_Bucket)


@dataclass
class StepBucket:
    """Steps that ended within one bucket of wall time, summed."""

    start: float
    steps: int = 0
    step_time_s: float = 0.0
    data_wait_s: float = 0.0
    samples: int = 0


@dataclass
class MemoryBucket:
    """Device memory within one bucket: the last sample's levels and the highest peaks."""

    start: float
    capacity_bytes: int = 0
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    beyond_torch_bytes: int = 0
    """What NVML saw used beyond torch's reserve (0 without NVML)."""


@dataclass
class HostBucket:
    """Host memory within one bucket (the last sample)."""

    start: float
    ram_used_bytes: int = 0
    ram_total_bytes: int = 0
    swap_used_bytes: int = 0
    swap_total_bytes: int = 0


class BucketSeries(Generic[B]):
    """One-second buckets in time order, at most ``MAX_BUCKETS`` of them."""

    def __init__(self, factory: Callable[[float], B], maxlen: int = MAX_BUCKETS) -> None:
        self.factory = factory
        self.buckets: deque[B] = deque(maxlen=maxlen)

    def at(self, time: float) -> B | None:
        """The bucket holding ``time`` (new if needed); None if older than the newest bucket."""
        start = math.floor(time / BUCKET_S) * BUCKET_S
        if self.buckets:
            last = self.buckets[-1]
            if last.start == start:
                return last
            if start < last.start:
                return None
        bucket = self.factory(start)
        self.buckets.append(bucket)
        return bucket


# --------------------------------------------------------------------------- per rank


@dataclass
class RankSeries:
    """One rank's recent records and chart buckets."""

    rank: int
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    device: deque[DeviceSample] = field(default_factory=lambda: deque(maxlen=RECENT_DEVICE))
    step_buckets: BucketSeries[StepBucket] = field(default_factory=lambda: BucketSeries(StepBucket))
    memory_buckets: BucketSeries[MemoryBucket] = field(
        default_factory=lambda: BucketSeries(MemoryBucket)
    )
    last_seq: int = 0
    """The highest telemetry seq seen from this rank."""
    lost_batches: int = 0
    """Telemetry batches never received (gaps in seq)."""

    @property
    def last_step(self) -> int:
        """The newest step recorded."""
        return self.steps[-1].step if self.steps else 0

    def add_steps(self, records: Iterable[StepRecord]) -> bool:
        """Add records newer than the newest one; True if any was new."""
        added = False
        last = self.last_step
        for record in records:
            if record.step <= last:
                continue
            last = record.step
            self.steps.append(record)
            added = True
            if record.step_time_s <= 0:
                continue
            bucket = self.step_buckets.at(record.end_time)
            if bucket is not None:
                bucket.steps += 1
                bucket.step_time_s += record.step_time_s
                bucket.data_wait_s += min(record.data_wait_s, record.step_time_s)
                bucket.samples += record.samples
        return added

    def add_device(self, samples: Iterable[DeviceSample]) -> bool:
        """Add samples newer than the newest one; True if any was new."""
        added = False
        for sample in samples:
            if self.device and sample.time <= self.device[-1].time:
                continue
            self.device.append(sample)
            added = True
            bucket = self.memory_buckets.at(sample.time)
            if bucket is None:
                continue
            bucket.capacity_bytes = sample.capacity_bytes
            bucket.allocated_bytes = sample.allocated_bytes
            bucket.reserved_bytes = sample.reserved_bytes
            bucket.peak_reserved_bytes = max(
                bucket.peak_reserved_bytes, sample.peak_reserved_bytes, sample.reserved_bytes
            )
            bucket.peak_allocated_bytes = max(
                bucket.peak_allocated_bytes, sample.peak_allocated_bytes, sample.allocated_bytes
            )
            if sample.nvml_used_bytes is not None:
                bucket.beyond_torch_bytes = max(0, sample.nvml_used_bytes - sample.reserved_bytes)
        return added

    def note_seq(self, seq: int) -> None:
        """Count batches lost between the previous seq and this one."""
        if self.last_seq and seq > self.last_seq + 1:
            self.lost_batches += seq - self.last_seq - 1
        self.last_seq = max(self.last_seq, seq)


# --------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class RankSummary:
    """One rank's numbers, for the verdict and the multi-rank line."""

    rank: int
    steps: StepStats | None
    memory: MemoryStats | None


@dataclass(frozen=True)
class Summary:
    """What the widgets show, computed once per change of the data."""

    ranks: tuple[RankSummary, ...]
    focus_rank: int
    """The rank the verdict is about (the worst one), which the charts and panels show."""
    steps: StepStats | None
    memory: MemoryStats | None
    host: HostSample | None
    swap_growth_bytes: int
    verdict: Verdict


def verdict_inputs(
    ranks: Sequence[RankSummary], host: HostSample | None, swap_growth_bytes: int
) -> tuple[Inputs, int]:
    """The verdict's inputs (the worst rank for each number) and the rank it is about."""
    timed = [r for r in ranks if r.steps is not None]
    measured = [r for r in ranks if r.memory is not None and r.memory.capacity_bytes]
    waiting = max(timed, key=lambda r: r.steps.data_wait_fraction if r.steps else 0.0, default=None)
    fullest = max(
        measured, key=lambda r: r.memory.peak_used_fraction if r.memory else 0.0, default=None
    )
    steps = waiting.steps if waiting else None
    memory = fullest.memory if fullest else None
    inputs = Inputs(
        data_wait_fraction=steps.data_wait_fraction if steps else None,
        step_time_s=steps.step_time_s if steps else None,
        data_wait_s=steps.data_wait_s if steps else None,
        peak_memory_fraction=memory.peak_used_fraction if memory else None,
        peak_memory_bytes=memory.peak_used_bytes if memory else None,
        capacity_bytes=memory.capacity_bytes if memory else None,
        device_kind=memory.kind if memory else "cuda",
        host_ram_fraction=ram_fraction(host) if host else None,
        swap_used_bytes=host.swap_used_bytes if host else 0,
        swap_growth_bytes=swap_growth_bytes,
    )
    focus = ranks[0].rank if ranks else 0
    if fullest is not None and inputs.peak_memory_fraction is not None:
        focus = fullest.rank
    if waiting is not None and (
        inputs.peak_memory_fraction is None
        or (inputs.data_wait_fraction or 0.0) > inputs.peak_memory_fraction
    ):
        focus = waiting.rank
    return inputs, focus


# --------------------------------------------------------------------------- the run


def _initial_connection() -> ConnectionEvent:
    return ConnectionEvent(Status.CONNECTING, "looking for the run")


@dataclass
class RunState:
    """Everything the viewer knows about the run it is attached to."""

    info: RunInfo | None = None
    """The run's identity and device, from its latest snapshot."""
    ranks: list[RankInfo] = field(default_factory=list)
    control: ControlState | None = None
    """Config, pending, applied and rejected changes, as rank 0 last reported them."""
    control_seq: int = 0
    step: int = 0
    """The newest step any rank reported."""
    clock: float = 0.0
    """The source's clock at the latest batch (the recording's time in a replay)."""
    last_data_clock: float = 0.0
    """The clock when telemetry last arrived."""
    series: dict[int, RankSeries] = field(default_factory=dict)
    host: deque[HostSample] = field(default_factory=lambda: deque(maxlen=RECENT_HOST))
    host_buckets: BucketSeries[HostBucket] = field(default_factory=lambda: BucketSeries(HostBucket))
    checkpoints: deque[CheckpointRecord] = field(default_factory=lambda: deque(maxlen=64))
    counters: HookCounters | None = None
    """What the hook counts about itself (drops, its bad frames, its errors)."""
    ended: bool = False
    """Rank 0 sent its last batch."""
    bad_frames: int = 0
    """Frames the viewer could not decode."""
    last_bad_frame: str = ""
    ignored_batches: int = 0
    """Telemetry from another run (or before any snapshot), dropped."""
    connection: ConnectionEvent = field(default_factory=_initial_connection)
    connection_clock: float = 0.0
    """The clock when the connection status last changed."""
    notices: deque[Notice] = field(default_factory=lambda: deque(maxlen=NOTICES))
    """Outcomes of the operator's requests (and the receiver's notes), newest last."""
    data_version: int = 0
    """Bumped when steps, memory or host samples arrive."""
    control_version: int = 0
    """Bumped when the config or the change log changes."""
    connection_version: int = 0
    """Bumped when the connection status, the run's identity or the counters change."""
    _summary: Summary | None = field(default=None, repr=False)
    _summary_version: int = field(default=-1, repr=False)

    # ------------------------------------------------------------------ folding

    def apply(self, batch: ReceivedBatch) -> None:
        """Fold one batch from the receiver into the state."""
        self.clock = max(self.clock, batch.clock)
        if batch.bad_frames != self.bad_frames:
            self.bad_frames = batch.bad_frames
            self.last_bad_frame = batch.last_bad_frame
            self.connection_version += 1
        for event in batch.events:
            if isinstance(event, Telemetry):
                self.apply_telemetry(event)
            elif isinstance(event, Snapshot):
                self.apply_snapshot(event)
            elif isinstance(event, ConnectionEvent):
                self.set_connection(event)
            elif isinstance(event, Notice):
                self.add_notice(event)

    def add_notice(self, notice: Notice) -> None:
        """Keep a line for the operator (shown in the change log)."""
        self.notices.append(notice)
        self.control_version += 1

    def set_connection(self, event: ConnectionEvent) -> None:
        """Record a change of the connection."""
        if event != self.connection:
            self.connection = event
            self.connection_clock = self.clock
            self.connection_version += 1

    def _reset_run(self) -> None:
        """Forget the previous run (attached to another one)."""
        self.series.clear()
        self.host.clear()
        self.host_buckets.buckets.clear()
        self.checkpoints.clear()
        self.control = None
        self.control_seq = 0
        self.counters = None
        self.step = 0
        self.ended = False
        self.ignored_batches = 0

    def rank_series(self, rank: int) -> RankSeries:
        """The series of ``rank`` (created on first use)."""
        series = self.series.get(rank)
        if series is None:
            series = self.series[rank] = RankSeries(rank)
        return series

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        """Fold a snapshot: identity, config and history (attaching to a new run resets)."""
        new_run = self.info is None or snapshot.info.run != self.info.run
        if new_run:
            self._reset_run()
        self.info = snapshot.info
        self.ranks = list(snapshot.ranks)
        if new_run or snapshot.control_seq >= self.control_seq:
            self.control = snapshot.control
            self.control_seq = snapshot.control_seq
            self.control_version += 1
        if snapshot.counters is not None:
            self.counters = snapshot.counters
        self.step = max(self.step, snapshot.step)
        series = self.rank_series(snapshot.info.rank)
        series.add_steps(snapshot.steps)
        series.add_device(snapshot.device)
        series.last_seq = max(series.last_seq, snapshot.seq)
        self._add_host(snapshot.host)
        self._add_checkpoints(snapshot.checkpoints)
        self.data_version += 1
        self.connection_version += 1

    def apply_telemetry(self, batch: Telemetry) -> None:
        """Fold one telemetry batch of the run (others' batches are counted and dropped)."""
        if self.info is None or batch.run != self.info.run:
            self.ignored_batches += 1
            return
        series = self.rank_series(batch.rank)
        series.note_seq(batch.seq)
        changed = series.add_steps(batch.steps)
        changed = series.add_device(batch.device) or changed
        if batch.host is not None:
            changed = self._add_host([batch.host]) or changed
        self._add_checkpoints(batch.checkpoints)
        if (
            batch.control is not None
            and batch.rank == self.info.rank  # the rank that takes changes
            and batch.control_seq >= self.control_seq
        ):
            self.control = batch.control
            self.control_seq = batch.control_seq
            self.control_version += 1
        if batch.counters is not None and batch.counters != self.counters:
            self.counters = batch.counters
            self.connection_version += 1
        self.step = max(self.step, batch.step)
        self.last_data_clock = self.clock
        if batch.ended and batch.rank == 0:
            self.ended = True
        if changed or batch.steps:
            self.data_version += 1

    def _add_host(self, samples: Iterable[HostSample]) -> bool:
        added = False
        for sample in samples:
            if self.host and sample.time <= self.host[-1].time:
                continue
            self.host.append(sample)
            added = True
            bucket = self.host_buckets.at(sample.time)
            if bucket is not None:
                bucket.ram_used_bytes = sample.ram_used_bytes
                bucket.ram_total_bytes = sample.ram_total_bytes
                bucket.swap_used_bytes = sample.swap_used_bytes
                bucket.swap_total_bytes = sample.swap_total_bytes
        return added

    def _add_checkpoints(self, records: Iterable[CheckpointRecord]) -> None:
        for record in records:
            if not self.checkpoints or record.step > self.checkpoints[-1].step:
                self.checkpoints.append(record)

    # ------------------------------------------------------------------ reading

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        if self.control is not None:
            return self.control.world_size
        return self.info.world_size if self.info else 1

    @property
    def elapsed_s(self) -> float | None:
        """Time since the run started, on the source's clock."""
        if self.info is None or not self.clock:
            return None
        return max(0.0, self.clock - self.info.started)

    @property
    def silence_s(self) -> float:
        """Time since telemetry last arrived, on the source's clock."""
        return max(0.0, self.clock - self.last_data_clock) if self.last_data_clock else 0.0

    @property
    def lost_batches(self) -> int:
        """Telemetry batches lost over all ranks."""
        return sum(s.lost_batches for s in self.series.values())

    def swap_growth_bytes(self) -> int:
        """Swap growth over the last ``HOST_WINDOW_S`` of host samples."""
        if not self.host:
            return 0
        latest = self.host[-1]
        oldest = latest
        for sample in reversed(self.host):
            if latest.time - sample.time > HOST_WINDOW_S:
                break
            oldest = sample
        return latest.swap_used_bytes - oldest.swap_used_bytes

    def summary(self) -> Summary:
        """The summaries and the verdict (cached until the data changes)."""
        if self._summary is not None and self._summary_version == self.data_version:
            return self._summary
        ranks = tuple(
            RankSummary(rank, summarize_steps(s.steps), summarize_device(s.device))
            for rank, s in sorted(self.series.items())
        )
        host = self.host[-1] if self.host else None
        growth = self.swap_growth_bytes()
        inputs, focus = verdict_inputs(ranks, host, growth)
        focused = next((r for r in ranks if r.rank == focus), None)
        self._summary = Summary(
            ranks=ranks,
            focus_rank=focus,
            steps=focused.steps if focused else None,
            memory=focused.memory if focused else None,
            host=host,
            swap_growth_bytes=growth,
            verdict=decide(inputs),
        )
        self._summary_version = self.data_version
        return self._summary

    def pending_values(self) -> dict[str, KnobValue]:
        """What the pending changes will set, merged in queue order."""
        merged: dict[str, KnobValue] = {}
        if self.control is not None:
            for change in self.control.pending:
                merged.update(change.changes)
        return merged

    def knob_value(self, knob: str) -> KnobValue | None:
        """A knob's current value (None: unknown or not exposed)."""
        if self.control is None or knob not in KNOBS:
            return None
        value: KnobValue | None = getattr(self.control.config, knob)
        return value

    def effective_batch(self, pending: bool = False) -> int | None:
        """Micro-batch x accumulation x ranks, now or once the pending changes land."""
        values = self.pending_values() if pending else {}
        batch = values.get("batch_size", self.knob_value("batch_size"))
        accum = values.get("grad_accum", self.knob_value("grad_accum"))
        if batch is None or accum is None or isinstance(batch, bool) or isinstance(accum, bool):
            return None
        return effective_batch(batch, accum, self.world_size)
