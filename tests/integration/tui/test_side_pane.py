"""The viewer in a side pane (60x50, the narrow layout): the change log right under the config
panel, a change landing (its step, old → new, measured effect) seen without scrolling beside the
verdict, config and memory numbers; every entry wrapped between its parts, never cut."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.geometry import Region
from textual.pilot import Pilot

from memtui.advice.verdict import State
from memtui.transport.sources import ReplaySource
from memtui.tui.app import MemtuiApp
from memtui.tui.charts import to_columns
from memtui.tui.palette import Chip, flow
from memtui.tui.widgets.advice import title_chips
from memtui.tui.widgets.changelog import ChangeLog
from memtui.tui.widgets.series import (
    AXIS,
    NARROW_MAX_ROWS,
    SeriesChart,
    _merge_steps,
    narrow_rows,
)
from tests.integration.tui.test_app_replay import NARROW, WIDE, text_of
from tests.integration.tui.test_snapshots import (
    advice_pending,
    advice_rollback,
    autopilot,
    one_gpu,
    oom_risk,
    ranks_8,
    starving,
    starving_fixed,
)
from tests.support.viewer import ADVICE, STARVING, replay_app, run, screen_text, settle, until

pytestmark = pytest.mark.heavy

APPLIED = "applied  step 300  num_workers 0 → 4"
"""The change landing in demo_starving.mtrec."""
EFFECT = re.compile(r"\+\d+% samples/s, peak \d+ MiB → \d+ MiB")
"""Its measured effect."""


def in_view(pilot: Pilot[Any], selector: str) -> bool:
    """The widget is wholly on the screen, above the footer, with nothing scrolled."""
    screen = pilot.app.screen
    width, height = pilot.app.size
    shown = Region(0, 0, width, height - 1)
    region = screen.query_one(selector).region
    return screen.scroll_y == 0 and bool(region) and shown.contains_region(region)


def test_the_change_landing_is_seen_without_scrolling() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        screen = pilot.app.screen
        assert screen.max_scroll_y == 0, screen_text(pilot.app)
        for selector in ("#verdict", "#config", "#changes", "#memory", "#advice", "#charts"):
            assert in_view(pilot, selector), f"{selector} scrolled off\n{screen_text(pilot.app)}"
        changes = screen.query_one("#changes")
        assert changes.region.y == screen.query_one("#config").region.bottom  # right under it
        log = text_of(pilot, "#changes")
        assert APPLIED in log and EFFECT.search(log), log
        shown = screen_text(pilot.app)  # and on the terminal, whole
        assert APPLIED in shown and EFFECT.search(shown), shown

    run(replay_app(STARVING), check, NARROW)


def test_the_change_log_moves_with_the_width() -> None:
    """Wide, under everything; narrow, under the config panel; wide again, back at the bottom:
    the same entries each time, the panel's title kept."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        screen = pilot.app.screen
        side = screen.query_one("#side")
        for size, parent in ((NARROW, side), (WIDE, screen), (NARROW, side)):
            await pilot.resize_terminal(*size)
            await settle(pilot)
            assert len(screen.query(ChangeLog)) == 1
            changes = screen.query_one(ChangeLog)
            assert changes.parent is parent
            assert changes.border_title == "changes"
            assert in_view(pilot, "#changes"), screen_text(pilot.app)
            log = text_of(pilot, "#changes")
            assert APPLIED in log and EFFECT.search(log), log
        advice, charts = screen.query_one("#main-col").children
        assert advice.id == "advice" and charts.id == "charts"  # the charts fill what is left

    run(replay_app(STARVING), check, WIDE)


SCENES = [starving, starving_fixed, oom_risk, one_gpu, ranks_8, advice_pending, advice_rollback]
"""Every recorded stream, at the points the snapshots show."""


