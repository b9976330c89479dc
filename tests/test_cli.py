"""The command line's own surface: every option says what it does in ``--help``, and what
``memtui set`` prints where."""

from __future__ import annotations

from pathlib import Path

import click
from click.testing import CliRunner

from memtui.cli import main
from memtui.hooks import Options, Tuner
from memtui.knobs import LR_RULES
from tests.conftest import memtui_here
from tests.test_tuner import Config


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


def test_set_answers_on_stdout_in_order_and_quiet_prints_the_id_alone(tmp_path: Path) -> None:
    """``memtui set`` against a live run: what was queued, with its id, then the predicted peak,
    on stdout (a pipe or a log gets the whole answer, in the order a terminal shows it); a note
    on stderr; ``-q`` prints the id alone for scripts, and ``memtui cancel`` takes it."""
    tuner = Tuner(Config(), name="cli", state_dir=tmp_path, options=Options()).start()
    try:
        queued = memtui_here("set", tuner.run_id, "num_workers=1")
        assert queued.exit_code == 0, queued.output
        said = queued.stdout.splitlines()
        assert (
            said[0]
            == f"queued #1 on {tuner.run_id}: num_workers=1 (applies at the next checkpoint)"
        )
        assert said[1].startswith("predicted peak"), said
        assert len(said) == 2 and queued.stderr == "", queued.output
        pinned = memtui_here("set", tuner.run_id, "pin_memory=true", "-q")
        assert pinned.exit_code == 0 and pinned.stdout == "2\n", pinned.output
        assert pinned.stderr.startswith("note: pin_memory=true has no effect"), pinned.stderr
        cancelled = memtui_here("cancel", tuner.run_id, pinned.stdout.strip())
        assert cancelled.stdout.startswith("cancelled #2"), cancelled.output
        dry = memtui_here("set", tuner.run_id, "batch_size=8", "--dry-run", "--quiet")
        assert dry.exit_code == 0 and dry.stdout == "", dry.output
        both = memtui_here("set", tuner.run_id, "batch_size=8", "-q", "--json")
        assert both.exit_code == 2 and "--quiet and --json contradict" in both.stderr
        assert [c.id for c in tuner.control.state().pending] == [1]
    finally:
        tuner.close()
