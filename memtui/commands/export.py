"""`memtui export`: every live run of this node as Prometheus metrics."""

from __future__ import annotations

import sys

import click

from memtui.commands.common import fail, threshold_config


@click.command("export")
@click.option(
    "--listen",
    default="127.0.0.1:9464",
    show_default=True,
    metavar="HOST:PORT",
    help="Where to serve /metrics; :PORT listens on every interface (see the security model).",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    metavar="N",
    default=64,
    show_default=True,
    help="Runs watched at once (a thread each); runs beyond are counted, not watched.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    metavar="N",
    default=32,
    show_default=True,
    help="HTTP connections served at once; those beyond are answered 503 at once.",
)
@click.option(
    "--http-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Time a connection has to send its request (and to take each write of the reply).",
)
@click.option("--dashboard", is_flag=True, help="Print the Grafana dashboard (JSON) and exit.")
def export_command(
    listen: str, max_runs: int, max_connections: int, http_timeout: float, dashboard: bool
) -> None:
    """Serve every live run on this node as Prometheus metrics (OpenMetrics at /metrics)."""
    from memtui.export.serve import ListenError, parse_listen, serve
    from memtui.export.serve import dashboard as dashboard_json

    if dashboard:
        click.echo(dashboard_json(), nl=False)
        return
    try:
        host, port = parse_listen(listen)
    except ListenError as exc:
        fail(str(exc), 2)
        return

    def say(line: str) -> None:
        click.echo(f"memtui export: {line}", err=True)

    sys.exit(
        serve(
            host,
            port,
            threshold_config(),
            say,
            max_runs=max_runs,
            max_connections=max_connections,
            timeout_s=http_timeout,
        )
    )
