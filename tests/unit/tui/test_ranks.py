"""Many ranks, one view: per-rank summaries (pure state), and the table on a replayed 8-rank run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.pilot import Pilot

from memtui.advice.verdict import State
from memtui.core.stats import MemoryStats, RankSpread, StepStats
from memtui.runs.events import ReceivedBatch, Status
from memtui.runs.state import SILENT_AFTER_S, RunState
from memtui.transport.recording import RecordingWriter, read_recording
from memtui.transport.sources import ReplaySource
from memtui.tui.app import MemtuiApp
from memtui.tui.widgets.ranks import COLUMN_GAP, ROW_WIDTH
from memtui.wire import (
    ControlState,
    DeviceSample,
    Knobs,
    RankInfo,
    RunInfo,
    Snapshot,
    StepRecord,
    Telemetry,
)
from tests.support.viewer import RANKS_8, STARVING, replay_app, run, screen_text, settle, until

T0 = 2_000_000.0
GIB = 1 << 30
WIDE = (120, 40)
NARROW = (60, 50)


# --------------------------------------------------------------------------- pure state


def control(**knobs: int) -> ControlState:
    config = Knobs(batch_size=16, grad_accum=2, num_workers=knobs.get("num_workers", 2))
    return ControlState(config=config, tunable=["batch_size", "grad_accum", "num_workers"],
                        world_size=4)  # fmt: skip


def snapshot(world: int = 4) -> Snapshot:
    info = RunInfo(run="r", pid=1, host="h", started=T0, world_size=world)
    listed = [RankInfo(rank=r, pub=f"ipc:///x/pub{r}") for r in range(world)]
    return Snapshot(info=info, control=control(), ranks=listed, control_seq=1)


def batch(rank: int, seq: int, first: int, last: int, dt: float = 0.1, wait: float = 0.005,
          peak: float = 0.5, **fields: Any) -> Telemetry:  # fmt: skip
    """Rank ``rank``'s steps ``first``..``last`` of ``dt`` seconds, and one memory sample."""
    steps = [StepRecord(s, T0 + s * 0.1, dt, wait, 32, 1) for s in range(first, last + 1)]
    sample = DeviceSample(time=T0 + last * 0.1, step=last, kind="cuda", capacity_bytes=10 * GIB,
                          reserved_bytes=int(peak * 10 * GIB), allocated_bytes=GIB)  # fmt: skip
    return Telemetry(run="r", rank=rank, seq=seq, time=T0 + last * 0.1, step=last, steps=steps,
                     device=[sample], **fields)  # fmt: skip


def fold(state: RunState, clock: float, *events: object) -> None:
    state.apply(ReceivedBatch(list(events), clock))  # type: ignore[arg-type]


def four_ranks() -> RunState:
    """Rank 2 takes 1.5x the median step time, rank 3 peaks at 88%."""
    state = RunState()
    fold(state, T0 + 2, snapshot())
    fold(state, T0 + 2, batch(0, 1, 1, 20), batch(1, 1, 1, 20, peak=0.6),
         batch(2, 1, 1, 20, dt=0.15), batch(3, 1, 1, 20, peak=0.88))  # fmt: skip
    return state


def test_worst_first_with_the_straggler_and_the_rank_nearest_oom() -> None:
    summary = four_ranks().summary()
    assert [r.rank for r in summary.worst_first] == [2, 3, 1, 0]
    by_rank = {r.rank: r for r in summary.ranks}
    assert by_rank[2].straggler == "straggler 1.5x" and summary.stragglers == (2,)
    assert by_rank[3].nearest_oom and summary.nearest_oom == 3
    assert not by_rank[0].straggler and not by_rank[0].nearest_oom
    assert summary.median_step_s is not None and round(summary.median_step_s, 3) == 0.1


def test_the_verdict_is_the_worst_ranks_and_names_it() -> None:
    summary = four_ranks().summary()
    verdict = summary.verdict
    assert verdict.state is State.OOM_RISK and summary.focus_rank == 3
    assert verdict.headline == "rank 3: peak 88%, 85-90% edge band"
    labels = [r.label for r in verdict.reasons]
    assert labels[1] == "rank 3: peak memory" and labels[0].startswith("rank ")
    assert summary.memory is not None and round(summary.memory.peak_used_fraction, 2) == 0.88


