"""The app against real hooks in subprocesses (real zmq): steps, a change landing, reconnects."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
from textual.pilot import Pilot

from memtui.runs.events import Status
from memtui.transport.sources import LiveSource
from memtui.tui.app import MemtuiApp
from memtui.tui.screens.edit import EditKnobScreen
from memtui.wire import RankInfo, Telemetry, encode
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.processes import PLUMBING, DemoRun
from tests.support.viewer import HookLoop, run, screen_text, until

pytestmark = pytest.mark.heavy

CHECKPOINT_EVERY = 50
"""Steps between the live demo's boundaries: about 4 s of its light model at workers 0, so that
a change queued just after one is seen pending by a viewer on a loaded machine (at 20, under
two CPU hogs and the suite, the change landed before the viewer had drawn it pending)."""


def live_app(selector: str | None, **options: Any) -> MemtuiApp:
    """The viewer on a live run, as ``memtui attach`` makes it."""
    return MemtuiApp(LiveSource(selector), **options)


def test_queue_a_change_with_keys_and_see_it_land(start_demo: Callable[..., DemoRun]) -> None:
    # the light model, and one worker to add: the run stays bound by its data (a tenth of a core)
    # where four workers on the default model trained flat out once the change landed (28 CPU-s)
    demo = start_demo(
        "--workers", "0", "--steps", "3000", "--checkpoint-every", str(CHECKPOINT_EVERY), *PLUMBING
    )
    app = live_app(demo.run_id)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.step > 0, 30, "the first steps")
        first = state.step
        await until(pilot, lambda: state.step >= first + 5, 30, "steps to advance")
        app.refresh_view()
        await pilot.pause()
        assert re.search(r"step \d+ +elapsed", screen_text(app))
        assert state.connection.status is Status.LIVE

        # queued just after a boundary: pending for most of the steps to the next one (queued
        # just before one, a loaded viewer may fold the pending state and the boundary's batch
        # into one refresh and never show it pending)
        await until(pilot, lambda: 0 < state.step % CHECKPOINT_EVERY < CHECKPOINT_EVERY // 3,
                    30, "a boundary just passed")  # fmt: skip
        pressed_at = state.step
        await pilot.press("w")
        assert isinstance(app.screen, EditKnobScreen)
        await pilot.press("1", "enter")
        assert not isinstance(app.screen, EditKnobScreen)
        queued_at: list[int] = []

        def pending() -> bool:
            """Seen pending: where it was queued is kept (it may land before the next look: then
            the viewer's step when the keys went is where it was queued, at the latest)."""
            if state.knob_value("num_workers") == 1:
                queued_at.append(pressed_at)
                return True
            if state.pending_values() != {"num_workers": 1} or not state.control:
                return False
            queued_at.append(state.control.pending[0].queued_step)
            return True

        await until(pilot, pending, 10, "pending or landed")
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        if state.pending_values():  # (under heavy load the viewer may see it land first)
            assert "pending  #1 num_workers=1" in text and "→ 1" in text
        queued = queued_at[0]

        await until(pilot, lambda: bool(state.control and state.control.applied), 60, "applied")
        applied = state.control.applied[-1]
        app.refresh_view()
        await pilot.pause()
        assert f"applied  step {applied.step}  num_workers 0 → 1" in screen_text(app)
        assert state.knob_value("num_workers") == 1 and not state.pending_values()

        status = json.loads(memtui_cli("status", demo.run_id, "--json").stdout)
        assert status["applied"][-1]["step"] == applied.step
        assert applied.step % CHECKPOINT_EVERY == 0
        assert queued <= applied.step <= queued + CHECKPOINT_EVERY, "the next checkpoint"

        await pilot.press("P")  # prefetch_factor, now that the loader has workers
        assert isinstance(app.screen, EditKnobScreen)
        await pilot.press("3", "enter")
        await until(pilot, lambda: state.knob_value("prefetch_factor") == 3, 60, "prefetch 3")
        landed = state.control.applied[-1]  # type: ignore[union-attr]
        assert {k: (d.old, d.new) for k, d in landed.changes.items()} == {"prefetch_factor": (2, 3)}

    run(app, check, (120, 40))


def test_readonly_keys_send_nothing(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=60)
    app = live_app(loop.run_id, readonly=True)

    async def check(pilot: Pilot[Any]) -> None:
        await until(pilot, lambda: app.state.step > 0, 20, "steps")
        await pilot.press("w", "4", "enter", "b", "8", "enter", "c", "k")
        await pilot.pause(0.5)
        assert app.screen is app.screen_stack[0], "no editor in a read-only view"
        assert "READ-ONLY" in screen_text(app)

    run(app, check, (120, 40))
    status = json.loads(memtui_cli("status", loop.run_id, "--json").stdout)
    assert status["pending"] == [] and status["applied"] == [] and status["rejected"] == []


def test_a_plain_attach_offers_the_next_run_and_follows_it_on_f(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """``memtui attach`` without a run: once its run ends and another starts, the viewer stays on
    the ended run and offers the new one (it used to switch silently); ``f`` follows it, and the
    change log forgets what was queued on the previous run."""
    first = start_hook_loop(rate=100, seconds=60, checkpoint_every=1_000_000)
    app = live_app(None)  # `memtui attach` without a run: the newest live one

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.info is not None and state.info.run == first.run_id, 20,
                    "the first run")  # fmt: skip
        await until(pilot, lambda: state.control is not None, 20, "its config")
        await pilot.press("w", "4", "enter")
        await until(pilot, lambda: bool(state.notices), 10, "the change queued")
        app.refresh_view()
        await pilot.pause()
        assert "you      queued #1" in screen_text(app)
        first.proc.send_signal(signal.SIGINT)  # the loop ends the run on its way out
        await until(pilot, lambda: state.connection.status is Status.ENDED, 20, "the run's end")
        second = start_hook_loop(rate=100, seconds=60)
        await until(pilot, lambda: state.offer.run == second.run_id, 20, "the offer")
        start = app.receiver.counts.attempts
        await until(pilot, lambda: app.receiver.counts.attempts >= start + 2, 20, "two more looks")
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        assert state.info is not None and state.info.run == first.run_id, "not switched"
        assert f"f: follow {second.run_id} (pid {second.proc.pid}" in text
        assert "● ended" in text and "you      queued #1" in text

        await pilot.press("f")
        await until(pilot, lambda: state.info is not None and state.info.run == second.run_id, 20,
                    "the new run")  # fmt: skip
        await until(pilot, lambda: state.connection.status is Status.LIVE and state.step > 0, 20,
                    "live again")  # fmt: skip
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        assert second.run_id in text and "● live" in text and first.run_id not in text
        assert "queued #1" not in text and "f: follow" not in text and not state.offer.run

    run(app, check, (120, 40))


def test_garbage_on_a_telemetry_socket_is_counted(
    start_hook_loop: Callable[..., HookLoop], private_runtime: Path
) -> None:
    loop = start_hook_loop(rate=100, seconds=60)
    app = live_app(loop.run_id)
    endpoint = f"ipc://{private_runtime}/garbage{os.getpid()}"
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.step > 0, 20, "steps")
        app.receiver.source.subscribe(RankInfo(rank=9, pub=endpoint))  # type: ignore[attr-defined]
        alien = encode(Telemetry(run="x", rank=9, seq=1, time=time.time(), step=1, v=2))
        deadline = time.monotonic() + patience(10)
        while state.bad_frames < 3 and time.monotonic() < deadline:
            for frame in (b"\x00garbage", b"\xc1", alien):  # bad msgpack, reserved byte, v2
                pub.send(frame)
            await pilot.pause(0.2)
        assert state.bad_frames >= 3
        before = state.step
        await until(pilot, lambda: state.step > before + 10, 20, "steps after the garbage")
        app.refresh_view()
        await pilot.pause()
        assert "bad frames" in screen_text(app)
        assert state.connection.status is Status.LIVE and app.receiver.counts.errors == 0

    try:
        run(app, check, (120, 40))
    finally:
        pub.close(0)
        context.term()
