"""`memtui export`: every live run of this node as Prometheus metrics."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from memtui.commands.common import fail, threshold_config


@click.command("export")
@click.option(
    "--listen",
    default="127.0.0.1:9464",
    show_default=True,
    metavar="HOST:PORT|unix:PATH",
    help="Where to serve /metrics: a TCP address (:PORT: every interface), answering the bearer "
    "token only, or a Unix socket only this user and root can open (see the security model).",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="PATH",
    help="The bearer token a TCP scrape must send, made here (0600) if missing "
    "[default: ~/.config/memtui/export-token].",
)
@click.option(
    "--no-token",
    is_flag=True,
    help="Serve TCP without a token: anyone who reaches the port reads every run's metrics.",
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
    "--max-per-peer",
    type=click.IntRange(min=1),
    metavar="N",
    default=4,
    show_default=True,
    help="HTTP connections served at once for one peer (a local account, else an address); "
    "those beyond are answered 503 at once.",
)
@click.option(
    "--http-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Time a connection has to send its request line and headers (and to take each write "
    "of the reply).",
)
@click.option("--dashboard", is_flag=True, help="Print the Grafana dashboard (JSON) and exit.")
def export_command(
    listen: str,
    token_file: Path | None,
    no_token: bool,
    max_runs: int,
    max_connections: int,
    max_per_peer: int,
    http_timeout: float,
    dashboard: bool,
) -> None:
    """Serve every live run on this node as Prometheus metrics (OpenMetrics at /metrics)."""
    from memtui.export.auth import TokenError, default_token_file, load_token
    from memtui.export.serve import ListenError, parse_listen, serve, unix_path
    from memtui.export.serve import dashboard as dashboard_json

    if dashboard:
        click.echo(dashboard_json(), nl=False)
        return
    host, port = "", 0
    try:
        unix = unix_path(listen)
        if not unix:
            host, port = parse_listen(listen)
    except ListenError as exc:
        fail(str(exc), 2)
        return
    if no_token and token_file is not None:
        fail("--no-token and --token-file: choose one", 2)
        return
    token = ""
    token_path = token_file or default_token_file()
    if not unix and not no_token:
        try:
            token = load_token(token_path)
        except TokenError as exc:
            fail(f"{exc}", 2)
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
            max_per_peer=max_per_peer,
            timeout_s=http_timeout,
            token=token,
            token_file=str(token_path),
            unix=unix,
        )
    )