@pytest.mark.parametrize("make", SCENES, ids=lambda f: f.__name__)
def test_a_side_pane_fits_and_cuts_nothing(make: Callable[[], MemtuiApp]) -> None:
    """Every panel on the screen at once, no line cut short with an ellipsis."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        text = screen_text(pilot.app)
        assert pilot.app.screen.max_scroll_y == 0, text
        assert in_view(pilot, "#changes") and in_view(pilot, "#charts"), text
        assert not [line for line in text.splitlines() if "…│" in line], text
        charts = pilot.app.screen.query_one(SeriesChart)
        # the charts fill the lines left: the last panel ends on the footer
        assert charts.region.bottom == pilot.app.size[1] - 1, text

    run(make(), check, NARROW)


def chart_rows(lines: list[str], title: str) -> list[str]:
    """The rows of the chart under the line that starts with ``title`` (none if not shown)."""
    at = next((i for i, line in enumerate(lines) if line.startswith(title)), None)
    if at is None:
        return []
    return list(takewhile(lambda line: line[AXIS - 1 : AXIS] in ("┤", "│"), lines[at + 1 :]))


@pytest.mark.parametrize("make", [*SCENES, autopilot], ids=lambda f: f.__name__)
def test_the_chart_the_verdict_is_about_keeps_two_rows_and_draws_every_second(
    make: Callable[[], MemtuiApp],
) -> None:
    """At 60x50, with every recorded scene's change log and recommendations above them, the
    step time chart (the memory chart at OOM RISK) has two rows or more, and every column with
    steps draws at least its lowest block (30 ms steps on a 500 ms axis of one row were drawn
    blank)."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, MemtuiApp)
        text = text_of(pilot, "#charts")
        lines = text.splitlines()
        steps, memory = chart_rows(lines, "step time "), chart_rows(lines, "memory ")
        state = app.state
        oom = state.summary().verdict.state is State.OOM_RISK
        assert len(memory if oom else steps) >= 2, text
        if not steps:
            return
        series = state.series[state.summary().focus_rank]
        chart = app.screen.query_one(SeriesChart)
        columns = to_columns(list(series.step_buckets.buckets), lambda b: b.start, _merge_steps,
                             chart.content_size.width - AXIS, state.clock)  # fmt: skip
        bottom = steps[-1][AXIS:]
        drawn = [v is not None and v[0] > 0 for v in columns.values]
        assert any(drawn)
        assert [cell != " " for cell in bottom] == drawn[: len(bottom)], text

    run(make(), check, NARROW)


def lines(head: str, chips: list[Chip], width: int, indent: str = "  ") -> list[str]:
    return [line.plain for line in flow(Text(head), chips, width, indent)]


def test_flow_breaks_between_chips_and_leaves_out_what_is_optional() -> None:
    chips = [
        Chip(Text("step 300")),
        Chip(Text("num_workers 0 → 4")),
        Chip(Text("#1"), optional=True),
        Chip(Text("(the data loader is rebuilt at the next batch)"), optional=True),
        Chip(Text("+252% samples/s")),
    ]
    assert lines("applied  ", chips, 0) == [
        "applied  step 300  num_workers 0 → 4  #1  (the data loader is rebuilt at the next batch)"
        "  +252% samples/s"
    ]
    assert lines("applied  ", chips, 40) == [
        "applied  step 300  num_workers 0 → 4  #1",
        "  +252% samples/s",
    ]
    assert lines("applied  ", chips, 28) == [
        "applied  step 300",
        "  num_workers 0 → 4  #1",
        "  +252% samples/s",
    ]


def test_flow_breaks_a_chip_too_long_for_a_line_between_its_words() -> None:
    reason = Chip(Text("grad_accum=0: grad_accum must be between 1 and 65536, got 0"))
    out = lines("rejected ", [Chip(Text("step 162")), reason], 30, " " * 9)
    assert out == [
        "rejected step 162",
        "         grad_accum=0:",
        "         grad_accum must be",
        "         between 1 and 65536,",
        "         got 0",
    ]
    assert " ".join(line.strip() for line in out) == (
        "rejected step 162 grad_accum=0: grad_accum must be between 1 and 65536, got 0"
    )


def test_a_long_recommendation_keeps_its_changes_whole() -> None:
    title = "bigger micro-batch: batch_size 16 -> 32, grad_accum 2 -> 1"
    short = [chip.text.plain for chip in title_chips(title, 45)]
    assert short == ["batch_size 16 -> 32,", "grad_accum 2 -> 1"]  # the changes say it
    whole = [chip.text.plain for chip in title_chips(title, 80)]
    assert whole == ["bigger micro-batch:", "batch_size 16 -> 32,", "grad_accum 2 -> 1"]
    grows = "bigger micro-batch: batch_size 4 -> 8 (the effective batch grows)"
    parts = [chip.text.plain for chip in title_chips(grows, 30)]  # too long either way
    assert parts == ["bigger micro-batch:", "batch_size 4 -> 8", "(the effective batch grows)"]


