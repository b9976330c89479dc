"""The GPUs screen (key ``g``) on real Textual with Pilot: the no-driver message, and a table.

Where there is no NVIDIA driver, the first test shows the real no-driver path; the second
passes a reader over ``tests.integration.test_gpus.FakeNvml`` (a stand-in NVML: no GPU needed).
"""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot

from memtui.planning.gpus import read_gpus
from memtui.tui.screens.gpus import GpusScreen
from tests.integration.test_gpus import FakeNvml, describe, no_driver_here
from tests.support.viewer import STARVING, replay_app, run, screen_text, settle, until

WIDE = (120, 40)


def test_g_opens_the_gpus_screen_with_the_no_driver_message() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("g")
        await until(pilot, lambda: isinstance(pilot.app.screen, GpusScreen), 5, "the screen")
        screen = pilot.app.screen
        assert isinstance(screen, GpusScreen)
        await until(pilot, lambda: "NVML" in screen.body_text, 10, "the NVML read")
        await pilot.pause()
        text = screen_text(pilot.app)
        assert "GPUs on " in text
        if no_driver_here():
            assert "no NVIDIA driver on this host" in text
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(pilot.app.screen, GpusScreen), 5, "closed")

    run(replay_app(STARVING), check, WIDE)


def test_the_screen_lists_gpus_freest_first() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        screen = GpusScreen(reader=lambda: read_gpus(FakeNvml(), describe))
        await pilot.app.push_screen(screen)
        await until(pilot, lambda: "RTX 4090" in screen.body_text, 10, "the table")
        await pilot.pause()
        text = screen_text(pilot.app)
        rows = [line for line in text.splitlines() if "RTX 4090" in line]
        assert [row.split()[1] for row in rows] == ["1", "2", "3", "0"]
        assert "pid 4242" in text

    run(replay_app(STARVING), check, WIDE)
