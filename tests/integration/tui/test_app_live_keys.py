"""The app's keys against a real hook in a subprocess (real zmq): keys typed ahead in one burst,
cancel, pause, a run that goes quiet and comes back, the command palette, and how soon the
history shows."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from textual import events
from textual.command import CommandPalette
from textual.pilot import Pilot

from memtui.runs.events import Status
from memtui.tui.app import MemtuiApp
from memtui.tui.screens.cancel import CancelScreen
from memtui.tui.screens.edit import EditKnobScreen
from tests.integration.tui.test_app_live import live_app
from tests.integration.tui.test_app_replay import NARROW, WIDE, text_of
from tests.support.cli import status_json
from tests.support.clock import patience
from tests.support.viewer import HookLoop, run, screen_text, until

pytestmark = pytest.mark.heavy

NEVER = 10**9
"""A checkpoint interval the run never reaches: a queued change stays pending."""


async def status(run_id: str) -> dict[str, Any]:
    """``memtui status --json``: the run's own answer over its control socket (by click in this
    process: a few ms with the app held, where a subprocess took a third of a CPU-second)."""
    return status_json(run_id)


def shown_step(pilot: Pilot[Any]) -> int:
    """The step the header shows."""
    match = re.search(r"step ([\d,]+)", text_of(pilot, "#header"))
    assert match, screen_text(pilot.app)
    return int(match.group(1).replace(",", ""))


def type_ahead(app: MemtuiApp, *keys: str) -> None:
    """Send ``keys`` as a terminal's driver does for a burst: all of them queued before the app
    has handled the first (``Pilot.press`` waits for the app to be idle after each key)."""
    for key in keys:
        app.post_message(events.Key(key, key if len(key) == 1 else None))


def test_keys_typed_ahead_in_one_burst_all_land(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """The README's w, 2, Enter as one burst, then a burst through Escape and Enter (keys
    typed after either go to the main screen), while the run sends at its full rate; a second
    live run on the host, started after it (the newest), gets none of them."""
    loop = start_hook_loop(rate=1000, seconds=120, checkpoint_every=NEVER)
    other = start_hook_loop(rate=100, seconds=120, checkpoint_every=NEVER)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.control is not None and state.step > 0, 20, "the run")
        type_ahead(app, "w", "2", "enter")
        await until(pilot, lambda: state.pending_values() == {"num_workers": 2}, 10,
                    "w 2 Enter to queue num_workers=2")  # fmt: skip
        assert app.screen is app.main, "the editor closed"

        type_ahead(app, "b", "6", "4", "escape", "k", "w", "3", "enter", "space")
        await until(pilot, lambda: app.paused, 10, "the space typed last")
        await until(pilot, lambda: state.pending_values() == {"num_workers": 3}, 10,
                    "num_workers=3 queued")  # fmt: skip
        assert app.keep_effective_batch, "k after Escape reached the main screen"
        assert app.screen is app.main
        pending = (await status(loop.run_id))["pending"]
        assert [p["changes"] for p in pending] == [{"num_workers": 2}, {"num_workers": 3}]
        assert (await status(other.run_id))["pending"] == [], "the other run got no key"

    run(app, check, NARROW)


def test_cancel_a_pending_change_with_keys(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=120, checkpoint_every=NEVER)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.control is not None and state.step > 0, 20, "the run")
        await pilot.press("b")
        assert isinstance(app.screen, EditKnobScreen)
        await pilot.press("6", "4", "enter")
        await until(pilot, lambda: state.pending_values() == {"batch_size": 64}, 10, "pending")
        pending = (await status(loop.run_id))["pending"]
        assert [p["changes"] for p in pending] == [{"batch_size": 64}]

        await pilot.press("c")
        assert isinstance(app.screen, CancelScreen)
        assert f"#{pending[0]['id']} batch_size=64" in screen_text(app)
        await pilot.press("enter")
        assert not isinstance(app.screen, CancelScreen)
        await until(pilot, lambda: not state.pending_values(), 10, "the change to be cancelled")
        answer = await status(loop.run_id)
        assert answer["pending"] == [] and answer["applied"] == []
        assert answer["config"]["batch_size"] == 32, "the run kept its batch size"
        app.refresh_view()
        await pilot.pause()
        changes = text_of(pilot, "#changes")
        assert f"cancelled #{pending[0]['id']}" in changes and "pending" not in changes

    run(app, check, WIDE)


def test_pause_freezes_the_view_while_data_arrives(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    loop = start_hook_loop(rate=100, seconds=120)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.step > 20, 20, "steps")
        await pilot.press("space")
        await pilot.pause()
        frozen_step, frozen_charts = shown_step(pilot), text_of(pilot, "#charts")
        assert "PAUSED" in text_of(pilot, "#header")
        await until(pilot, lambda: state.step > frozen_step + 100, 20, "data while paused")
        await pilot.pause(0.6)  # a few of the refresh timer's ticks
        assert shown_step(pilot) == frozen_step, "the view stays as it was"
        assert text_of(pilot, "#charts") == frozen_charts
        await pilot.press("space")
        await pilot.pause()
        assert "PAUSED" not in text_of(pilot, "#header")
        assert shown_step(pilot) >= frozen_step + 100, "resumed: caught up at once"

    run(app, check, WIDE)


def test_a_run_that_goes_quiet_and_comes_back(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=300)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.connection.status is Status.LIVE and state.step > 0, 20,
                    "live")  # fmt: skip
        os.kill(loop.proc.pid, signal.SIGSTOP)
        try:
            silent = (Status.QUIET, Status.DISCONNECTED)
            await until(pilot, lambda: state.connection.status in silent, 20, "quiet")
            app.refresh_view()
            await pilot.pause()
            header = text_of(pilot, "#header")
            assert "● quiet: no data for" in header or "● disconnected" in header, header
            stopped_at = state.step
        finally:
            os.kill(loop.proc.pid, signal.SIGCONT)
        await until(pilot, lambda: state.connection.status is Status.LIVE, 20, "live again")
        await until(pilot, lambda: state.step > stopped_at + 20, 20, "steps again")
        app.refresh_view()
        await pilot.pause()
        assert "● live" in text_of(pilot, "#header")

    run(app, check, WIDE)


def test_the_command_palette_runs_a_command(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=120, checkpoint_every=NEVER)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.control is not None, 20, "the run's config")
        await pilot.press("ctrl+p")
        assert isinstance(app.screen, CommandPalette)
        type_ahead(app, *"keep-effective")  # as typed fast (a press waits for a redraw per key)
        await until(pilot, lambda: "Toggle keep-effective-batch" in screen_text(app), 5,
                    "the command to be listed")  # fmt: skip
        await pilot.press("enter")
        await until(pilot, lambda: not isinstance(app.screen, CommandPalette), 5, "closed")
        assert app.keep_effective_batch
        assert "keep effective batch on" in text_of(pilot, "#config")

        await pilot.press("ctrl+p")
        type_ahead(app, *"set num_workers")
        await until(pilot, lambda: "Set num_workers" in screen_text(app), 5, "listed")
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, EditKnobScreen), 5, "the editor")
        await pilot.press("3", "enter")
        await until(pilot, lambda: state.pending_values() == {"num_workers": 3}, 10, "pending")
        pending = (await status(loop.run_id))["pending"]
        assert [p["changes"] for p in pending] == [{"num_workers": 3}]

    run(app, check, WIDE)


def test_attach_shows_the_history_within_two_seconds(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    loop = start_hook_loop(rate=100, seconds=120)
    time.sleep(3.0)  # three seconds of history before the viewer comes
    app = live_app(loop.run_id)
    attached = time.time()

    async def check(pilot: Pilot[Any]) -> None:
        started = time.monotonic()
        state = app.state

        def history_shown() -> bool:
            series = state.series.get(0)
            if series is None or not series.step_buckets.buckets:
                return False
            first = series.step_buckets.buckets[0].start
            bars = text_of(pilot, "#charts").split("memory")[0].count("█")
            return first <= attached - 2.0 and bars >= 2

        await until(pilot, history_shown, 20, "the history")
        took = time.monotonic() - started
        print(f"the history showed {took:.2f} s after the viewer started")
        assert took < patience(2.0), f"the history took {took:.2f} s to show"

    run(app, check, WIDE)


def test_the_lr_rule_key_goes_with_an_edit_and_the_change_log_warns_when_the_lr_stays(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """``l`` picks the LR rule the next edit sends; the loop knows no optimizer, so the change
    lands with the warning (rule linear: no optimizer; rule none would say so) in the change log;
    ``P`` on a run without a loader says prefetch_factor is not tunable."""
    loop = start_hook_loop(rate=100, seconds=120, checkpoint_every=20)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.control is not None and state.step > 0, 20, "the run")
        await pilot.press("l")
        assert app.lr_scale == "linear"
        assert "lr rule linear (l)" in text_of(pilot, "#config")
        await pilot.press("b", "6", "4", "enter")
        await until(pilot, lambda: bool(state.control and state.control.applied), 30, "applied")
        applied = state.control.applied[-1]  # type: ignore[union-attr]
        warning = "effective batch 32 -> 64, the LR does not follow (no optimizer known to memtui)"
        assert applied.lr_note == f"warning: {warning}" and applied.lr_factor is None
        app.refresh_view()
        await pilot.pause()
        assert warning in " ".join(text_of(pilot, "#changes").split())
        await pilot.press("P")
        assert app.screen is app.main, "no editor for a knob the run lacks"

    run(app, check, WIDE)


def test_a_turns_the_autopilot_on_and_a_change_typed_pauses_it(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """``A`` turns the run's autopilot on (the advice panel says so), ``w 2 Enter`` pauses it at
    once (the panel says why), and ``A`` again turns it off."""
    loop = start_hook_loop(rate=200, seconds=120, checkpoint_every=NEVER)
    app = live_app(loop.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.control is not None and state.step > 0, 20, "the run")
        await pilot.press("A")
        await until(pilot, lambda: "autopilot on" in text_of(pilot, "#advice"), 10, "it on")
        type_ahead(app, "w", "2", "enter")
        await until(pilot, lambda: "autopilot paused" in text_of(pilot, "#advice"), 10, "paused")
        assert "queued #" in text_of(pilot, "#advice")
        assert (await status(loop.run_id))["autopilot"]["mode"] == "paused"
        await pilot.press("A")
        await until(pilot, lambda: "autopilot" not in text_of(pilot, "#advice"), 10, "it off")

    run(app, check, WIDE)
