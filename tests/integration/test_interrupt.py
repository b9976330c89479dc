"""Ctrl-C on a plain training loop with memtui installed: the user's own traceback, once, and not
a word from memtui (its close neither fails nor says that training goes on while it stops)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_docs import example
from tests.support.clock import patience
from tests.support.processes import wait_for


def interrupted(tmp_path: Path, *args: str, again_after_s: float | None = None) -> tuple[int, str]:
    """Run the plain loop, press Ctrl-C once it trains (SIGINT to its whole process group, as a
    terminal sends it, loader workers included), and with ``again_after_s`` once more that long
    after its traceback is out (while memtui closes); its exit status and stderr."""
    script = tmp_path / "train.py"
    script.write_text(example("plain-loop"))  # the getting-started script, as documented
    err = tmp_path / "stderr.log"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(script), "--out", str(tmp_path / "ckpt"), *args],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,
            # a terminal's program gets Ctrl-C as SIGINT even where the test runner ignores it
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # trains, and checkpoint boundaries have passed
            if line.startswith("step 1000/"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        if again_after_s is not None:
            wait_for(lambda: "KeyboardInterrupt" in err.read_text(), 30, 0.001, "the traceback")
            time.sleep(again_after_s)
            os.killpg(proc.pid, signal.SIGINT)
        proc.stdout.read()
        code = proc.wait(patience(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return code, err.read_text()


FD_HANDOFF = 'multiprocessing/resource_sharer.py", line'
"""Where a loader worker's thread that hands a batch's file descriptor to the training process
prints a ``ConnectionResetError`` when Ctrl-C cuts the hand-off (torch's ``file_descriptor``
sharing over Python's ``resource_sharer``): a race between the two processes' own code, which the
same script prints without memtui."""


def assert_only_the_users_traceback(code: int, stderr: str) -> None:
    """One traceback, the user's KeyboardInterrupt, and nothing from memtui (besides a loader
    worker's cut batch hand-off, which is torch's and Python's own)."""
    assert code in (-signal.SIGINT, 130), (code, stderr)
    handoffs = 1 if FD_HANDOFF in stderr and "in _serve" in stderr else 0
    assert stderr.count("Traceback (most recent call last)") == 1 + handoffs, stderr
    ends = [line for line in stderr.splitlines() if line and not line.startswith(" ")]
    assert ends[-1] == "KeyboardInterrupt" or (handoffs and "KeyboardInterrupt" in ends), stderr
    assert "Exception ignored" not in stderr, stderr
    assert "memtui:" not in stderr and "training goes on" not in stderr, stderr


def test_ctrl_c_shows_the_users_traceback_once_and_nothing_from_memtui(tmp_path: Path) -> None:
    assert_only_the_users_traceback(*interrupted(tmp_path))
    # and the run's last summary, beside its tuned config, says how it ended
    summary = json.loads((tmp_path / "ckpt" / "memtui-summary.json").read_text())
    assert summary["ended"] == "interrupted"
    assert summary["last_step"] >= 1000


@pytest.mark.parametrize("again_after_s", [0.0, 0.02])
def test_a_second_ctrl_c_while_memtui_closes_adds_no_traceback(
    tmp_path: Path, again_after_s: float
) -> None:
    """The second press lands while memtui closes at exit (or once it is done): it stops the
    wait for the last telemetry quietly, never with a traceback of memtui's close."""
    assert_only_the_users_traceback(*interrupted(tmp_path, again_after_s=again_after_s))


def test_ctrl_c_with_loader_workers_stops_them_without_a_word_from_memtui(tmp_path: Path) -> None:
    """The terminal's SIGINT reaches the loader's workers too: they end first, and memtui's
    sampler, which reads their memory, does not report that as a failure."""
    assert_only_the_users_traceback(*interrupted(tmp_path, "--num_workers", "2"))
