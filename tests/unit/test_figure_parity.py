"""One figure everywhere: ``memtui status`` (its text and its JSON), the viewer (its state and its
panels) and the exporter say the same of the same run at the same moment, for every recorded
stream under ``tests/data/``.

At points along each recording every rank's hook is asked for the snapshot it would answer a
hello with (``HookHistories``); the status report is built from those snapshots, a fresh viewer
state folds the same snapshots (as a viewer that attaches then), and the exporter's families are
made from that state. The figures they share are compared: the verdict, each rank's step time,
data wait share and samples/s (none where the wait was not measured), peak memory, every knob's
value, the effective batch, and the predicted peaks of the recommendations and pending changes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.core import Metric
from rich.text import Text

from memtui.advice.assess import STATE_NAMES
from memtui.core.knobs import KNOBS, format_value
from memtui.core.stats import StepStats, format_bytes, format_duration
from memtui.export.fleet import FleetReading, run_reading
from memtui.export.metrics import families
from memtui.runs.events import ReceivedBatch
from memtui.runs.report import StatusReport, build_status, render_status, status_json
from memtui.runs.state import RankSummary, RunState, ViewOptions
from memtui.storage.userconfig import load_thresholds
from memtui.transport.recording import read_recording
from memtui.tui.widgets.advice import advice_lines
from memtui.tui.widgets.changelog import change_lines
from memtui.tui.widgets.config import ConfigPanel
from memtui.tui.widgets.ranks import aggregate_line, rank_row
from memtui.wire import Decoder, Snapshot
from tests.unit.test_verdict_parity import RECORDINGS, HookHistories

EVERY = 16
"""Compare after every this many frames (and at the end)."""


def _points(path: Path) -> list[tuple[float, list[Snapshot]]]:
    """Every rank's hello answer at points along the recording, with the recording's clock."""
    decoder, hooks = Decoder(), HookHistories()
    frames = read_recording(path).frames
    points = []
    for index, frame in enumerate(frames, 1):
        hooks.add(decoder.decode(frame.frame))
        if hooks.first is None or (index % EVERY and index != len(frames)):
            continue
        points.append((frame.offset_s, [hooks.hello(rank) for rank in sorted(hooks.info)]))
    return points


def _viewer(snapshots: list[Snapshot], clock: float) -> RunState:
    """A viewer's state that has just attached: every rank's snapshot folded."""
    state = RunState()
    state.apply(ReceivedBatch(events=list(snapshots), clock=clock))
    return state


def _exported(metrics: list[Metric], name: str, by: str = "", **labels: str) -> dict[str, float]:
    """The samples named ``name`` whose labels include ``labels``, by their label ``by``."""
    found: dict[str, float] = {}
    for family in metrics:
        for sample in family.samples:
            if sample.name != name or any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            found[sample.labels.get(by, "")] = sample.value
    return found


def _speed(steps: StepStats | None) -> dict[str, float | None] | None:
    """A rank's speed figures: the data wait only where it was measured, the samples only where
    they were counted."""
    if steps is None:
        return None
    measured = steps.data_wait_measured
    return {
        "step_time_s": round(steps.step_time_s, 9),
        "data_wait_fraction": round(steps.data_wait_fraction, 9) if measured else None,
        "samples_per_s": round(steps.samples_per_s, 6) if steps.samples_counted else None,
    }


def _status_speed(metrics: dict[str, Any] | None) -> dict[str, float | None] | None:
    if metrics is None:
        return None
    measured, counted = metrics["data_wait_measured"], metrics["samples_counted"]
    return {
        "step_time_s": round(metrics["step_time_s"], 9),
        "data_wait_fraction": round(metrics["data_wait_fraction"], 9) if measured else None,
        "samples_per_s": round(metrics["samples_per_s"], 6) if counted else None,
    }


def _exported_speed(metrics: list[Metric], run: str, rank: int) -> dict[str, float | None] | None:
    labels = {"run": run, "rank": str(rank)}

    def one(name: str) -> float | None:
        values = list(_exported(metrics, name, **labels).values())
        return values[0] if values else None

    step = one("memtui_step_time_seconds")
    if step is None:
        return None
    wait, samples = one("memtui_data_wait_ratio"), one("memtui_samples_per_second")
    return {
        "step_time_s": round(step, 9),
        "data_wait_fraction": round(wait, 9) if wait is not None else None,
        "samples_per_s": round(samples, 6) if samples is not None else None,
    }


def _status_config_words(text: str) -> dict[str, str]:
    """``memtui status``'s config line as {knob: the value it prints}."""
    line = next(ln for ln in text.splitlines() if ln.startswith("config: "))
    return {k: v for k, v in re.findall(r"(\w+)=(\S+)", line) if k in KNOBS}