def test_a_single_rank_verdict_names_no_rank() -> None:
    state = RunState()
    fold(state, T0 + 2, snapshot(world=1), batch(0, 1, 1, 20, peak=0.88))
    verdict = state.summary().verdict
    assert verdict.headline.startswith("peak 88% of device memory")
    assert [r.label for r in verdict.reasons] == ["data wait", "peak memory"]


def test_stragglers_by_data_wait_and_by_lag() -> None:
    spread = RankSpread(step_time_s=0.1, data_wait_s=0.005, lead_step=500)
    fine = StepStats(50, 0.1, 0.01, 320.0, 10.0)
    assert spread.straggler(fine, 499) == ""
    assert spread.straggler(StepStats(50, 0.1, 0.04, 320.0, 10.0), 500) == "straggler: data"
    assert spread.straggler(fine, 470) == "30 steps behind"  # 3 s of steps
    assert spread.straggler(StepStats(50, 0.125, 0.0, 256.0, 8.0), 500) == "straggler 1.2x"


def test_a_rank_that_stops_reporting_goes_silent_and_comes_first() -> None:
    state = four_ranks()
    for k in range(1, 5):  # ranks 0, 1 and 3 go on; rank 2 said nothing since T0 + 2
        fold(state, T0 + 2 + k, batch(0, 1 + k, 20 + k, 20 + k), batch(1, 1 + k, 20 + k, 20 + k),
             batch(3, 1 + k, 20 + k, 20 + k, peak=0.88))  # fmt: skip
    summary = state.summary()
    assert summary.silent == (2,)
    first = summary.worst_first[0]
    assert first.rank == 2 and first.silent and round(first.age_s) == 4
    assert not first.straggler, "a silent rank is not compared"
    assert summary.stragglers == ()


def test_a_listed_rank_that_never_reports_goes_silent() -> None:
    state = RunState()
    fold(state, T0, snapshot())
    fold(state, T0 + 1, batch(0, 1, 1, 10), batch(1, 1, 1, 10), batch(2, 1, 1, 10))
    assert state.summary().silent == ()
    fold(state, T0 + 4, batch(0, 2, 11, 12), batch(1, 2, 11, 12), batch(2, 2, 11, 12))
    summary = state.summary()
    assert summary.silent == (3,)
    assert not summary.worst_first[0].reported and summary.worst_first[0].rank == 3


def test_another_ranks_snapshot_adds_its_history_and_config_only() -> None:
    state = four_ranks()
    history = [StepRecord(s, T0 + s * 0.1, 0.1, 0.0, 32, 1) for s in range(21, 30)]
    info = RunInfo(run="r", pid=2, host="h", started=T0, rank=1, world_size=4)
    other = Snapshot(info=info, control=control(num_workers=6), control_seq=3, steps=history)
    fold(state, T0 + 3, other)
    assert state.info is not None and state.info.rank == 0, "still rank 0's run"
    assert state.knob_value("num_workers") == 2, "the config is rank 0's"
    assert state.series[1].last_step == 29
    summary = state.summary()
    assert {r.rank: r.config_differs for r in summary.ranks}[1]


# --------------------------------------------------------------------------- the table


def text_of(pilot: Pilot[Any], selector: str) -> str:
    rendered = pilot.app.screen.query_one(selector).render()
    return str(getattr(rendered, "plain", rendered))


def rows(pilot: Pilot[Any]) -> list[list[str]]:
    """The table's rows, column by column (the order they are ranked in), split into cells."""
    table = text_of(pilot, "#ranks").splitlines()
    start = next(i for i, line in enumerate(table) if line.lstrip().startswith("rank ")) + 1
    lines = [line for line in table[start:] if not line.startswith("+")]
    step = ROW_WIDTH + COLUMN_GAP
    columns = max(len(line) for line in lines) // step + 1
    return [line[c * step : (c + 1) * step].split() for c in range(columns) for line in lines
            if line[c * step : (c + 1) * step].strip()]  # fmt: skip


