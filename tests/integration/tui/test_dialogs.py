"""The dialogs in a side pane (60 columns) and on a wide screen: drawn whole, the help wrapped
under each entry's own text, and the cancel dialog following the run's pending changes."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from textual.pilot import Pilot
from textual.widgets import OptionList

from memtui.runs.events import ReceivedBatch
from memtui.transport.recording import read_recording
from memtui.tui.app import MemtuiApp
from memtui.tui.screens.cancel import CancelScreen
from memtui.tui.screens.help import KEYS, HelpScreen
from memtui.wire import CancelledChange, ControlState, Decoder, Telemetry
from tests.integration.tui.test_app_replay import NARROW, WIDE
from tests.support.viewer import OOM, STARVING, pending_offset, replay_app, run, screen_text, settle
from tests.support.viewer import until as until_true

DIALOG_KEYS = {"editor": ["w"], "cancel": ["c"], "advice": ["O"], "help": ["question_mark"]}
"""The keys that open each dialog on the main screen."""


@pytest.mark.parametrize("size", [NARROW, WIDE], ids=["60x50", "120x40"])
def test_every_dialog_is_drawn_whole_with_its_borders(size: tuple[int, int]) -> None:
    """The editor, cancel, advice and help dialogs fit the screen: their four borders drawn
    (a side pane lost the right one when the viewer took itself for 80 columns wide)."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        for name, keys in DIALOG_KEYS.items():
            await pilot.press(*keys)
            await until_true(pilot, lambda: len(app.screen_stack) == 2, 10, f"the {name}")
            await pilot.pause()
            dialog = app.screen.query_one("#dialog").region
            assert dialog.x >= 0 and dialog.right <= size[0], f"{name}: {dialog}"
            rows = screen_text(app).splitlines()
            for y in range(dialog.y, dialog.bottom):
                edges = rows[y][dialog.x], rows[y][dialog.right - 1]
                assert set(edges) <= set("█▀▄"), f"{name}, row {y}: {edges}\n" + "\n".join(rows)
            await pilot.press("escape")
            await until_true(pilot, lambda: len(app.screen_stack) == 1, 10, f"{name} closed")

    run(replay_app(OOM), check, size)