def _panel_words(state: RunState) -> dict[str, str]:
    """The viewer's config panel as {knob: the value it shows now}."""
    rendered = ConfigPanel().build(state, ViewOptions(), 70)
    assert isinstance(rendered, Text)
    rows = [line.split() for line in rendered.plain.splitlines()]
    return {row[0]: row[1] for row in rows if row and row[0] in KNOBS}


def _status_waits(text: str) -> dict[int, str]:
    """``memtui status``'s per-rank table as {rank: its data wait cell}."""
    rows = re.findall(r"^ *(\d+)  .{12}  +\d+  .{9}  (.{9})  ", text, re.MULTILINE)
    return {int(rank): wait.strip() for rank, wait in rows}


def _viewer_wait(rank: RankSummary) -> str:
    """The viewer's per-rank table: the rank's data wait cell."""
    return rank_row(rank, -1).plain[23:27].strip()


def _compare(path: Path, clock: float, snapshots: list[Snapshot]) -> list[str]:
    """The figures two surfaces disagree on at this point, in words ([] when none)."""
    where = f"{path.name} at {clock:.1f} s"
    several = len(snapshots) > 1
    report: StatusReport = build_status(
        snapshots[0], snapshots if several else None, load_thresholds()
    )
    data = json.loads(status_json(report))
    text = render_status(report, now=report.started + 60)
    state = _viewer(snapshots, clock)
    summary = state.refresh_summary()
    known = state.known_config()
    reading = run_reading(state)
    assert known is not None and reading is not None and summary.advice is not None
    metrics = families(FleetReading((reading,), (), {}, 1, 0, 0, 0.0), lambda _rank: None)
    run = report.run
    wrong: list[str] = []

    def same(what: str, **figures: object) -> None:
        if len({json.dumps(v, sort_keys=True, default=str) for v in figures.values()}) > 1:
            wrong.append(f"{where}: {what}: {figures}")

    # the verdict
    states = _exported(metrics, "memtui_verdict", by="memtui_verdict", run=run)
    exported_verdict = [state for state, on in states.items() if on]
    same(
        "verdict",
        status=data["verdict"]["state"],
        viewer=STATE_NAMES[summary.verdict.state],
        exporter=exported_verdict[0] if exported_verdict else None,
    )
    # each rank's speed and peak memory
    by_rank = {r.rank: r for r in summary.ranks}
    for entry in data["ranks"] or [{"rank": 0, "reachable": True}]:
        rank = entry["rank"]
        if not entry["reachable"] or rank not in by_rank:
            continue
        status_metrics = entry.get("metrics") if several else data["metrics"]
        same(
            f"rank {rank} speed",
            status=_status_speed(status_metrics),
            viewer=_speed(by_rank[rank].steps),
            exporter=_exported_speed(metrics, run, rank),
        )
        status_memory = entry.get("memory") if several else data["memory"]
        viewer_memory = by_rank[rank].memory
        peaks = _exported(metrics, "memtui_device_peak_reserved_bytes", run=run, rank=str(rank))
        same(
            f"rank {rank} peak memory",
            status=status_memory["peak_bytes"] if status_memory else None,
            viewer=viewer_memory.peak_bytes if viewer_memory else None,
            exporter=int(peaks[""]) if peaks else None,
        )
    step_line = next(ln for ln in text.splitlines() if ln.startswith(f"step {report.step}"))
    own = by_rank.get(snapshots[0].info.rank)
    if own is not None and own.steps is not None:
        if f"{format_duration(own.steps.step_time_s)}/step" not in step_line:
            wrong.append(f"{where}: status text {step_line!r}, the viewer's step time differs")
        measured = own.steps.data_wait_measured
        if measured != ("not measured" not in step_line):
            wrong.append(
                f"{where}: status text {step_line!r}, the viewer's wait measured={measured}"
            )
    if several:  # the per-rank tables: the same wait cell ("-" where not measured)
        for rank, wait in _status_waits(text).items():
            shown_wait = _viewer_wait(by_rank[rank]) if rank in by_rank else None
            if shown_wait is not None and shown_wait != wait:
                wrong.append(f"{where}: rank {rank} wait: status {wait}, the viewer {shown_wait}")
    # every knob, and the effective batch
    exported_knobs = _exported(metrics, "memtui_knob", by="knob", run=run)
    same(
        "knobs",
        status=data["config"],
        viewer=known.values,
        exporter={
            k: (bool(exported_knobs[k]) if k == "pin_memory" else int(exported_knobs[k]))
            if k in exported_knobs
            else None
            for k in KNOBS
        },
    )
    shown = {k: "?" if v is None else format_value(v) for k, v in known.values.items()}
    same(
        "knobs as printed",
        status=_status_config_words(text),
        viewer=_panel_words(state),
        expected=shown,
    )
    exported_batch = list(_exported(metrics, "memtui_effective_batch", run=run).values())
    same(
        "effective batch",
        status=data["effective_batch"],
        viewer=state.effective_batch(),
        exporter=int(exported_batch[0]) if exported_batch else None,
    )
    panel = ConfigPanel().build(state, ViewOptions(), 70)
    eff = data["effective_batch"]
    if (eff is not None) != (f"effective batch {eff}" in str(panel)):
        wrong.append(f"{where}: effective batch {eff}, the panel: {panel}")
    if eff is not None and f"(effective batch {eff})" not in text:
        wrong.append(f"{where}: effective batch {eff}, status text: {text}")
    # the recommendations and their predicted peaks
    same(
        "recommendations",
        status=[(o["title"], o["predicted_peak_bytes"]) for o in data["recommendations"]],
        viewer=[(o.title, o.predicted_peak_bytes) for o in summary.advice.recommendations],
    )
    pending = {c.id: c for c in (state.control.pending if state.control else [])}
    for option in summary.advice.recommendations:
        repeats = [c for c in pending.values() if set(c.changes) & set(option.changes)]
        if repeats:
            wrong.append(f"{where}: {option.title} repeats pending #{repeats[0].id}")
    advised = "\n".join(line.plain for line in advice_lines(state, ViewOptions(), 200, False))
    for option in summary.advice.recommendations[:2]:
        peak = option.predicted_peak_bytes
        if peak is not None and f"(peak {format_bytes(peak)})" not in advised:
            wrong.append(f"{where}: {option.title}'s peak not in the panel: {advised}")
    logged = "\n".join(line.plain for line in change_lines(state, ViewOptions(), 200, False, 0))
    for change in data["pending"]:
        peak = change.get("predicted_peak_bytes")
        if peak is not None and f"predicted peak {format_bytes(peak)}" not in text:
            wrong.append(f"{where}: pending #{change['id']}'s peak not in status text")
        if peak is not None and format_bytes(peak) not in logged:
            wrong.append(f"{where}: pending #{change['id']}'s peak not in the change log")
    return wrong


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_status_the_viewer_and_the_exporter_show_the_same_figures(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))  # the default bands
    points = _points(path)
    assert len(points) >= 3, f"{path.name}: only {len(points)} points"
    wrong = [line for clock, snapshots in points for line in _compare(path, clock, snapshots)]
    assert not wrong, "\n".join(wrong[:10]) + f"\n({len(wrong)} in all)"


def test_a_wait_not_measured_is_no_figure_anywhere(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Eight ranks whose steps drew no batch memtui timed (a loop without a DataLoader): the
    data wait is "not measured" in the status headline, "-" in both per-rank tables, and no
    sample of the exporter, never 0%; the samples the steps counted are the same figure
    everywhere."""
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))
    path = next(p for p in RECORDINGS if p.stem == "ranks_8")
    clock, snapshots = _points(path)[-1]
    untimed = [
        msgspec.structs.replace(
            s,
            steps=[msgspec.structs.replace(r, data_wait_s=0.0, micro_batches=0) for r in s.steps],
        )
        for s in snapshots
    ]
    assert _compare(path, clock, untimed) == []
    report = build_status(untimed[0], untimed, load_thresholds())
    text = render_status(report, now=report.started + 60)
    assert "data wait not measured" in text
    assert set(_status_waits(text).values()) == {"-"} and len(_status_waits(text)) == 8, text
    summary = _viewer(untimed, clock).refresh_summary()
    assert {_viewer_wait(rank) for rank in summary.ranks} == {"-"}
    assert "wait" not in aggregate_line(summary, 200).plain, "no median of waits not measured"