def test_the_charts_share_the_lines_left_the_step_time_first() -> None:
    """Both charts from 6 lines (2 rows each under their titles, the step time's the odd row);
    fewer, one chart alone takes them, the step time or, at OOM RISK, the memory chart (a
    60x50 pane with a long change log and the autopilot's line had a step time chart of one
    row, and a memory chart cut off)."""
    assert narrow_rows(6, host=False) == (2, 2, False)
    assert narrow_rows(7, host=False) == (3, 2, False)  # the step time gets the odd row
    assert narrow_rows(7, host=True) == (3, 2, False)  # no room for the host chart
    assert narrow_rows(12, host=True) == (4, 3, True)
    assert narrow_rows(5, host=False) == (4, 0, False)  # the step time chart alone
    assert narrow_rows(3, host=False) == (2, 0, False)
    assert narrow_rows(5, host=False, memory_first=True) == (0, 4, False)  # at OOM RISK
    assert narrow_rows(0, host=False) == (1, 0, False)  # the least: a row
    most = narrow_rows(100, host=False)
    assert most == (*NARROW_MAX_ROWS, True)  # a tall pane: room for the host chart too


@dataclass
class Frame:
    """One frame the viewer sent to the terminal, as the side pane showed it."""

    scrollbar: bool
    overflow: int
    text: str


@pytest.mark.parametrize("path", [STARVING, ADVICE], ids=lambda p: p.stem)
def test_a_long_replay_at_60x50_never_overflows_or_cuts_the_footer(path: Path) -> None:
    """Every frame painted while a recording plays at 4x (the verdict's text changing length
    as the run goes): no scrollbar, nothing below the screen, all 60 columns and the whole
    footer."""
    app = MemtuiApp(ReplaySource(path, speed=4.0, at_end="hold"))
    frames: list[Frame] = []
    display = app._display

    def checked(screen: Any, renderable: Any) -> None:
        display(screen, renderable)
        if renderable is not None and not app._batch_count and screen is app.screen:
            overflow = screen.max_scroll_y
            frames.append(Frame(screen.show_vertical_scrollbar, overflow, screen_text(app)))

    app._display = checked  # type: ignore[method-assign]

    async def check(pilot: Pilot[Any]) -> None:
        await until(pilot, lambda: app.caught_up, 60, "the replay to end")
        await pilot.pause(0.5)

    run(app, check, NARROW)
    # from the first frame that shows the run (before it, the screen is being put together)
    shown = [i for i, frame in enumerate(frames) if "step " in frame.text.split("╭")[0]]
    frames = frames[shown[0] :] if shown else []
    # (4 Hz: ~25 frames on a quiet machine; under a load of 10 on 2 cores the viewer coalesced
    # its repaints into 4, as it should when it falls behind)
    assert len(frames) >= 3, "the replay was drawn frame by frame, not only at its end"
    footer = frames[-1].text.splitlines()[-1].rstrip()
    assert footer.endswith("q quit"), footer
    for index, frame in enumerate(frames):
        lines = frame.text.splitlines()
        where = f"frame {index} of {len(frames)}\n{frame.text}"
        assert not frame.scrollbar and frame.overflow == 0, where
        assert len(lines) == NARROW[1] and lines[-1].rstrip() == footer, where


def test_the_footer_shows_o_and_g_where_they_fit() -> None:
    """Wide, o and g are in the footer; at 60 columns there is room for the others only (the
    help lists every key), and the footer is whole; the width changing recomposes it."""

    async def check(pilot: Pilot[Any]) -> None:
        for size in (WIDE, NARROW, WIDE):
            await pilot.resize_terminal(*size)
            await settle(pilot)
            footer = screen_text(pilot.app).splitlines()[-1].rstrip()
            wide = size == WIDE
            assert ("o queue advice  g GPUs" in footer) == wide, footer
            assert footer.endswith("^p palette" if wide else "␣ pause  ? help  q quit"), footer

    run(replay_app(STARVING), check, NARROW)
