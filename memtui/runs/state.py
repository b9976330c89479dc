"""The viewer's state: plain dataclasses folded from the receiver's batches (no Textual here).

The receiver thread turns frames into :class:`~memtui.runs.events.ReceivedBatch` objects; the
app folds each one into a :class:`RunState` with :meth:`RunState.apply`, and widgets render from
the state. Everything is bounded: recent raw records for the summaries (the same windows as
``memtui status``), and one-second buckets for the charts (an hour of them), whatever the step
rate.

Every rank has its own series (every rank publishes, and answers hello with its own history and
config). :meth:`RunState.summary` compares them: the medians, stragglers (``memtui.core.stats``), the
rank nearest OOM, silent ranks, each rank's pressure (how close to a threshold) and the order
worst first; the verdict is made from the worst rank's numbers and names that rank.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Generic, Protocol, TypeVar

from memtui.advice.assess import (
    Advice,
    advise,
    known_of,
    swap_growth,
    verdict_host,
    verdict_inputs,
)
from memtui.advice.autopilot import AUTOPILOT
from memtui.advice.verdict import (
    THRESHOLDS,
    Inputs,
    State,
    ThresholdConfig,
    Thresholds,
    Verdict,
    VerdictTracker,
)
from memtui.core.knobs import KNOBS, KnownConfig, merge
from memtui.core.stats import (
    STRAGGLER_STEP_FACTOR,
    STRAGGLER_WAIT_SHARE,
    MemoryStats,
    ProcessTree,
    RankSpread,
    StepStats,
    median,
    process_tree,
    summarize_device,
    summarize_steps,
)
from memtui.runs.events import ConnectionEvent, Notice, ReceivedBatch, RunOffer, Status
from memtui.runs.plausible import check_snapshot, check_telemetry, is_time, rank_limit
from memtui.runs.throughput import Throughput, job_throughput
from memtui.transport.client import client_name
from memtui.wire import (
    AppliedChange,
    CheckpointRecord,
    ControlState,
    DeviceSample,
    HookCounters,
    HostSample,
    Knobs,
    KnobValue,
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
RECENT_STEPS = 64
"""Raw step records kept per rank for the summaries (their window is 50 steps; the charts keep
their own one-second sums). Few, so that 64 ranks at 1,000 steps/s stay in the CPU's caches."""
RECENT_DEVICE = 150
"""Raw device samples kept per rank for the summaries."""
RECENT_HOST = 600
"""Host samples kept (about ten minutes at the hook's 1 Hz)."""
NOTICES = 20
QUEUED_BY = 256
"""Change ids whose client the viewer remembers, to say who queued each (the newest kept)."""
"""Request outcomes and receiver notes kept for the change log."""
NEAREST_OOM_FROM = 0.5
"""The rank nearest OOM is called out once its peak is at least this share of its capacity."""
SILENT_AFTER_S = 3.0
"""A rank that has not reported for this long is silent (the hook sends at least one batch a
second): its row says so, and the header counts it."""

_STEP_TIME = attrgetter("step_time_s")
_DATA_WAIT = attrgetter("data_wait_s")
_END_TIME = attrgetter("end_time")


