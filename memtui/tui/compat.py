"""Where the viewer relies on Textual beyond its public API, each use with the Textual version it
was checked on (and the viewer's terminal driver, which stops the viewer on SIGTERM and SIGHUP
as ``q`` does): a Textual release that changes one of them breaks it here, in one module, and
``pyproject.toml`` bounds Textual to the versions tested (``tests/unit/tui/test_compat.py`` checks the
installed one against ``CHECKED_ON``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import termios
from types import FrameType
from typing import IO, Any

from textual.app import App
from textual.drivers.linux_driver import LinuxDriver
from textual.widget import Widget

CHECKED_ON = ("8.2",)
"""The Textual releases (major.minor) the uses below were checked on."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop the viewer the way ``q`` does, the terminal given back as it was."""
SIGNALLED = 128
"""A viewer stopped by signal N leaves with return code ``SIGNALLED + N``, as a shell says it."""
RESTORE = (
    "\x1b[?1000l\x1b[?1003l\x1b[?1015l\x1b[?1006l"  # no mouse reporting
    "\x1b[?2004l\x1b[?7h\x1b[<u\x1b[?1049l\x1b[?25h\x1b[?1004l"
)
"""What Textual's ``stop_application_mode`` writes, at once: no mouse reporting or bracketed
paste, line wrap on, the Kitty keyboard protocol off, the main screen, the cursor shown, no
focus events (a second stop signal: the app did not leave after the first)."""


def stop_signal(return_code: int | None) -> int:
    """The signal that stopped the viewer, from the app's return code (0: none did)."""
    if return_code is None or return_code <= SIGNALLED:
        return 0
    return return_code - SIGNALLED


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
        self._handlers: dict[int, Any] = {}
        """The handlers of ``STOP_SIGNALS`` before the viewer took them (given back at the end)."""
        self.stopped_by = 0
        """The stop signal received (0: none)."""

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
        """Open the terminal (again after a suspend, which closes it), then start as Textual;
        SIGTERM and SIGHUP then stop the viewer as ``q`` does (Python's default would end the
        process with the terminal left in the alternate screen, reporting the mouse)."""
        self.open_terminal()
        super().start_application_mode()
        loop = asyncio.get_running_loop()

        def stop(signum: int, frame: FrameType | None) -> None:
            if self.stopped_by:  # the app did not leave after the first: restore, and go
                self.restore_now()
                os._exit(SIGNALLED + signum)
            self.stopped_by = signum
            loop.call_soon_threadsafe(self._app.exit, None, SIGNALLED + signum)

        for signum in STOP_SIGNALS:
            try:
                self._handlers.setdefault(signum, signal.signal(signum, stop))
            except ValueError:  # not the main thread: the signals keep their handlers
                return

    def stop_application_mode(self) -> None:
        """Give the terminal back as Textual does, then the stop signals their handlers."""
        super().stop_application_mode()
        for signum, handler in self._handlers.items():
            signal.signal(signum, handler)
        self._handlers.clear()

    def restore_now(self) -> None:
        """Give the terminal back at once, past Textual's writer thread: the screen, the mouse,
        the cursor and the terminal's settings as they were."""
        try:
            os.write(self.fileno, RESTORE.encode())
            if self.attrs_before is not None:
                termios.tcsetattr(self.fileno, termios.TCSANOW, self.attrs_before)
        except (OSError, termios.error):  # the terminal went away: nothing to give back
            pass

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
