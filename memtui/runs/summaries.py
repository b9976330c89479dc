"""A run's summary, wherever it is: a live run (asked as ``memtui status`` asks it), a state
directory or the summary file a finished run left there, or a recording (``.mtrec``), replayed
through the same builder the hook keeps its summary with (``advice.summary``)."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from memtui.advice.summary import SummaryBuilder
from memtui.storage import ownfiles, paths, registry
from memtui.wire import (
    ControlState,
    Decoder,
    DeviceSample,
    Hello,
    HookCounters,
    HostSample,
    Knobs,
    RunInfo,
    RunSummary,
    Snapshot,
    StepRecord,
    Telemetry,
)

if TYPE_CHECKING:
    from memtui.advice.verdict import Thresholds

SUMMARY_FILE = "memtui-summary.json"
"""The summary a run writes in its state directory (``hooks.persist.SUMMARY_FILE``)."""
MAX_SUMMARY_BYTES = 16 << 20
"""A summary file larger than this is not one memtui wrote: refused."""
LOOK_HISTORY = 64
"""Steps a look takes the verdict over (``memtui status`` takes the last 50)."""


class SummaryError(Exception):
    """No summary where the user pointed, in one line that says why and what to do."""


@dataclass(frozen=True)
class Found:
    """A run's summary and where it came from."""

    summary: RunSummary
    source: str
    """``live run RUN``, ``PATH``, ``recording PATH``."""
    live: bool = False
    note: str = ""
    """What the reader should know about it ("" nothing): a run gone without its last word, a
    recording cut short, a summary rebuilt from a live run's recent steps only."""


def find(target: str | None, timeout_s: float = 3.0) -> Found:
    """The summary ``target`` names: a path (a state directory, a summary file, a recording), a
    live run (its id, a prefix, a pid), a finished run's id or prefix in the state home; without
    a target the newest live run, else the newest summary in the state home; raise
    SummaryError."""
    if target and Path(target).exists():
        return read_path(Path(target))
    try:
        live = registry.find_run(target)
    except registry.RunNotFound as exc:
        found = _in_state_home(target)
        if found is None:
            home = paths.state_home()
            raise SummaryError(f"{exc}; no summary under {home} matches it either") from None
        return read_path(found)
    except registry.RegistryError as exc:
        raise SummaryError(str(exc)) from None
    return read_live(live, timeout_s)


def _in_state_home(prefix: str | None) -> Path | None:
    """The newest summary under the state home whose run id starts with ``prefix`` (any run's
    without one); raise SummaryError when a prefix matches several runs."""
    home = paths.state_home()
    try:
        found = [d / SUMMARY_FILE for d in home.iterdir() if (d / SUMMARY_FILE).is_file()]
    except OSError:
        return None
    if prefix:
        exact = [f for f in found if f.parent.name == prefix]
        found = exact or [f for f in found if f.parent.name.startswith(prefix)]
        if len(found) > 1:
            names = ", ".join(sorted(f.parent.name for f in found))
            raise SummaryError(f"{prefix!r} matches several finished runs: {names}")
    return max(found, key=lambda f: f.stat().st_mtime, default=None)


def read_path(path: Path) -> Found:
    """The summary at ``path``: a directory's summary file, a summary file, or a recording."""
    if path.is_dir():
        file = path / SUMMARY_FILE
        if not file.is_file():
            raise SummaryError(
                f"{path} holds no {SUMMARY_FILE}: a run writes it in its state directory "
                "within its first seconds (memtui's hook, publishing)"
            )
        return read_file(file)
    with open(path, "rb") as handle:
        head = handle.read(8)
    if head.startswith(b"MTREC"):
        return read_recording_summary(path)
    return read_file(path)


def read_file(path: Path) -> Found:
    """A summary file (the user's own, writable by nobody else); raise SummaryError."""
    try:
        fd = ownfiles.open_read(path)
    except OSError as exc:
        raise SummaryError(f"cannot read {path}: {exc}") from None
    with open(fd, "rb") as handle:
        data = handle.read(MAX_SUMMARY_BYTES + 1)
    if len(data) > MAX_SUMMARY_BYTES:
        raise SummaryError(f"{path} is over {MAX_SUMMARY_BYTES >> 20} MiB: not a run's summary")
    try:
        summary = msgspec.json.decode(data, type=RunSummary)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SummaryError(f"{path} is not a run's summary: {exc}") from None
    return Found(summary, str(path), note=_gone_note(summary))


def _gone_note(summary: RunSummary) -> str:
    """What a summary written while its run was alive says once the run is gone ("" while the
    run still runs, or when it ended and said so)."""
    if summary.ended:
        return ""
    info = summary.info
    if not registry.process_exited(info.pid, info.host, info.started):
        return "the run was still running when this was written (memtui report RUN reads it live)"
    return (
        "the run stopped without its last summary (killed, or it lost its hook): the figures "
        "are those of its last periodic summary"
    )


