"""One verdict: ``memtui status --json`` and the viewer say the same of the same run at the same
moment, for every recorded stream under ``tests/data/``.

Both sides are fed the same recorded frames. The viewer's side is its state model (``RunState``,
no terminal). The status side gets what each rank's hook would answer a hello with at that point
(its publisher's bounded histories, rebuilt from the frames the rank sent) and goes through
``build_status``, the report behind ``memtui status --json``. The viewer's verdict adds
hysteresis (a state must hold for a moment before it shows), so the one-shot verdict is compared
at every point and the shown one where the one-shot verdict has been stable.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

import msgspec
import pytest

from memtui.advice.assess import STATE_NAMES
from memtui.advice.verdict import decide
from memtui.hooks.publisher import HISTORY_STEPS
from memtui.runs.events import ReceivedBatch
from memtui.runs.report import build_status
from memtui.runs.state import RunState
from memtui.storage.userconfig import load_thresholds
from memtui.transport.recording import RecordedFrame, read_recording
from memtui.wire import (
    CheckpointRecord,
    ControlState,
    Decoder,
    DeviceSample,
    Hello,
    HostSample,
    Snapshot,
    StepRecord,
    Telemetry,
    encode,
)
from tests.support.processes import ROOT

MIB = 1 << 20

RECORDINGS = sorted((ROOT / "tests" / "data").glob("*.mtrec"))
SWAP_STORY = "demo_starving_swap_early"
"""The starving demo's stream with its swap rewritten: 80 MiB swapped in the first 8 s, then
flat. Whether that is "swap growing" depends on the window: the one both sides now share (the
last 30 s) says no; a status built from the whole history (~2 min) said yes while the viewer
said no."""
EVERY = 8
"""Compare after every this many frames."""
STABLE = 3
"""Points the one-shot verdict must have held before the viewer's shown verdict must match it."""


class HookHistories:
    """What each rank's hook holds for a hello at this point of the recording."""

    def __init__(self) -> None:
        self.first: Snapshot | None = None
        self.info: dict[int, Snapshot] = {}
        self.steps: dict[int, deque[StepRecord]] = {}
        self.device: dict[int, deque[DeviceSample]] = {}
        self.host: dict[int, deque[HostSample]] = {}
        self.checkpoints: dict[int, deque[CheckpointRecord]] = {}
        self.control: dict[int, ControlState] = {}
        self.step: dict[int, int] = {}

    def _rank(self, rank: int, base: Snapshot) -> None:
        if rank not in self.info:
            info = msgspec.structs.replace(base.info, rank=rank)
            self.info[rank] = msgspec.structs.replace(base, info=info)
            self.steps[rank] = deque(maxlen=HISTORY_STEPS)
            self.device[rank] = deque(maxlen=600)
            self.host[rank] = deque(maxlen=120)
            self.checkpoints[rank] = deque(maxlen=128)
            self.control[rank] = base.control

    def add(self, message: object) -> None:
        if isinstance(message, Snapshot):
            rank = message.info.rank
            self.first = self.first or message
            self.info.pop(rank, None)
            self._rank(rank, message)
            self.add_steps(rank, message.steps)
            self.device[rank].extend(message.device)
            self.host[rank].extend(message.host)
            self.checkpoints[rank].extend(message.checkpoints)
            self.step[rank] = message.step
        elif isinstance(message, Telemetry) and self.first is not None:
            rank = message.rank
            self._rank(rank, self.info.get(rank, self.first))
            self.add_steps(rank, message.steps)
            self.device[rank].extend(message.device)
            if message.host is not None:
                self.host[rank].append(message.host)
            self.checkpoints[rank].extend(message.checkpoints)
            if message.control is not None:
                self.control[rank] = message.control
            self.step[rank] = message.step

    def add_steps(self, rank: int, records: list[StepRecord]) -> None:
        """The rank's new step records (a recording repeats a snapshot's steps in the telemetry
        that follows it; the hook's history holds each step once)."""
        held = self.steps[rank]
        last = held[-1].step if held else 0
        for record in records:
            if record.step > last:
                held.append(record)
                last = record.step

    def hello(self, rank: int) -> Snapshot:
        """The snapshot this rank's hook would answer ``memtui status``'s hello with."""
        history = Hello().history
        return msgspec.structs.replace(
            self.info[rank],
            control=self.control[rank],
            step=self.step.get(rank, 0),
            steps=list(self.steps[rank])[-history:],
            device=list(self.device[rank])[-300:],
            host=list(self.host[rank]),
            checkpoints=list(self.checkpoints[rank]),
        )

    def status_state(self) -> str:
        """The verdict ``memtui status --json`` prints now."""
        snapshots = [self.hello(rank) for rank in sorted(self.info)]
        ranks = snapshots if len(snapshots) > 1 else None
        return build_status(snapshots[0], ranks, load_thresholds()).verdict.state


