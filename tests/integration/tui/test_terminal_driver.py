"""The viewer's driver on the controlling terminal, in a child process on a pseudo-terminal of
its own (its stdout a pipe, its stderr a file) and in one without a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from tests.support.clock import patience
from tests.support.processes import ROOT

CHILD = """
import asyncio, json, os, shutil, sys
from memtui.tui.app import MemtuiApp
from memtui.transport.sources import ReplaySource

async def main():
    app = MemtuiApp(ReplaySource({recording!r}, speed=None))
    driver = app.driver_class(app)  # a driver is made inside the app's event loop
    seen = {{"driver": type(driver).__name__, "stdout_size": list(shutil.get_terminal_size())}}
    seen["opened"] = driver.open_terminal()
    seen["size"] = list(driver._get_terminal_size())
    seen["draws_on_stderr"] = driver._file is sys.__stderr__
    first = driver.fileno
    driver.close()  # as a suspend does: the terminal is opened again at the resume
    seen["closed_back_to_stdin"] = driver.fileno == sys.__stdin__.fileno()
    seen["opened_again"] = driver.open_terminal() and driver.fileno != sys.__stdin__.fileno()
    driver.close()
    seen["terminal_closed"] = first == sys.__stdin__.fileno() or not os.path.exists(
        f"/proc/self/fd/{{first}}"
    )
    print(json.dumps(seen), file=sys.__stderr__ if {report_on_stderr} else sys.__stdout__)

asyncio.run(main())
"""


def child(report_on_stderr: bool) -> str:
    """The child's code: build the viewer's driver, open, close and open the terminal again."""
    recording = str(ROOT / "tests" / "data" / "demo_starving.mtrec")
    return CHILD.format(recording=recording, report_on_stderr=report_on_stderr)


def test_on_a_terminal_the_viewer_is_sized_by_it_whatever_stdout_is(tmp_path: Path) -> None:
    """A 60x50 terminal, the child's stdout a pipe and its stderr a file (``memtui demo
    2>err.log | cat``): the driver draws on the terminal and takes its size from it (Textual
    asked stdout: 80x24); after a close (a suspend) it opens the terminal again."""
    report = tmp_path / "report.json"
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        try:
            out = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            _reader, writer = os.pipe()
            os.dup2(writer, 1)  # stdout a pipe
            os.dup2(out, 2)  # stderr a file (the report goes there)
            os.chdir(ROOT)
            os.execv(sys.executable, [sys.executable, "-c", child(report_on_stderr=True)])
        finally:
            os._exit(111)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 60, 0, 0))
    deadline = time.monotonic() + patience(60)
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        try:
            os.read(fd, 4096)  # drain what the child writes to the terminal
        except OSError:
            pass
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the child did not finish")
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, report.read_text()
    seen = json.loads(report.read_text().splitlines()[-1])
    assert seen == {
        "driver": "TerminalDriver",
        "stdout_size": [80, 24],  # what Textual's own driver would have drawn at
        "opened": True,
        "size": [60, 50],
        "draws_on_stderr": False,
        "closed_back_to_stdin": True,
        "opened_again": True,
        "terminal_closed": True,
    }


def test_without_a_terminal_the_driver_keeps_textual_streams() -> None:
    """No controlling terminal (a new session, as under a daemon): the driver says so and
    draws on stderr and reads stdin, as Textual does."""
    done = subprocess.run(
        [sys.executable, "-c", child(report_on_stderr=False)],
        cwd=ROOT, capture_output=True, text=True, timeout=patience(60), start_new_session=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["driver"] == "TerminalDriver"
    assert seen["opened"] is False and seen["draws_on_stderr"] is True
    assert seen["opened_again"] is False
