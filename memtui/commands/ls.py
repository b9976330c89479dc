"""`memtui ls`: the live runs on this host."""

from __future__ import annotations

import time

import click

from memtui.commands.common import fail


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_command(as_json: bool) -> None:
    """List live runs on this host."""
    import json

    from memtui.runs.text import clean
    from memtui.storage import registry
    from memtui.transport.security import exposure, tcp_endpoints
    from memtui.wire import to_builtins

    try:
        runs = registry.list_runs()
    except registry.RegistryError as exc:
        fail(str(exc))
        return
    if as_json:
        rows = [
            {
                "run": r.run,
                "pid": r.pid,
                "host": r.host,
                "ranks": r.world_size,
                "started": r.started,
                "command": r.command,
                "cwd": r.cwd,
                "control": r.control,
                "endpoints": [to_builtins(k) for k in r.ranks],
                "state_dir": r.state_dir,
                "security": r.security,
            }
            for r in runs
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    if not runs:
        click.echo("no live runs")
        return
    click.echo(f"{'RUN':<24} {'PID':>7} {'RANKS':>5}  {'STARTED':<8}  COMMAND")
    for r in runs:
        started = time.strftime("%H:%M:%S", time.localtime(r.started))
        command = " ".join(r.command[1:] if len(r.command) > 1 else r.command)
        # a command line's control characters are shown, never obeyed by the terminal
        run, shown = clean(r.run), clean(command, 80)
        click.echo(f"{run:<24} {r.pid:>7} {r.world_size:>5}  {started:<8}  {shown}")
        warning = exposure(r.security, tcp_endpoints(r.ranks))
        if warning:
            click.echo(f"  {clean(warning)}")
