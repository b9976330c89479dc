"""The viewer's uses of Textual beyond its public API hold on the installed Textual."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

from textual.app import App, ComposeResult
from textual.widgets import Static

from memtui.tui.compat import CHECKED_ON, TerminalDriver, cached_content_height


def test_the_installed_textual_is_one_the_private_uses_were_checked_on() -> None:
    installed = ".".join(version("textual").split(".")[:2])
    assert installed in CHECKED_ON, f"Textual {installed}: check memtui/tui/compat.py's uses"


def test_the_cached_content_height_and_the_drivers_attributes_are_there() -> None:
    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield Static("one\ntwo", id="text")

    async def measure() -> None:
        async with app.run_test(size=(40, 10)) as pilot:
            await pilot.pause()
            assert cached_content_height(app.query_one("#text")) in (None, 2)
            driver = TerminalDriver(app)
            assert driver._streams == (driver._file, driver.fileno, driver.input_tty)

    app = One()
    asyncio.run(measure())
