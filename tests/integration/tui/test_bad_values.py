"""Well-formed messages with impossible numbers: dropped and counted, and the viewer lives on."""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from textual.pilot import Pilot

from memtui.core.stats import format_bytes, format_duration
from memtui.runs.events import ReceivedBatch, Status
from memtui.runs.state import RunState
from memtui.transport.sources import LiveSource
from memtui.tui.app import MemtuiApp
from memtui.tui.messages import ReceiverUpdate
from memtui.tui.palette import rate
from memtui.wire import (
    AppliedChange,
    CheckpointRecord,
    DeviceSample,
    Effect,
    GpuProcess,
    HostSample,
    KnobDiff,
    Knobs,
    MemoryModel,
    PendingChange,
    RankInfo,
    StepRecord,
    Telemetry,
    encode,
)
from tests.support.clock import patience
from tests.support.viewer import (
    OOM,
    STARVING,
    HookLoop,
    replay_app,
    run,
    screen_text,
    settle,
    until,
)
from tests.unit.tui.test_state import GIB, T0, fold, snapshot, telemetry

INF, NAN = math.inf, math.nan
NASTY_FLOATS = (INF, -INF, NAN, -1.0, 1e300, -1e300)
NASTY_INTS = (-1, -(2**63), 2**63 - 1, 10**18)


def test_formatting_takes_any_number() -> None:
    assert format_duration(INF) == format_duration(NAN) == format_duration(-INF) == "-"
    assert format_bytes(INF) == format_bytes(NAN) == "-"
    assert format_duration(-5.0) == "-5.0 s"
    assert format_duration(3 * 86400 + 4 * 3600) == "3d04h"
    assert len(format_duration(1e300)) < 12 and len(format_bytes(1e300)) < 16
    assert rate(INF) == rate(NAN) == "-" and rate(1024.0) == "1,024"


def test_impossible_records_are_dropped_and_counted_and_the_series_goes_on() -> None:
    state = RunState()
    fold(state, snapshot())
    good = StepRecord(11, T0 + 1.1, 0.1, 0.02, 32, 2)
    bad_steps = [
        StepRecord(12, T0 + 1.2, INF, 0.02, 32, 2),
        StepRecord(12, T0 + 1.2, 0.1, -INF, 32, 2),
        StepRecord(12, NAN, 0.1, 0.02, 32, 2),
        StepRecord(12, T0 + 1.2, -0.1, 0.02, 32, 2),
        StepRecord(12, T0 + 1.2, 0.1, 0.02, -32, 2),
        StepRecord(10**18, T0 + 1.2, 0.1, 0.02, 32, 2),  # would hide every later step
    ]
    device = [
        DeviceSample(time=NAN, step=11, kind="cuda", capacity_bytes=24 * GIB),
        DeviceSample(time=T0 + 1, step=11, kind="cuda", capacity_bytes=24 * GIB,
                     reserved_bytes=-GIB),
        DeviceSample(time=T0 + 1, step=11, kind="cuda", capacity_bytes=24 * GIB,
                     utilization_pct=INF),
        DeviceSample(time=T0 + 1.1, step=11, kind="cuda", capacity_bytes=24 * GIB,
                     allocated_bytes=GIB, reserved_bytes=2 * GIB, peak_reserved_bytes=3 * GIB),
    ]  # fmt: skip
    host = HostSample(time=T0 + 1, ram_total_bytes=-1, ram_available_bytes=0, ram_used_bytes=0)
    batch = Telemetry(run="r1", rank=0, seq=5, time=T0 + 1.2, step=11, steps=[good, *bad_steps],
                      device=device, host=host,
                      checkpoints=[CheckpointRecord(10, T0 + 1, NAN)])  # fmt: skip
    fold(state, batch)
    series = state.series[0]
    assert series.last_step == 11 and len(series.device) == 1
    assert series.host is None
    assert state.bad_values == len(bad_steps) + 3 + 1 + 1
    # a batch whose own step is absurd is dropped whole; the run's step is not poisoned
    fold(state, msgspec.structs.replace(telemetry(0, 6, 12, 12), step=2**62))
    assert state.bad_values == len(bad_steps) + 6
    assert state.step == 11
    fold(state, telemetry(0, 7, 12, 20))
    assert series.last_step == 20 and state.step == 20
    summary = state.refresh_summary()
    assert summary.steps is not None and math.isfinite(summary.steps.step_time_s)
    assert summary.memory is not None and summary.memory.peak_bytes == 3 * GIB
    assert "ms" in summary.verdict.reasons[0].value  # formatted, not inf


