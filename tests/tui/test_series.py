"""The step time chart's scale: it follows the data, not one slow column."""

from __future__ import annotations

from memtui.tui.charts import nice_ceiling
from memtui.tui.widgets.series import step_axis_top


def test_a_warm_up_spike_does_not_set_the_scale() -> None:
    """Issue 16: a 400 ms first second kept a 500 ms axis over 60 ms steps."""
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
