"""Snapshot tests (pytest-textual-snapshot) on recorded streams replayed to a fixed point.

Deterministic by construction: a replay delivers its frames at once, every time and age shown
comes from the recording's clock, and nothing animates. Update after an intended change of the
look with ``pytest tests/tui/test_snapshots.py --snapshot-update`` and review the SVGs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from memtui.tui.app import MemtuiApp
from tests.tui.conftest import (
    ADVICE,
    OOM,
    RANKS_8,
    STARVING,
    forced_pending_offset,
    one_rank,
    pending_offset,
    replay_app,
    settle,
)

SIZES = {"wide": (120, 40), "narrow": (60, 50)}


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
    ],
    ids=lambda f: f.__name__,
)
def test_snapshot(snap_compare: Any, make: Callable[[], MemtuiApp], size: str) -> None:
    assert snap_compare(make(), terminal_size=SIZES[size], run_before=settle)
