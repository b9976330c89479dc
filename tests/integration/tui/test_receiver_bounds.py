"""The receiver against a peer that sends what no run sends, over real ZeroMQ sockets: a stand-in
run (a PUB socket and a ROUTER control socket, registered as a hook registers) feeds the real
receiver (``LiveSource``, found by run id) an implausible control seq, and batches of ranks past
its world size. The receiver does not believe them, keeps asking for a snapshot when a change is
missed, asks no more often than ``refresh_s``, keeps no entry for a rank the run does not have,
and counts what it dropped as bad values."""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import zmq

from memtui.runs.events import ReceivedBatch, Status
from memtui.runs.plausible import MAX_RANKS
from memtui.runs.receiver import DEFAULT_TIMINGS, MAX_CONTROL_JUMP, Receiver, ReceiverTimings
from memtui.runs.state import RunState
from memtui.storage import registry
from memtui.transport.recording import RecordedFrame, Recording, RecordingHeader
from memtui.transport.sources import LiveSource, ReplaySource
from memtui.wire import (
    ControlState,
    Decoder,
    Hello,
    Knobs,
    RankInfo,
    RunInfo,
    RunRecord,
    Snapshot,
    Telemetry,
    encode,
)
from tests.integration.tui.test_receiver import events, receiving, statuses
from tests.support.clock import patience
from tests.support.processes import wait_for

TUNABLE = ["batch_size", "grad_accum", "num_workers", "pin_memory"]


class StandInRun:
    """A run of ``world_size`` ranks as the viewer sees one: rank 0 answers hellos with a
    snapshot of its control state, and every rank's telemetry goes out on rank 0's PUB socket
    (one thread owns both sockets); rank 0 sends a heartbeat every ``heartbeat_s``."""

    def __init__(self, world_size: int = 1, heartbeat_s: float = 0.1) -> None:
        self.world_size = world_size
        self.heartbeat_s = heartbeat_s
        self.run = registry.new_run_id("standin")
        self.rundir = registry.run_dir(self.run)
        self.control_seq = 1
        """The run's own count of changes to its control state."""
        self.config = Knobs(batch_size=16, grad_accum=2, num_workers=0, pin_memory=False)
        self.hellos = 0
        """Hellos answered."""
        self.seq = 0
        self.started = time.time()
        self._outbox: queue.SimpleQueue[Telemetry] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def control(self) -> ControlState:
        return ControlState(config=self.config, tunable=TUNABLE, world_size=self.world_size)

    def info(self) -> RunInfo:
        return RunInfo(self.run, os.getpid(), "standin-host", self.started,
                       world_size=self.world_size)  # fmt: skip

    def telemetry(self, **fields: object) -> Telemetry:
        """A batch of rank 0 (or ``rank=``) at the run's seq and control seq, with ``fields``."""
        with self._lock:
            self.seq += 1
            seq, control_seq = self.seq, self.control_seq
        values: dict[str, object] = dict(
            run=self.run, rank=0, seq=seq, time=time.time(), step=seq, control_seq=control_seq
        )
        values.update(fields)
        return Telemetry(**values)  # type: ignore[arg-type]

    def send(self, message: Telemetry) -> None:
        """Publish ``message`` (from the run's thread, in order)."""
        self._outbox.put(message)

    def change(self, **knobs: object) -> None:
        """A change of the control state whose batch (with the control state) the viewer
        misses: the count goes up, and later batches carry it without the state."""
        with self._lock:
            self.config = msgspec.structs.replace(self.config, **knobs)
            self.control_seq += 1

    def _serve(self) -> None:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(self.rundir.pub_endpoint(0))
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.rundir.control_endpoint(0))
        rank0 = RankInfo(rank=0, pub=self.rundir.pub_endpoint(0),
                         control=self.rundir.control_endpoint(0), host="standin-host",
                         pid=os.getpid())  # fmt: skip
        pid = os.getpid()
        self.rundir.write(RunRecord(run=self.run, pid=pid,
                                    create_time=registry.process_create_time(pid),
                                    started=self.started, host="standin-host",
                                    control=self.rundir.control_endpoint(0), ranks=[rank0],
                                    command=sys.argv, world_size=self.world_size))  # fmt: skip
        decoder = Decoder()
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                if router.poll(10):
                    frames = router.recv_multipart()
                    if isinstance(decoder.decode(frames[-1]), Hello):
                        with self._lock:
                            self.hellos += 1
                            snapshot = Snapshot(info=self.info(), control=self.control(),
                                                ranks=[rank0], step=self.seq, seq=self.seq,
                                                control_seq=self.control_seq)  # fmt: skip
                        router.send_multipart([*frames[:-1], encode(snapshot)])
                while True:
                    try:
                        pub.send(encode(self._outbox.get_nowait()))
                    except queue.Empty:
                        break
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.heartbeat_s
                    pub.send(encode(self.telemetry()))
        finally:
            pub.close(0)
            router.close(0)
            context.term()
            self.rundir.remove()

    def __enter__(self) -> StandInRun:
        self.rundir.create()
        self._thread.start()
        wait_for(lambda: self.rundir.record_path.exists(), 5, what="the stand-in's registry record")
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(patience(5))