def test_an_impossible_clock_or_start_is_not_taken() -> None:
    state = RunState()
    fold(state, snapshot())
    fold(state, telemetry(0, 5, 11, 12), clock=INF)
    fold(state, telemetry(0, 6, 13, 14), clock=1e300)
    assert state.clock == T0 + 5 and state.elapsed_s == 5.0
    other = msgspec.structs.replace(snapshot(run="r2"), info=msgspec.structs.replace(
        snapshot().info, run="r2", started=NAN))  # fmt: skip
    fold(state, other)
    assert state.info is not None and state.info.run == "r2"
    assert state.elapsed_s is None and state.bad_values == 1


def nasty_batch(rnd: random.Random, state: RunState) -> Telemetry:
    """A well-formed telemetry batch of the run with impossible numbers here and there."""
    assert state.info is not None and state.control is not None
    series = state.series[state.info.rank]
    clock, last = state.clock, series.newest_step

    def number(good: float) -> float:
        return rnd.choice((good, good, *NASTY_FLOATS))

    def count(good: int) -> int:
        return rnd.choice((good, good, *NASTY_INTS))

    records = [
        StepRecord(count(last + k), number(clock), number(0.05), number(0.01), count(4), count(1))
        for k in (1, 2, 3)
    ]
    device = DeviceSample(
        time=number(clock), step=count(last), kind=rnd.choice(("cuda", "cpu")),
        capacity_bytes=count(24 * GIB), allocated_bytes=count(GIB),
        peak_allocated_bytes=count(2 * GIB), reserved_bytes=count(2 * GIB),
        peak_reserved_bytes=count(3 * GIB), inactive_split_bytes=count(0),
        nvml_used_bytes=count(3 * GIB), utilization_pct=number(50.0),
        other_processes=[GpuProcess(pid=count(7), name="x", used_bytes=count(GIB))],
    )  # fmt: skip
    host = HostSample(
        time=number(clock), ram_total_bytes=count(64 * GIB), ram_available_bytes=count(GIB),
        ram_used_bytes=count(32 * GIB), swap_used_bytes=count(0), main_rss_bytes=count(GIB),
        workers=count(2), workers_rss_bytes=count(GIB), cpu_percent=number(90.0),
    )  # fmt: skip
    control = state.control
    if rnd.random() < 0.3:
        effect = Effect(count(10), count(10), number(1.0), number(1.0), number(0.1), number(0.1),
                        number(0.01), number(0.01), count(GIB), count(GIB))  # fmt: skip
        model = MemoryModel(kind="cuda", batch_size=count(8), capacity_bytes=count(24 * GIB),
                            steady_bytes=count(GIB), per_sample_bytes=number(1e6),
                            overhead_ratio=number(1.1), fit_error=number(0.01))  # fmt: skip
        control = msgspec.structs.replace(
            control,
            config=Knobs(batch_size=count(8), grad_accum=count(1), num_workers=count(2),
                         pin_memory=True),
            world_size=count(control.world_size),
            model=model,
            pending=[PendingChange(id=count(3), changes={"batch_size": count(9)},
                                   requested={"batch_size": count(9)}, queued_time=number(clock),
                                   queued_step=count(last), predicted_peak_bytes=count(GIB))],
            applied=[AppliedChange(ids=[count(2)], step=count(last), time=number(clock),
                                   changes={"batch_size": KnobDiff(count(8), count(9))},
                                   predicted_peak_bytes=count(GIB),
                                   observed_peak_bytes=count(GIB), effect=effect)],
        )  # fmt: skip
    return Telemetry(
        run=state.info.run, rank=rnd.choice((state.info.rank, state.info.rank, 1)),
        seq=count(series.last_seq + 1), time=number(clock), step=count(last + 3), steps=records,
        device=[device], host=host, checkpoints=[CheckpointRecord(count(last), number(clock), 0.1)],
        control=control, control_seq=state.control_seq + 1,
    )  # fmt: skip


def feed(app: MemtuiApp, *events: object, clock: float | None = None) -> None:
    """Hand the app a batch as the receiver does: into the inbox, then the update message."""
    app.inbox.put(ReceivedBatch(list(events), app.state.clock if clock is None else clock))  # type: ignore[arg-type]
    app.post_message(ReceiverUpdate())


