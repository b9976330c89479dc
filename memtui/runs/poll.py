"""A live run read once, as ``memtui status`` reads it: rank 0's snapshot, then every other rank's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtui.storage import registry
from memtui.transport.client import hello_many

if TYPE_CHECKING:
    from memtui.advice.verdict import ThresholdConfig
    from memtui.runs.report import StatusReport
    from memtui.transport.client import ControlClient
    from memtui.wire import Snapshot


def rank_snapshots(snapshot: Snapshot, timeout: float = 2.0) -> list[Snapshot | None]:
    """Rank 0's snapshot and every other rank's (None where a rank did not answer)."""
    others = [r for r in snapshot.ranks if r.rank != snapshot.info.rank]
    answers = hello_many([registry.rank_control(r) for r in others], timeout_s=timeout)
    by_rank = {r.rank: a for r, a in zip(others, answers, strict=True)}
    by_rank[snapshot.info.rank] = snapshot
    return [by_rank.get(r.rank) for r in snapshot.ranks] if snapshot.ranks else [snapshot]


def read_status(client: ControlClient, thresholds: ThresholdConfig | None) -> StatusReport:
    """The run's status report from one hello (and one per other rank); raises ClientError."""
    from memtui.runs.report import build_status

    snapshot = client.hello()
    ranks = rank_snapshots(snapshot) if len(snapshot.ranks) > 1 else None
    return build_status(snapshot, ranks, thresholds)
