"""`memtui status`: a run's step, speed, memory, config and changes."""

from __future__ import annotations

import click

from memtui.commands.common import TIMEOUT_HELP, client_for, fail, find_target, threshold_config


@click.command("status")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def status_command(run: str | None, as_json: bool, timeout: float) -> None:
    """Show a run's step, speed, memory, config and changes (RUN: id, prefix, pid or endpoint)."""
    from memtui.runs.poll import read_status
    from memtui.runs.report import render_status, status_json
    from memtui.transport.client import ClientError

    target = find_target(run)
    try:
        report = read_status(client_for(target, timeout), threshold_config())
    except ClientError as exc:
        fail(str(exc))
        return
    click.echo(status_json(report) if as_json else render_status(report))
