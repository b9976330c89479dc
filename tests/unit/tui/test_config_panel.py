"""The config panel says which knobs a run takes, why it cannot take the others, and where the
changes it takes apply."""

from __future__ import annotations

from rich.text import Text

from memtui.runs.state import ViewOptions
from memtui.tui.widgets.config import ConfigPanel
from memtui.wire import ControlState, Knobs
from tests.unit.tui.test_changelog import attached

WHY = "memtui run cannot change a plain loop's batch size or accumulation: the loop's own code sets them"


def panel_text(control: ControlState) -> str:
    """The panel's text for a run whose control state is ``control``, 60 columns wide."""
    rendered = ConfigPanel().build(attached(control), ViewOptions(), 60)
    assert isinstance(rendered, Text)
    return rendered.plain


def test_a_watched_loop_shows_its_worker_knobs_the_reason_for_the_rest_and_its_boundary() -> None:
    control = ControlState(
        config=Knobs(num_workers=0, pin_memory=False, prefetch_factor=2),
        tunable=["num_workers", "pin_memory", "prefetch_factor"],
        untunable={"batch_size": WHY, "grad_accum": WHY},
        boundary="the training DataLoader's next epoch",
    )
    lines = panel_text(control).splitlines()
    assert lines[1].split()[:2] == ["batch_size", "n/a"]
    assert "changes apply at the training DataLoader's next epoch" in lines
    assert f"not tunable: batch_size, grad_accum: {WHY}" in lines


def test_a_run_with_every_knob_says_nothing_more() -> None:
    control = ControlState(
        config=Knobs(batch_size=8, grad_accum=1, num_workers=0, pin_memory=False),
        tunable=["batch_size", "grad_accum", "num_workers", "pin_memory", "prefetch_factor"],
    )
    text = panel_text(control)
    assert "not tunable" not in text and "changes apply at" not in text
