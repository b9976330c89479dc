"""The viewer's state, folded from batches without a terminal (plain dataclasses)."""

from __future__ import annotations

from rich.style import Style

from memtui.advice.verdict import State
from memtui.runs.events import ConnectionEvent, Notice, ReceivedBatch, Status
from memtui.runs.state import RunState
from memtui.tui.charts import nice_ceiling, pick_scale, stacked_rows, to_columns
from memtui.wire import (
    ControlState,
    DeviceSample,
    HostSample,
    Knobs,
    PendingChange,
    RunInfo,
    Snapshot,
    StepRecord,
    Telemetry,
)

T0 = 1_000_000.0
GIB = 1 << 30


def steps(first: int, last: int, wait: float = 0.06, dt: float = 0.1) -> list[StepRecord]:
    return [StepRecord(s, T0 + s * dt, dt, wait, 32, 2) for s in range(first, last + 1)]


def control(pending: dict[str, int] | None = None) -> ControlState:
    changes = [PendingChange(7, dict(pending), dict(pending), T0, 5)] if pending else []
    return ControlState(
        config=Knobs(batch_size=16, grad_accum=2, num_workers=0, pin_memory=False),
        tunable=["batch_size", "grad_accum", "num_workers", "pin_memory"],
        world_size=2,
        pending=changes,
    )


def snapshot(run: str = "r1", last_step: int = 10) -> Snapshot:
    info = RunInfo(run=run, pid=1, host="h", started=T0, world_size=2)
    return Snapshot(info=info, control=control(), step=last_step, control_seq=3,
                    steps=steps(1, last_step), seq=4)  # fmt: skip


def telemetry(rank: int, seq: int, first: int, last: int, **fields: object) -> Telemetry:
    return Telemetry(run=fields.pop("run", "r1"), rank=rank, seq=seq, time=T0 + last * 0.1,  # type: ignore[arg-type]
                     step=last, steps=steps(first, last), **fields)  # type: ignore[arg-type]  # fmt: skip


def fold(state: RunState, *events: object, clock: float = T0 + 5) -> None:
    state.apply(ReceivedBatch(list(events), clock))  # type: ignore[arg-type]


def test_snapshot_then_telemetry_dedupes_steps_and_counts_lost_batches() -> None:
    state = RunState()
    fold(state, snapshot(), telemetry(0, 5, 8, 12), telemetry(0, 8, 13, 15))
    series = state.series[0]
    assert [r.step for r in series.steps] == list(range(1, 16))
    assert series.lost_batches == 2  # seq 6 and 7 never came
    assert state.step == 15
    assert state.elapsed_s == 5.0


def test_control_comes_from_the_control_rank_only() -> None:
    state = RunState()
    fold(state, snapshot())
    other = telemetry(1, 1, 1, 3, control=control({"batch_size": 99}), control_seq=9)
    fold(state, other)
    assert state.pending_values() == {}
    mine = telemetry(0, 5, 11, 12, control=control({"num_workers": 4}), control_seq=4)
    fold(state, mine)
    assert state.pending_values() == {"num_workers": 4}
    stale = telemetry(0, 6, 13, 13, control=control(), control_seq=2)
    fold(state, stale)
    assert state.pending_values() == {"num_workers": 4}, "an older control state is ignored"


def test_other_runs_and_early_batches_are_dropped_and_counted() -> None:
    state = RunState()
    fold(state, telemetry(0, 1, 1, 3))
    assert not state.series and state.ignored_batches == 1
    fold(state, snapshot(), telemetry(0, 5, 11, 12, run="someone-else"))
    assert state.ignored_batches == 1
    assert state.series[0].last_step == 10


def test_a_new_run_resets_the_state() -> None:
    state = RunState()
    fold(state, snapshot("r1", 10), telemetry(0, 5, 11, 40))
    fold(state, snapshot("r2", 3))
    assert state.info is not None and state.info.run == "r2"
    assert state.step == 3
    assert [r.step for r in state.series[0].steps] == [1, 2, 3]


def test_summary_and_verdict_use_the_worst_rank() -> None:
    state = RunState()
    fold(state, snapshot())
    fold(state, Telemetry(run="r1", rank=1, seq=1, time=T0, step=10, steps=steps(1, 10, wait=0.08)))
    summary = state.summary()
    assert summary.verdict.state is State.STARVED
    assert summary.focus_rank == 1
    assert round(summary.steps.data_wait_fraction, 2) == 0.8  # type: ignore[union-attr]
    assert state.summary() is summary, "cached until the data changes"


