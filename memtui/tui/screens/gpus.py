"""The GPUs screen: every GPU on this host, its memory and the processes holding it (key ``g``).

Other processes' memory is part of the run's OOM risk. NVML is read on a worker thread every
two seconds (never in a widget's render); where there is no driver the screen says so.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

from memtui.core.stats import format_bytes
from memtui.planning.gpus import GpuInfo, NoDriver, format_gpus, host_gpus
from memtui.tui.safe import as_text

REFRESH_S = 2.0
"""Seconds between NVML reads while the screen is open."""


class GpusScreen(ModalScreen[None]):
    """The GPUs of the viewer's host, freest first, refreshed every two seconds."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,g,q", "dismiss_screen", "Back"),
        Binding("r", "refresh_now", "Refresh"),
    ]

    def __init__(self, reader: Callable[[], list[GpuInfo]] = host_gpus) -> None:
        super().__init__()
        self.reader = reader
        self.body_text = "reading NVML..."

    def compose(self) -> ComposeResult:
        """Title, the table and the keys."""
        with Vertical(id="dialog"):
            yield Label(as_text(f"GPUs on {socket.gethostname()}"), id="dialog-title")
            yield Static(as_text(self.body_text), id="gpus-table")
            yield Static(
                "freest first · the viewer's host (a run on another node is not shown) · "
                "r: refresh · esc: back",
                id="dialog-help",
            )

    def on_mount(self) -> None:
        """Read now, then every ``REFRESH_S``."""
        self.action_refresh_now()
        self.set_interval(REFRESH_S, self.action_refresh_now)

    def action_refresh_now(self) -> None:
        """Read NVML again (on a worker thread)."""
        self._read()

    @work(thread=True, exclusive=True, group="gpus")
    def _read(self) -> None:
        try:
            gpus = self.reader()
            text = format_gpus(gpus, format_bytes)
        except NoDriver as exc:
            text = f"{exc}\n\nmemtui gpus and this screen need an NVIDIA driver (NVML)."
        except Exception as exc:  # the screen stays up whatever NVML does
            text = f"could not read the GPUs: {type(exc).__name__}: {exc}"
        self.app.call_from_thread(self._show, text)

    def _show(self, text: str) -> None:
        self.body_text = text
        if self.is_attached:
            # names and command lines are other users' words: text, never markup
            self.query_one("#gpus-table", Static).update(as_text(text))

    def action_dismiss_screen(self) -> None:
        """Close the screen."""
        self.dismiss(None)