def swapping_early(frames: list[RecordedFrame]) -> list[RecordedFrame]:
    """``frames`` with every host sample's swap rewritten to ``SWAP_STORY``'s."""
    decoder = Decoder()
    messages = [decoder.decode(f.frame) for f in frames]
    start = min(
        h.time
        for m in messages
        for h in (
            m.host
            if isinstance(m, Snapshot)
            else [m.host]
            if isinstance(m, Telemetry) and m.host
            else []
        )
    )

    def swapped(sample: HostSample) -> HostSample:
        grown = min(sample.time - start, 8.0) / 8.0 * 80 * MIB
        return msgspec.structs.replace(sample, swap_used_bytes=int(MIB + grown))

    out = []
    for frame, message in zip(frames, messages, strict=True):
        if isinstance(message, Snapshot):
            message = msgspec.structs.replace(message, host=[swapped(h) for h in message.host])
        elif isinstance(message, Telemetry) and message.host is not None:
            message = msgspec.structs.replace(message, host=swapped(message.host))
        out.append(RecordedFrame(frame.offset_s, frame.rank, encode(message)))
    return out


STREAMS = [*RECORDINGS, ROOT / "tests" / "data" / f"{SWAP_STORY}.mtrec"]


@pytest.mark.parametrize("path", STREAMS, ids=[p.stem for p in STREAMS])
def test_status_and_the_viewer_give_the_same_verdict(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))  # the default bands
    thresholds = load_thresholds().thresholds
    if path.stem == SWAP_STORY:
        frames = swapping_early(read_recording(path.with_name("demo_starving.mtrec")).frames)
    else:
        frames = read_recording(path).frames
    decoder = Decoder()
    hooks = HookHistories()
    viewer = RunState()
    compared: list[tuple[str, str, str]] = []
    for index, frame in enumerate(frames, 1):
        message = decoder.decode(frame.frame)
        assert message is not None, decoder.last_error
        hooks.add(message)
        viewer.apply(ReceivedBatch(events=[message], clock=frame.offset_s))
        if index % EVERY and index != len(frames):
            continue
        summary = viewer.refresh_summary()
        if hooks.first is None or summary.verdict_inputs is None:
            continue
        viewer_now = STATE_NAMES[decide(summary.verdict_inputs, thresholds).state]
        status_now = hooks.status_state()
        assert status_now == viewer_now, (
            f"{path.name} at {frame.offset_s:.1f} s (frame {index}): status says {status_now}, "
            f"the viewer {viewer_now}"
        )
        compared.append((status_now, viewer_now, STATE_NAMES[summary.verdict.state]))
    assert len(compared) >= 5, f"{path.name}: only {len(compared)} points compared"
    states = [status for status, _viewer, _shown in compared]
    for i in range(STABLE, len(compared)):
        if len(set(states[i - STABLE : i + 1])) == 1:
            assert compared[i][2] == states[i], (path.name, i, compared[i])
    assert len(set(states)) >= 1


