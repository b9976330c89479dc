"""The tests' time limits, stretched by the machine's load: a limit is there to end a hang, and a
host whose cores are shared (a busy server, several suites at once) must not turn a slow pass
into a failure.

A limit is written as the seconds it takes on an idle machine. ``load_factor`` says how many times
slower this machine runs now (the 1-minute load average per core, at least 1); a ``Deadline``
moves away as that factor grows while it is waited for, and ``patience`` stretches a limit given
once (a subprocess's, the per-test hang guard).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from typing import Any

MOST = 10.0
"""The most a limit is stretched: a test that hangs still fails."""


def load_factor() -> float:
    """How many times slower than idle this machine runs now: the 1-minute load average per
    core, between 1 and ``MOST``."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(MOST, max(1.0, load / (cores or 1)))


def patience(seconds: float) -> float:
    """``seconds`` on an idle machine, stretched by the load now."""
    return seconds * load_factor()


class Deadline:
    """A limit of ``seconds`` on an idle machine, from now; it moves away while the load grows
    (the most stretched it has been is kept: the load average lags the load)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()
        self.factor = load_factor()

    def passed(self) -> bool:
        """Whether the limit, stretched by the highest load seen, has passed."""
        self.factor = max(self.factor, load_factor())
        return time.monotonic() > self.start + self.seconds * self.factor

    def left(self) -> float:
        """Seconds left before the limit (stretched by the highest load seen so far)."""
        self.factor = max(self.factor, load_factor())
        return self.start + self.seconds * self.factor - time.monotonic()

    @property
    def waited(self) -> str:
        """How long it waited, in words for a failure (``60 s at 3.2x load``)."""
        spent = time.monotonic() - self.start
        return f"{spent:.0f} s ({self.seconds:.0f} s idle, the load {self.factor:.1f}x)"


def run(args: Sequence[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(args, timeout=...)`` with ``timeout`` a ``Deadline``: the process is
    killed (``subprocess.TimeoutExpired``) only once the limit, stretched by the load while it
    ran, has passed."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    given = kwargs.pop("input", None)
    if given is not None:
        kwargs["stdin"] = subprocess.PIPE
    deadline = Deadline(timeout)
    with subprocess.Popen(args, **kwargs) as process:
        while True:
            try:
                stdout, stderr = process.communicate(
                    given, timeout=max(0.1, min(1.0, deadline.left()))
                )
                break
            except subprocess.TimeoutExpired:
                given = None  # sent with the first call
                if deadline.passed():
                    process.kill()
                    process.communicate()
                    raise subprocess.TimeoutExpired(args, deadline.seconds) from None
        return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)
