"""In a real terminal: `memtui attach` in a detached tmux pane, read back, and the README's
w 4 Enter typed in one burst."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.conftest import ROOT, DemoRun, status_json, wait_for
from tests.tui.conftest import HookLoop

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
    deadline = time.monotonic() + timeout
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
    deadline = time.monotonic() + 10
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
    """Issue 16: `memtui attach` in a pane with nothing running waits (it exited with "no live
    memtui run"), saying so, and shows the first run that starts."""
    with pane(f"{sys.executable} -m memtui attach", 100, 30) as tmux:
        waiting = re.compile(r"● connecting: waiting\s+for\s+a\s+run\s+in\s+\S+\s+\(ctrl\+c\s+to")
        wait_pane(tmux, waiting.search, 30, "waiting line")
        loop = start_hook_loop(rate=100, seconds=60)
        wait_pane(tmux, lambda t: loop.run_id in t and "● live" in t, 30, "the run, live")
        quit_pane(tmux)
