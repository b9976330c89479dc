"""Several runs on one host: commands that change a run never guess which, and a run is never
taken for dead because the wall clock stepped."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import msgspec

from memtui.hooks import Options, Tuner
from memtui.storage import ownfiles, registry
from memtui.wire import decode_run_record, encode_run_record
from tests.integration.test_tuner import Config
from tests.support.cli import memtui_cli, memtui_here
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


def rewrite_record(runtime: Path, run: str, **changes: object) -> None:
    """Rewrite a registry record's fields in place, as another clock or another process would
    make them read."""
    path = runtime / run / registry.RUN_FILE
    record = decode_run_record(path.read_bytes())
    assert record is not None
    ownfiles.replace_file(path, encode_run_record(msgspec.structs.replace(record, **changes)))


def test_a_clock_step_never_makes_ls_drop_a_live_run(tmp_path: Path, private_runtime: Path) -> None:
    """A run's start time is read against the boot time, which a step of the wall clock moves:
    a live run whose start time no longer matches its record (a clock stepped by an hour) is
    listed while its control socket answers, and its directory kept; a run whose process is gone,
    a pid that now names another process, and an old directory without a record or a live
    socket are removed; an old directory whose socket answers (a run still starting) is kept."""
    live = Tuner(Config(), name="live", state_dir=tmp_path / "a", options=Options()).start()
    try:
        wait_for(lambda: registry.list_runs(), 20, what="the run to register")
        record = registry.list_runs()[0]
        rewrite_record(private_runtime, live.run_id, create_time=record.create_time + 3600)
        gone = subprocess.Popen(["true"])
        gone.wait()
        for name, pid in (("gone-1", gone.pid), ("reused-1", os.getpid())):
            (private_runtime / name).mkdir(mode=0o700)
            fake = msgspec.structs.replace(record, run=name, pid=pid, create_time=1.0)
            fake = msgspec.structs.replace(fake, control=f"ipc://{private_runtime / name / 'ctl'}")
            ownfiles.replace_file(
                private_runtime / name / registry.RUN_FILE, encode_run_record(fake)
            )
        long_ago = time.time() - 7200
        starting, debris = private_runtime / "starting-1", private_runtime / "debris-1"
        with socket.socket(socket.AF_UNIX) as listening:
            for directory in (starting, debris):
                directory.mkdir(mode=0o700)
            listening.bind(str(starting / "ctl"))
            listening.listen()
            for directory in (starting, debris):
                os.utime(directory, (long_ago, long_ago))
            listed = memtui_here("ls")
            assert listed.exit_code == 0, listed.output
            assert live.run_id in listed.stdout
            assert "gone-1" not in listed.stdout and "reused-1" not in listed.stdout
            assert sorted(p.name for p in private_runtime.iterdir()) == [
                live.run_id,
                "starting-1",
            ]
        assert memtui_here("set", live.run_id, "num_workers=2").exit_code == 0
    finally:
        live.close()
