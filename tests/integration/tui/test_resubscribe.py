"""One oversized telemetry frame does not silence the viewer for good: libzmq drops a SUB
connection on a frame over its size limit (``MAX_FRAME``) and never makes it again, so when the
run (or one rank) answers a hello but sends nothing, the viewer subscribes anew, counts it and
shows it in the header. Real ZeroMQ: stand-in ranks (a PUB and a ROUTER socket each, registered
as a hook registers them) send heartbeats, then one frame over the limit, then heartbeats."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from textual.pilot import Pilot

from memtui.runs.events import Status
from memtui.storage import registry
from memtui.transport.sources import MAX_FRAME, LiveSource
from memtui.tui.app import MemtuiApp
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
from tests.integration.tui.test_app_replay import WIDE, text_of
from tests.integration.tui.test_receiver import events, receiving
from tests.support.clock import patience
from tests.support.processes import wait_for
from tests.support.viewer import until

OVERSIZED = b"\0" * (MAX_FRAME + 1)
"""One frame over the viewer's limit (its content does not matter: it is never received)."""


class StandInRank:
    """One rank of a run: heartbeats (a batch every ``beat_s``) on its own PUB socket, a
    snapshot for every hello on its own ROUTER socket, and raw frames sent when asked."""

    def __init__(self, run: str, rank: int, world_size: int, beat_s: float = 0.1) -> None:
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.beat_s = beat_s
        rundir = registry.run_dir(run)
        self.info = RankInfo(rank=rank, pub=rundir.pub_endpoint(rank),
                             control=rundir.control_endpoint(rank), pid=os.getpid())  # fmt: skip
        self.ranks: list[RankInfo] = []
        """Every rank of the run (its snapshot lists them)."""
        self.seq = 0
        self.hellos = 0
        self._raw: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def send_raw(self, frame: bytes) -> None:
        """Publish ``frame`` as it is, between two heartbeats."""
        self._raw.put(frame)

    def _snapshot(self) -> Snapshot:
        info = RunInfo(self.run, os.getpid(), "", time.time(), rank=self.rank,
                       world_size=self.world_size)  # fmt: skip
        control = ControlState(config=Knobs(batch_size=8), tunable=["batch_size"],
                               world_size=self.world_size)  # fmt: skip
        return Snapshot(info=info, control=control, ranks=self.ranks, step=self.seq, seq=self.seq)

    def _serve(self) -> None:
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(self.info.pub)
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.info.control)
        self._bound.set()
        decoder = Decoder()
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if router.poll(10):
                    frames = router.recv_multipart()
                    if isinstance(decoder.decode(frames[-1]), Hello):
                        self.hellos += 1
                        router.send_multipart([*frames[:-1], encode(self._snapshot())])
                while not self._raw.empty():
                    pub.send(self._raw.get())
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.beat_s
                    self.seq += 1
                    pub.send(encode(Telemetry(run=self.run, rank=self.rank, seq=self.seq,
                                              time=time.time(), step=self.seq)))  # fmt: skip
        finally:
            pub.close(0)
            router.close(0)
            context.term()

    def start(self) -> None:
        """Bind the sockets and start beating."""
        self._thread.start()
        assert self._bound.wait(patience(5))

    def stop(self) -> None:
        """Close the sockets."""
        self._stop.set()
        self._thread.join(patience(5))


@contextmanager
def stand_in_run(world_size: int) -> Iterator[list[StandInRank]]:
    """A run of ``world_size`` stand-in ranks, registered (rank 0 takes the hellos)."""
    run = registry.new_run_id("oversized")
    rundir = registry.run_dir(run)
    rundir.create()
    ranks = [StandInRank(run, rank, world_size) for rank in range(world_size)]
    for rank in ranks:
        rank.ranks = [r.info for r in ranks]
        rank.start()
    pid = os.getpid()
    rundir.write(RunRecord(run=run, pid=pid, create_time=registry.process_create_time(pid),
                           started=time.time(), host="", control=ranks[0].info.control,
                           ranks=[r.info for r in ranks], world_size=world_size))  # fmt: skip
    try:
        yield ranks
    finally:
        for rank in ranks:
            rank.stop()
        rundir.remove()


def seqs(batches: list[Any], rank: int) -> list[int]:
    """The seqs of ``rank``'s telemetry received, in order."""
    return [e.seq for e in events(batches) if isinstance(e, Telemetry) and e.rank == rank]


@pytest.mark.parametrize("big", [1, 0], ids=["another rank", "the control rank"])
def test_an_oversized_frame_of_one_rank_is_survived_and_the_others_lose_nothing(big: int) -> None:
    """One rank of two sends a frame over the limit: its connection is dropped, the other rank
    goes on; the silent rank is asked (a hello, not waited for), answers, and is subscribed to
    anew: its heartbeats come back, and the other rank lost no batch meanwhile."""
    other = 1 - big
    with stand_in_run(2) as ranks, receiving(LiveSource(ranks[0].run)) as (receiver, batches):
        wait_for(lambda: len(seqs(batches, 0)) > 3 and len(seqs(batches, 1)) > 3, 10, what="both")
        hellos = ranks[big].hellos
        ranks[big].send_raw(OVERSIZED)
        sent = ranks[big].seq
        started = time.monotonic()
        wait_for(lambda: max(seqs(batches, big)) > sent + 3, 15, what="the rank to be heard again")
        took = time.monotonic() - started
        assert receiver.counts.reconnects == 1
        assert took < receiver.timings.quiet_after_s + 4, took
        heard = seqs(batches, big)
        assert any(b - a > 10 for a, b in itertools.pairwise(heard)), "it was silent a while"
        assert ranks[big].hellos > hellos, "it was asked before it was resubscribed"
        kept = [s for s in seqs(batches, other) if s > 2]
        assert kept == list(range(kept[0], kept[0] + len(kept))), "the other rank lost batches"


def test_the_viewer_gets_data_again_after_an_oversized_frame() -> None:
    """A run of one rank sends a frame over the limit: the header says quiet (the run answers),
    then live again with new steps and ``1 reconnect``."""
    with stand_in_run(1) as ranks:
        app = MemtuiApp(LiveSource(ranks[0].run))

        async def check(pilot: Pilot[Any]) -> None:
            state = app.state
            await until(pilot, lambda: state.step > 3, 10, "the first heartbeats")
            ranks[0].send_raw(OVERSIZED)
            sent = ranks[0].seq
            started = time.monotonic()
            await until(pilot, lambda: state.connection.status is Status.QUIET, 10, "quiet")
            # live again: heartbeats (the snapshot of the hello has a step, not a status)
            await until(pilot, lambda: state.connection.status is Status.LIVE, 10, "live again")
            await until(pilot, lambda: state.step > sent + 5, 10, "new steps")
            assert time.monotonic() - started < patience(8)
            assert state.reconnects == 1
            app.refresh_view()
            await pilot.pause()
            assert "1 reconnect" in text_of(pilot, "#header")

        async def main() -> None:
            async with app.run_test(size=WIDE) as pilot:
                await check(pilot)

        asyncio.run(main())
