"""`memtui run`: a command with memtui in every Python process it starts."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    pass


@click.command(
    "run",
    short_help="Run a command with memtui in its Python processes.",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--name", help="The run's name, as install(name=...) gives it.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    help="Where the run keeps its audit log and tuned config, as install(state_dir=...).",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND [ARGS]...")
def run_command(name: str | None, state_dir: str | None, command: tuple[str, ...]) -> None:
    """Run a command with memtui in every Python process it starts (no code change)."""
    from memtui.launch.run import exec_command

    if not command:
        raise click.UsageError("name the command to run: memtui run -- python train.py")
    sys.exit(exec_command(command, name=name, state_dir=state_dir))
