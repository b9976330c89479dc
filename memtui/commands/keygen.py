"""`memtui keygen`: the CURVE keys for runs over TCP."""

from __future__ import annotations

import click

from memtui.commands.common import fail


@click.command("keygen")
@click.option("--force", is_flag=True, help="Replace existing keys.")
def keygen_command(force: bool) -> None:
    """Make the CURVE keys for multi-node runs over TCP (files 0600 in ~/.config/memtui/curve)."""
    from memtui.transport.security import SecurityError, keygen

    try:
        root = keygen(force=force)
    except SecurityError as exc:
        fail(str(exc))
        return
    click.echo(f"keys written to {root}")
    click.echo("copy this directory to every node of the job (or share the home directory)")
