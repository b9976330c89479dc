"""`memtui attach`: the viewer on a run."""

from __future__ import annotations

import os
import sys

import click


@click.command("attach")
@click.argument("run", required=False)
@click.option("--readonly", is_flag=True, help="Show everything, send nothing (for shared panes).")
@click.option(
    "--insecure",
    is_flag=True,
    help="Reach plain (keyless) TCP endpoints, on loopback only (read-only unless the run "
    "was started with --insecure-control).",
)
@click.option(
    "--wait/--no-wait",
    default=None,
    help="Wait for a run if none matches (default: wait without RUN on a terminal).",
)
def attach_command(run: str | None, readonly: bool, insecure: bool, wait: bool | None) -> None:
    """Open the viewer on a run (RUN: id, prefix, pid or endpoint; default: the newest) and stay
    on it; without RUN, f follows another run once this one is gone."""
    from memtui.tui.app import run_app

    if insecure:
        os.environ["MEMTUI_INSECURE"] = "1"  # read by every client socket the viewer makes
    if wait is None:
        wait = run is None and sys.stdout.isatty()
    sys.exit(run_app(run, readonly=readonly, wait=wait))