def test_memory_and_host_feed_the_verdict() -> None:
    state = RunState()
    fold(state, snapshot())
    device = [
        DeviceSample(time=T0 + i, step=10, kind="cuda", capacity_bytes=24 * GIB,
                     reserved_bytes=20 * GIB, peak_reserved_bytes=20 * GIB,
                     allocated_bytes=17 * GIB, nvml_used_bytes=21 * GIB)
        for i in range(3)
    ]  # fmt: skip
    host = [
        HostSample(time=T0 + i, ram_total_bytes=64 * GIB, ram_available_bytes=30 * GIB,
                   ram_used_bytes=34 * GIB, swap_used_bytes=(1 + i) * GIB)
        for i in range(3)
    ]  # fmt: skip
    fold(state, telemetry(0, 5, 11, 11, device=device, host=host[0]))
    fold(state, telemetry(0, 6, 12, 12, host=host[2]))
    summary = state.summary()
    assert summary.memory is not None
    assert summary.memory.peak_used_bytes == 21 * GIB  # 20 reserved + 1 beyond torch
    assert summary.verdict.state is State.OOM_RISK
    assert state.swap_growth_bytes() == 2 * GIB
    bucket = state.series[0].memory_buckets.buckets[-1]
    assert bucket.beyond_torch_bytes == 1 * GIB


def test_effective_batch_now_and_pending() -> None:
    state = RunState()
    fold(state, snapshot())
    assert state.effective_batch() == 16 * 2 * 2
    fold(state, telemetry(0, 5, 11, 11, control=control({"batch_size": 24}), control_seq=4))
    assert state.effective_batch(pending=True) == 24 * 2 * 2
    assert state.knob_value("num_workers") == 0


def test_connection_and_outcomes_bump_their_versions() -> None:
    state = RunState()
    versions = (state.connection_version, state.control_version)
    fold(state, ConnectionEvent(Status.QUIET, "no data for 3 s"), Notice(True, "queued #1"))
    assert state.connection.status is Status.QUIET
    assert (state.connection_version, state.control_version) > versions
    assert state.notices[-1].text == "queued #1"


def test_ended_only_from_rank_zero() -> None:
    state = RunState()
    fold(state, snapshot(), telemetry(1, 1, 1, 2, ended=True))
    assert not state.ended
    fold(state, telemetry(0, 5, 11, 11, ended=True))
    assert state.ended


def test_steps_go_into_one_second_buckets_and_chart_columns() -> None:
    state = RunState()
    fold(state, snapshot("r1", 0), telemetry(0, 5, 1, 35))  # 0.1 s steps over 3.5 s
    buckets = list(state.series[0].step_buckets.buckets)
    assert [b.steps for b in buckets] == [9, 10, 10, 6]
    count = lambda group: sum(b.steps for b in group)  # noqa: E731
    columns = to_columns(buckets, lambda b: b.start, count, 4, T0 + 3.5)
    assert columns.values == [9, 10, 10, 6] and columns.seconds_per_column == 1
    later = to_columns(buckets, lambda b: b.start, count, 4, T0 + 5.5)
    assert later.values == [None, 19, 16, None], "zoomed out to 2 s/col; the quiet now shows"
    assert later.seconds_per_column == 2
    wide = to_columns(buckets, lambda b: b.start, count, 2, T0 + 3.5)
    assert wide.seconds_per_column == 2 and sum(v or 0 for v in wide.values) == 35


def test_chart_scale_ceiling_and_stacked_rows() -> None:
    assert pick_scale(50, 60) == 1 and pick_scale(61, 60) == 2 and pick_scale(1e9, 10) == 600
    assert nice_ceiling(0.8) == 1.0 and nice_ceiling(130) == 200 and nice_ceiling(0) == 1.0
    red, green = Style(color="red"), Style(color="green")
    rows = stacked_rows([[(0.5, red), (0.75, green)], None], 2, 1.0)
    assert [r.plain for r in rows] == ["▄ ", "█ "]
    top = rows[0].spans[0].style
    assert isinstance(top, Style) and top.color == green.color and top.bgcolor is None
