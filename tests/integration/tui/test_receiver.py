"""The receiver: one thread owns the source, decodes, reports batches; never dies on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from memtui.runs.events import ConnectionEvent, Notice, ReceivedBatch, Status
from memtui.runs.receiver import DEFAULT_TIMINGS, Inbox, Receiver, ReceiverTimings
from memtui.runs.state import RunState
from memtui.storage.registry import find_run
from memtui.transport.recording import RecordingWriter, read_recording
from memtui.transport.sources import LiveSource, ReplaySource, Source
from memtui.wire import SetRequest, Snapshot, Telemetry, encode
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.processes import ROOT, wait_for
from tests.support.viewer import STARVING, HookLoop


@contextmanager
def receiving(
    source: Source, readonly: bool = False, timings: ReceiverTimings = DEFAULT_TIMINGS
) -> Iterator[tuple[Receiver, list[ReceivedBatch]]]:
    """A receiver on its thread; the batches it posts are collected as the app would."""
    inbox = Inbox()
    batches: list[ReceivedBatch] = []
    lock = threading.Lock()

    def notify() -> None:
        with lock:
            batches.extend(inbox.drain())

    receiver = Receiver(source, inbox, notify, readonly=readonly, timings=timings)
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    try:
        yield receiver, batches
    finally:
        receiver.stop()
        thread.join(patience(5))
        assert not thread.is_alive()


def events(batches: list[ReceivedBatch]) -> list[object]:
    return [e for b in list(batches) for e in b.events]


def statuses(batches: list[ReceivedBatch]) -> list[Status]:
    return [e.status for e in events(batches) if isinstance(e, ConnectionEvent)]


def test_bad_frames_are_counted_and_survived(tmp_path: Path) -> None:
    recording = read_recording(STARVING)
    path = tmp_path / "garbage.mtrec"
    wrong_version = encode(Telemetry(run="x", rank=0, seq=1, time=0.0, step=1, v=99))
    with RecordingWriter(path, recording.header) as writer:
        for index, frame in enumerate(recording.frames[:40]):
            writer.write(frame.offset_s, frame.rank, frame.frame)
            if index == 10:
                writer.write(frame.offset_s, 0, b"\xc1 not msgpack")
                writer.write(frame.offset_s, 0, wrong_version)
    with receiving(ReplaySource(path, speed=None)) as (receiver, batches):
        wait_for(receiver.caught_up.is_set, 10, what="the replay")
    assert batches[-1].bad_frames == 2 and "version 99" in batches[-1].last_bad_frame
    state = RunState()
    for batch in batches:
        state.apply(batch)
    assert state.bad_frames == 2
    assert state.step == max(t.step for t in events(batches) if isinstance(t, Telemetry | Snapshot))
    assert statuses(batches) == [Status.LIVE]


def test_a_replay_that_goes_silent_disconnects() -> None:
    source = ReplaySource(STARVING, speed=None, until_s=3.0, at_end="disconnect")
    with receiving(source) as (receiver, batches):
        wait_for(receiver.caught_up.is_set, 10, what="the replay")
        time.sleep(0.3)
        outcome_count = len(batches)
        receiver.submit(SetRequest(changes={"num_workers": 4}))
        wait_for(lambda: len(batches) > outcome_count, 5, what="the refusal")
    assert statuses(batches) == [Status.LIVE, Status.DISCONNECTED]
    refusals = [e for e in events(batches) if isinstance(e, Notice)]
    assert refusals and not refusals[0].ok and "takes no changes" in refusals[0].text


def test_live_set_applies_then_the_run_ends(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=6, checkpoint_every=50)
    with receiving(LiveSource(loop.run_id)) as (receiver, batches):
        wait_for(lambda: any(isinstance(e, Telemetry) for e in events(batches)), 10, what="data")
        receiver.submit(SetRequest(changes={"num_workers": 3}, client=receiver.client))
        wait_for(lambda: any(isinstance(e, Notice) for e in events(batches)), 10, what="reply")
        outcome = next(e for e in events(batches) if isinstance(e, Notice))
        assert outcome.ok and outcome.text.startswith("queued #1: num_workers=3"), outcome

        def applied() -> bool:
            return any(
                isinstance(e, Telemetry) and e.control is not None and e.control.applied
                for e in events(batches)
            )

        wait_for(applied, 10, what="the change applied at a checkpoint")
        wait_for(lambda: Status.ENDED in statuses(batches), 15, what="the end of the run")
        time.sleep(1.5)  # it looks for the run again, and stays ended
    assert statuses(batches) == [Status.LIVE, Status.ENDED]
    state = RunState()
    for batch in batches:
        state.apply(batch)
    assert state.ended and state.control is not None
    applied_step = state.control.applied[-1].step
    assert applied_step % 50 == 0
    assert state.connection.detail == f"run ended at step {state.step}"


def test_readonly_sends_nothing(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=30)
    with receiving(LiveSource(loop.run_id), readonly=True) as (receiver, batches):
        wait_for(lambda: Status.LIVE in statuses(batches), 10, what="the connection")
        receiver.submit(SetRequest(changes={"num_workers": 3}))
        wait_for(lambda: any(isinstance(e, Notice) for e in events(batches)), 10, what="reply")
    outcome = next(e for e in events(batches) if isinstance(e, Notice))
    assert not outcome.ok and "read-only" in outcome.text
    status = json.loads(memtui_cli("status", loop.run_id, "--json").stdout)
    assert status["pending"] == [] and status["rejected"] == []


def test_attach_by_control_endpoint(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=30)
    endpoint = find_run(loop.run_id).control
    with receiving(LiveSource(endpoint)) as (_receiver, batches):
        wait_for(lambda: any(isinstance(e, Telemetry) for e in events(batches)), 10, what="data")
    snapshot = next(e for e in events(batches) if isinstance(e, Snapshot))
    assert snapshot.info.run == loop.run_id and statuses(batches)[0] is Status.LIVE


def test_ranks_that_appear_later_are_followed_and_asked() -> None:
    # the benchmark's stand-in for a many-rank job (real sockets, the hook's cadence): rank 2
    # publishes from the start but is listed (registry, snapshots) only after 2 s
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "tui_ranks.py"), "--publish", "--ranks", "3",
         "--late", "1", "--rate", "50", "--for", "30"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        run = proc.stdout.readline().split()[1]
        source = LiveSource(run, ranks_refresh_s=0.3)
        with receiving(source) as (_receiver, batches):

            def heard(rank: int) -> bool:
                return any(isinstance(e, Telemetry) and e.rank == rank for e in events(batches))

            wait_for(lambda: heard(0) and heard(1), 10, what="the listed ranks")
            first = next(e for e in events(batches) if isinstance(e, Snapshot))
            assert [r.rank for r in first.ranks] == [0, 1], "rank 2 is not listed yet"
            wait_for(lambda: heard(2), 10, what="the late rank, from the registry")
            wait_for(
                lambda: any(isinstance(e, Snapshot) and e.info.rank == 2 for e in events(batches)),
                10,
                what="the late rank's answer to its hello",
            )
        state = RunState()
        for batch in batches:
            state.apply(batch)
        assert sorted(state.series) == [0, 1, 2] and state.info is not None
        assert state.info.rank == 0, "the late rank's snapshot did not take over the run"
    finally:
        proc.terminate()
        proc.wait(patience(10))
