"""Where the viewer relies on Textual beyond its public API, each use with the Textual version it
was checked on: a Textual release that changes one of them breaks it here, in one module, and
``pyproject.toml`` bounds Textual to the versions tested (``tests/unit/tui/test_compat.py`` checks the
installed one against ``CHECKED_ON``).
"""

from __future__ import annotations

import os
from typing import IO, Any

from textual.app import App
from textual.drivers.linux_driver import LinuxDriver
from textual.widget import Widget

CHECKED_ON = ("8.2",)
"""The Textual releases (major.minor) the uses below were checked on."""


def cached_content_height(widget: Widget) -> int | None:
    """The content height Textual measured for ``widget`` since its content last changed (None:
    none). Reads ``Widget._content_height_cache``, a ``(width, height)`` pair (Textual 8.2)."""
    width, height = widget._content_height_cache  # noqa: SLF001
    return height if width is not None else None


class TerminalDriver(LinuxDriver):
    """Textual's driver on the controlling terminal (``/dev/tty``): the viewer is sized, drawn
    and read there whatever stdin, stdout and stderr are (``memtui demo 2>&1 | tee log`` pipes
    stdout, ``2>err.log`` sends stderr to a file); without a terminal, Textual's own streams.

    Sets ``LinuxDriver``'s ``_file``, ``fileno`` and ``input_tty`` (where it writes, reads and
    whether input is a terminal) and overrides its ``_get_terminal_size`` (Textual 8.2).
    """

    def __init__(
        self, app: App[Any], *, debug: bool = False, mouse: bool = True, size: Any = None
    ) -> None:
        super().__init__(app, debug=debug, mouse=mouse, size=size)
        self._terminal: IO[str] | None = None
        self._streams = self._file, self.fileno, self.input_tty
        """Textual's own (stderr, stdin): used where no terminal can be opened."""

    def open_terminal(self) -> bool:
        """Draw on and read from the controlling terminal; False (Textual's streams) if none."""
        if self._terminal is not None:
            return True
        try:
            fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:  # no controlling terminal (a daemon, a CI job): stdin and stderr
            return False
        self._terminal = open(fd, "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._file, self.fileno, self.input_tty = self._terminal, fd, True
        return True

    def start_application_mode(self) -> None:
        """Open the terminal (again after a suspend, which closes it), then start as Textual."""
        self.open_terminal()
        super().start_application_mode()

    def _get_terminal_size(self) -> tuple[int, int]:
        """The terminal's own size (Textual asks stdout, which may be a pipe: 80 x 24 then)."""
        if self._terminal is None:
            return super()._get_terminal_size()
        try:
            columns, lines = os.get_terminal_size(self.fileno)
        except OSError:
            return super()._get_terminal_size()
        return columns or 80, lines or 25

    def close(self) -> None:
        """Stop the writer, then close the terminal it wrote to."""
        super().close()
        terminal, self._terminal = self._terminal, None
        self._file, self.fileno, self.input_tty = self._streams
        if terminal is not None:
            try:
                terminal.close()
            except OSError:  # the terminal went away (the pane was closed): nothing to flush to
                pass
