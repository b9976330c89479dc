"""`memtui autotune`: the autopilot on or off."""

from __future__ import annotations

import click

from memtui.commands.common import TIMEOUT_HELP, client_for, fail, find_target


@click.command("autotune")
@click.argument("switch", type=click.Choice(["on", "off"]))
@click.argument("run", required=False)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def autotune_command(switch: str, run: str | None, timeout: float) -> None:
    """Turn the autopilot on or off: memtui autotune on|off [RUN]."""
    from memtui.advice.autopilot import describe_state
    from memtui.transport.client import ClientError

    target = find_target(run, changes=True, usage=f"memtui autotune {switch} RUN")
    try:
        reply = client_for(target, timeout).autotune(switch == "on")
    except ClientError as exc:
        fail(str(exc))
        return
    if not reply.ok or reply.state is None:
        fail(reply.reason or "the run did not say", 2)
        return
    click.echo(describe_state(reply.state) + (f" on {target.run}" if target.run else ""))
