"""In a real terminal: `memtui attach` in a detached tmux pane, read back, and the README's
w 4 Enter typed in one burst."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import psutil
import pytest

from tests.support.cli import status_json
from tests.support.clock import patience
from tests.support.processes import ROOT, DemoRun, wait_for
from tests.support.viewer import HookLoop

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@contextmanager
def pane(command: str, width: int, height: int) -> Iterator[list[str]]:
    """``command`` in a detached tmux session ``side`` of ``width`` x ``height`` (this test's
    runtime directory), on a tmux server of its own; yields the tmux command line to drive it."""
    tmux = ["tmux", "-L", f"memtui-test-{os.getpid()}"]
    env = [f"{k}={os.environ[k]}" for k in ("MEMTUI_RUNTIME_DIR", "XDG_STATE_HOME")]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "side", "-x", str(width), "-y", str(height),
         *(a for pair in env for a in ("-e", pair)), f"cd {ROOT} && exec {command}"],
        check=True,
    )  # fmt: skip
    try:
        yield tmux
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def wait_pane(tmux: list[str], shows: Callable[[str], object], timeout: float, what: str) -> str:
    """What the pane shows once ``shows`` holds for it; fail after ``timeout`` seconds."""
    text = ""
    deadline = time.monotonic() + patience(timeout)
    while time.monotonic() < deadline:
        text = subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "side"], capture_output=True, text=True
        ).stdout
        if shows(text):
            return text
        time.sleep(0.5)
    pytest.fail(f"no {what} in the pane:\n{text}")


def quit_pane(tmux: list[str]) -> None:
    """Press q: the viewer quits, and the pane closes with it."""
    subprocess.run([*tmux, "send-keys", "-t", "side", "q"], check=True)
    deadline = time.monotonic() + patience(10)
    while time.monotonic() < deadline:
        alive = subprocess.run([*tmux, "has-session", "-t", "side"], capture_output=True)
        if alive.returncode != 0:
            return
        time.sleep(0.2)
    pytest.fail("q did not quit the viewer")


def pending(run_id: str) -> list[dict[str, object]]:
    """The changes the run has pending, as ``memtui status --json`` lists them."""
    return [change["changes"] for change in status_json(run_id)["pending"]]


def test_attach_in_a_tmux_side_pane(start_demo: Callable[..., DemoRun]) -> None:
    demo = start_demo("--workers", "0", "--steps", "3000", "--checkpoint-every", "50")
    with pane(f"{sys.executable} -m memtui attach", 60, 50) as tmux:

        def verdict(text: str) -> bool:
            step = re.search(r"step (\d+)", text)
            verdict = re.search(r"STARVED|BALANCED|OOM RISK", text)
            return bool(step and int(step.group(1)) > 0 and verdict)

        text = wait_pane(tmux, verdict, 45, "verdict and step")
        assert demo.run_id in text
        lines = text.splitlines()
        assert len(lines) <= 50 and all(len(line) <= 60 for line in lines)
        # the README's walkthrough typed as one burst (one write to the terminal): it lands
        subprocess.run([*tmux, "send-keys", "-t", "side", "w4", "Enter"], check=True)
        queued = wait_for(lambda: pending(demo.run_id), 20, 0.5, what="w4 Enter to queue it")
        assert queued == [{"num_workers": 4}]
        quit_pane(tmux)


def test_attach_with_nothing_running_waits_for_a_run(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """`memtui attach` in a pane with nothing running waits (rather than exit with "no live
    memtui run"), saying so, and shows the first run that starts."""
    with pane(f"{sys.executable} -m memtui attach", 100, 30) as tmux:
        waiting = re.compile(r"● connecting: waiting\s+for\s+a\s+run\s+in\s+\S+\s+\(ctrl\+c\s+to")
        wait_pane(tmux, waiting.search, 30, "waiting line")
        loop = start_hook_loop(rate=100, seconds=60)
        wait_pane(tmux, lambda t: loop.run_id in t and "● live" in t, 30, "the run, live")
        quit_pane(tmux)


TERMINAL_MODES = "#{alternate_on} #{mouse_any_flag} #{mouse_button_flag} #{cursor_flag}"
"""What a viewer leaves set in its pane: the alternate screen, mouse reporting, the cursor."""
RESTORED = "0 0 0 1"
"""The main screen back, no mouse reporting, the cursor shown."""


def kept_pane(
    command: str, width: int, height: int, logs: Path
) -> AbstractContextManager[list[str]]:
    """``pane`` running ``command`` in bash between two ``stty -g`` (into ``logs``), the pane
    kept a minute after it: what it shows and its modes can be read once the command ends."""
    script = f"stty -g >{logs}/stty.before; {command}; stty -g >{logs}/stty.after; sleep 60"
    return pane(f"bash -c {shlex.quote(script)}", width, height)


def quit_kept_pane(tmux: list[str], logs: Path) -> str:
    """Press q: the viewer quits and its command ends; what the pane shows then."""
    subprocess.run([*tmux, "send-keys", "-t", "side", "q"], check=True)
    deadline = time.monotonic() + patience(15)
    while time.monotonic() < deadline:
        if (logs / "stty.after").is_file() and (logs / "stty.after").read_text().endswith("\n"):
            return capture(tmux)
        time.sleep(0.2)
    pytest.fail(f"q did not quit the viewer:\n{capture(tmux)}")


def tmux_format(tmux: list[str], spec: str) -> str:
    """A tmux format (``#{alternate_on}``) of the pane."""
    done = subprocess.run([*tmux, "display-message", "-p", "-t", "side", spec],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


def capture(tmux: list[str]) -> str:
    """What the pane shows now."""
    return subprocess.run(
        [*tmux, "capture-pane", "-p", "-t", "side"], capture_output=True, text=True
    ).stdout


def side_pane_layout(text: str) -> bool:
    """The side-pane layout: config, change log and memory panels stacked, in that order."""
    lines = text.splitlines()
    found = [[i for i, line in enumerate(lines) if f"─ {title} " in line]
             for title in ("config", "changes", "memory")]  # fmt: skip
    rows = [rows[0] for rows in found if rows]
    return len(rows) == 3 and rows == sorted(rows) and not any("╮╭" in line for line in lines)


def wide_layout(text: str) -> bool:
    """The wide layout: the config panel beside the charts."""
    return any("─ config " in line and "─ history " in line for line in text.splitlines())


def open_and_close_editor(tmux: list[str], width: int) -> None:
    """w opens the num_workers editor, drawn inside the pane (both side borders on its title's
    line, its top border whole); escape closes it: the keys reach the viewer."""
    subprocess.run([*tmux, "send-keys", "-t", "side", "w"], check=True)
    text = wait_pane(tmux, lambda t: "Set num_workers" in t, 15, "the editor")
    lines = text.splitlines()
    title = next(i for i, line in enumerate(lines) if "Set num_workers" in line)
    left = lines[title].index("█")
    right = lines[title].rindex("█")
    assert left < lines[title].index("Set num_workers") < right < width, text
    assert lines[title - 2][left : right + 1].strip("▀█") == "", f"no top border:\n{text}"
    subprocess.run([*tmux, "send-keys", "-t", "side", "Escape"], check=True)
    wait_pane(tmux, lambda t: "Set num_workers" not in t, 15, "the editor closed")


def assert_left_clean(tmux: list[str], shown: str, logs: Path, written: str) -> None:
    """After q: no traceback in the pane or the log, no escape sequence in the log, and the
    terminal as it was (its modes, and its settings as ``stty -g`` prints them)."""
    for where, text in (("pane", shown), ("log", written)):
        assert "Traceback" not in text and "Error" not in text, f"{where}:\n{text}"
    assert "\x1b[" not in written, "the screen went into the log, not to the terminal"
    assert tmux_format(tmux, TERMINAL_MODES) == RESTORED
    before, after = ((logs / f"stty.{when}").read_text() for when in ("before", "after"))
    assert after == before


@pytest.mark.parametrize(
    "redirect",
    ["2>&1 | tee {log}", "2>{log} | cat"],
    ids=["stdout-and-stderr-piped", "stdout-piped-stderr-to-a-file"],
)
def test_viewer_with_piped_output_sizes_itself_from_the_terminal(
    start_hook_loop: Callable[..., HookLoop], tmp_path: Path, redirect: str
) -> None:
    """A viewer whose stdout is a pipe (its output teed to a log) or whose stderr goes to a
    file is drawn on the pane's terminal at the pane's size and reads its keys: the side-pane
    layout at 60 columns, the editor whole; q leaves with its farewell line, no traceback and
    the terminal restored."""
    loop = start_hook_loop(rate=100, seconds=60)
    log = tmp_path / "viewer.log"
    command = f"{sys.executable} -m memtui attach {loop.run_id} " + redirect.format(log=log)
    with kept_pane(command, 60, 50, tmp_path) as tmux:
        text = wait_pane(tmux, lambda t: "● live" in t and "─ memory " in t, 30, "the live view")
        assert side_pane_layout(text), f"not the side-pane layout:\n{text}"
        open_and_close_editor(tmux, 60)
        shown = quit_kept_pane(tmux, tmp_path)
        written = log.read_text()
        assert f"memtui: run {loop.run_id}, last step" in written
        if "tee" in redirect:  # the farewell reaches the terminal through tee too
            assert f"memtui: run {loop.run_id}, last step" in " ".join(shown.split())
        assert_left_clean(tmux, shown, tmp_path, written)


@pytest.mark.parametrize(
    ("redirect", "size"),
    [("2>{log}", (60, 50)), ("2>&1 | tee {log}", (120, 40))],
    ids=["stderr-to-a-file-60x50", "teed-120x40"],
)
def test_memtui_demo_with_redirected_output_draws_in_the_pane(
    tmp_path: Path, redirect: str, size: tuple[int, int]
) -> None:
    """``memtui demo 2>err.log`` (stderr to a file) and ``memtui demo 2>&1 | tee log`` (what
    ``make demo`` runs, teed) draw the viewer at the pane's size (side pane at 60x50, wide at
    120x40) and read its keys; q stops the demo with no traceback and the terminal restored."""
    log = tmp_path / "demo-err.log"
    command = f"{sys.executable} -m memtui demo " + redirect.format(log=log)
    width, height = size
    with kept_pane(command, width, height, tmp_path) as tmux:
        text = wait_pane(tmux, lambda t: "● live" in t and "step time " in t, 90, "the demo")
        layout = side_pane_layout if width < 80 else wide_layout
        assert layout(text), f"not the {layout.__name__}:\n{text}"
        open_and_close_editor(tmux, width)
        shown = quit_kept_pane(tmux, tmp_path)
        written = log.read_text()
        assert "memtui demo: stopping the demo training" in written, written
        assert re.search(r"memtui: run demo-\w+, last step", written), written
        assert_left_clean(tmux, shown, tmp_path, written)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_gives_the_terminal_back(
    start_hook_loop: Callable[..., HookLoop], tmp_path: Path, signum: signal.Signals
) -> None:
    """The viewer killed with SIGTERM or SIGHUP (a closed SSH session, ``kill``) leaves as q
    does: the pane back on its main screen with no mouse reporting and the cursor shown, the
    terminal's settings as they were, the farewell line, and 128 + the signal as its status."""
    loop = start_hook_loop(rate=100, seconds=60)
    viewer = f"{sys.executable} -m memtui attach {loop.run_id}"
    script = (
        f"stty -g >{tmp_path}/stty.before; {viewer}; echo $? >{tmp_path}/status; "
        f"stty -g >{tmp_path}/stty.after; sleep 60"
    )
    with pane(f"bash -c {shlex.quote(script)}", 100, 30) as tmux:
        wait_pane(tmux, lambda t: "● live" in t and "─ memory " in t, 30, "the live view")
        assert tmux_format(tmux, "#{alternate_on} #{mouse_any_flag}") == "1 1", "not drawn yet"
        shell = psutil.Process(int(tmux_format(tmux, "#{pane_pid}")))
        (child,) = shell.children()
        child.send_signal(signum)
        status = tmp_path / "status"
        wait_for(lambda: status.is_file() and status.read_text().endswith("\n"), 15, 0.2,
                 what=f"the viewer to leave on {signum.name}")  # fmt: skip
        wait_for(lambda: (tmp_path / "stty.after").is_file(), 5, 0.1, what="stty after it")
        assert int(status.read_text()) == 128 + signum, status.read_text()
        shown = capture(tmux)
        assert_left_clean(tmux, shown, tmp_path, "")
        assert f"memtui: run {loop.run_id}, last step" in " ".join(shown.split()), shown
