"""The change log reads without the docs: each row says who acted (you, another shell, the
autopilot, the run), a knob the run had not set reads as its default, a prediction stands next
to what was measured, and the memory predictions' accuracy sits under the rows in words."""

from __future__ import annotations

import dataclasses

from memtui.advice.autopilot import AUTOPILOT
from memtui.runs.events import RUN, VIEWER, Notice
from memtui.runs.receiver import describe_reply
from memtui.runs.state import RunState, ViewOptions, who_is
from memtui.transport.client import client_name
from memtui.tui.widgets.changelog import change_lines
from memtui.wire import (
    AppliedChange,
    AutopilotState,
    CancelledChange,
    CheckpointRecord,
    ControlState,
    Effect,
    KnobDiff,
    Knobs,
    PendingChange,
    RunInfo,
    SetReply,
    SetRequest,
    Snapshot,
    Telemetry,
)
from tests.unit.tui.test_state import T0, fold

MIB = 1 << 20
CONFIG = Knobs(batch_size=16, grad_accum=2, num_workers=2, pin_memory=False)
TUNABLE = ["batch_size", "grad_accum", "num_workers", "pin_memory", "prefetch_factor"]


def lines_of(state: RunState, limit: int = 40) -> list[str]:
    """The change log's lines, wide, as plain text."""
    return [line.plain for line in change_lines(state, ViewOptions(), limit)]


def attached(control: ControlState) -> RunState:
    """A viewer's state attached to a run whose control state is ``control``."""
    state = RunState()
    info = RunInfo(run="r1", pid=1, host="h", started=T0)
    fold(state, Snapshot(info=info, control=control, step=100, control_seq=1))
    return state


def test_who_is_names_this_viewer_another_shell_another_viewer_and_the_autopilot() -> None:
    assert who_is(client_name("tui")) == "you"
    assert who_is("cli:ann@box:4242") == "another shell"
    assert who_is("tui:ann@box:4242") == "another viewer"
    assert who_is(AUTOPILOT) == "the autopilot"
    assert who_is("") == ""


def test_each_row_says_who_acted_and_the_run_exiting_is_not_labelled_you() -> None:
    """Two changes queued, one from this viewer, one from a shell, land; the autopilot's trial
    waits with its reason; a shell cancels a change; then the demo training exits."""
    mine = PendingChange(1, {"num_workers": 4}, {"num_workers": 4}, T0, 40,
                         client=client_name("tui"))  # fmt: skip
    shell = PendingChange(2, {"batch_size": 32}, {"batch_size": 32}, T0, 40,
                          client="cli:ann@box:4242")  # fmt: skip
    state = attached(ControlState(config=CONFIG, tunable=TUNABLE, pending=[mine, shell]))
    lines = lines_of(state)
    assert any("#1 num_workers=4" in line and "by you" in line for line in lines), lines
    assert any("#2 batch_size=32" in line and "from another shell" in line for line in lines)

    trial = PendingChange(3, {"prefetch_factor": 4}, {"prefetch_factor": 4}, T0 + 2, 90,
                          client=AUTOPILOT, origin=AUTOPILOT)  # fmt: skip
    why = "31% of each step waits for data: prefetch_factor 2 -> 4"
    pilot = AutopilotState(mode="on", phase="trying", why=why, trying={"prefetch_factor": 4})
    landed = [
        AppliedChange([1], 50, T0 + 1, {"num_workers": KnobDiff(2, 4)}),
        AppliedChange([2], 50, T0 + 1, {"batch_size": KnobDiff(16, 32)}),
        AppliedChange([9], 60, T0 + 1.5, {"prefetch_factor": KnobDiff(None, 2)}),
    ]
    gone = CancelledChange(4, {"num_workers": 1}, T0 + 1.6, 70, client="cli:ann@box:4242")
    later = ControlState(config=CONFIG, tunable=TUNABLE, pending=[trial], applied=landed,
                         cancelled=[gone], autopilot=pilot)  # fmt: skip
    fold(state, Telemetry(run="r1", rank=0, seq=1, time=T0 + 3, step=100, control=later,
                          control_seq=2))  # fmt: skip
    state.add_notice(Notice(True, "the demo training exited with status 0", T0 + 4, RUN))
    lines = lines_of(state)
    text = "\n".join(lines)
    assert any(line.startswith("pending  #3 prefetch_factor=4") for line in lines), text
    assert "by the autopilot" in text and f"({why})" in text, "its row says why"
    assert "num_workers 2 → 4  #1  by you" in text
    assert "batch_size 16 → 32  #2  from another shell" in text
    assert "prefetch_factor default → 2  #9  by an operator" in text, "queued before we looked"
    assert "#4 num_workers=1  from another shell" in text
    assert "run      the demo training exited with status 0" in text
    assert not [line for line in lines if line.startswith("you ")], "the user did not do that"
    state.add_notice(Notice(False, "receiver error: boom", T0 + 5, VIEWER))
    assert lines_of(state)[1].startswith("viewer   receiver error: boom")


