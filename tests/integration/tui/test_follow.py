"""Which run the viewer shows, with two live runs on one host.

Real hooks in subprocesses (the benchmark's light loop, no torch), real sockets, the real
``memtui`` command line from "another shell", and the real viewer driven by Pilot.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from textual.pilot import Pilot

from memtui.cli import main
from memtui.hooks import Options, Tuner
from memtui.runs.events import Status
from memtui.storage import registry
from memtui.transport.sources import LiveSource
from memtui.tui.app import MemtuiApp
from tests.integration.test_tuner import Config
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.processes import wait_for
from tests.support.viewer import HookLoop, run, screen_text, until

pytestmark = pytest.mark.heavy

WIDE = (120, 40)
NEVER = 1_000_000
"""A checkpoint interval no test reaches: queued changes stay pending."""


def listed(run_id: str) -> bool:
    """``memtui ls`` (the real command) lists the run."""
    return run_id in memtui_cli("ls").stdout


async def looked_again(pilot: Pilot[Any], app: MemtuiApp, times: int = 3) -> None:
    """Let the receiver look for its run ``times`` more times (it looks once a second)."""
    start = app.receiver.counts.attempts
    await until(
        pilot, lambda: app.receiver.counts.attempts >= start + times, 20, "the receiver to look"
    )
    app.refresh_view()
    await pilot.pause()


def test_a_named_run_is_kept_after_it_ends_and_another_starts_in_its_state_dir(
    tmp_path: Path,
) -> None:
    """``memtui attach RUN``: the run ends and another starts in the same state directory (as a
    second ``memtui demo`` does); the view stays on RUN, says "ended" and offers nothing (it
    used to switch to the new run a second after it registered)."""
    first = Tuner(Config(), name="first", state_dir=tmp_path, options=Options()).start()
    app = MemtuiApp(LiveSource(first.run_id))
    later: list[Tuner] = []

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.connection.status is Status.LIVE, 20, "the run")
        first.close()
        await until(pilot, lambda: state.connection.status is Status.ENDED, 20, "the run's end")
        second = Tuner(Config(), name="second", state_dir=tmp_path, options=Options()).start()
        later.append(second)
        assert listed(second.run_id)
        await looked_again(pilot, app)
        assert state.info is not None and state.info.run == first.run_id
        assert state.connection.status is Status.ENDED and not state.offer.run
        text = screen_text(app)
        assert first.run_id in text and "● ended: run ended at step" in text
        assert second.run_id not in text and "follow" not in text

    try:
        run(app, check, WIDE)
    finally:
        first.close()
        for tuner in later:
            tuner.close()


def test_a_killed_run_is_said_to_have_exited(start_hook_loop: Callable[..., HookLoop]) -> None:
    """``kill -9`` of the run: the header says its process exited (it said "disconnected ... no
    answer" forever), since the process was on this host and is gone; another live run on the
    host is neither taken nor offered (the run was named)."""
    loop = start_hook_loop(rate=100, seconds=60)
    other = start_hook_loop(rate=100, seconds=60)
    app = MemtuiApp(LiveSource(loop.run_id))

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.step > 0, 20, "steps")
        os.kill(loop.proc.pid, signal.SIGKILL)  # not reaped yet: a zombie, gone all the same
        await until(pilot, lambda: state.connection.status is Status.EXITED, 20, "exited")
        await looked_again(pilot, app)
        text = screen_text(app)
        pid = loop.proc.pid
        assert f"● exited: process {pid} exited without ending the run (killed or crashed)" in text
        assert "no answer" not in text and state.connection.status is Status.EXITED
        assert other.run_id not in text and not state.offer.run

    run(app, check, WIDE)


def test_cancellations_from_another_shell_show_in_the_change_log_newest_first(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """Two live runs; ``memtui set`` and ``memtui cancel`` on one of them from another shell:
    the viewer shows the cancellation with who made it, and every entry newest first (pending
    #3 over #2; the viewer's own request over the older cancellation)."""
    watched = start_hook_loop(rate=100, seconds=60, checkpoint_every=NEVER)
    other = start_hook_loop(rate=100, seconds=60, checkpoint_every=NEVER)
    app = MemtuiApp(LiveSource(watched.run_id))

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.control is not None, 20, "the run's config")
        for words in (["set", "num_workers=2"], ["set", "num_workers=3"], ["cancel", "1"]):
            done = memtui_cli(words[0], watched.run_id, *words[1:])
            assert done.returncode == 0, done.stderr
        assert memtui_cli("cancel", "all").returncode == 2, "two live runs: name one"

        def cancelled() -> bool:
            return state.control is not None and [c.id for c in state.control.cancelled] == [1]

        await until(pilot, cancelled, 10, "the cancellation")
        told = memtui_cli("status", watched.run_id).stdout
        assert "cancelled #1 num_workers=2 at step" in told and "by cli:" in told, told
        await pilot.press("w", "5", "enter")

        def pending() -> list[int]:
            return [c.id for c in state.control.pending] if state.control is not None else []

        await until(pilot, lambda: pending() == [2, 3] and state.notices, 10, "#3 queued")
        app.refresh_view()
        await pilot.pause()
        lines = [line.strip("│ ") for line in screen_text(app).splitlines()]
        entries = [line for line in lines if line.startswith(("pending", "you", "cancelled"))]
        assert [e.split()[0:2] for e in entries] == [
            ["pending", "#3"],
            ["pending", "#2"],
            ["you", "queued"],
            ["cancelled", "step"],
        ], entries
        assert "#1 num_workers=2" in entries[3] and "from another shell" in entries[3]
        assert other.run_id not in screen_text(app)

    run(app, check, (WIDE[0], WIDE[1] + 8))  # the log's four entries below five knobs' rows


def test_a_plain_attach_among_two_live_runs_says_which_it_took(
    start_hook_loop: Callable[..., HookLoop],
) -> None:
    """``memtui attach`` with two live runs takes the newest and says so in the viewer (the
    note went to stderr, behind the viewer's screen), naming the other."""
    older = start_hook_loop(rate=100, seconds=60, checkpoint_every=NEVER)
    wait_for(lambda: listed(older.run_id), 20, 0.2, "the first run in memtui ls")
    newer = start_hook_loop(rate=100, seconds=60, checkpoint_every=NEVER)
    wait_for(lambda: listed(newer.run_id), 20, 0.2, "the second run in memtui ls")
    app = MemtuiApp(LiveSource(None))

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: bool(state.notices), 20, "the note of the run taken")
        app.refresh_view()
        await pilot.pause()
        text = " ".join(screen_text(app).split())
        assert f"2 live runs; picked the newest, {newer.run_id} (others: {older.run_id})" in text
        assert state.info is not None and state.info.run == newer.run_id

    run(app, check, WIDE)


def test_process_exited_tells_a_gone_or_reused_pid_from_a_live_one() -> None:
    """The pid check behind "exited": a live process is not, a reaped one is, and a pid whose
    process started after the run did is another process (reused)."""
    host, now = socket.gethostname(), time.time()
    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    assert reaped.wait(patience(30)) == 0
    assert registry.process_exited(reaped.pid, host, now)
    assert not registry.process_exited(os.getpid(), host, now)
    assert registry.process_exited(os.getpid(), host, now - 3600 * 24 * 365)
    assert not registry.process_exited(os.getpid(), "another-host", 0.0)


def test_attach_without_a_terminal_or_with_a_run_not_live_exits_at_once() -> None:
    """Nothing to wait for by default off a terminal, or for a RUN that is not live (a typo
    fails fast): exit status 1, with the way to wait."""
    for words in (["attach"], ["attach", "demo-000000"], ["attach", "--no-wait"]):
        result = CliRunner().invoke(main, words)
        assert result.exit_code == 1, (words, result.output)
        assert "--wait waits for one" in result.output, result.output
