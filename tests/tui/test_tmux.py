"""Smoke test in a real terminal: `memtui attach` in a detached 60x50 tmux pane, read back, and
the README's w 4 Enter typed in one burst."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from tests.conftest import ROOT, DemoRun, memtui_cli, wait_for

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def pending(run_id: str) -> list[dict[str, object]]:
    """The changes the run has pending, as ``memtui status --json`` lists them."""
    answer = json.loads(memtui_cli("status", run_id, "--json").stdout)
    return [change["changes"] for change in answer["pending"]]


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
        # the README's walkthrough typed as one burst (one write to the terminal): it lands
        subprocess.run([*tmux, "send-keys", "-t", "side", "w4", "Enter"], check=True)
        queued = wait_for(lambda: pending(demo.run_id), 20, 0.5, what="w4 Enter to queue it")
        assert queued == [{"num_workers": 4}]
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