@dataclass(frozen=True)
class ViewOptions:
    """The viewer's own switches, which the widgets show."""

    paused: bool = False
    """The view is frozen (data is still received and folded)."""
    readonly: bool = False
    """Nothing is sent to the run."""
    keep_effective_batch: bool = False
    """A batch_size change recomputes grad_accum to keep micro x accum."""
    lr_scale: str = ""
    """How the LR follows an edit that moves the effective batch ('': the run's rule)."""
    replay_speed: float | None = None
    """``memtui replay``: the replay's speed (x real time); None in a live view."""


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
    """Data wait summed over the bucket's steps (each batch's at most its step time)."""


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
    """One rank's recent records, chart buckets, newest host sample and own control state."""

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
    host: HostSample | None = None
    """The rank's newest host sample (its own process tree's RSS, its node's RAM)."""
    control: ControlState | None = None
    """The rank's own config and applied changes, as it last reported them (None: not yet)."""
    control_seq: int = 0
    counters: HookCounters | None = None
    """What the rank's hook counts about itself, as it last reported it (None: not yet)."""
    reported: bool = False
    """The rank has sent something (it may be listed by the run before it does)."""
    reported_step: int = 0
    """The newest step the rank's batches announced (their records may have been sampled out)."""
    last_clock: float = 0.0
    """The source's clock when the rank last reported (or was first listed)."""
    version: int = 0
    """Bumped when the rank's steps or memory change; its summaries are cached until then."""
    _stats: tuple[int, StepStats | None, MemoryStats | None] | None = field(
        default=None, repr=False
    )

    @property
    def last_step(self) -> int:
        """The newest step recorded."""
        return self.steps[-1].step if self.steps else 0

    @property
    def newest_step(self) -> int:
        """The newest step the rank reported, recorded or not."""
        return max(self.reported_step, self.steps[-1].step if self.steps else 0)

    def stats(self) -> tuple[StepStats | None, MemoryStats | None]:
        """Speed and memory over the recent records (recomputed only after new records)."""
        if self._stats is None or self._stats[0] != self.version:
            self._stats = (self.version, summarize_steps(self.steps), summarize_device(self.device))
        return self._stats[1], self._stats[2]

    def add_steps(self, records: Sequence[StepRecord]) -> bool:
        """Add records newer than the newest one; True if any was new."""
        if not records:
            return False
        first = records[0]
        if first.step <= self.last_step or records[-1].step - first.step != len(records) - 1:
            return self._add_steps_one_by_one(records)
        # the usual batch: consecutive new steps, summed per bucket without a loop per record
        self.steps.extend(records if len(records) <= RECENT_STEPS else records[-RECENT_STEPS:])
        self.version += 1
        self._bucket_steps(records)
        return True

    def _add_steps_one_by_one(self, records: Iterable[StepRecord]) -> bool:
        added: list[StepRecord] = []
        last = self.last_step
        for record in records:
            if record.step > last:
                last = record.step
                added.append(record)
        if not added:
            return False
        self.steps.extend(added)
        self.version += 1
        self._bucket_steps(added)
        return True

    def _bucket_steps(self, records: Sequence[StepRecord]) -> None:
        """Sum time-ordered records into their buckets, one slice per bucket."""
        start, count = 0, len(records)
        while start < count:
            end_time = records[start].end_time
            edge = (math.floor(end_time / BUCKET_S) + 1) * BUCKET_S
            end = bisect.bisect_left(records, edge, start, count, key=_END_TIME)
            end = max(end, start + 1)
            bucket = self.step_buckets.at(end_time)
            if bucket is not None:
                part = records if start == 0 and end == count else records[start:end]
                times = list(map(_STEP_TIME, part))
                if min(times) > 0:
                    total = sum(times)
                    bucket.steps += len(part)
                    bucket.step_time_s += total
                    bucket.data_wait_s += min(total, sum(map(_DATA_WAIT, part)))
                else:  # untimed records (none in a usual batch) are left out
                    for record in part:
                        if record.step_time_s > 0:
                            bucket.steps += 1
                            bucket.step_time_s += record.step_time_s
                            bucket.data_wait_s += min(record.data_wait_s, record.step_time_s)
            start = end

    def add_device(self, samples: Iterable[DeviceSample]) -> bool:
        """Add samples newer than the newest one; True if any was new."""
        added = False
        for sample in samples:
            if self.device and sample.time <= self.device[-1].time:
                continue
            self.device.append(sample)
            added = True
            self.version += 1
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

    def take_control(self, control: ControlState, seq: int) -> bool:
        """Keep the rank's control state unless an older one; True if it was kept."""
        if self.control is not None and seq < self.control_seq:
            return False
        self.control = control
        self.control_seq = seq
        return True


# --------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class RankSummary:
    """One rank's numbers, for the verdict and the per-rank table."""

    rank: int
    steps: StepStats | None
    memory: MemoryStats | None
    last_step: int = 0
    tree: ProcessTree | None = None
    """The rank's process tree in host RAM: the main process's RSS plus its loader workers' own
    memory (USS, else RSS), counted as ``memtui status`` counts it (None: no host sample)."""
    age_s: float = 0.0
    """Seconds since the rank last reported (or, if it has not yet, since it was listed)."""
    reported: bool = True
    silent: bool = False
    """No word from the rank for ``SILENT_AFTER_S``."""
    config: Knobs | None = None
    """The rank's own config (None: not known)."""
    config_differs: bool = False
    """The rank's config is not the control rank's."""
    straggler: str = ""
    """Why the rank straggles behind the others, in a few words ("" when it does not)."""
    nearest_oom: bool = False
    """The rank with the highest peak memory fraction (of two or more measured), from
    ``NEAREST_OOM_FROM`` of its capacity up."""
    pressure: float = 0.0
    """How close the rank is to a threshold (1.0 at one); the table puts the highest first."""