@contextmanager
def attached(
    run: StandInRun, refresh_s: float = DEFAULT_TIMINGS.refresh_s
) -> Iterator[tuple[Receiver, list[ReceivedBatch]]]:
    """The real receiver on the stand-in run, once it hears the run's heartbeats."""
    timings = ReceiverTimings(refresh_s=refresh_s)
    with receiving(LiveSource(run.run), timings=timings) as (receiver, batches):
        wait_for(lambda: Status.LIVE in statuses(batches), 10, what="the connection")
        heard = len([e for e in events(batches) if isinstance(e, Telemetry)])
        wait_for(
            lambda: len([e for e in events(batches) if isinstance(e, Telemetry)]) > heard + 2,
            10,
            what="heartbeats (the SUB socket is connected)",
        )
        yield receiver, batches


def folded(batches: list[ReceivedBatch]) -> RunState:
    """The state the app would make of the batches posted so far."""
    state = RunState()
    for batch in list(batches):
        state.apply(batch)
    return state


def test_a_huge_control_seq_is_not_believed_and_a_missed_change_still_asks() -> None:
    """A batch of the control rank claims control seq 2^39 with a made-up config: not believed
    (its control state dropped, counted). The run then changes batch_size, and the viewer
    misses the batch that carried it: the count going up still makes it ask for a snapshot,
    and the view shows the run's config and count."""
    with StandInRun() as run, attached(run, refresh_s=0.2) as (receiver, batches):
        asked = run.hellos
        bogus = ControlState(config=Knobs(batch_size=999), tunable=TUNABLE)
        run.send(run.telemetry(control_seq=2**39, control=bogus))
        wait_for(
            lambda: receiver.counts.bad_values == 1, 10, what="the bogus control state dropped"
        )
        run.change(batch_size=32)

        def shows_the_change() -> bool:
            control = folded(batches).control
            return control is not None and control.config.batch_size == 32

        # one snapshot asked after the bogus count at least (on a busy machine the bogus count
        # and the change's arrive in one poll, and one snapshot answers both)
        wait_for(shows_the_change, 30, what="the run's config in the view")
        assert run.hellos > asked
        state = folded(batches)
        assert state.control_seq == run.control_seq == 2
        assert state.bad_values == 1
        assert all(
            not (isinstance(e, Telemetry) and e.control is not None and e.control_seq > 2)
            for e in events(batches)
        ), "the implausible control state never reaches the view"


def test_a_control_seq_that_goes_back_asks_for_the_run_s_own() -> None:
    """A jump within reach (a bad peer's, believed) then the run's own lower count: going back
    is not believed either, and the snapshot brings the run's count back."""
    with StandInRun() as run, attached(run, refresh_s=0.2) as (receiver, batches):
        fake = ControlState(config=Knobs(batch_size=7), tunable=TUNABLE)
        asked = run.hellos
        run.send(run.telemetry(control_seq=1 + MAX_CONTROL_JUMP, control=fake))

        def jump_believed() -> bool:
            return any(
                isinstance(e, Telemetry)
                and e.control_seq == 1 + MAX_CONTROL_JUMP
                and e.control is not None
                for e in events(batches)
            )

        # The receiver's count is at the jump only until the next heartbeat: what the view was
        # given says it was believed, and that does not pass.
        wait_for(jump_believed, 10, what="the jump believed (its control state in the view)")
        wait_for(lambda: run.hellos > asked, 10, what="a snapshot asked: the count went back")
        wait_for(lambda: receiver._control_seq == 1, 10, what="the run's own count")
        run.change(grad_accum=4)
        wait_for(
            lambda: (folded(batches).control or fake).config.grad_accum == 4,
            10,
            what="a later change missed, then fetched",
        )


