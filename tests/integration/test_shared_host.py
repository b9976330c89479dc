"""Several runs on one host: commands that change a run never guess which."""

from __future__ import annotations

from pathlib import Path

from memtui.hooks import Options, Tuner
from tests.integration.test_tuner import Config
from tests.support.cli import memtui_cli
from tests.support.processes import wait_for


def test_set_and_cancel_refuse_to_guess_among_live_runs_and_name_the_run(tmp_path: Path) -> None:
    """With two live runs, ``memtui set`` and ``cancel`` without a RUN exit 2 and list both
    (one used to be picked, the newest, and the confirmation did not name it); named, the
    confirmation says which run it touched. ``status`` still shows the newest, and says so."""
    first = Tuner(Config(), name="first", state_dir=tmp_path / "a", options=Options()).start()
    second = Tuner(Config(), name="second", state_dir=tmp_path / "b", options=Options()).start()
    try:
        wait_for(
            lambda: len(memtui_cli("ls", "--json").stdout.split('"run"')) == 3, 20, what="2 runs"
        )
        refused = memtui_cli("set", "num_workers=2")
        assert refused.returncode == 2, refused.stderr
        assert "2 live runs: name the one to change" in refused.stderr
        assert first.run_id in refused.stderr and second.run_id in refused.stderr
        assert memtui_cli("cancel", "all").returncode == 2
        assert first.control.state().pending == [] and second.control.state().pending == []

        named = memtui_cli("set", first.run_id, "num_workers=2")
        assert named.returncode == 0, named.stderr
        assert named.stdout.startswith(f"queued #1 on {first.run_id}: num_workers=2")
        assert len(first.control.state().pending) == 1 and not second.control.state().pending
        dry = memtui_cli("set", second.run_id, "num_workers=3", "--dry-run")
        assert f"would queue num_workers=3 on {second.run_id}" in dry.stdout
        cancelled = memtui_cli("cancel", first.run_id, "1")
        assert cancelled.stdout.strip() == f"cancelled #1 on {first.run_id}"
        status = memtui_cli("status")
        assert status.returncode == 0 and "2 live runs; picked the newest" in status.stderr
    finally:
        first.close()
        second.close()
