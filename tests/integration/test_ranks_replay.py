"""The 64-rank viewer benchmark's publisher replays recorded hook streams, one socket per rank."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from memtui.transport.recording import read_recording
from memtui.transport.sources import LiveSource
from memtui.wire import Decoder, Hello, Snapshot, Telemetry
from tests.support.clock import patience
from tests.support.processes import ROOT

RECORDING = ROOT / "tests" / "data" / "ranks_8.mtrec"


def test_recorded_streams_are_replayed_one_socket_per_rank(tmp_path: Path) -> None:
    """Three ranks of the 8-rank recording, replayed 40x faster (it loops every ~0.5 s)."""
    stats = tmp_path / "stats.json"
    recorded = read_recording(RECORDING)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "tui_ranks.py"), "--publish", "--ranks", "3",
         "--recording", str(RECORDING), "--speed", "40", "--for", "30", "--stats", str(stats)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    source: LiveSource | None = None
    try:
        assert proc.stdout is not None
        run = proc.stdout.readline().split()[1]
        source = LiveSource(run)
        source.connect()
        snapshot = source.request(Hello(client="test", history=16), Snapshot)
        assert snapshot.info.run == run and snapshot.info.world_size == 3
        assert [r.rank for r in snapshot.ranks] == [0, 1, 2]
        assert len({r.pub for r in snapshot.ranks}) == 3, "one socket per rank"
        decoder = Decoder()
        last: dict[int, int] = {}
        steps: dict[int, int] = {}
        deadline = time.monotonic() + patience(15)
        while time.monotonic() < deadline and min(steps.values(), default=0) < 200:
            for _rank, frame in source.poll(0.2):
                message = decoder.decode(frame)
                if not isinstance(message, Telemetry) or not message.steps:
                    continue
                assert message.run == run and not message.ended
                first = message.steps[0].step
                if message.rank in last:  # one step after another, across the loop's seam
                    assert first == last[message.rank] + 1, (message.rank, last, first)
                last[message.rank] = message.steps[-1].step
                steps[message.rank] = steps.get(message.rank, 0) + len(message.steps)
                assert abs(message.time - time.time()) < 5, "times moved on to now"
        assert sorted(steps) == [0, 1, 2] and min(steps.values()) >= 200, steps
        recorded_steps = sum(
            len(m.steps)
            for f in recorded.frames
            if isinstance(m := decoder.decode(f.frame), Telemetry) and m.rank == 0
        )
        assert recorded_steps < 100, "so 200 steps means the stream looped"
    finally:
        if source is not None:
            source.close()
        proc.terminate()
        proc.wait(patience(20))
    published = json.loads(stats.read_text())
    assert published["streams"][:3] == ["ranks_8.mtrec#0", "ranks_8.mtrec#1", "ranks_8.mtrec#2"]
