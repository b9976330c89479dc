"""The config panel says which knobs a run takes, why it cannot take the others (with their
values where the run holds them), and where the changes it takes apply."""

from __future__ import annotations

from rich.text import Text

from memtui.runs.events import ReceivedBatch
from memtui.runs.state import ViewOptions
from memtui.tui.widgets.config import ConfigPanel
from memtui.wire import ControlState, Knobs, StepRecord, Telemetry
from tests.unit.tui.test_changelog import T0, attached

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
    assert lines[1].split()[:2] == ["batch_size", "?"], "not known yet: no step measured it"
    assert "changes apply at the training DataLoader's next epoch" in lines
    assert f"not tunable: batch_size, grad_accum: {WHY}" in lines


def test_a_run_with_every_knob_says_nothing_more() -> None:
    control = ControlState(
        config=Knobs(batch_size=8, grad_accum=1, num_workers=0, pin_memory=False),
        tunable=["batch_size", "grad_accum", "num_workers", "pin_memory", "prefetch_factor"],
    )
    text = panel_text(control)
    assert "not tunable" not in text and "changes apply at" not in text


def test_knobs_the_run_holds_but_memtui_cannot_change_show_their_values() -> None:
    """A loader over a stream (memtui keeps its 4 workers), a batch of 4 read from it and an
    accumulation of 2 measured from the steps: values, not ``n/a``; prefetch_factor is tunable
    with 4 workers (a worker count read is not 0); the effective batch is 4 x 2 x 1."""
    control = ControlState(
        config=Knobs(pin_memory=True, prefetch_factor=2),
        tunable=["pin_memory", "prefetch_factor"],
        untunable={"batch_size": WHY, "grad_accum": WHY, "num_workers": "a stream"},
        untunable_values={"batch_size": 4, "num_workers": 4},
    )
    state = attached(control)
    steps = [StepRecord(s, T0 + s, 0.1, 0.01, 8, 2) for s in range(101, 121)]
    batch = Telemetry(run="r1", rank=0, seq=1, time=T0 + 20, step=120, steps=steps, control_seq=1)
    state.apply(ReceivedBatch(events=[batch], clock=T0 + 20))
    rendered = ConfigPanel().build(state, ViewOptions(), 60)
    assert isinstance(rendered, Text)
    rows = {line.split()[0]: line.split()[1:] for line in rendered.plain.splitlines()[1:6]}
    assert rows["batch_size"] == ["4"]
    assert rows["grad_accum"] == ["2", "measured"]
    assert rows["num_workers"] == ["4"]
    assert rows["prefetch_factor"] == ["2", "P"]
    assert "effective batch 8 = 4 x 2 x 1 ranks" in rendered.plain
    assert state.effective_batch() == 8
