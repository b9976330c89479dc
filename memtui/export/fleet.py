"""The live runs the exporter watches: one receiver thread and one folded state per run.

:class:`Fleet` reads the registry (the same user's runs on this node; a run's ranks on other
nodes are reached over CURVE TCP where the keys are here, as the viewer reaches them), starts a
:class:`RunWatch` for every new run and stops the watch of a run that left the registry or ended.
A watch is the viewer's own transport and state: a :class:`~memtui.sources.LiveSource` read by a
:class:`~memtui.tui.receiver.Receiver` on its thread, each batch folded into a
:class:`~memtui.tui.state.RunState` as it is posted. :meth:`RunWatch.read` copies what the metrics
need into a plain :class:`RunReading` under the watch's lock, with the verdict made by the
state's summary (``advice.assess.verdict_inputs``, as the viewer and ``memtui status`` make it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import zmq

from memtui import registry
from memtui.advice.verdict import State, ThresholdConfig
from memtui.client import client_name
from memtui.sources import LiveSource
from memtui.stats import MemoryStats, StepStats
from memtui.tui.events import Status
from memtui.tui.receiver import Inbox, Receiver
from memtui.tui.state import RankSeries, RunState
from memtui.wire import HostSample

REFRESH_S = 2.0
"""How often the registry is read for runs that started or left."""


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


def device_label(series: RankSeries) -> str:
    """The rank's device as a label: ``cuda:INDEX`` or ``cpu`` ("" before any sample)."""
    if not series.device:
        return ""
    sample = series.device[-1]
    return "cpu" if sample.kind == "cpu" else f"{sample.kind}:{sample.index}"


class RunWatch:
    """One run followed by the viewer's receiver on a thread of its own, folded into a state."""

    def __init__(self, run: str, thresholds: ThresholdConfig, context: zmq.Context) -> None:
        self.run = run
        self.state = RunState(thresholds=thresholds, chart_seconds=1)  # it draws no chart
        self._lock = threading.Lock()
        self._inbox = Inbox()
        self._applied_seen: dict[int, set[tuple[int, tuple[int, ...], bool]]] = {}
        """Each rank's applied changes seen so far (step, ids, rollback): a count that the
        run's capped history cannot lower."""
        self._ooms_seen: dict[int, set[tuple[float, int]]] = {}
        """Each rank's out-of-memory events seen so far (time, step)."""
        source = LiveSource(run, context=context, client=client_name("export"))
        self.receiver = Receiver(source, self._inbox, self._fold, readonly=True)
        self._thread = threading.Thread(
            target=self.receiver.run, name=f"memtui-export-{run}", daemon=True
        )

    def start(self) -> None:
        """Start receiving."""
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the receiver and wait for its thread (it closes its sockets); True once it has
        ended."""
        self.receiver.stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def ended(self) -> bool:
        """Rank 0 sent its last batch: the run is over."""
        with self._lock:
            return self.state.ended or self.state.connection.status is Status.ENDED

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
            state = self.state
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
                        applied=self._count_applied(series),
                        ooms=self._count_ooms(series),
                        hook_errors=series.counters.errors if series.counters else None,
                    )
                )
            control = state.control
            return RunReading(
                run=state.info.run,
                host=state.info.host,
                control_rank=state.info.rank,
                verdict=summary.verdict.state,
                pending=len(control.pending) if control is not None else 0,
                ranks=tuple(ranks),
            )

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


class Fleet:
    """Every live run of the registry this user may see, each watched while it lives."""

    def __init__(self, thresholds: ThresholdConfig, refresh_s: float = REFRESH_S) -> None:
        self.thresholds = thresholds
        self.refresh_s = refresh_s
        self.problem = ""
        """Why the registry could not be read at the last refresh ("" when it could)."""
        self._context = zmq.Context()
        self._watches: dict[str, RunWatch] = {}
        self._ended: set[str] = set()
        """Runs that sent their last batch while their record lingered: not watched again."""
        self._lock = threading.Lock()

    def refresh(self) -> tuple[list[str], list[str]]:
        """Watch the runs that started, stop watching those that left or ended; returns the
        runs started and stopped."""
        try:
            live = {record.run for record in registry.list_runs()}
            self.problem = ""
        except registry.RegistryError as exc:
            self.problem = str(exc)
            return [], []
        started, stopped = [], []
        with self._lock:
            for run, watch in list(self._watches.items()):
                if watch.ended:
                    self._ended.add(run)
                if run not in live or run in self._ended:
                    del self._watches[run]
                    watch.stop()
                    stopped.append(run)
            self._ended &= live
            for run in sorted(live - self._watches.keys() - self._ended):
                watch = RunWatch(run, self.thresholds, self._context)
                self._watches[run] = watch
                watch.start()
                started.append(run)
        return started, stopped

    def runs(self) -> list[str]:
        """The runs watched now."""
        with self._lock:
            return sorted(self._watches)

    def readings(self) -> list[RunReading]:
        """Every watched run's numbers (runs that have not answered yet left out)."""
        with self._lock:
            watches = list(self._watches.values())
        readings = (watch.read() for watch in watches)
        return [reading for reading in readings if reading is not None]

    def close(self) -> None:
        """Stop every watch and release the sockets."""
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        stopped = [watch.stop() for watch in watches]
        if all(stopped):  # a thread still in a poll would keep term() waiting for its sockets
            self._context.term()
