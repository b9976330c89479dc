"""The runs the exporter follows: every registered run asked from one loop, those that answer
watched by the viewer's receiver, each part within a bound.

:class:`Fleet` reads the registry (the same user's runs on this node; a run's ranks on other
nodes are reached over CURVE TCP where the keys are here, as the viewer reaches them) every
``refresh_s``, or less often when reading it takes long. Every registered run, up to
``MAX_TRACKED``, is *tracked*; one that has no watch is asked for a hello from the fleet's own
loop (:meth:`Fleet.step`): the hellos of up to ``MAX_PROBES`` runs are in flight at once on
ZeroMQ sockets polled together, each given ``PROBE_TIMEOUT_S`` and never waited on by anything
else; a run whose ipc socket is not there is not asked at all. A run that does not answer is
asked again later (after ``PROBE_FIRST_S``, doubling to ``PROBE_MAX_S``) and shown as not up.

A run that answers gets a :class:`RunWatch` while fewer than ``max_runs`` are watched: the
viewer's own transport and state, a :class:`~memtui.transport.sources.LiveSource` read by a
:class:`~memtui.runs.receiver.Receiver` on a thread of its own, each batch folded into a
:class:`~memtui.runs.state.RunState` as it is posted. With every place taken, the run is left
unwatched and counted once (``dropped``). A watch whose run stops answering for ``LOST_AFTER_S``
is stopped, and the run asked again from the loop; a run that ends, or leaves the registry, is
let go. The threads are therefore the loop's, at most ``max_runs`` receivers, and the HTTP
server's, however many runs are registered.

:meth:`Fleet.collect` copies what the metrics need into a plain :class:`FleetReading`, each
watched run's under its watch's lock (:meth:`RunWatch.read`), the verdict made by the state's
summary (``advice.assess.verdict_inputs``, as the viewer and ``memtui status`` make it). A
``Fleet`` is used from one thread (the exporter's loop); only its watches are shared, with their
receivers.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from memtui.advice.verdict import State, ThresholdConfig
from memtui.core.stats import MemoryStats, StepStats
from memtui.runs.events import Status
from memtui.runs.receiver import Inbox, Receiver
from memtui.runs.state import RankSeries, RunState
from memtui.runs.throughput import Throughput
from memtui.storage import registry
from memtui.transport.client import client_name, send_request
from memtui.transport.sources import LiveSource
from memtui.wire import Decoder, Hello, HostSample, KnobValue, RunRecord, Snapshot, encode

REFRESH_S = 2.0
"""How often the registry is read for runs that started or left (at least)."""
REFRESH_SHARE = 0.05
"""The most of its time the loop spends reading the registry: with many runs registered it is
read less often than ``REFRESH_S``."""
DEFAULT_MAX_RUNS = 64
"""Runs watched at once (a receiver thread each), unless ``max_runs`` says otherwise."""
MAX_TRACKED = 4096
"""Registered runs followed at all (asked, shown as not up); those beyond are counted dropped."""
MAX_PROBES = 16
"""Hellos in flight at once (a ZeroMQ socket each)."""
PROBE_TIMEOUT_S = 2.0
"""How long a run has to answer a hello."""
PROBE_FIRST_S = 2.0
"""The wait before a run that did not answer is asked again (doubling at each silence)."""
PROBE_MAX_S = 30.0
"""The longest wait between two hellos to a run that does not answer."""
PROBE_MAX_REPLY = 4 << 20
"""The largest answer to a hello taken (a snapshot without history: its config, its ranks)."""
LOST_AFTER_S = 10.0
"""A watched run that has not answered for this long loses its watch (and its thread)."""
SILENT_RANKS_SHOWN = 64
"""Ranks of a run that does not answer shown as not up (its record lists them), at most."""
STOP_WAIT_S = 3.0
"""How long closing the fleet waits for the receivers' threads, all together."""


