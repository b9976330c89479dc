"""Smoke test in a real terminal: `memtui attach` in a detached 60x50 tmux pane, read back."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.conftest import ROOT, DemoRun

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def test_attach_in_a_tmux_side_pane(start_demo: Callable[..., DemoRun]) -> None:
    demo = start_demo("--workers", "0", "--steps", "3000", "--checkpoint-every", "50")
    server = f"memtui-test-{os.getpid()}"
    tmux = ["tmux", "-L", server]
    env = [f"{k}={os.environ[k]}" for k in ("MEMTUI_RUNTIME_DIR", "XDG_STATE_HOME")]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "side", "-x", "60", "-y", "50",
         *(a for pair in env for a in ("-e", pair)),
         f"cd {ROOT} && exec {sys.executable} -m memtui attach"],
        check=True,
    )  # fmt: skip
    try:
        pane = ""
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline:
            pane = subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "side"], capture_output=True, text=True
            ).stdout
            step = re.search(r"step (\d+)", pane)
            if step and int(step.group(1)) > 0 and re.search(r"STARVED|BALANCED|OOM RISK", pane):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no verdict and step in the pane:\n{pane}")
        assert demo.run_id in pane
        lines = pane.splitlines()
        assert len(lines) <= 50 and all(len(line) <= 60 for line in lines)
        subprocess.run([*tmux, "send-keys", "-t", "side", "q"], check=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = subprocess.run([*tmux, "has-session", "-t", "side"], capture_output=True)
            if alive.returncode != 0:
                break  # q quit the viewer, and the pane closed with it
            time.sleep(0.2)
        else:
            pytest.fail("q did not quit the viewer")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