def test_status_and_the_viewer_show_the_same_max_safe_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The largest safe micro-batch in the viewer's config panel and in ``memtui status`` is one
    figure at every point of every recording with a memory model (a CPU run showed ``> 128``
    in the viewer and 25016 in ``status``; a guess shows only its floor in both)."""
    from memtui.runs.report import render_status
    from memtui.tui.widgets.config import safe_batch_lines

    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))  # the default bands
    figures: dict[str, set[str]] = {}
    for path in RECORDINGS:
        decoder = Decoder()
        hooks = HookHistories()
        viewer = RunState()
        for index, frame in enumerate(read_recording(path).frames, 1):
            message = decoder.decode(frame.frame)
            hooks.add(message)
            viewer.apply(ReceivedBatch(events=[message], clock=frame.offset_s))
            control = viewer.control
            if index % EVERY or hooks.first is None or control.model is None:
                continue
            edge = viewer.thresholds.thresholds.memory_edge_fraction
            shown = safe_batch_lines(control.model, edge, 120, 2, control.ceiling)[0].plain
            snapshots = [hooks.hello(rank) for rank in sorted(hooks.info)]
            ranks = snapshots if len(snapshots) > 1 else None
            report = build_status(snapshots[0], ranks, load_thresholds())
            printed = re.search(
                r"largest micro-batch under \d+%: (> \d+|\d+)", render_status(report)
            )
            in_viewer = re.match(r"max safe batch  (> \d+|\d+|unknown)", shown)
            assert in_viewer, shown
            assert (printed.group(1) if printed else "unknown") == in_viewer.group(1), (
                f"{path.name} at {frame.offset_s:.1f} s: status {printed}, the viewer {shown!r}"
            )
            figures.setdefault(path.stem, set()).add(in_viewer.group(1))
    assert any(f.startswith(">") for f in figures.get("demo_starving", ())), figures
    assert any(f.isdigit() for f in figures.get("demo_advice", ())), figures


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_status_and_the_viewer_count_each_ranks_process_tree_alike(path: Path) -> None:
    """A rank's process tree in host memory is one figure in the viewer's per-rank table and in
    ``memtui status`` at every point of every recording: the main process's RSS plus its loader
    workers' own memory (USS) where it was read, else their RSS, said (the table added their
    RSS, 1.4 GiB where status said 577 MiB + 24 MiB)."""
    from memtui.core.stats import format_bytes
    from memtui.runs.report import ProcessTreeMemory
    from memtui.tui.widgets.ranks import rank_row

    decoder, hooks, viewer = Decoder(), HookHistories(), RunState()
    compared = by_uss = 0
    for index, frame in enumerate(read_recording(path).frames, 1):
        message = decoder.decode(frame.frame)
        hooks.add(message)
        viewer.apply(ReceivedBatch(events=[message], clock=frame.offset_s))
        if index % EVERY or hooks.first is None:
            continue
        snapshots = [hooks.hello(rank) for rank in sorted(hooks.info)]
        report = build_status(snapshots[0], snapshots if len(snapshots) > 1 else None)
        said = {r.rank: r.process_tree for r in report.ranks} or {0: report.process_tree}
        for rank in viewer.refresh_summary().ranks:
            tree, told = rank.tree, said.get(rank.rank)
            if tree is None or not isinstance(told, ProcessTreeMemory):
                continue
            host = viewer.series[rank.rank].host
            assert host is not None
            assert (tree.total_bytes, tree.workers, tree.measure) == (
                told.total_bytes,
                told.workers,
                told.workers_measure,
            )
            assert format_bytes(told.total_bytes) in rank_row(rank, 0).plain
            if host.workers and host.workers_uss_bytes:
                assert told.total_bytes == host.main_rss_bytes + host.workers_uss_bytes
                by_uss += host.workers_uss_bytes < host.workers_rss_bytes
            compared += 1
    assert compared >= 5, f"{path.name}: only {compared} points compared"
    if path.stem in ("ranks_8", "oom_risk"):
        assert by_uss, "workers whose USS was read counted by it, not by their RSS"
