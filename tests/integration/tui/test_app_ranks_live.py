"""The viewer on a real two-rank run (gloo on CPU): one view, one decision, a rank lost.

One job for the whole file, its two ranks forked with torchrun's environment (``launch_ranks``;
under torchrun itself with ``MEMTUI_TEST_FORK=0``): both ranks' rows appear and advance, a change
queued with the keys lands on both ranks at the same step, then rank 1 is stopped (SIGSTOP) and
its row goes silent while the viewer stays live on rank 0.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from memtui.runs.events import Status
from memtui.transport.sources import LiveSource
from memtui.tui.app import MemtuiApp
from memtui.tui.widgets.ranks import COLUMN_GAP, ROW_WIDTH
from tests.support.processes import LIGHT, DemoRun
from tests.support.viewer import run, screen_text, until

pytestmark = pytest.mark.heavy

EVERY = 120
"""Checkpoint every 120 steps (2.4 s at the 50 steps/s an idle machine gives, more under load).

The change is pending from the keys to the next boundary: the agent sends it at once, and the
test has to see it in that window. At 60 steps a loaded machine (two pytest workers, the two
ranks) once folded the pending state and the boundary's batch into one refresh: never seen.
"""


def text_of(app: MemtuiApp, selector: str) -> str:
    """The plain text a widget shows."""
    rendered = app.screen.query_one(selector).render()
    return str(getattr(rendered, "plain", rendered))


def rows(app: MemtuiApp) -> list[list[str]]:
    """The per-rank table's rows (read across its columns), each split into cells."""
    table = text_of(app, "#ranks").splitlines()
    lines = table[
        next(i for i, line in enumerate(table) if line.lstrip().startswith("rank ")) + 1 :
    ]
    step = ROW_WIDTH + COLUMN_GAP
    return [line[i : i + step].split() for line in lines for i in range(0, len(line), step)]


def test_two_ranks_one_view_one_decision_and_a_lost_rank(
    start_demo: Callable[..., DemoRun],
) -> None:
    # a light model whose loader sleeps: about the default model's pace flat out (~50 ms a
    # step), at a tenth of its CPU (two ranks flat out took both cores of a 2-core machine)
    demo = start_demo("--steps", "100000", "--checkpoint-every", str(EVERY), "--slow-data-ms", "3",
                      "--batch-size", "8", *LIGHT, ranks=2)  # fmt: skip
    app = MemtuiApp(LiveSource(demo.run_id))
    stopped: list[int] = []

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state

        def steps(rank: int) -> int:
            series = state.series.get(rank)
            return series.last_step if series is not None else 0

        await until(pilot, lambda: steps(0) > 0 and steps(1) > 0, 60, "both ranks' steps")
        first = (steps(0), steps(1))
        await until(pilot, lambda: steps(0) > first[0] + 3 and steps(1) > first[1] + 3, 30,
                    "both ranks to advance")  # fmt: skip
        await until(pilot, lambda: all(s.control for s in state.series.values()), 10,
                    "every rank's own config (its hello)")  # fmt: skip
        app.refresh_view()
        await pilot.pause()
        table = text_of(app, "#ranks")
        assert "2 ranks · median" in table
        assert sorted(row[0] for row in rows(app)) == ["0", "1"], table
        assert state.connection.status is Status.LIVE

        await until(pilot, lambda: 0 < steps(0) % EVERY < EVERY // 3, 40, "a boundary just passed")
        await pilot.press("a", "3", "enter")

        def landed() -> bool:
            return all(
                s.control is not None and s.control.config.grad_accum == 3
                for s in state.series.values()
            )

        await until(pilot, lambda: state.pending_values() == {"grad_accum": 3}, 10, "pending")
        app.refresh_view()
        await pilot.pause()
        # under load the boundary may already have taken it: then the panel shows it as now
        assert "→ 3" in text_of(app, "#config") or landed(), text_of(app, "#config")

        await until(pilot, landed, 60, "the change on both ranks")
        applied = [s.control.applied[-1] for s in state.series.values() if s.control]
        assert applied[0].step == applied[1].step and applied[0].ids == applied[1].ids
        assert applied[0].step % EVERY == 0
        app.refresh_view()
        await pilot.pause()
        assert f"applied  step {applied[0].step}  on 2/2 ranks  grad_accum 2 → 3" in text_of(
            app, "#changes"
        )

        pid = next(r.pid for r in state.ranks if r.rank == 1)
        os.kill(pid, signal.SIGSTOP)  # rank 1 hangs; rank 0 waits for it, its agent still sends
        stopped.append(pid)
        await until(pilot, lambda: 1 in state.summary().silent, 15, "rank 1 to go silent")
        app.refresh_view()
        await pilot.pause()
        assert state.connection.status is Status.LIVE and 0 not in state.summary().silent
        assert "rank 1 silent" in text_of(app, "#header")
        first_row = rows(app)[0]
        assert first_row[0] == "1" and "no data" in " ".join(first_row), "silent ranks first"
        assert app.receiver.counts.errors == 0
        assert "● live" in screen_text(app)

    try:
        run(app, check, (120, 40))
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