@dataclass(frozen=True)
class RankReading:
    """One rank's numbers at a scrape."""

    rank: int
    host: str
    device: str
    """``cuda:0``, ``cpu``: the kind and index of the rank's latest device sample."""
    pid: int
    """The rank's process (0: not known)."""
    reporting: bool
    """The rank sent something within the viewer's silence limit."""
    last_step: int
    steps: StepStats | None
    memory: MemoryStats | None
    host_sample: HostSample | None
    applied: int
    """Changes (rollbacks included) the rank applied, as far as this exporter has seen."""
    ooms: int
    """Out-of-memory errors the rank's hook caught, as far as this exporter has seen."""
    hook_errors: int | None
    """Exceptions caught inside the rank's hook (None: not reported yet)."""


@dataclass(frozen=True)
class RunReading:
    """One run's numbers at a scrape."""

    run: str
    host: str
    """The control rank's host."""
    control_rank: int
    verdict: State
    pending: int
    """Changes queued and waiting for the next checkpoint."""
    ranks: tuple[RankReading, ...]
    throughput: Throughput | None = None
    """The job's samples/s (its reporting ranks' summed), as the viewer and ``memtui status``
    give it."""
    config: dict[str, KnobValue | None] = field(default_factory=dict)
    """Every knob's value as ``memtui status`` gives it (None: not known)."""
    tunable: tuple[str, ...] = ()
    """The knobs memtui can change in this run."""
    effective_batch: int | None = None


@dataclass(frozen=True)
class SilentRank:
    """A rank of a run that does not answer: its labels only."""

    rank: int
    host: str
    device: str
    """The device label it had when it last answered ("" if it never did)."""


@dataclass(frozen=True)
class SilentRun:
    """A registered run that does not answer (or has not yet): shown as not up."""

    run: str
    host: str
    ranks: tuple[SilentRank, ...]


@dataclass(frozen=True)
class FleetReading:
    """Everything the metrics show, copied at one moment."""

    runs: tuple[RunReading, ...]
    """The watched runs that have answered their watch."""
    silent: tuple[SilentRun, ...]
    """Tracked runs that do not answer now."""
    last_seen_age_s: dict[tuple[str, str], float]
    """Each tracked run's (run, host): seconds since it last answered this exporter; one that
    never has: since it started (its registry record)."""
    registered: int
    """Live runs the registry listed at its last read."""
    unwatched: int
    """Registered runs not followed now for a cap: answering with ``max_runs`` watched, or past
    ``MAX_TRACKED``."""
    dropped: int
    """Runs left unwatched for a cap so far, each counted once."""
    registry_read_s: float
    """How long the last read of the registry took."""


def device_label(series: RankSeries) -> str:
    """The rank's device as a label: ``cuda:INDEX`` or ``cpu`` ("" before any sample)."""
    if not series.device:
        return ""
    sample = series.device[-1]
    return "cpu" if sample.kind == "cpu" else f"{sample.kind}:{sample.index}"


