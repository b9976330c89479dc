"""Recorded streams: the file format, the committed recordings, replay, and the recorder."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from memtui.transport.recording import (
    CONTROL_RANK,
    MAGIC,
    RecordingError,
    RecordingHeader,
    RecordingWriter,
    read_recording,
)
from memtui.transport.sources import ReplaySource, SourceUnavailable, record
from memtui.wire import Decoder, Hello, Snapshot, Telemetry
from tests.support.clock import patience
from tests.support.processes import ROOT
from tests.support.viewer import DATA, OOM, STARVING, HookLoop


def test_a_recording_reads_back_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "x.mtrec"
    with RecordingWriter(path, RecordingHeader(started=100.0, run="r")) as writer:
        writer.write(0.5, 0, b"\x01\x02")
        writer.write(1.25, CONTROL_RANK, b"")
    recording = read_recording(path)
    assert recording.header.run == "r" and recording.header.started == 100.0
    assert [(f.offset_s, f.rank, f.frame) for f in recording.frames] == [
        (0.5, 0, b"\x01\x02"),
        (1.25, -1, b""),
    ]
    assert recording.duration_s == 1.25


def test_damaged_files_are_refused_or_read_up_to_the_cut(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mtrec"
    bad.write_bytes(b"not a recording")
    with pytest.raises(RecordingError, match="magic"):
        read_recording(bad)
    good = tmp_path / "good.mtrec"
    with RecordingWriter(good, RecordingHeader()) as writer:
        writer.write(0.0, 0, b"x" * 100)
    truncated = tmp_path / "truncated.mtrec"
    truncated.write_bytes(good.read_bytes()[:-10])
    cut = read_recording(truncated)  # a cut tail is not fatal: what is whole
    assert cut.frames == [] and cut.cut_at is not None and "cut at byte" in cut.cut_note
    empty = tmp_path / "empty.mtrec"
    empty.write_bytes(MAGIC)
    with pytest.raises(RecordingError, match="no header"):
        read_recording(empty)


@pytest.mark.parametrize("path", [STARVING, OOM], ids=["starving", "oom"])
def test_committed_recordings_are_small_and_clean(path: Path) -> None:
    assert path.stat().st_size < 300_000
    recording = read_recording(path)
    decoder = Decoder()
    messages = [decoder.decode(f.frame) for f in recording.frames]
    assert decoder.bad_frames == 0
    assert isinstance(messages[0], Snapshot) and recording.frames[0].rank == CONTROL_RANK
    assert all(isinstance(m, Telemetry) for m in messages[1:])
    offsets = [f.offset_s for f in recording.frames]
    assert offsets == sorted(offsets)


def test_oom_stream_is_regenerated_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "oom.mtrec"
    subprocess.run(
        [sys.executable, str(DATA / "make_oom_stream.py"), "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True,
    )  # fmt: skip
    assert out.read_bytes() == OOM.read_bytes()


def test_replay_at_once_until_and_silence() -> None:
    source = ReplaySource(STARVING, speed=None, until_s=5.0, at_end="disconnect", silence_s=10)
    source.connect()
    frames = source.poll(0.1)
    assert frames and source.delivered and not source.finished
    last_time = source.now()
    assert last_time == pytest.approx(source.recording.header.started + 5.0, abs=0.2)
    assert source.poll(0.01) == []
    assert source.finished and source.now() == last_time + 10
    with pytest.raises(SourceUnavailable, match="end of the recording"):
        source.connect()
    with pytest.raises(SourceUnavailable):
        source.request(Hello(), Snapshot)


def test_replay_at_speed_keeps_time() -> None:
    source = ReplaySource(STARVING, speed=20.0, until_s=4.0)
    source.connect()
    start = time.monotonic()
    delivered = 0
    while not source.finished:
        delivered += len(source.poll(0.05))
    elapsed = time.monotonic() - start
    assert delivered == len([f for f in source.recording.frames if f.offset_s <= 4.0])
    assert 0.1 < elapsed < patience(1.5), "4 s of recording at 20x takes about 0.2 s"


def test_record_a_live_hook(tmp_path: Path, start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=200, seconds=2.5, checkpoint_every=100)
    path = tmp_path / "live.mtrec"
    summary = record(loop.run_id, path, duration_s=30, history=64)
    assert summary.ended, "the recording stops at the run's last batch"
    assert summary.run == loop.run_id and summary.bad_frames == 0
    recording = read_recording(path)
    decoder = Decoder()
    messages = [decoder.decode(f.frame) for f in recording.frames]
    assert isinstance(messages[0], Snapshot)
    telemetry = [m for m in messages if isinstance(m, Telemetry)]
    assert telemetry[-1].ended
    steps = [s.step for t in telemetry for s in t.steps]
    assert steps and steps == sorted(steps) and steps[-1] >= 300


def test_a_replay_pauses_and_changes_speed() -> None:
    source = ReplaySource(STARVING, speed=1.0)
    source.connect()
    source.pause(True)
    frozen = source.position()
    time.sleep(0.2)
    assert source.position() == frozen
    assert source.poll(0.05) == [] or source.position() == frozen  # nothing new comes due
    source.set_speed(50.0)
    source.pause(False)
    time.sleep(0.2)
    assert source.position() >= frozen + 50.0 * 0.15  # continuous: no jump back, no loss
    with pytest.raises(ValueError):
        source.set_speed(0)
