"""`memtui cancel`: cancel a pending change."""

from __future__ import annotations

import click

from memtui.commands.common import TIMEOUT_HELP, client_for, fail, find_target

NOTHING_PENDING = "no change is pending"
"""The hook's answer to cancelling every pending change when none is."""


@click.command("cancel")
@click.argument("args", nargs=-1)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def cancel_command(args: tuple[str, ...], timeout: float) -> None:
    """Cancel a pending change: memtui cancel [RUN] ID (or 'all')."""
    from memtui.transport.client import ClientError

    words = list(args)
    if not words:
        fail("give the change id to cancel, or 'all'", 2)
    which = words.pop()
    run = words[0] if words else None
    if which != "all" and not which.lstrip("#").isdigit():
        fail(f"expected a change id or 'all', got {which!r}", 2)
    change_id = 0 if which == "all" else int(which.lstrip("#"))
    target = find_target(run, changes=True, usage=f"memtui cancel RUN {which}")
    try:
        reply = client_for(target, timeout).cancel(change_id)
    except ClientError as exc:
        fail(str(exc))
        return
    where = f" on {target.run}" if target.run else ""
    if not reply.ok and change_id == 0 and reply.reason == NOTHING_PENDING:
        click.echo(f"nothing pending{where}")  # all of nothing is cancelled: not an error
        return
    if not reply.ok:
        fail(reply.reason, 2)
    click.echo("cancelled " + " ".join(f"#{i}" for i in reply.cancelled) + where)
