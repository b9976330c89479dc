"""The command line's own surface: every option says what it does in ``--help``, what
``memtui set`` prints where, each command asks for its run in its own words, and the demo's
first line is its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from memtui.cli import main
from memtui.core.knobs import LR_RULES
from memtui.demo.launcher import NO_NUMPY_WARNING, quiet_numpy_warning
from memtui.hooks import Options, Tuner
from tests.integration.test_tuner import Config
from tests.support.cli import memtui_cli, memtui_here
from tests.support.clock import patience


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


def test_with_two_runs_each_command_asks_for_its_run_in_its_own_words(tmp_path: Path) -> None:
    """Two live runs: ``cancel``, ``autotune`` and ``set`` without RUN each say their own usage
    (not ``memtui set RUN ...`` for all three); a missing RUN and a prefix matching both runs
    are the same usage error (exit 2), a RUN matching none a lookup failure (exit 1); cancelling
    all with nothing pending says so and succeeds."""
    first = Tuner(Config(), name="cli", state_dir=tmp_path / "a", options=Options()).start()
    second = Tuner(Config(), name="cli", state_dir=tmp_path / "b", options=Options()).start()
    try:
        for words, usage in (
            (["cancel", "all"], "memtui cancel RUN all"),
            (["cancel", "3"], "memtui cancel RUN 3"),
            (["autotune", "on"], "memtui autotune on RUN"),
            (["set", "num_workers=1"], "memtui set RUN KEY=VALUE..."),
        ):
            asked = memtui_here(*words)
            assert asked.exit_code == 2, asked.output
            assert f"2 live runs: name the one to change ({usage}): " in asked.stderr, asked.stderr
            assert first.run_id in asked.stderr and second.run_id in asked.stderr
        both = memtui_here("cancel", "cli", "all")  # both run ids start with the tuner's name
        assert both.exit_code == 2 and "'cli' matches several runs" in both.stderr, both.output
        missing = memtui_here("cancel", "nosuch", "all")
        assert missing.exit_code == 1 and "no live run matches 'nosuch'" in missing.stderr
        nothing = memtui_here("cancel", first.run_id, "all")
        assert nothing.exit_code == 0, nothing.output
        assert nothing.stdout == f"nothing pending on {first.run_id}\n" and not nothing.stderr
        assert memtui_here("set", first.run_id, "num_workers=1").exit_code == 0
        cancelled = memtui_here("cancel", first.run_id, "all")
        assert cancelled.stdout == f"cancelled #1 on {first.run_id}\n", cancelled.output
        unknown = memtui_here("cancel", first.run_id, "7")
        assert unknown.exit_code == 2 and "no pending change #7" in unknown.stderr
    finally:
        first.close()
        second.close()


def test_the_demo_does_not_start_with_torchs_numpy_warning(tmp_path: Path) -> None:
    """Where NumPy is not installed, torch warns ``Failed to initialize NumPy`` as it is imported:
    the demo's training (in this command's process, or a child such as torchrun's launcher and
    its ranks) leaves that one warning out; a user's own script keeps it."""
    hidden = tmp_path / "site"  # NumPy not installed, as in a venv with torch alone
    hidden.mkdir()
    (hidden / "numpy.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(hidden))
    warning = "Failed to initialize NumPy"

    def imports_torch(extra: dict[str, str]) -> str:
        done = subprocess.run(
            [sys.executable, "-c", "import torch"],
            capture_output=True, text=True, env={**env, **extra}, timeout=patience(120),
        )  # fmt: skip
        return done.stderr

    assert warning in imports_torch({}), "a user's script: torch's own warning, as it is"
    children = quiet_numpy_warning(os.environ.get("PYTHONWARNINGS", ""))
    assert warning not in imports_torch({"PYTHONWARNINGS": children})
    assert quiet_numpy_warning("error") == f"{NO_NUMPY_WARNING},error", "the user's filters win"
    demo = memtui_cli(
        "demo", "--no-tui", "--steps", "2", "--out", str(tmp_path / "out"), env=env, timeout=120
    )
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.startswith("run demo-"), demo.stdout
    assert "NumPy" not in demo.stdout + demo.stderr, demo.stderr
