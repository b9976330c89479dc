"""What memtui keeps on disk survives a full disk and an unwritable state dir.

The full disk is real: a 64 KiB tmpfs mounted for the test (skipped, with the reason, where
this process may not mount one). The tuned YAML is retried at every boundary until it is
written and said once a minute while it is not; what a full disk cuts of an audit line is
taken back (the log stays valid JSONL); no temp file is left; the log is bounded and rotated;
the files are 0600.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from memtui.hooks import Options, Tuner
from memtui.hooks.persist import MAX_BYTES, MAX_LINE, UNWRITTEN, AuditLog, read_audit
from memtui.wire import SetRequest


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB file system (tmpfs), unmounted afterwards."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte; return the filler file."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1024, 1):  # blocks, then the last bytes
            with contextlib.suppress(OSError):
                while os.write(fd, b"x" * size):
                    pass
    finally:
        os.close(fd)
    return filler


def change(tuner: Tuner, config: SimpleNamespace, accum: int) -> None:
    """Queue ``grad_accum=accum``, run a step and a boundary, and check it applied."""
    assert tuner.control.queue(SetRequest(changes={"grad_accum": accum})).ok
    tuner.step()
    assert tuner.checkpoint() is not None and config.grad_accum == accum


def on_disk(state: Path) -> int:
    """The grad_accum the tuned YAML holds."""
    return int(yaml.safe_load((state / "memtui-tuned.yaml").read_text())["config"]["grad_accum"])


def test_a_full_disk_then_space_again(small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = small_disk / "state"
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = Tuner(config, state_dir=state, options=Options(publish=False)).start()
    try:
        change(tuner, config, 2)
        assert on_disk(state) == 2
        filler = fill(small_disk)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "memtui"):
            for _ in range(3):
                tuner.step()
            change(tuner, config, 3)  # training goes on; nothing can be written
            unsaved = tuner.tuned_unsaved_step
            assert unsaved == tuner.step_count
            change(tuner, config, 4)
            assert tuner.tuned_unsaved_step == unsaved, "since the first step not saved"
        said = [r.getMessage() for r in caplog.records if "not saved since step" in r.getMessage()]
        assert len(said) == 1 and f"since step {unsaved}" in said[0], said
        assert on_disk(state) == 2, "the old file stands, whole"
        assert not [p for p in state.iterdir() if p.name.endswith(".tmp")], "no temp file left"

        filler.unlink()  # space again: the next boundary writes it, nothing queued
        tuner.step()
        assert tuner.checkpoint() is None
        assert on_disk(state) == 4 and tuner.tuned_unsaved_step is None
        change(tuner, config, 5)
        events = read_audit(state / "memtui-audit.jsonl")
        assert [e["changes"]["grad_accum"][1] for e in events if e["event"] == "applied"][-1] == 5
        for line in (state / "memtui-audit.jsonl").read_text().splitlines()[-3:]:
            json.loads(line)  # the lines after the full disk are whole, none glued to a torn one
    finally:
        tuner.close()


def test_an_unwritable_tuned_path_is_retried_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "memtui-tuned.yaml").mkdir()  # unwritable as a file, even for root
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = Tuner(config, state_dir=tmp_path, options=Options(publish=False)).start()
    try:
        with caplog.at_level(logging.WARNING, "memtui"):
            for _ in range(5):  # more failures than the error report's first three
                change(tuner, config, 2 + tuner.step_count % 2)
        assert tuner.tuned_unsaved_step == 1
        said = [
            r.getMessage() for r in caplog.records if "not saved since step 1" in r.getMessage()
        ]
        assert said and all("\n" not in m for m in said)
        assert not list(tmp_path.glob(".*.tmp"))
        (tmp_path / "memtui-tuned.yaml").rmdir()
        tuner.step()
        tuner.checkpoint()
        assert tuner.tuned_unsaved_step is None and on_disk(tmp_path) == config.grad_accum
    finally:
        tuner.close()


def test_a_line_a_full_disk_cuts_is_taken_back_and_the_log_stays_valid_jsonl(
    small_disk: Path,
) -> None:
    audit = AuditLog(small_disk / "state" / "memtui-audit.jsonl", "run")
    for i in range(5):
        audit.append("queued", {"id": i})
    whole = audit.path.stat().st_size
    filler = fill(small_disk)
    with pytest.raises(OSError, match="cut at"):  # the line crosses into a page there is not
        audit.append("queued", {"id": 5, "note": "x" * (MAX_LINE - 200)})
    assert audit.path.stat().st_size == whole, "the bytes written of the cut line are taken back"
    filler.unlink()
    audit.append("applied", {"id": 6})
    lines = audit.path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == list(range(7)), "every line parses"


def test_a_cut_audit_line_is_never_glued_to_the_next(tmp_path: Path) -> None:
    """Where even the truncation failed, the torn line is ended before the next one."""
    audit = AuditLog(tmp_path / "audit.jsonl", "run")
    audit.append("queued", {"id": 1})
    with open(audit.path, "a") as handle:
        handle.write('{"time": 1, "event": "app')  # what a full disk leaves of a line
    audit._torn = True  # as a short write records it
    audit.append("applied", {"id": 2})
    assert [e["id"] for e in read_audit(audit.path)] == [1, 2]


def test_audit_lines_are_bounded_and_the_log_rotates(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", "run")
    audit.append("rejected", {"requested": {"\0" * 100_000: 1}, "reason": "x" * 100_000})
    line = audit.path.read_bytes()
    assert len(line) <= MAX_LINE and json.loads(line)["event"] == "rejected"
    big = {"note": "y" * 3000}
    for _ in range(MAX_BYTES // 3000 + 10):
        audit.append("queued", big)
    assert audit.path.stat().st_size < MAX_BYTES
    assert (tmp_path / "audit.jsonl.1").stat().st_size >= MAX_BYTES
    assert len(list(tmp_path.iterdir())) == 2, "one rotated file, never more"


def test_the_state_files_are_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    old = os.umask(0o022)
    tuner = Tuner(config, state_dir=state, options=Options(publish=False)).start()
    try:
        change(tuner, config, 2)
    finally:
        tuner.close()
        os.umask(old)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in ("memtui-tuned.yaml", "memtui-audit.jsonl"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name


class InjectedDisk:
    """``os.write`` to files under ``root`` as on a full disk: half of it, then ENOSPC."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = str(root)
        self.full = False
        self._write = os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: bytes) -> int:
        """The real write, cut when full and ``fd`` is a file under ``root``."""
        if self.full and os.readlink(f"/proc/self/fd/{fd}").startswith(self.root):
            if len(data) <= 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._write(fd, bytes(data)[: len(data) // 2])
        return self._write(fd, data)


def test_audit_lines_held_back_by_a_full_disk_are_written_when_space_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    disk = InjectedDisk(state, monkeypatch)
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = Tuner(config, state_dir=state, options=Options(publish=False)).start()
    try:
        change(tuner, config, 2)
        disk.full = True
        with caplog.at_level(logging.WARNING, "memtui"):
            # queued, applying and applied: no line is written (said at the tuned config's
            # write, between the two phases of the change)
            change(tuner, config, 3)
            said = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
            assert len(said) == 1 and "2 audit log lines" in said[0], said
            assert "tuned config is not saved since step" in said[0]
            disk.full = False
            tuner.step()
            assert tuner.checkpoint() is None
        assert "saved again" in caplog.records[-1].getMessage()
        audit = read_audit(state / "memtui-audit.jsonl")
        events = [(e["event"], e.get("id"), e.get("ids")) for e in audit]
        assert events == [
            ("queued", 1, None),
            ("applying", None, [1]),
            ("applied", None, [1]),
            ("queued", 2, None),
            ("applying", None, [2]),
            ("applied", None, [2]),
        ], "the held lines, in order, once each"
        for line in (state / "memtui-audit.jsonl").read_text().splitlines():
            json.loads(line)  # every cut write was taken back: the log is valid JSONL
        assert on_disk(state) == 3 and tuner.tuned_unsaved_step is None
        assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]
    finally:
        tuner.close()


def test_an_audit_log_that_cannot_be_written_is_said_at_every_boundary_not_three_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("memtui.hooks.persist.UNSAVED_WARN_S", 0.0)  # every boundary, not a minute
    (tmp_path / "memtui-audit.jsonl").mkdir()  # unwritable as a file, even for root
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = Tuner(config, state_dir=tmp_path, options=Options(publish=False)).start()
    try:
        with caplog.at_level(logging.WARNING, "memtui"):
            for accum in (2, 3, 2, 3, 2, 3):
                change(tuner, config, accum)
        said = [r.getMessage() for r in caplog.records if "audit log lines" in r.getMessage()]
        # said at each tuned config write: the last change's applied line is not written yet
        assert len(said) == 6 and "17 audit log lines are not written" in said[-1], said
        assert on_disk(tmp_path) == 3, "the tuned config is written all along"
        (tmp_path / "memtui-audit.jsonl").rmdir()
        tuner.step()
        tuner.checkpoint()
        applied = [
            e for e in read_audit(tmp_path / "memtui-audit.jsonl") if e["event"] == "applied"
        ]
        assert [e["ids"] for e in applied] == [[i] for i in range(1, 7)]
    finally:
        tuner.close()


def test_the_lines_held_back_are_bounded(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", "run")
    audit.path.mkdir()
    for i in range(UNWRITTEN + 10):
        with pytest.raises(OSError):
            audit.append("queued", {"id": i})
    assert len(audit.unwritten) == UNWRITTEN and audit.dropped == 10
    audit.path.rmdir()
    audit.flush()
    assert [e["id"] for e in read_audit(audit.path)] == list(range(10, UNWRITTEN + 10))
    assert not audit.unwritten