class RunWatch:
    """One run followed by the viewer's receiver on a thread of its own, folded into a state."""

    def __init__(
        self, record: RunRecord, thresholds: ThresholdConfig, context: zmq.Context
    ) -> None:
        self.run = record.run
        self.record = record
        self.state = RunState(thresholds=thresholds, chart_seconds=1)  # it draws no chart
        self._lock = threading.Lock()
        self._inbox = Inbox()
        self._applied_seen: dict[int, set[tuple[int, tuple[int, ...], bool]]] = {}
        """Each rank's applied changes seen so far (step, ids, rollback): a count that the
        run's capped history cannot lower."""
        self._ooms_seen: dict[int, set[tuple[float, int]]] = {}
        """Each rank's out-of-memory events seen so far (time, step)."""
        # the run's own control endpoint: the source reads no registry (the fleet does, once for
        # every run, and hands a watch the ranks its record lists)
        self.source = LiveSource(
            record.control,
            context=context,
            client=client_name("export"),
            ranks_refresh_s=math.inf,
        )
        self.source.subscribe(*record.ranks)
        self.receiver = Receiver(self.source, self._inbox, self._fold, readonly=True)
        self._thread = threading.Thread(
            target=self.receiver.run, name=f"memtui-export-{record.run}", daemon=True
        )

    def start(self) -> None:
        """Start receiving."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the receiver to end (it closes its sockets on its way out); not waited for."""
        self.receiver.stop()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the receiver's thread; True once it has ended."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """The receiver's thread still runs."""
        return self._thread.is_alive()

    def listed(self, record: RunRecord) -> None:
        """The run's registry record as read now: ranks it lists anew are subscribed to."""
        if record.ranks != self.record.ranks:
            self.source.subscribe(*record.ranks)
        self.record = record

    @property
    def ended(self) -> bool:
        """Rank 0 sent its last batch: the run is over."""
        with self._lock:
            return self.state.ended or self.state.connection.status is Status.ENDED

    @property
    def answering(self) -> bool:
        """The receiver is connected to the run (live, or quiet while it answers hellos)."""
        with self._lock:
            return self.state.connection.status in (Status.LIVE, Status.QUIET)

    @property
    def heard(self) -> float:
        """When the run's telemetry last arrived (wall clock; 0: not yet)."""
        with self._lock:
            return self.state.last_data_clock

    def devices(self) -> dict[int, str]:
        """Each rank's device label as last seen."""
        with self._lock:
            return {rank: device_label(series) for rank, series in self.state.series.items()}

    def _fold(self) -> None:
        """Fold the batches the receiver posted (on the receiver's thread)."""
        batches = self._inbox.drain()
        with self._lock:
            for batch in batches:
                try:
                    self.state.apply(batch)
                except Exception as exc:  # one bad batch: counted, the next ones folded
                    self.state.note_viewer_error("folding a batch", exc)

    def read(self) -> RunReading | None:
        """The run's numbers now (None until it has answered)."""
        with self._lock:
            return run_reading(self.state, self._count_applied, self._count_ooms)

    def _count_applied(self, series: RankSeries) -> int:
        seen = self._applied_seen.setdefault(series.rank, set())
        if series.control is not None:
            seen.update((a.step, tuple(a.ids), a.rollback) for a in series.control.applied)
        return len(seen)

    def _count_ooms(self, series: RankSeries) -> int:
        seen = self._ooms_seen.setdefault(series.rank, set())
        if series.control is not None:
            seen.update((o.time, o.step) for o in series.control.ooms)
        return len(seen)


def _applied_now(series: RankSeries) -> int:
    """The changes the rank's control state records as applied now."""
    return len(series.control.applied) if series.control is not None else 0


def _ooms_now(series: RankSeries) -> int:
    """The out-of-memory errors the rank's control state records now."""
    return len(series.control.ooms) if series.control is not None else 0


def run_reading(
    state: RunState,
    applied: Callable[[RankSeries], int] = _applied_now,
    ooms: Callable[[RankSeries], int] = _ooms_now,
) -> RunReading | None:
    """What the exporter serves of the run ``state`` holds (None until it has answered), the
    changes and out-of-memory errors of each rank counted by ``applied`` and ``ooms`` (a
    ``RunWatch`` keeps counts the run's capped history cannot lower)."""
    if state.info is None:
        return None
    summary = state.refresh_summary()
    hosts = {info.rank: info for info in state.ranks}
    ranks = []
    for rank in summary.ranks:
        series = state.series[rank.rank]
        listed = hosts.get(rank.rank)
        ranks.append(
            RankReading(
                rank=rank.rank,
                host=listed.host if listed is not None and listed.host else state.info.host,
                device=device_label(series),
                pid=listed.pid if listed is not None else 0,
                reporting=rank.reported and not rank.silent,
                last_step=rank.last_step,
                steps=rank.steps,
                memory=rank.memory,
                host_sample=series.host,
                applied=applied(series),
                ooms=ooms(series),
                hook_errors=series.counters.errors if series.counters else None,
            )
        )
    control = state.control
    known = state.known_config()
    return RunReading(
        run=state.info.run,
        host=state.info.host,
        control_rank=state.info.rank,
        verdict=summary.verdict.state,
        pending=len(control.pending) if control is not None else 0,
        ranks=tuple(ranks),
        config=dict(known.values) if known is not None else {},
        tunable=known.tunable if known is not None else (),
        effective_batch=known.effective_batch() if known is not None else None,
        throughput=summary.throughput,
    )


