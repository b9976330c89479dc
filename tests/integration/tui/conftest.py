"""The viewer's fixtures: a fast hook loop (a real hook and real sockets, no torch to import)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from tests.support.processes import ROOT, wait_for
from tests.support.viewer import HookLoop


@pytest.fixture
def start_hook_loop() -> Iterator[Callable[..., HookLoop]]:
    """Start ``benchmarks/tui_cpu.py --loop`` (real hook, real sockets) and wait for its run id."""
    loops: list[HookLoop] = []

    def start(rate: float = 100.0, seconds: float = 60.0, checkpoint_every: int = 50) -> HookLoop:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "benchmarks" / "tui_cpu.py"), "--loop",
             "--rate", str(rate), "--seconds", str(seconds),
             "--checkpoint-every", str(checkpoint_every)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ),
        )  # fmt: skip
        assert proc.stdout is not None
        line = str(wait_for(proc.stdout.readline, 30, what="the hook loop's run id"))
        loop = HookLoop(proc, line.split()[1])
        loops.append(loop)
        return loop

    yield start
    for loop in loops:
        loop.stop()
