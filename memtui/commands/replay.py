"""`memtui replay`: a recorded stream in the viewer."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    pass


@click.command("replay")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--speed",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Playback speed (x real time, above 0).",
)
def replay_command(path: str, speed: float) -> None:
    """Show a recorded stream (.mtrec) in the viewer, with pause and speed controls."""
    from memtui.tui.app import run_replay

    sys.exit(run_replay(path, speed=speed))