@dataclass
class Tracked:
    """A registered run the fleet follows: its record, when it was heard, its watch if any."""

    record: RunRecord
    heard: float = 0.0
    """When the run last answered this exporter (wall clock; 0: never)."""
    next_probe: float = 0.0
    """When to ask it for a hello next (``time.monotonic``)."""
    wait_s: float = PROBE_FIRST_S
    """The wait after the next hello that goes unanswered."""
    watch: RunWatch | None = None
    lost_since: float | None = None
    """When its watch was first seen not answering (``time.monotonic``; None: it answers)."""
    devices: dict[int, str] = field(default_factory=dict)
    """Each rank's device label when the run last answered (kept for its not-up series)."""
    dropped: bool = False
    """It answered with every watch taken: left unwatched (not shown), asked again later."""
    counted: bool = False
    """It has been counted in the fleet's ``dropped`` (once per run)."""


class Fleet:
    """Every live run of the registry this user may see: tracked, asked, watched within bounds."""

    def __init__(
        self,
        thresholds: ThresholdConfig,
        refresh_s: float = REFRESH_S,
        max_runs: int = DEFAULT_MAX_RUNS,
        max_tracked: int = MAX_TRACKED,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.thresholds = thresholds
        self.refresh_s = refresh_s
        self.max_runs = max_runs
        self.max_tracked = max_tracked
        self.probe_timeout_s = probe_timeout_s
        self.problem = ""
        """Why the registry could not be read at the last refresh ("" when it could)."""
        self.registered = 0
        """Live runs the registry listed at its last read."""
        self.dropped = 0
        """Runs left unwatched for a cap so far (each counted once while it stays registered)."""
        self.registry_read_s = 0.0
        self._context = zmq.Context()
        self._tracked: dict[str, Tracked] = {}
        self._untracked: set[str] = set()
        """Registered runs past ``max_tracked`` (counted dropped once each)."""
        self._ended: set[str] = set()
        """Runs that sent their last batch while their record lingered: not watched again."""
        self._stopping: list[RunWatch] = []
        """Watches asked to stop whose threads may still run (they count against the cap)."""
        self._probes: dict[zmq.Socket, tuple[str, float]] = {}
        """Hellos in flight: socket -> (run, give up at)."""
        self._poller = zmq.Poller()
        self._decoder = Decoder()
        self._hello = encode(Hello(client=client_name("export"), history=0))
        self._next_refresh = 0.0

    # ------------------------------------------------------------------ the registry

    def refresh_due(self) -> bool:
        """Whether the registry should be read now."""
        return time.monotonic() >= self._next_refresh

    def refresh(self) -> list[str]:
        """Read the registry: track the runs that started, let go of those that left or ended;
        returns the watched runs let go."""
        started = time.monotonic()
        try:
            records = registry.list_runs()
            self.problem = ""
        except (registry.RegistryError, OSError) as exc:
            self.problem = str(exc)
            records = None
        finally:
            self.registry_read_s = time.monotonic() - started
            wait = max(self.refresh_s, self.registry_read_s / REFRESH_SHARE)
            self._next_refresh = time.monotonic() + wait
        if records is None:
            return []
        live = {record.run: record for record in records}
        self.registered = len(live)
        gone = []
        for run, tracked in list(self._tracked.items()):
            if run not in live or run in self._ended:
                if tracked.watch is not None:
                    gone.append(run)
                self._let_go(run)
        self._ended &= live.keys()
        self._untracked &= live.keys()
        for run, record in live.items():  # oldest first: a run tracked stays tracked
            known = self._tracked.get(run)
            if known is not None:
                known.record = record
                if known.watch is not None:
                    known.watch.listed(record)
            elif run in self._ended:
                continue
            elif len(self._tracked) < self.max_tracked:
                self._tracked[run] = Tracked(record)
                self._untracked.discard(run)
            elif run not in self._untracked:
                self._untracked.add(run)
                self.dropped += 1
        return gone

    def _let_go(self, run: str) -> None:
        tracked = self._tracked.pop(run)
        if tracked.watch is not None:
            self._stop_watch(tracked)

    # ------------------------------------------------------------------ the loop

    def step(
        self, wait_s: float, stop: threading.Event | None = None
    ) -> tuple[list[str], list[str]]:
        """One turn of the loop: look after the watches, ask the runs due, and wait up to
        ``wait_s`` for answers (or for ``stop``); returns the runs watched anew, and the watched
        runs that ended."""
        ended = self._tend_watches()
        self._ask_due()
        return self._take_answers(wait_s, stop), ended

    def _tend_watches(self) -> list[str]:
        """Let go of ended runs, stop the watches of runs that stopped answering, and forget
        the stopped watches whose threads have ended; returns the runs that ended."""
        now = time.monotonic()
        ended = []
        for run, tracked in list(self._tracked.items()):
            watch = tracked.watch
            if watch is None:
                continue
            if watch.ended:
                self._ended.add(run)
                self._let_go(run)
                ended.append(run)
                continue
            if watch.answering:
                tracked.lost_since = None
            elif tracked.lost_since is None:
                tracked.lost_since = now
            elif now - tracked.lost_since >= LOST_AFTER_S:
                self._stop_watch(tracked)
                tracked.next_probe = now + tracked.wait_s
        self._stopping = [watch for watch in self._stopping if watch.alive]
        return ended

    def _stop_watch(self, tracked: Tracked) -> None:
        watch = tracked.watch
        if watch is None:
            return
        tracked.heard = max(tracked.heard, watch.heard)
        tracked.devices.update(watch.devices())
        tracked.watch = None
        tracked.lost_since = None
        watch.stop()
        self._stopping.append(watch)

    @property
    def watching(self) -> int:
        """Receiver threads started and not yet ended (watches, and watches stopping)."""
        return sum(t.watch is not None for t in self._tracked.values()) + len(self._stopping)

    def _ask_due(self) -> None:
        """Send a hello to the runs due (as many as may be in flight); a run whose ipc socket is
        not there does not answer, and is not asked."""
        now = time.monotonic()
        asking = {run for run, _give_up in self._probes.values()}
        due = [
            t
            for t in self._tracked.values()
            if t.watch is None and t.next_probe <= now and t.record.run not in asking
        ]
        due.sort(key=lambda t: t.next_probe)
        for tracked in due:
            if len(self._probes) >= MAX_PROBES:
                return
            endpoint = tracked.record.control
            path = registry.endpoint_path(endpoint)
            if not endpoint or (path is not None and not os.path.exists(path)):
                self._unanswered(tracked, now)
                continue
            sock = send_request(self._context, endpoint, self._hello, PROBE_MAX_REPLY)
            if sock is None:
                self._unanswered(tracked, now)
                continue
            self._probes[sock] = (tracked.record.run, now + self.probe_timeout_s)
            self._poller.register(sock, zmq.POLLIN)

    @staticmethod
    def _unanswered(tracked: Tracked, now: float) -> None:
        tracked.dropped = False  # shown as not up from now on
        tracked.next_probe = now + tracked.wait_s
        tracked.wait_s = min(2 * tracked.wait_s, PROBE_MAX_S)

    def _take_answers(self, wait_s: float, stop: threading.Event | None) -> list[str]:
        """Wait up to ``wait_s`` for the hellos' answers; watch the runs that answered."""
        if not self._probes:
            if stop is not None:
                stop.wait(wait_s)
            else:
                time.sleep(wait_s)
            return []
        ready = dict(self._poller.poll(int(wait_s * 1000)))
        now = time.monotonic()
        started = []
        for sock, (run, give_up) in list(self._probes.items()):
            answer = None
            if sock in ready:
                with contextlib.suppress(zmq.ZMQError):
                    answer = self._decoder.decode(sock.recv(zmq.NOBLOCK))
            elif now < give_up:
                continue
            self._close_probe(sock)
            tracked = self._tracked.get(run)
            if tracked is None or tracked.watch is not None:
                continue
            if isinstance(answer, Snapshot) and answer.info.run == run:
                tracked.heard = time.time()
                tracked.wait_s = PROBE_FIRST_S
                if self._watch(tracked):
                    started.append(run)
            else:
                self._unanswered(tracked, now)
        return started

    def _close_probe(self, sock: zmq.Socket) -> None:
        self._probes.pop(sock, None)
        with contextlib.suppress(KeyError):
            self._poller.unregister(sock)
        sock.close(0)

    def _watch(self, tracked: Tracked) -> bool:
        """Watch a run that answered, if a place is free (else it is dropped: counted once, and
        asked again later); True when it is watched."""
        if self.watching >= self.max_runs:
            tracked.dropped = True
            if not tracked.counted:
                tracked.counted = True
                self.dropped += 1
            tracked.next_probe = time.monotonic() + PROBE_MAX_S
            return False
        tracked.dropped = False
        tracked.lost_since = None
        tracked.watch = RunWatch(tracked.record, self.thresholds, self._context)
        tracked.watch.start()
        return True

    # ------------------------------------------------------------------ reading

    @property
    def unwatched(self) -> int:
        """Registered runs not followed now for a cap (answering with every watch taken, or
        past ``max_tracked``)."""
        return len(self._untracked) + sum(t.dropped for t in self._tracked.values())

    def runs(self) -> list[str]:
        """The runs watched now."""
        return sorted(run for run, t in self._tracked.items() if t.watch is not None)

    def collect(self) -> FleetReading:
        """Every tracked run's numbers now: the watched runs' readings, the others as not up."""
        runs, silent = [], []
        ages: dict[tuple[str, str], float] = {}
        now = time.time()
        for tracked in self._tracked.values():
            record = tracked.record
            reading = tracked.watch.read() if tracked.watch is not None else None
            heard = max(tracked.heard, tracked.watch.heard if tracked.watch is not None else 0.0)
            if reading is not None:
                runs.append(reading)
                tracked.devices.update({r.rank: r.device for r in reading.ranks if r.device})
            elif not tracked.dropped:
                silent.append(self._silent(tracked))
            if not tracked.dropped:
                since = heard or record.started
                ages[(record.run, reading.host if reading else record.host)] = max(0.0, now - since)
        return FleetReading(
            runs=tuple(runs),
            silent=tuple(silent),
            last_seen_age_s=ages,
            registered=self.registered,
            unwatched=self.unwatched,
            dropped=self.dropped,
            registry_read_s=self.registry_read_s,
        )

    @staticmethod
    def _silent(tracked: Tracked) -> SilentRun:
        record = tracked.record
        listed = [(info.rank, info.host) for info in record.ranks[:SILENT_RANKS_SHOWN]]
        ranks = tuple(
            SilentRank(rank, host or record.host, tracked.devices.get(rank, ""))
            for rank, host in listed or [(0, record.host)]  # a record lists rank 0 at least
        )
        return SilentRun(record.run, record.host, ranks)

    def close(self) -> None:
        """Stop every watch, close the hellos in flight and release the sockets."""
        for tracked in self._tracked.values():
            self._stop_watch(tracked)
        self._tracked.clear()
        for sock in list(self._probes):
            self._close_probe(sock)
        deadline = time.monotonic() + STOP_WAIT_S
        ended = [watch.join(max(0.0, deadline - time.monotonic())) for watch in self._stopping]
        if all(ended):  # a thread still in a poll would keep term() waiting for its sockets
            self._context.term()
