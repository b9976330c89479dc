"""The command line's own surface: every option says what it does in ``--help``."""

from __future__ import annotations

import click
from click.testing import CliRunner

from memtui.cli import main


def test_every_option_of_every_command_has_help() -> None:
    """An option without help text shows as a bare flag in ``--help`` (``--timeout`` did)."""
    bare = [
        f"{name} {'/'.join(param.opts)}"
        for name, command in main.commands.items()
        for param in command.params
        if isinstance(param, click.Option) and not param.help and "--help" not in param.opts
    ]
    assert not bare, bare
    for name in ("status", "set", "cancel"):
        shown = CliRunner().invoke(main, [name, "--help"]).output
        assert "Seconds to wait for the run's answer." in shown, shown
