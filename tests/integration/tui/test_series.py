"""The step time chart: its scale follows the data, not one slow column, and a bar above zero
is always drawn."""

from __future__ import annotations

from rich.style import Style

from memtui.tui.charts import nice_ceiling, stacked_rows
from memtui.tui.widgets.series import step_axis_top


def test_a_warm_up_spike_does_not_set_the_scale() -> None:
    """A 400 ms first second must not keep a 500 ms axis over 60 ms steps."""
    columns: list[float | None] = [None] * 10 + [0.4] + [0.06] * 40
    assert nice_ceiling(step_axis_top(columns)) == 0.1


def test_the_scale_follows_steps_that_got_slower() -> None:
    columns: list[float | None] = [0.06] * 40 + [0.3] * 5
    assert nice_ceiling(step_axis_top(columns)) == 0.5


def test_a_slow_stretch_of_the_history_keeps_its_scale() -> None:
    """Starving for 30 s, then fast: the old steps stay on the chart to compare with."""
    columns: list[float | None] = [0.17] * 30 + [0.06] * 20
    assert nice_ceiling(step_axis_top(columns)) == 0.2
    assert step_axis_top([None, None]) == 0.0


def test_a_bar_above_zero_is_never_blank() -> None:
    """30 ms steps (3 ms of data wait) on a 500 ms axis of one row round to no eighth: the
    lowest block is drawn, in the colour of the part that takes most of the step (compute)."""
    wait, compute = Style(color="red"), Style(color="green")
    steps = [(0.003, wait), (0.03, compute)]
    (row,) = stacked_rows([steps, None, [(0.0, wait), (0.0, compute)]], 1, 0.5)
    assert row.plain == "▁  ", "a column without steps (or of zero) stays blank"
    style = row.spans[0].style
    assert isinstance(style, Style) and style.color == compute.color
    top, bottom = stacked_rows([steps], 2, 0.5)  # only the bottom row gets the floor
    assert (top.plain, bottom.plain) == (" ", "▁")
    waiting = [(0.02, wait), (0.025, compute)]  # mostly data wait: the data wait's colour
    (row,) = stacked_rows([waiting], 1, 0.5)
    style = row.spans[0].style
    assert row.plain == "▁" and isinstance(style, Style) and style.color == wait.color


def test_a_step_that_ends_in_the_cell_its_data_wait_starts_is_drawn() -> None:
    """30 ms steps with 3.6 ms of data wait under a 100 ms row: the wait rounds to no eighth,
    and the compute above it ends in the same cell (2 eighths), which was drawn blank."""
    wait, compute = Style(color="red"), Style(color="green")
    top, bottom = stacked_rows([[(0.0036, wait), (0.03, compute)]], 2, 0.2)
    assert (top.plain, bottom.plain) == (" ", "▂")
    style = bottom.spans[0].style
    assert isinstance(style, Style) and style.color == compute.color and style.bgcolor is None
    top, _bottom = stacked_rows([[(0.102, wait), (0.13, compute)]], 2, 0.2)  # an upper row too
    assert top.plain == "▂"
