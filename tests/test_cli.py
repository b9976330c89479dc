"""The command line's own surface: every option says what it does in ``--help``."""

from __future__ import annotations

import click
from click.testing import CliRunner

from memtui.cli import main
from memtui.knobs import LR_RULES


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


def test_set_refuses_an_lr_rule_without_allowing_the_effective_batch_to_change() -> None:
    """Both refused before any run is looked for: the words say which flag is missing or clashes."""
    runner = CliRunner()
    alone = runner.invoke(main, ["set", "batch_size=16", "--lr-scale", "linear"])
    assert alone.exit_code == 2 and "--lr-scale needs --allow-effective-batch" in alone.output
    both = runner.invoke(
        main, ["set", "batch_size=16", "--keep-effective-batch", "--allow-effective-batch"]
    )
    assert both.exit_code == 2 and "contradict" in both.output
    choices = next(p for p in main.commands["set"].params if p.name == "lr_scale").type
    assert tuple(choices.choices) == LR_RULES  # type: ignore[attr-defined]
    rule = runner.invoke(
        main, ["set", "batch_size=16", "--allow-effective-batch", "--lr-scale", "cube"]
    )
    assert rule.exit_code == 2 and "'cube' is not one of 'linear', 'sqrt', 'none'" in rule.output
