"""What memtui reads from files is bounded and shown as text: a recording that is a device, a FIFO
or too large; terminal escapes in the config file's keys, a tuned config's note or a run's command
line never reach the terminal as escapes."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from memtui.hooks import Options, Tuner
from memtui.hooks.persist import TUNED_FILE
from memtui.transport import recording
from tests.support.cli import memtui_cli, memtui_here

ESCAPES = "\x1b]0;owned\x07\x1b[2J"
"""A terminal title set and a cleared screen: obeyed if printed raw."""
IN_YAML = '"\\e]0;owned\\a\\e[2J"'
"""``ESCAPES`` as a YAML file writes them (raw control characters are not YAML)."""
DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_replay_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    """``/dev/zero`` grew the reader without bound and a FIFO blocked it: both are refused at
    once, in one line."""
    path = Path("/dev/zero")
    if kind == "fifo":
        path = tmp_path / "run.mtrec"
        os.mkfifo(path)
    done = memtui_cli("replay", str(path), timeout=20)
    assert done.returncode == 1
    assert done.stderr == f"memtui: cannot replay {path}: {path} is not a regular file: refused\n"


def test_replay_reads_a_bounded_part_of_a_larger_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording larger than memtui reads is replayed as far as it was read, and that is said."""
    path = DATA / "demo_starving.mtrec"
    whole = recording.read_recording(path)
    monkeypatch.setattr(recording, "MAX_RECORDING", path.stat().st_size // 2)
    part = recording.read_recording(path)
    assert 0 < len(part.frames) < len(whole.frames) and part.limited
    assert part.cut_note.startswith(f"the recording is {path.stat().st_size} bytes, more than")


def test_the_config_files_keys_are_shown_not_obeyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"verdict:\n  {IN_YAML}: 1\n")
    monkeypatch.setenv("MEMTUI_CONFIG", str(config))
    with caplog.at_level(logging.WARNING, "memtui"):
        tuner = Tuner(SimpleNamespace(batch_size=8), state_dir=tmp_path / "state").start()
    try:
        said = [r.getMessage() for r in caplog.records if "unknown key" in r.getMessage()]
        assert len(said) == 1 and "\x1b" not in said[0] and "␛]0;owned␇" in said[0], said
        status = memtui_cli("status")
        assert status.returncode == 0, status.stderr
        assert "unknown key" in status.stderr and "\x1b" not in status.stderr, status.stderr
    finally:
        tuner.close()


def test_a_tuned_configs_note_is_shown_not_obeyed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / TUNED_FILE).write_text(
        "run: x\nstep: 4\nconfig:\n  batch_size: 8\n"
        f"ceiling:\n  batch_size: 16\n  step: 4\n  note: {IN_YAML}\n"
    )
    (tmp_path / TUNED_FILE).chmod(0o600)
    with caplog.at_level(logging.WARNING, "memtui"):
        tuner = Tuner(
            SimpleNamespace(batch_size=4), state_dir=tmp_path, resume=True, options=Options()
        ).start()
    tuner.close()
    said = [r.getMessage() for r in caplog.records if "ceiling" in r.getMessage()]
    assert len(said) == 1 and "\x1b" not in said[0] and "␛[2J" in said[0], said


def test_ls_shows_a_command_lines_escapes_as_symbols(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.argv", ["train.py", ESCAPES])
    tuner = Tuner(SimpleNamespace(batch_size=8), state_dir=tmp_path, options=Options()).start()
    try:
        listed = memtui_here("ls")
        assert listed.exit_code == 0 and tuner.run_id in listed.stdout
        assert "\x1b" not in listed.stdout and "␛]0;owned␇␛[2J" in listed.stdout
    finally:
        tuner.close()
