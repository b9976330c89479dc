"""The suite's time limits end hangs, not slow passes: written for an idle machine, they stretch
with the load (the 1-minute load average per core), as a busy 2-core host at load 8 has."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support import clock


@pytest.fixture
def load(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The load average the clock reads (settable), on a machine of two cores."""
    now = [0.5]
    monkeypatch.setattr(os, "getloadavg", lambda: (now[0], now[0], now[0]))
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    return now


def test_a_limit_stretches_with_the_load_per_core(load: list[float]) -> None:
    """Idle: a limit is its seconds; at load 8 on two cores, four times them; never over ten."""
    assert clock.patience(30) == 30
    load[0] = 8.0
    assert clock.patience(30) == 120
    load[0] = 400.0
    assert clock.patience(30) == 30 * clock.MOST


def test_a_deadline_moves_away_when_the_load_grows_while_it_is_waited_for(
    load: list[float],
) -> None:
    """Set while the machine was idle, a 0.2 s deadline has not passed after 0.3 s once the load
    reached 8 on two cores (0.8 s), and passes after that."""
    deadline = clock.Deadline(0.2)
    load[0] = 8.0
    time.sleep(0.3)
    assert not deadline.passed() and deadline.left() > 0.3
    time.sleep(0.6)
    assert deadline.passed()
    assert "the load 4.0x" in deadline.waited


def test_a_command_that_outlasts_its_idle_limit_on_a_busy_machine_is_not_killed(
    load: list[float],
) -> None:
    """``clock.run`` (what ``memtui_cli`` runs commands with): a command taking 1 s under a 0.5 s
    limit finishes with its whole output at load 8 on two cores, and is killed when idle."""
    command = [sys.executable, "-c", "import time; print('all of it', flush=True); time.sleep(1)"]
    load[0] = 8.0
    done = clock.run(command, timeout=0.5, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "all of it\n"
    load[0] = 0.5
    with pytest.raises(subprocess.TimeoutExpired):
        clock.run(command, timeout=0.5, capture_output=True, text=True)


def test_the_per_test_guard_is_stretched_by_the_load(request: pytest.FixtureRequest) -> None:
    """pytest-timeout's guard of this very test was set from the ``timeout`` of ``pyproject.toml``
    (240 s) stretched by the load as it started: at least 240 s, never more than ten times."""
    marker = request.node.get_closest_marker("timeout")
    assert marker is not None
    assert 240 <= marker.args[0] <= 240 * clock.MOST
