"""`memtui status`: a run's step, speed, memory, config and changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from memtui.commands.common import TIMEOUT_HELP, client_for, fail, find_target, threshold_config

if TYPE_CHECKING:
    from memtui.wire import Snapshot


def rank_snapshots(snapshot: Snapshot, timeout: float = 2.0) -> list[Snapshot | None]:
    """Rank 0's snapshot and every other rank's (None where a rank did not answer)."""
    from memtui import registry
    from memtui.client import hello_many

    others = [r for r in snapshot.ranks if r.rank != snapshot.info.rank]
    answers = hello_many([registry.rank_control(r) for r in others], timeout_s=timeout)
    by_rank = {r.rank: a for r, a in zip(others, answers, strict=True)}
    by_rank[snapshot.info.rank] = snapshot
    return [by_rank.get(r.rank) for r in snapshot.ranks] if snapshot.ranks else [snapshot]


@click.command("status")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def status_command(run: str | None, as_json: bool, timeout: float) -> None:
    """Show a run's step, speed, memory, config and changes (RUN: id, prefix, pid or endpoint)."""
    from memtui.client import ClientError
    from memtui.report import build_status, render_status, status_json

    target = find_target(run)
    try:
        snapshot = client_for(target, timeout).hello()
    except ClientError as exc:
        fail(str(exc))
        return
    ranks = rank_snapshots(snapshot) if len(snapshot.ranks) > 1 else None
    report = build_status(snapshot, ranks, threshold_config())
    click.echo(status_json(report) if as_json else render_status(report))