@dataclass(frozen=True)
class Summary:
    """What the widgets show, computed once per change of the data."""

    ranks: tuple[RankSummary, ...]
    """Every rank, in rank order."""
    worst_first: tuple[RankSummary, ...]
    """Every rank, silent ones first, then by pressure (the per-rank table's order)."""
    focus_rank: int
    """The rank the verdict is about (the worst one), which the charts and panels show."""
    steps: StepStats | None
    memory: MemoryStats | None
    host: HostSample | None
    swap_growth_bytes: int
    verdict: Verdict
    median_step_s: float | None = None
    """The median of the ranks' mean step times (None without timed steps)."""
    median_wait_fraction: float | None = None
    nearest_oom: int | None = None
    stragglers: tuple[int, ...] = ()
    silent: tuple[int, ...] = ()
    """Ranks that have not reported for ``SILENT_AFTER_S``."""
    serial: int = 0
    """Counts the summaries made: a new serial means new numbers."""
    advice: Advice | None = None
    """The memory breakdown, ranked recommendations and model limits of the control rank (the
    same function as ``memtui status --json``), made with the summary (None: no config yet)."""
    verdict_inputs: Inputs | None = None
    """What the verdict was decided from (``advice.assess.verdict_inputs``, as for ``memtui
    status``); ``verdict`` adds the tracker's hysteresis."""
    throughput: Throughput | None = None
    """The job's samples/s, the ranks it sums and what a step is (``runs.throughput``, as for
    ``memtui status`` and the exporter); silent ranks are left out."""


def rank_pressure(
    rank: RankSummary, spread: RankSpread | None, thresholds: Thresholds = THRESHOLDS
) -> float:
    """How close one rank is to a threshold (1.0 at one; inf when silent): its peak memory over
    the edge band, its data wait over the starved share, and how far its step time and data wait
    are above the ranks' medians against the straggler thresholds."""
    if rank.silent:
        return math.inf
    parts = [0.0]
    if rank.memory is not None and rank.memory.capacity_bytes:
        parts.append(rank.memory.peak_used_fraction / thresholds.memory_edge_fraction)
    if rank.steps is not None:
        parts.append(rank.steps.data_wait_fraction / thresholds.starved_wait_fraction)
        if spread is not None and spread.step_time_s > 0:
            ratio = rank.steps.step_time_s / spread.step_time_s
            parts.append((ratio - 1) / (STRAGGLER_STEP_FACTOR - 1))
            excess = rank.steps.data_wait_s - spread.data_wait_s
            parts.append(excess / (STRAGGLER_WAIT_SHARE * spread.step_time_s))
    return max(parts)


def compare_ranks(
    ranks: Sequence[RankSummary], control: Knobs | None, thresholds: Thresholds = THRESHOLDS
) -> tuple[list[RankSummary], RankSpread | None]:
    """The ranks with their stragglers, nearest OOM, config differences and pressure filled in."""
    live = [r for r in ranks if not r.silent]
    timed = [r for r in live if r.steps is not None]
    spread = None
    if len(timed) > 1:
        spread = RankSpread.of([r.steps for r in timed if r.steps], [r.last_step for r in timed])
    measured = [r for r in ranks if r.memory is not None and r.memory.capacity_bytes]
    nearest = None
    if len(measured) > 1:
        nearest = max(measured, key=lambda r: r.memory.peak_used_fraction if r.memory else 0.0)
        if nearest.memory is None or nearest.memory.peak_used_fraction < NEAREST_OOM_FROM:
            nearest = None  # nobody is near
    out = []
    several = len(ranks) > 1
    for rank in ranks:
        straggler = ""
        if spread is not None and rank.steps is not None and not rank.silent:
            straggler = spread.straggler(rank.steps, rank.last_step)
        differs = several and control is not None and rank.config not in (None, control)
        out.append(
            dataclasses.replace(
                rank,
                straggler=straggler,
                nearest_oom=nearest is not None and rank.rank == nearest.rank,
                config_differs=differs,
                pressure=rank_pressure(rank, spread, thresholds),
            )
        )
    return out, spread


def measured_waits(steps: Iterable[StepStats]) -> list[float]:
    """The data wait shares of the steps whose wait was measured (a 0 not measured is not one)."""
    return [s.data_wait_fraction for s in steps if s.data_wait_measured]