def read_live(target: registry.Target, timeout_s: float) -> Found:
    """A live run's summary, as its hook keeps it now; from an older hook, its state directory's
    file, else one built from the steps its snapshot holds."""
    from memtui.transport.client import ClientError, ControlClient

    client = ControlClient(target.control, timeout_s=timeout_s)
    try:
        snapshot = client.request(
            Hello(client=client.client, history=LOOK_HISTORY, summary=True), Snapshot
        )
    except ClientError as exc:
        raise SummaryError(str(exc)) from None
    source = f"live run {snapshot.info.run}"
    if snapshot.summary is not None:
        return Found(snapshot.summary, source, live=True)
    state = snapshot.info.state_dir
    if state and (Path(state) / SUMMARY_FILE).is_file():
        found = read_file(Path(state) / SUMMARY_FILE)
        note = "its hook sends no summary: this is the one in its state directory"
        return Found(found.summary, source, live=True, note=note)
    return Found(
        from_snapshot(snapshot),
        source,
        live=True,
        note=f"its hook keeps no summary: built from its last {len(snapshot.steps)} steps only",
    )


def from_snapshot(snapshot: Snapshot, thresholds: Thresholds | None = None) -> RunSummary:
    """A summary of what one snapshot holds (its recent steps and samples)."""
    builder = SummaryBuilder(seed=snapshot.info.run)
    builder.add_records(snapshot.steps)
    builder.add_device(snapshot.device)
    builder.add_host(snapshot.host)
    now = snapshot.steps[-1].end_time if snapshot.steps else snapshot.info.started
    builder.look(snapshot, thresholds, now)
    return builder.summary(snapshot.info, snapshot.control, now, counters=snapshot.counters)


# ---------------------------------------------------------------------------- recordings


@dataclass
class _Replay:
    """One rank's stream of a recording, folded as the hook folds its own."""

    builder: SummaryBuilder
    steps: deque[StepRecord]
    device: deque[DeviceSample]
    host: deque[HostSample]
    last_step: int = 0
    ended: bool = False
    last_time: float = 0.0


def read_recording_summary(path: Path, thresholds: Thresholds | None = None) -> Found:
    """A recording's summary: its frames replayed through the builder the hook uses, the
    verdict taken every ``SUMMARY_LOOK_S`` of its time as the hook takes it."""
    from memtui.transport.recording import RecordingError, read_recording

    try:
        recording = read_recording(path)
    except (RecordingError, OSError) as exc:
        raise SummaryError(f"cannot read the recording {path}: {exc}") from None
    header = recording.header
    decoder = Decoder()
    info = RunInfo(run=header.run, pid=0, host="", started=header.started)
    control: ControlState | None = None
    counters: HookCounters | None = None
    ranks: dict[int, _Replay] = {}

    def replay_of(rank: int) -> _Replay:
        if rank not in ranks:
            ranks[rank] = _Replay(
                SummaryBuilder(seed=header.run or "memtui"),
                deque(maxlen=LOOK_HISTORY),
                deque(maxlen=300),
                deque(maxlen=120),
            )
        return ranks[rank]

    def fold(replay: _Replay, steps: list[StepRecord], device: list[DeviceSample],
             host: list[HostSample]) -> None:  # fmt: skip
        new = [s for s in steps if s.step > replay.last_step]
        if new:
            replay.last_step = new[-1].step
        replay.builder.add_device(device)
        replay.builder.add_host(host)
        replay.builder.add_records(new)
        replay.steps.extend(new)
        replay.device.extend(device)
        replay.host.extend(host)

    for frame in recording.frames:
        message = decoder.decode(frame.frame)
        if isinstance(message, Snapshot):
            info, control = message.info, message.control
            counters = message.counters or counters
            fold(replay_of(message.info.rank), message.steps, message.device, message.host)
        elif isinstance(message, Telemetry):
            replay = replay_of(message.rank)
            fold(replay, message.steps, message.device, [message.host] if message.host else [])
            replay.ended = replay.ended or message.ended
            replay.last_time = max(replay.last_time, message.time)
            if message.rank == min(ranks):
                control = message.control or control
                counters = message.counters or counters
                _look(replay, info, control, message.time, thresholds)
    if not ranks:
        raise SummaryError(f"the recording {path} holds no frame of a run")
    lead = ranks[min(ranks)]
    if control is not None:
        _look(lead, info, control, lead.last_time, thresholds, force=True)
    figures = [
        r.builder.figures(rank, info.host, r.last_time, len(control.ooms) if control else 0)
        for rank, r in sorted(ranks.items())
    ]
    summary = lead.builder.summary(
        info,
        control,
        lead.last_time,
        ended="ended" if lead.ended else "",
        ranks=figures if len(figures) > 1 else figures[:1],
        counters=counters,
    )
    notes = [recording.cut_note] if recording.cut_note else []
    if not lead.ended:
        notes.append("the recording stops before the run's end")
    return Found(summary, f"recording {path}", note="; ".join(notes))


def _look(
    replay: _Replay,
    info: RunInfo,
    control: ControlState | None,
    now: float,
    thresholds: Thresholds | None,
    force: bool = False,
) -> None:
    """Take the verdict over the replayed rank's recent steps when a look is due."""
    builder = replay.builder
    if not replay.steps or not (force or builder.look_due(now)):
        return
    snapshot = Snapshot(
        info=info,
        control=control or ControlState(config=Knobs(), tunable=[]),
        steps=list(replay.steps),
        device=list(replay.device),
        host=list(replay.host),
    )
    builder.look(snapshot, thresholds, now)


def summary_path(state_dir: str | os.PathLike[str]) -> Path:
    """Where a run with this state directory keeps its summary."""
    return Path(state_dir) / SUMMARY_FILE