@pytest.mark.parametrize(("path", "size"), [(OOM, (60, 50)), (STARVING, (120, 40))])
def test_nasty_batches_never_stop_the_viewer(path: Path, size: tuple[int, int]) -> None:
    app = replay_app(path)
    rnd = random.Random(7)

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        state = app.state
        for _ in range(40):
            feed(app, nasty_batch(rnd, state), clock=rnd.choice((state.clock, INF, NAN)))
            await pilot.pause()
            app.refresh_view()
            await pilot.pause()
        assert app.is_running
        assert state.viewer_errors == 0, state.last_viewer_error
        assert state.bad_values > 40
        text = screen_text(app)
        assert "bad values" in text and "verdict" in text and "memory" in text
        assert "nan" not in text.lower() and "inf " not in text

    run(app, check, size)


def test_a_batch_that_cannot_be_folded_or_drawn_is_counted_and_shown() -> None:
    app = replay_app(STARVING)

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        state = app.state
        assert state.info is not None and state.control is not None
        step = state.step
        # not what the decoder makes (device must be a list): the fold raises, the app goes on
        broken = Telemetry(run=state.info.run, rank=0, seq=state.series[0].last_seq + 1,
                           time=state.clock, step=step + 1, device=None)  # type: ignore[arg-type]  # fmt: skip
        feed(app, broken)
        await until(pilot, lambda: state.viewer_errors == 1, 5, "the fold's error to be counted")
        assert "folding a batch" in state.last_viewer_error
        # a pending change without changes: the panels that list it cannot be drawn
        pending = PendingChange(id=9, changes=None, requested={}, queued_time=state.clock,  # type: ignore[arg-type]
                                queued_step=step)  # fmt: skip
        control = msgspec.structs.replace(state.control, pending=[pending])
        feed(app, telemetry(0, state.series[0].last_seq + 1, step + 1, step + 2,
                            run=state.info.run, control=control, control_seq=state.control_seq + 1))  # fmt: skip
        await until(pilot, lambda: state.viewer_errors > 1, 5, "the drawing error")
        assert "drawing" in state.last_viewer_error
        app.refresh_view()
        await pilot.pause()
        assert app.is_running
        text = screen_text(app)
        assert "viewer errors" in text and f"step {step + 2:,}" in text
        assert "verdict" in text and "history" in text  # the other panels are still drawn

    run(app, check, (120, 40))


def test_impossible_numbers_through_the_real_receiver(
    start_hook_loop: Callable[..., HookLoop], private_runtime: Path
) -> None:
    """A second publisher of the same run (real zmq, the real receiver and decoder) sends
    infinite, NaN, negative and absurd numbers; the viewer counts them and goes on."""
    loop = start_hook_loop(rate=100, seconds=60)
    app = MemtuiApp(LiveSource(loop.run_id))
    endpoint = f"ipc://{private_runtime}/nasty{os.getpid()}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)

    def frames(seq: int) -> list[bytes]:
        now = time.time()
        cuda = {"kind": "cuda", "capacity_bytes": 24 * GIB}
        return [encode(m) for m in (
            Telemetry(run=loop.run_id, rank=9, seq=seq, time=now, step=5,
                      steps=[StepRecord(5, now, INF, 0.0, 32, 1),
                             StepRecord(6, now, 0.1, NAN, 32, 1),
                             StepRecord(10**15, now, 0.1, 0.0, 32, 1),
                             StepRecord(7, -INF, 0.1, 0.0, -3, 1)],
                      device=[DeviceSample(time=NAN, step=5, **cuda),  # type: ignore[arg-type]
                              DeviceSample(time=now, step=5, allocated_bytes=-GIB, **cuda)]),  # type: ignore[arg-type]
            Telemetry(run=loop.run_id, rank=9, seq=seq + 1, time=now, step=2**62),
        )]  # fmt: skip

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.step > 0, 20, "steps")
        app.receiver.source.subscribe(RankInfo(rank=9, pub=endpoint))  # type: ignore[attr-defined]
        deadline = time.monotonic() + patience(10)
        seq = 1
        while state.bad_values < 7 and time.monotonic() < deadline:
            for frame in frames(seq):
                pub.send(frame)
            seq += 2
            await pilot.pause(0.2)
        assert state.bad_values >= 7
        before = state.step
        await until(pilot, lambda: state.step > before + 10, 20, "steps after the bad values")
        assert state.step < 10**6, "the absurd step was not taken"
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        assert "bad values" in text and "● live" in text
        assert state.connection.status is Status.LIVE
        assert (
            state.viewer_errors == 0 and app.receiver.counts.errors == 0 and state.bad_frames == 0
        )

    try:
        run(app, check, (120, 40))
    finally:
        pub.close(0)
        context.term()