def focus_of(
    verdict: Verdict,
    worst_first: Sequence[RankSummary],
    waiting: RankSummary | None,
    fullest: RankSummary | None,
) -> int:
    """The rank the verdict is about: the fullest at OOM risk, the one waiting most when starved,
    else the rank under the most pressure (silent ranks aside)."""
    if verdict.state is State.OOM_RISK and fullest is not None:
        return fullest.rank
    if verdict.state is State.STARVED and waiting is not None:
        return waiting.rank
    for rank in worst_first:
        if not rank.silent and (rank.steps is not None or rank.memory is not None):
            return rank.rank
    return worst_first[0].rank if worst_first else 0


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
    bad_values: int = 0
    """Records, samples and numbers dropped for impossible values (``memtui.runs.plausible``):
    infinite, NaN, negative or absurd, in otherwise well-formed messages."""
    receiver_bad_values: int = 0
    """Of ``bad_values``, those the receiver dropped before they came here (its count)."""
    viewer_errors: int = 0
    """Exceptions the viewer caught while folding or drawing a batch (and survived)."""
    last_viewer_error: str = ""
    reconnects: int = 0
    """Times the receiver subscribed anew to a run that answered but whose telemetry stopped (a
    frame over the size limit makes ZeroMQ drop the connection for good)."""
    ignored_batches: int = 0
    """Telemetry from another run (or before any snapshot), dropped."""
    connection: ConnectionEvent = field(default_factory=_initial_connection)
    connection_clock: float = 0.0
    """The clock when the connection status last changed."""
    notices: deque[Notice] = field(default_factory=lambda: deque(maxlen=NOTICES))
    queued_by: dict[int, str] = field(default_factory=dict)
    """The client that queued each change seen pending, by id (the newest ``QUEUED_BY``): the
    change log says who queued a change once it has landed."""
    """Outcomes of the operator's requests (and the receiver's notes) about this run, newest
    last, each with its time."""
    offer: RunOffer = field(default_factory=RunOffer)
    """Another live run the user may follow (a key), now that this one is lost ("": none)."""
    data_version: int = 0
    """Bumped when steps, memory or host samples arrive."""
    control_version: int = 0
    """Bumped when the config or the change log changes."""
    connection_version: int = 0
    """Bumped when the connection status, the run's identity or the counters change."""
    thresholds: ThresholdConfig = field(
        default_factory=lambda: ThresholdConfig(THRESHOLDS, "built-in defaults")
    )
    """The verdict's thresholds in force and where they came from (the YAML config file)."""
    tracker: VerdictTracker = field(default_factory=VerdictTracker)
    """Keeps the previous verdict's state: the hysteresis (made with ``thresholds``)."""
    hold_summary: bool = False
    """Keep the summary already made even if the data changed, until ``refresh_summary`` (the
    app makes it anew at the charts' rate: with many ranks it is the costliest thing it draws)."""
    chart_seconds: int = MAX_BUCKETS
    """One-second chart buckets kept per rank (``memtui export`` draws no chart: it keeps one)."""
    _summary: Summary | None = field(default=None, repr=False)
    _summary_version: tuple[int, int, int] = field(default=(-1, 0, 0), repr=False)

    # ------------------------------------------------------------------ folding

    def apply(self, batch: ReceivedBatch) -> None:
        """Fold one batch from the receiver into the state."""
        if is_time(batch.clock):
            self.clock = max(self.clock, batch.clock)
        if batch.bad_frames != self.bad_frames:
            self.bad_frames = batch.bad_frames
            self.last_bad_frame = batch.last_bad_frame
            self.connection_version += 1
        if batch.reconnects != self.reconnects:
            self.reconnects = batch.reconnects
            self.connection_version += 1
        if batch.bad_values > self.receiver_bad_values:
            self._count_bad_values(batch.bad_values - self.receiver_bad_values)
            self.receiver_bad_values = batch.bad_values
        for event in batch.events:
            if isinstance(event, Telemetry):
                self.apply_telemetry(event)
            elif isinstance(event, Snapshot):
                self.apply_snapshot(event)
            elif isinstance(event, ConnectionEvent):
                self.set_connection(event)
            elif isinstance(event, Notice):
                self.add_notice(event)
            elif isinstance(event, RunOffer):
                self.offer = event
                self.connection_version += 1

    def note_viewer_error(self, what: str, error: BaseException) -> None:
        """Count an exception the viewer survived while doing ``what`` (shown in the header)."""
        self.viewer_errors += 1
        self.last_viewer_error = f"{what}: {type(error).__name__}: {error}"[:200]
        self.connection_version += 1

    def _count_bad_values(self, dropped: int) -> None:
        if dropped:
            self.bad_values += dropped
            self.connection_version += 1

    def add_notice(self, notice: Notice) -> None:
        """Keep a line for the operator (shown in the change log), timed by the clock now if it
        has no time of its own; a change this viewer queued is remembered as its own."""
        self.notices.append(notice if notice.time else dataclasses.replace(notice, time=self.clock))
        if notice.queued:
            self.queued_by[notice.queued] = own_client()
            while len(self.queued_by) > QUEUED_BY:
                del self.queued_by[next(iter(self.queued_by))]
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
        self.notices.clear()  # "queued #1" was about the previous run
        self.queued_by.clear()

    def rank_series(self, rank: int) -> RankSeries:
        """The series of ``rank`` (created on first use)."""
        series = self.series.get(rank)
        if series is None:
            series = self.series[rank] = RankSeries(
                rank,
                step_buckets=BucketSeries(StepBucket, self.chart_seconds),
                memory_buckets=BucketSeries(MemoryBucket, self.chart_seconds),
            )
        return series

    def apply_snapshot(self, snapshot: Snapshot) -> None:
        """Fold a snapshot: identity, config and history (a new run resets; another rank's
        snapshot of the same run only adds to that rank's history and config); impossible
        values are dropped and counted."""
        checked, dropped = check_snapshot(snapshot)
        self._count_bad_values(dropped)
        if checked is None:
            return
        snapshot = checked
        info = self.info
        if info is not None and snapshot.info.run == info.run and snapshot.info.rank != info.rank:
            if snapshot.info.rank >= self.rank_limit:  # a rank the run does not have
                self._count_bad_values(1)
                return
            self._apply_rank_snapshot(snapshot)
            return
        new_run = info is None or snapshot.info.run != info.run
        if new_run:
            self._reset_run()
        self.info = snapshot.info
        self.list_ranks(snapshot.ranks)
        # the run's own word, even a lower count than a batch claimed (the receiver asks for a
        # snapshot when a count is not believable: this is how the view gets back to the run's)
        self.control = snapshot.control
        self.control_seq = snapshot.control_seq
        self.control_version += 1
        self._remember_clients(snapshot.control)
        if snapshot.counters is not None:
            self.counters = snapshot.counters
        self.step = max(self.step, snapshot.step)
        series = self._heard_from(snapshot.info.rank)
        series.add_steps(snapshot.steps)
        series.add_device(snapshot.device)
        series.last_seq = max(series.last_seq, snapshot.seq)
        series.take_control(snapshot.control, snapshot.control_seq)
        series.counters = snapshot.counters or series.counters
        if snapshot.host:
            series.host = snapshot.host[-1]
        self._add_host(snapshot.host)
        self._add_checkpoints(snapshot.checkpoints)
        self.data_version += 1
        self.connection_version += 1

    def _apply_rank_snapshot(self, snapshot: Snapshot) -> None:
        series = self._heard_from(snapshot.info.rank)
        series.add_steps(snapshot.steps)
        series.add_device(snapshot.device)
        series.last_seq = max(series.last_seq, snapshot.seq)
        if series.take_control(snapshot.control, snapshot.control_seq):
            self.control_version += 1
        series.counters = snapshot.counters or series.counters
        if snapshot.host:
            series.host = snapshot.host[-1]
        self.step = max(self.step, snapshot.step)
        self.data_version += 1

    def list_ranks(self, ranks: Iterable[RankInfo]) -> None:
        """Know the run's ranks (from a snapshot): each gets a row, even before it reports."""
        self.ranks = list(ranks)
        for info in self.ranks:
            if info.rank not in self.series:
                self.rank_series(info.rank).last_clock = self.clock

    def _heard_from(self, rank: int) -> RankSeries:
        series = self.rank_series(rank)
        series.reported = True
        series.last_clock = self.clock
        return series

    def apply_telemetry(self, batch: Telemetry) -> None:
        """Fold one telemetry batch of the run (others' batches are counted and dropped, and
        so are impossible values)."""
        checked, dropped = check_telemetry(batch)
        self._count_bad_values(dropped)
        if checked is None:
            return
        batch = checked
        if self.info is None or batch.run != self.info.run:
            self.ignored_batches += 1
            return
        if batch.rank >= self.rank_limit:  # a rank the run does not have: no series for it
            self._count_bad_values(1)
            return
        series = self._heard_from(batch.rank)
        series.note_seq(batch.seq)
        changed = series.add_steps(batch.steps)
        if batch.step > series.reported_step:
            series.reported_step = batch.step
            changed = True
        changed = series.add_device(batch.device) or changed
        control_rank = batch.rank == self.info.rank  # the rank that takes changes
        if batch.host is not None:
            series.host = batch.host
            if control_rank:  # the charts and swap growth follow one host's samples
                self._add_host([batch.host])
            changed = True
        self._add_checkpoints(batch.checkpoints)
        if batch.control is not None:
            if series.take_control(batch.control, batch.control_seq) and not control_rank:
                self.control_version += 1
            if control_rank and batch.control_seq >= self.control_seq:
                self.control = batch.control
                self.control_seq = batch.control_seq
                self.control_version += 1
                self._remember_clients(batch.control)
        series.counters = batch.counters or series.counters
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
    def rank_limit(self) -> int:
        """Ranks numbered under this are the run's: its world size (the snapshot's or the
        control state's, the larger), at most ``MAX_RANKS`` (``plausible.rank_limit``)."""
        sizes = [self.info.world_size if self.info else 0]
        sizes.append(self.control.world_size if self.control else 0)
        return rank_limit(max(sizes) or None)

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        if self.control is not None:
            return self.control.world_size
        return self.info.world_size if self.info else 1

    @property
    def elapsed_s(self) -> float | None:
        """Time since the run started, on the source's clock."""
        if self.info is None or not self.clock or self.info.started <= 0:
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
        return swap_growth(self.host)

    def rank_summaries(self) -> list[RankSummary]:
        """Each rank's own numbers, in rank order (not yet compared with the others)."""
        out = []
        for rank, series in sorted(self.series.items()):
            steps, memory = series.stats()
            host = series.host
            age = max(0.0, self.clock - series.last_clock) if series.last_clock else 0.0
            out.append(
                RankSummary(
                    rank=rank,
                    steps=steps,
                    memory=memory,
                    last_step=series.newest_step,
                    tree=process_tree(host) if host else None,
                    age_s=age,
                    reported=series.reported,
                    silent=age >= SILENT_AFTER_S,
                    config=series.control.config if series.control is not None else None,
                )
            )
        return out

    def summary(self) -> Summary:
        """The summaries, the ranks compared, and the verdict (cached until the data changes or
        the clock passes a second, and while ``hold_summary`` is set)."""
        if self._summary is not None and self.hold_summary:
            return self._summary
        return self.refresh_summary()

    def refresh_summary(self) -> Summary:
        """Make the summary anew if the data changed or the clock passed a second."""
        version = (self.data_version, int(self.clock), self.control_version)
        if self._summary is not None and self._summary_version == version:
            return self._summary
        control = self.control.config if self.control is not None else None
        thresholds = self.thresholds.thresholds
        if self.tracker.thresholds is not thresholds:
            self.tracker = VerdictTracker(thresholds)
        ranks, spread = compare_ranks(self.rank_summaries(), control, thresholds)
        worst_first = sorted(ranks, key=lambda r: (-round(r.pressure, 2), r.rank))
        host, growth = self._verdict_host(ranks)
        pin = control.pin_memory if control is not None else None
        inputs, waiting, fullest = verdict_inputs(ranks, host, growth, pin)
        verdict = self.tracker.update(inputs)
        focus = focus_of(verdict, worst_first, waiting, fullest)
        focused = next((r for r in ranks if r.rank == focus), None)
        timed = [r.steps for r in ranks if r.steps is not None and not r.silent]
        heard = any(not r.silent for r in ranks)
        serial = self._summary.serial + 1 if self._summary is not None else 1
        self._summary = Summary(
            ranks=tuple(ranks),
            worst_first=tuple(worst_first),
            focus_rank=focus,
            steps=focused.steps if focused else None,
            memory=focused.memory if focused else None,
            host=host,
            swap_growth_bytes=growth,
            verdict=verdict,
            median_step_s=spread.step_time_s
            if spread
            else (timed[0].step_time_s if timed else None),
            median_wait_fraction=median(waits) if (waits := measured_waits(timed)) else None,
            nearest_oom=next((r.rank for r in ranks if r.nearest_oom), None),
            stragglers=tuple(r.rank for r in ranks if r.straggler),
            silent=tuple(r.rank for r in ranks if r.silent),
            serial=serial,
            advice=self._advice(verdict, host),
            verdict_inputs=inputs,
            throughput=job_throughput(
                # the ranks heard from; a run gone silent whole keeps its last figure (the
                # header says it is silent)
                (None if r.silent and heard else r.steps for r in ranks),
                self.world_size,
            ),
        )
        self._summary_version = version
        return self._summary

    def _advice(self, verdict: Verdict, host: HostSample | None) -> Advice | None:
        """Breakdown, recommendations and limits from the control rank's numbers."""
        if self.control is None:
            return None
        rank = self.info.rank if self.info is not None else 0
        series = self.series.get(rank)
        steps, memory = series.stats() if series is not None else (None, None)
        last = series.steps[-1] if series is not None and series.steps else None
        samples = float(last.samples) if last is not None and last.samples else None
        own_host = series.host if series is not None and series.host is not None else host
        return advise(
            self.control,
            memory,
            steps,
            samples,
            own_host,
            verdict,
            self.thresholds.thresholds,
            self.info,
        )

    def _verdict_host(self, ranks: Sequence[RankSummary]) -> tuple[HostSample | None, int]:
        """The host sample the verdict weighs (the fullest host of any rank) and its swap growth."""
        return verdict_host(
            self.host, (self.series[r.rank].host for r in ranks if r.rank in self.series)
        )

    def applied_on(self, applied: AppliedChange) -> tuple[int, int]:
        """On how many ranks a change of the control rank is recorded as applied at the same step,
        out of the ranks whose own change log is known."""
        known = [s.control for s in self.series.values() if s.control is not None]
        landed = sum(
            any(a.ids == applied.ids and a.step == applied.step for a in control.applied)
            for control in known
        )
        return landed, len(known)

    def _remember_clients(self, control: ControlState) -> None:
        """Keep who queued each pending change, for when it lands (bounded)."""
        for change in control.pending:
            self.queued_by[change.id] = AUTOPILOT if change.origin == AUTOPILOT else change.client
        while len(self.queued_by) > QUEUED_BY:
            del self.queued_by[next(iter(self.queued_by))]

    def who_queued(self, ids: Iterable[int]) -> str:
        """Who queued the changes ``ids`` in words (``you``, ``another shell``...; '' unknown)."""
        found = {who_is(self.queued_by[i]) for i in ids if i in self.queued_by}
        return found.pop() if len(found) == 1 else ""

    def pending_values(self) -> dict[str, KnobValue]:
        """What the pending changes will set, merged in queue order."""
        return merge(c.changes for c in self.control.pending) if self.control is not None else {}

    def known_config(self) -> KnownConfig | None:
        """The run's knobs as far as memtui knows them (those it can change, those the run holds
        that it cannot, what the control rank's steps measured), as ``memtui status`` shows them
        (None: no config yet)."""
        if self.control is None:
            return None
        rank = self.info.rank if self.info is not None else 0
        series = self.series.get(rank)
        steps = series.stats()[0] if series is not None else None
        return known_of(self.control, steps)

    def knob_value(self, knob: str) -> KnobValue | None:
        """A knob's current value, tunable or not (None: not known)."""
        known = self.known_config()
        return known.value(knob) if known is not None and knob in KNOBS else None

    def effective_batch(self, pending: bool = False) -> int | None:
        """Micro-batch x accumulation x ranks, now or once the pending changes land (None:
        either is not known)."""
        known = self.known_config()
        if known is None:
            return None
        return known.effective_batch(self.pending_values() if pending else None)


def who_is(client: str) -> str:
    """A client's name in a request (``cli:user@host:pid``) in the change log's words: ``you``
    (this viewer), ``another shell`` (``memtui set``/``cancel``), ``another viewer``, ``the
    autopilot``, else the tool's name ('' when none was given)."""
    if not client:
        return ""
    if client == AUTOPILOT:
        return "the autopilot"
    if client == own_client():
        return "you"
    tool = client.partition(":")[0]
    return {"cli": "another shell", "tui": "another viewer"}.get(tool, tool)


def own_client() -> str:
    """This viewer's name in its requests (the receiver's, made the same way)."""
    return client_name("tui")
