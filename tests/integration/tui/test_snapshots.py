"""Snapshot tests (pytest-textual-snapshot) on recorded streams replayed to a fixed point.

Deterministic by construction: a replay delivers its frames at once, every time and age shown
comes from the recording's clock, and nothing animates. Update after an intended change of the
look with ``pytest tests/integration/tui/test_snapshots.py --snapshot-update`` and review the SVGs.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from memtui.tui.app import MemtuiApp
from tests.support.processes import ROOT
from tests.support.viewer import (
    ADVICE,
    AUTOPILOT,
    OOM,
    RANKS_8,
    STARVING,
    WATCHED,
    autopilot_offset,
    forced_pending_offset,
    one_rank,
    pending_offset,
    replay_app,
    run,
    settle,
)

pytestmark = pytest.mark.heavy

SIZES = {"wide": (120, 40), "narrow": (60, 50)}
SNAPSHOTS = Path(__file__).parent / "__snapshots__" / "test_snapshots"


def starving() -> MemtuiApp:
    """The demo starving with --workers 0, num_workers=4 queued for the next checkpoint."""
    return replay_app(STARVING, until_s=pending_offset())


def starving_fixed() -> MemtuiApp:
    """The same demo at its end: num_workers=4 applied and measured, BALANCED, the loader
    workers counted by their own memory (USS); no memory limit, so the max safe batch is a
    floor (8x the largest micro-batch seen)."""
    return replay_app(STARVING)


def oom_risk() -> MemtuiApp:
    """Two CUDA ranks at 88% of 24 GiB, a change pending (synthetic: no GPU here)."""
    return replay_app(OOM)


def one_gpu() -> MemtuiApp:
    """The same CUDA stream as one rank alone: every memory number beside the bar."""
    return replay_app(one_rank(OOM))


def ranks_8() -> MemtuiApp:
    """Eight CUDA ranks: rank 5 straggles on data, rank 6 at 88% (synthetic: no GPU here)."""
    return replay_app(RANKS_8)


def advice_pending() -> MemtuiApp:
    """A real CPU demo under a 900 MiB limit: batch 8 applied and measured, batch 22 forced and
    pending with its predicted peak over the limit."""
    return replay_app(ADVICE, until_s=forced_pending_offset())


def advice_rollback() -> MemtuiApp:
    """The same run at its end: the forced change went out of memory and was rolled back."""
    return replay_app(ADVICE)


def autopilot() -> MemtuiApp:
    """A real demo tuned by its autopilot (no live run: its recording), measuring its second trial:
    its line at the top of the advice panel, its kept first trial in the change log as its own."""
    return replay_app(AUTOPILOT, until_s=autopilot_offset())


def watched() -> MemtuiApp:
    """A plain loop under ``memtui run`` at its end: the knobs it cannot change with their values
    (read from its loader, the accumulation measured), a change never applied."""
    return replay_app(WATCHED)


def disconnected() -> MemtuiApp:
    """The demo starving, then silent for 10 s: the run is gone without a word."""
    return replay_app(STARVING, until_s=20.0, at_end="disconnect")


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
@pytest.mark.parametrize(
    "make",
    [
        starving,
        starving_fixed,
        oom_risk,
        one_gpu,
        ranks_8,
        disconnected,
        advice_pending,
        advice_rollback,
        autopilot,
        watched,
    ],
    ids=lambda f: f.__name__,
)
def test_snapshot(snap_compare: Any, make: Callable[[], MemtuiApp], size: str) -> None:
    assert snap_compare(make(), terminal_size=SIZES[size], run_before=settle)


def svg_lines(svg: str) -> list[str]:
    """The text of a screenshot's SVG, line by line (each run of text put at its column)."""
    runs = re.findall(
        r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="([\d.]+)" '
        r'clip-path="url\(#[\w-]+-line-(\d+)\)">([^<]*)</text>',
        svg,
    )
    cell = min(float(length) / len(html.unescape(text)) for _x, length, _n, text in runs if text)
    rows: dict[int, list[str]] = {}
    for x, _length, number, escaped in runs:
        text = html.unescape(escaped).replace("\xa0", " ")
        row = rows.setdefault(int(number), [])
        column = round(float(x) / cell)
        row.extend(" " * (column + len(text) - len(row)))
        row[column : column + len(text)] = text
    return ["".join(rows[n]).rstrip() for n in sorted(rows)]


def test_the_side_pane_snapshot_shows_the_change_landing() -> None:
    """At 60x50, the demo's num_workers change applied at step 300 and measured: its line and its
    effect are in the SVG the snapshot test compares (made the same way: settled, then saved)
    beside the verdict, the config and the memory numbers; nothing is scrolled off."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        assert pilot.app.screen.max_scroll_y == 0
        text = "\n".join(svg_lines(pilot.app.export_screenshot()))
        assert "BALANCED" in text and "num_workers          4" in text and "main RSS" in text
        stored = SNAPSHOTS / "test_snapshot[starving_fixed-narrow].svg"
        saved = "\n".join(svg_lines(stored.read_text(encoding="utf-8")))
        for svg in (text, saved):  # the stored one too (--snapshot-update writes it at the end)
            assert "applied  step 300  num_workers 0 → 4" in svg, svg
            assert re.search(r"\+\d+% samples/s, peak \d+ MiB → \d+ MiB", svg), svg

    run(starving_fixed(), check, SIZES["narrow"])


def test_the_autopilot_snapshot_shows_its_line_and_its_own_change() -> None:
    """The stored SVGs (both sizes) say what the autopilot does and mark its trial in the change
    log as its own: the snapshot shows the autopilot, not only a replay."""
    for size in SIZES:
        stored = SNAPSHOTS / f"test_snapshot[autopilot-{size}].svg"
        text = "\n".join(svg_lines(stored.read_text(encoding="utf-8")))
        assert "autopilot on: measuring num_workers=2" in text, text
        assert "num_workers 1 → 2  #2  by the autopilot" in text, text


def test_the_viewer_guide_says_which_lines_wrap_and_which_are_cut() -> None:
    """The stored snapshots: at 120 columns a recommendation longer than its panel is cut with
    ``…``; in the side pane the top recommendation wraps between its parts, never cut. The
    viewer guide says both."""
    cut = []
    for size in SIZES:
        for svg in sorted(SNAPSHOTS.glob(f"test_snapshot[[]*-{size}].svg")):
            lines = svg_lines(svg.read_text(encoding="utf-8"))
            cut += [(size, line) for line in lines if re.search(r"│ 1\. .*…\s*│$", line)]
    assert cut and all(size == "wide" for size, _ in cut), cut
    guide = " ".join((ROOT / "docs" / "guides" / "viewer.md").read_text().split())
    assert "a line longer than its panel is cut with `…`" in guide
    assert "the top recommendation wrap between their parts" in guide
