"""The viewer under test: the recorded streams replayed, the screen as text, a pilot's waits, a
fast hook loop."""

from __future__ import annotations

import asyncio
import io
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console
from textual.app import App
from textual.pilot import Pilot

from memtui.transport.recording import RecordedFrame, Recording, read_recording
from memtui.transport.sources import ReplayEnd, ReplaySource
from memtui.tui.app import MemtuiApp
from memtui.wire import Decoder, Snapshot, Telemetry, encode
from tests.support.clock import Deadline, patience
from tests.support.processes import ROOT

DATA = ROOT / "tests" / "data"
STARVING = DATA / "demo_starving.mtrec"
"""A real demo run: starving with --workers 0, num_workers=4 queued and applied, then the end."""
OOM = DATA / "oom_risk.mtrec"
"""A synthetic two-rank CUDA run at 88% of its 24 GiB (make_oom_stream.py)."""
ADVICE = DATA / "demo_advice.mtrec"
"""A real CPU demo under a 900 MiB limit (make_advice_stream.py): underused at batch 4, batch 8
applied (measured effect, prediction error), batch 22 forced over the limit, OOM, rollback."""
AUTOPILOT = DATA / "demo_autopilot.mtrec"
"""A real demo run started with --workers 0 and its autopilot on (make_demo_stream.py --autotune):
num_workers 0 -> 1 kept, then trials reverted, converged with its budget spent."""
RANKS_8 = DATA / "ranks_8.mtrec"
"""Eight synthetic CUDA ranks: rank 5 straggles on data, rank 6 at 88% (make_ranks_stream.py)."""
WATCHED = DATA / "watched_stream.mtrec"
"""A plain loop under ``memtui run`` over a stream's loader with 2 workers, batch 4 and an
accumulation of 2 in the loop (make_watched_stream.py): prefetch_factor=4 applied,
pin_memory=true still pending when the run ended."""


def one_rank(path: Path) -> Recording:
    """The recording's control rank alone, as the run of one rank it would be (its frames
    decoded, the world size set to 1, encoded again): the single-GPU view of a CUDA stream."""
    recording = read_recording(path)
    decoder = Decoder()
    frames = []
    for frame in recording.frames:
        message = decoder.decode(frame.frame)
        if isinstance(message, Snapshot) and message.info.rank == 0:
            message = msgspec.structs.replace(
                message,
                info=msgspec.structs.replace(message.info, world_size=1),
                control=msgspec.structs.replace(message.control, world_size=1),
                ranks=message.ranks[:1],
            )
        elif isinstance(message, Telemetry) and message.rank == 0:
            if message.control is not None:
                control = msgspec.structs.replace(message.control, world_size=1)
                message = msgspec.structs.replace(message, control=control)
        else:
            continue
        frames.append(RecordedFrame(frame.offset_s, frame.rank, encode(message)))
    return Recording(recording.header, frames)


def pending_offset() -> float:
    """Just after num_workers=4 was queued in the starving recording (still pending)."""
    offset = read_recording(STARVING).offset_of(
        lambda m: isinstance(m, Telemetry) and bool(m.control and m.control.pending)
    )
    assert offset is not None
    return offset + 0.05


def forced_pending_offset() -> float:
    """Just after the forced batch_size change was queued in the advice recording."""
    offset = read_recording(ADVICE).offset_of(
        lambda m: (
            isinstance(m, Telemetry)
            and bool(m.control and any(p.forced for p in m.control.pending))
        )
    )
    assert offset is not None
    return offset + 0.05


def autopilot_offset() -> float:
    """Just after the autopilot began measuring its second trial (num_workers=2) in its
    recording: its first one, num_workers=1, kept and in the change log."""
    offset = read_recording(AUTOPILOT).offset_of(
        lambda m: (
            isinstance(m, Telemetry)
            and m.control is not None
            and m.control.autopilot is not None
            and m.control.autopilot.phase == "measuring"
            and m.control.autopilot.trying == {"num_workers": 2}
        )
    )
    assert offset is not None
    return offset + 0.05


def replay_app(
    path: Path | Recording,
    *,
    until_s: float | None = None,
    at_end: ReplayEnd = "hold",
    **options: Any,
) -> MemtuiApp:
    """The viewer on a recording replayed at once (deterministic)."""
    return MemtuiApp(ReplaySource(path, speed=None, until_s=until_s, at_end=at_end), **options)


def screen_text(app: App[Any]) -> str:
    """What the terminal shows, as plain text."""
    width, height = app.size
    console = Console(
        width=width, height=height, file=io.StringIO(), record=True, color_system=None,
        legacy_windows=False,
    )  # fmt: skip
    update = app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    console.print(update)
    return console.export_text()


async def until(
    pilot: Pilot[Any], predicate: Callable[[], object], timeout: float = 30.0, what: str = ""
) -> None:
    """Let the app run until ``predicate()`` holds; fail after ``timeout`` seconds of an idle
    machine (stretched by the load: ``clock.Deadline``)."""
    deadline = Deadline(timeout)
    while not predicate():
        if deadline.passed():
            text = screen_text(pilot.app)
            pytest.fail(f"timed out after {deadline.waited} waiting for {what}\n{text}")
        await pilot.pause(0.05)


async def settle(pilot: Pilot[Any]) -> None:
    """Wait until a replay has been delivered, folded and drawn, and the layout has settled (a
    scrollbar shown while the data came in goes once the view fits, within a second)."""
    app = pilot.app
    assert isinstance(app, MemtuiApp)
    await until(pilot, lambda: app.caught_up, 20, "the replay to be folded")
    app.refresh_view()
    await pilot.pause()
    screen = app.screen
    deadline = time.monotonic() + patience(1.0)
    while time.monotonic() < deadline:
        if not (screen.show_vertical_scrollbar or screen.max_scroll_y):
            break
        await pilot.pause(0.05)
    await pilot.pause()
    # and the screen has stopped changing: a panel that grew (a status line, a notice) lays the
    # charts out again in the next pass, and under load a capture fell between the two
    # (a repaint between the two looks: under load one frame showed the header and verdict of
    # a summary made before the last records were folded, then never redrawn)
    shown, deadline = screen_text(app), time.monotonic() + patience(3.0)
    while time.monotonic() < deadline:
        app.refresh_view()
        await pilot.pause(0.05)
        now = screen_text(app)
        if now == shown:
            break
        shown = now


def run(
    app: MemtuiApp, test: Callable[[Pilot[Any]], Awaitable[None]], size: tuple[int, int]
) -> None:
    """Run ``test`` against ``app`` headless at ``size``."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await test(pilot)

    asyncio.run(main())


@dataclass
class HookLoop:
    """The benchmark's fast loop: a real hook stepping in a subprocess (no torch to import)."""

    proc: subprocess.Popen[str]
    run_id: str

    def stop(self) -> None:
        """End the loop (its hook sends the last batch) if it still runs."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