def test_a_change_this_viewer_queued_is_its_own_when_it_lands_before_it_was_seen_pending() -> None:
    """The run answered ``queued #5`` and applied #5 at a checkpoint before the next telemetry
    (a run that checkpoints every second): the change log says ``by you``, not ``by an
    operator``; a change queued elsewhere and never seen pending stays an operator's."""
    state = attached(ControlState(config=CONFIG, tunable=TUNABLE))
    request = SetRequest(changes={"num_workers": 4}, client=client_name("tui"))
    told = describe_reply(request, SetReply(ok=True, id=5, changes={"num_workers": 4}))
    assert told == Notice(True, "queued #5: num_workers=4", queued=5)
    state.add_notice(dataclasses.replace(told, time=T0 + 1))
    landed = [
        AppliedChange([5], 50, T0 + 1.2, {"num_workers": KnobDiff(2, 4)}),
        AppliedChange([6], 100, T0 + 2.2, {"pin_memory": KnobDiff(False, True)}),
    ]
    later = ControlState(config=CONFIG, tunable=TUNABLE, applied=landed)
    fold(state, Telemetry(run="r1", rank=0, seq=1, time=T0 + 3, step=120, control=later,
                          control_seq=2))  # fmt: skip
    text = "\n".join(lines_of(state))
    assert "num_workers 2 → 4  #5  by you" in text, text
    assert "pin_memory false → true  #6  by an operator" in text, text


def test_c_with_nothing_pending_says_that_this_viewers_change_landed_and_how_to_undo_it() -> None:
    """A run that checkpoints every second applies a change before ``c`` can cancel it: ``c``
    says so, with the step, the run's pace and the way back."""
    from memtui.tui.app import nothing_to_cancel

    state = attached(ControlState(config=CONFIG, tunable=TUNABLE))
    assert nothing_to_cancel(state) == "no change is pending"
    state.add_notice(Notice(True, "queued #5: num_workers=4", T0 + 1, queued=5))
    landed = [AppliedChange([5], 1250, T0 + 1.2, {"num_workers": KnobDiff(2, 4)})]
    marks = [CheckpointRecord(1200 + 50 * i, T0 + 0.2 + i, 0.01) for i in range(3)]
    fold(state, Telemetry(run="r1", rank=0, seq=1, time=T0 + 3, step=1300, checkpoints=marks,
                          control=ControlState(config=CONFIG, tunable=TUNABLE, applied=landed),
                          control_seq=2))  # fmt: skip
    assert nothing_to_cancel(state) == (
        "no change is pending: your #5 landed at step 1,250 (a checkpoint comes every 1.0 s "
        "here); to undo it, queue the old value again"
    )


def test_a_prediction_reads_next_to_the_measurement_and_the_accuracy_sits_under_the_rows() -> None:
    effect = Effect(20, 20, 100.0, 333.0, 0.3, 0.09, 0.2, 0.01, 400 * MIB, 420 * MIB, 0.06)
    applied = AppliedChange([1], 50, T0 + 1, {"num_workers": KnobDiff(0, 2)},
                            predicted_peak_bytes=430 * MIB, observed_peak_bytes=420 * MIB,
                            effect=effect, predicted_speed_delta=1.18,
                            speed_note="loading ...")  # fmt: skip
    many = [
        AppliedChange([i], 50 + i, T0 + 1 + i, {"num_workers": KnobDiff(2, 2 + i)})
        for i in range(2, 30)
    ]
    state = attached(ControlState(config=CONFIG, tunable=TUNABLE, applied=[applied]))
    lines = lines_of(state)
    assert "+233% +-6% samples/s (predicted +118%)" in lines[1], lines
    assert "peak 400 MiB → 420 MiB (predicted 430 MiB, 2% high)" in lines[1]
    assert lines[-1] == (
        "memory predictions off by 2.4% on average over 1 change (aim: under 10%)"
    ), "the last line, in words"
    assert not [line for line in lines if "pts" in line or "mean error" in line], lines
    crowded = attached(ControlState(config=CONFIG, tunable=TUNABLE, applied=[applied, *many]))
    shown = lines_of(crowded, limit=8)
    assert len(shown) == 8 and shown[-1].startswith("memory predictions off by 2.4%"), shown


def test_a_change_that_cannot_act_reads_why_instead_of_an_effect() -> None:
    """Pinning on a run without an accelerator: no effect to wait for, and the row says why."""
    note = "pin_memory does nothing without an accelerator: its effect is not measured"
    applied = AppliedChange([1], 50, T0 + 1, {"pin_memory": KnobDiff(False, True)},
                            effect_note=note)  # fmt: skip
    lines = lines_of(attached(ControlState(config=CONFIG, tunable=TUNABLE, applied=[applied])))
    assert any(note in line for line in lines), lines
    assert not any("measuring the effect" in line for line in lines), lines