def test_a_storm_of_implausible_counts_asks_at_most_once_per_refresh() -> None:
    """Forty batches in two seconds, each with another implausible count: the run is asked
    for a snapshot at most once every ``refresh_s`` (0.5 s), not forty times."""
    with StandInRun() as run, attached(run, refresh_s=0.5) as (receiver, _batches):
        asked = run.hellos
        begin = time.monotonic()
        for k in range(40):
            control = ControlState(config=Knobs(batch_size=100 + k), tunable=TUNABLE)
            run.send(run.telemetry(control_seq=10**6 + 1000 * k, control=control))
            time.sleep(0.05)
        wait_for(lambda: receiver.counts.bad_values >= 40, 10, what="every bogus control state")
        # The receiver counts an ask when it sends it; the run counts it when it answers. Wait
        # for the last ask in flight to be answered (all but the connection's hello are asks).
        wait_for(
            lambda: receiver.counts.snapshots_asked == run.hellos - 1,
            5,
            what="the asks in flight answered",
        )
        elapsed = time.monotonic() - begin
        assert 1 <= run.hellos - asked <= elapsed / 0.5 + 2, (run.hellos - asked, elapsed)


def test_ranks_past_the_world_size_are_dropped_and_counted() -> None:
    """A two-rank run whose stream also carries 2,000 ranks it does not have (and rank 2^40):
    the receiver keeps entries for ranks 0 and 1 only (its own set, the decoder's budget, the
    view's series) and counts every other batch as a bad value, which the view shows."""
    with StandInRun(world_size=2) as run, attached(run) as (receiver, batches):
        run.send(run.telemetry(rank=1))
        extra = [*range(2, 2002), 2**40]
        for start in range(0, len(extra), 100):
            for rank in extra[start : start + 100]:
                run.send(run.telemetry(rank=rank, steps=[]))
            time.sleep(0.02)
        wait_for(
            lambda: receiver.counts.bad_values == len(extra), 20, what="every extra rank counted"
        )
        wait_for(lambda: folded(batches).bad_values == len(extra), 10, what="posted")
        assert receiver._ranks_seen == {0, 1}
        assert set(receiver.decoder._tokens) <= {0, 1}
        state = folded(batches)
        assert sorted(state.series) == [0, 1]
        assert state.rank_limit == 2


def test_before_the_world_size_is_known_at_most_max_ranks_are_followed() -> None:
    """A recording with no snapshot (the world size unknown) and batches of 5,000 ranks: the
    receiver follows ranks under ``MAX_RANKS`` only, and counts the rest."""
    header = RecordingHeader(started=time.time(), run="r", source="test")
    frames = [
        RecordedFrame(0.001 * rank, rank, encode(Telemetry(run="r", rank=rank, seq=1,
                                                           time=time.time(), step=1)))
        for rank in range(5000)
    ]  # fmt: skip
    source = ReplaySource(Recording(header, frames), speed=None)
    with receiving(source) as (receiver, _batches):
        wait_for(receiver.caught_up.is_set, 20, what="the replay")
    assert len(receiver._ranks_seen) == MAX_RANKS
    assert receiver.counts.bad_values == 5000 - MAX_RANKS


def test_a_snapshot_listing_ranks_past_its_world_size() -> None:
    """A snapshot of a two-rank run listing 10,000 ranks: two rows, the rest counted; another
    rank's snapshot or batch numbered past the world size is dropped and counted."""
    info = RunInfo("r", 1, "h", time.time(), world_size=2)
    listed = [RankInfo(rank=r, pub="", control="", host="h", pid=1) for r in range(10_000)]
    state = RunState()
    state.apply(ReceivedBatch([Snapshot(info=info, control=ControlState(config=Knobs(),
                                        tunable=[], world_size=2), ranks=listed)], info.started))  # fmt: skip
    assert sorted(state.series) == [0, 1] and state.bad_values == 10_000 - 2
    other = Snapshot(info=msgspec.structs.replace(info, rank=7), control=ControlState(Knobs(), []))
    state.apply(ReceivedBatch([other, Telemetry(run="r", rank=5, seq=1, time=info.started,
                                                step=1)], info.started))  # fmt: skip
    assert sorted(state.series) == [0, 1] and state.bad_values == 10_000 - 2 + 2