def test_the_help_wraps_each_entry_under_its_own_text_at_60_columns() -> None:
    """At 60 columns a key's description goes on under the description, not under the key
    column; a rule's under the rule, not under its label; no line is wider than the dialog."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("question_mark")
        app = pilot.app
        await until_true(pilot, lambda: isinstance(app.screen, HelpScreen), 10, "the help")
        widget = app.screen.query_one("#help-text")
        await until_true(pilot, lambda: getattr(widget, "wrapped_to", 0) > 0, 10, "the wrap")
        await pilot.pause()
        width = widget.content_size.width
        assert width < 60
        lines = str(widget.render()).splitlines()
        assert max(len(line) for line in lines) <= width
        keys = lines[1 : lines.index("Changes") - 1]
        assert len(keys) > len(KEYS), "no description was wrapped"
        starts = [line for line in keys if not line.startswith(" " * 10)]
        assert [line.split()[0] for line in starts] == [key.split()[0] for key, _ in KEYS]
        assert all(line.startswith("  ") and line[2] != " " for line in starts)
        verdict = lines[lines.index("Changes") :]
        oom = next(i for i, line in enumerate(verdict) if line.startswith("  OOM RISK "))
        assert verdict[oom + 1].startswith(" " * 17) and verdict[oom + 1][17] != " ", verdict

    run(replay_app(OOM), check, NARROW)


def telemetry(app: MemtuiApp, control: ControlState) -> Telemetry:
    """A batch of the control rank carrying ``control`` as its newest control state."""
    state = app.state
    assert state.info is not None
    series = state.series[state.info.rank]
    return Telemetry(
        run=state.info.run, rank=state.info.rank, seq=series.last_seq + 1, time=state.clock,
        step=state.step, control=control, control_seq=state.control_seq + 1,
    )  # fmt: skip


def fold(app: MemtuiApp, *batches: Any) -> None:
    """Hand ``batches`` to the app as the receiver does."""
    app.inbox.put(ReceivedBatch(list(batches), app.state.clock))
    app._post_update()


def later_frames() -> tuple[list[Any], ControlState]:
    """The starving recording's messages after the pending offset, up to the batch whose
    control state has num_workers=4 applied; and that state."""
    decoder = Decoder()
    offset = pending_offset()
    messages = []
    for frame in read_recording(STARVING).frames:
        if frame.offset_s <= offset:
            continue
        message = decoder.decode(frame.frame)
        messages.append(message)
        control = getattr(message, "control", None)
        if control is not None and not control.pending and control.applied:
            return messages, control
    raise AssertionError("the change is never applied in the recording")


async def open_cancel(pilot: Pilot[Any], listed: int) -> CancelScreen:
    """Press c; the cancel dialog, once it lists ``listed`` options."""
    await pilot.press("c")
    app = pilot.app
    await until_true(pilot, lambda: isinstance(app.screen, CancelScreen), 10, "the dialog")
    screen = app.screen
    assert isinstance(screen, CancelScreen)
    options = screen.query_one(OptionList)
    await until_true(pilot, lambda: options.option_count == listed, 10, "its options")
    return screen


def test_the_cancel_dialog_closes_when_its_change_was_applied_meanwhile() -> None:
    """num_workers=4 pending, c: the dialog lists it; the run applies it at its checkpoint
    while the dialog is open: the dialog closes and says what happened to it."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, MemtuiApp)
        await open_cancel(pilot, 1)
        messages, applied = later_frames()
        fold(app, *messages)
        step = next(a.step for a in applied.applied if 1 in a.ids)
        await until_true(pilot, lambda: len(app.screen_stack) == 1, 10, "the dialog closed")
        told = [n.message for n in app._notifications]
        assert f"#1 num_workers=4 was applied at step {step:,} meanwhile: nothing left to " \
            "cancel" in told, told  # fmt: skip

    run(replay_app(STARVING, until_s=pending_offset()), check, NARROW)


def test_the_cancel_dialog_lists_what_is_still_pending_and_says_what_went() -> None:
    """Two changes pending, c: both and "all 2" listed; one applied meanwhile: the dialog
    lists the other only and says the first was applied; it cancelled from another shell:
    the dialog closes, saying so."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, MemtuiApp)
        first_state = app.state.control
        assert first_state is not None and [c.id for c in first_state.pending] == [1]
        first = first_state.pending[0]
        second = msgspec.structs.replace(
            first, id=2, changes={"batch_size": 8}, requested={"batch_size": 8}
        )
        fold(app, telemetry(app, msgspec.structs.replace(first_state, pending=[first, second])))
        screen = await open_cancel(pilot, 3)  # #2, #1 and all 2
        assert "all 2 pending changes" in screen_text(app)
        _messages, applied = later_frames()
        fold(app, telemetry(app, msgspec.structs.replace(applied, pending=[second])))
        options = screen.query_one(OptionList)
        await until_true(pilot, lambda: options.option_count == 1, 10, "#1 taken off")
        await pilot.pause()
        text = " ".join(screen_text(app).split())
        assert "#2 batch_size=8" in text and "#1 num_workers=4 (queued" not in text, text
        step = next(a.step for a in applied.applied if 1 in a.ids)
        assert f"#1 num_workers=4 was applied at step {step:,} meanwhile" in text, text
        assert isinstance(app.screen, CancelScreen)
        cancelled = CancelledChange(2, second.changes, app.state.clock, step, "cli:4242")
        fold(app, telemetry(app, msgspec.structs.replace(applied, cancelled=[cancelled])))
        await until_true(pilot, lambda: len(app.screen_stack) == 1, 10, "the dialog closed")
        told = [n.message for n in app._notifications]
        assert "#2 batch_size=8 was cancelled by cli:4242 meanwhile: nothing left to cancel" in (
            told
        ), told

    run(replay_app(STARVING, until_s=pending_offset()), check, NARROW)