def test_eight_ranks_full_width() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        table = rows(pilot)
        assert [r[0] for r in table] == ["5", "6", "0", "4", "2", "1", "7", "3"]
        assert table[0][-2:] == ["straggler:", "data"] and table[0][4] == "38%"
        assert table[1][-2:] == ["nearest", "OOM"] and table[1][5] == "88%"
        assert "+" not in text_of(pilot, "#ranks"), "all eight fit at full width"
        aggregate = "8 ranks · median 449.9 ms/step · wait 2% · peak 69-88%"
        assert aggregate in text_of(pilot, "#ranks")
        verdict = text_of(pilot, "#verdict")
        assert "rank 6: peak 88%, 85-90% edge band" in verdict
        assert "rank 5: data wait 38%" in verdict and "rank 6: peak memory 88%" in verdict
        assert pilot.app.screen.query_one("#memory").border_title == "memory · rank 6"
        assert "applied  step 1200  on 8/8 ranks  num_workers 4 → 6" in text_of(pilot, "#changes")

    run(replay_app(RANKS_8), check, WIDE)


def test_eight_ranks_in_a_side_pane_fold_to_the_worst_four() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        table = text_of(pilot, "#ranks").splitlines()
        assert [r[0] for r in rows(pilot)] == ["5", "6", "0", "4"]
        assert table[-1] == "+4 more: step time ±0% of median, wait ≤ 2%, peak ≤ 72%"
        text = screen_text(pilot.app)
        lines = text.splitlines()
        assert len(lines) == 50 and all(len(line) <= 60 for line in lines)
        assert "q quit" in lines[-1] and "applied  step 1200" in text, "it all fits: no scrolling"
        assert pilot.app.screen.query_one("#ranks").region.width == 60

    run(replay_app(RANKS_8), check, NARROW)


def test_a_dead_ranks_row_goes_stale(tmp_path: Path) -> None:
    recording = read_recording(RANKS_8)
    path = tmp_path / "rank7-dies.mtrec"
    kept = [f for f in recording.frames if not (f.rank == 7 and f.offset_s > 8.0)]  # dies 8 s in
    with RecordingWriter(path, recording.header) as writer:
        for frame in kept:
            writer.write(frame.offset_s, frame.rank, frame.frame)

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        state = app.state
        end = recording.header.started + kept[-1].offset_s
        # the replay's clock runs on to its end (20 s) once every frame is folded: under load
        # the last folds can trail the caught-up flag, so wait for the clock, do not sample it.
        # Rank 7's age is 12 s at most: a rank is stamped with the clock of the poll that
        # delivered its frame, and under two CPU hogs one poll of this 10x replay spanned 3.5 s
        # of the recording (rank 7 read 8.5 s); silent is what the row shows
        await until(
            pilot,
            lambda: (
                state.clock >= end
                and state.refresh_summary().worst_first[0].age_s >= SILENT_AFTER_S
            ),
            40,
            "the replay's end, rank 7 silent since 8 s in",
        )
        app.refresh_view()
        await pilot.pause()
        first = rows(pilot)[0]
        assert first[0] == "7" and first[-4:-2] == ["no", "data"], first
        assert "rank 7 silent" in text_of(pilot, "#header")
        assert state.connection.status is Status.LIVE, "the other ranks still report"

    # at 10x real time: a replay at once would deliver every rank's frames in the same instant
    app = MemtuiApp(ReplaySource(path, speed=10.0))
    run(app, check, NARROW)


def test_a_single_rank_run_has_no_table() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        screen = pilot.app.screen
        assert not screen.has_class("multirank")
        assert not screen.query_one("#ranks").display
        assert "ranks, worst first" not in screen_text(pilot.app)

    run(replay_app(STARVING, until_s=10), check, NARROW)


def test_memory_stats_fraction_is_what_the_table_shows() -> None:
    stats = MemoryStats("cuda", 10 * GIB, GIB, 8 * GIB, 8 * GIB, GIB, 0, 9 * GIB, 0, 0)
    assert round(stats.peak_used_fraction, 2) == 0.9  # 8 reserved + 1 beyond torch
