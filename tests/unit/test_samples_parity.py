"""One samples/s: the job's figure and every rank's own are the same in ``memtui status --json``,
its text, the viewer (its state and its header) and the exporter's metric families, at every
point of every recorded stream under ``tests/data/`` (one rank, two and eight).

The status side is what each rank's hook would answer a hello with at that point, through
``build_status`` (the report behind ``memtui status``); the viewer's side is its state model fed
the same frames (no terminal) and the header drawn from it; the exporter's side is the run's
reading made from that state and the families ``/metrics`` serves from it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from memtui.core.stats import format_rate
from memtui.export.fleet import FleetReading, run_reading
from memtui.export.metrics import families
from memtui.runs.events import ReceivedBatch
from memtui.runs.report import build_status, render_status, status_json
from memtui.runs.state import RunState, ViewOptions
from memtui.storage.userconfig import load_thresholds
from memtui.transport.recording import read_recording
from memtui.tui.widgets.header import RunHeader
from memtui.wire import Decoder
from tests.unit.test_verdict_parity import RECORDINGS, HookHistories

EVERY = 8
"""Compare after every this many frames."""
RUN_LINE = re.compile(r"^step \d+  .*?  (?:([\d,.]+) samples/s|samples not counted)", re.M)
RANK_ROW = re.compile(
    r"^\s*(\d+)  \S+\s+\d+\s+.+?\s+(?:\d+%|-)\s+([\d,.]+|-)\s+(?:\d+%|-)(?:\s|$)", re.M
)
HEADER_SAMPLES = re.compile(r"([\d,.]+) samples/s")


def exporter_figures(state: RunState) -> tuple[list[float], dict[int, float]]:
    """The job's samples/s and each rank's, as the exporter's families serve them."""
    reading = run_reading(state, lambda _series: 0, lambda _series: 0)
    assert reading is not None
    fleet = FleetReading(
        runs=(reading,),
        silent=(),
        last_seen_age_s={},
        registered=1,
        unwatched=0,
        dropped=0,
        registry_read_s=0.0,
    )
    built = {family.name: family for family in families(fleet, lambda _rank: None)}
    job = [s.value for s in built["memtui_job_samples_per_second"].samples]
    ranks = {int(s.labels["rank"]): s.value for s in built["memtui_samples_per_second"].samples}
    return job, ranks


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def compare(hooks: HookHistories, viewer: RunState, where: str) -> dict[str, Any]:
    """Every surface's job figure and per-rank figures at this point; asserts they agree."""
    snapshots = [hooks.hello(rank) for rank in sorted(hooks.info)]
    report = build_status(
        snapshots[0], snapshots if len(snapshots) > 1 else None, load_thresholds()
    )
    data = json.loads(status_json(report))
    text = render_status(report)
    summary = viewer.refresh_summary()
    job = data["throughput"]
    shown = summary.throughput
    assert shown is not None, where
    # the job: the JSON, the viewer's state, the exporter
    assert same(job["samples_per_s"], shown.samples_per_s), (where, job, shown)
    assert job["ranks"] == shown.ranks and job["world_size"] == shown.world_size, where
    assert same(job["micro_batches_per_step"], shown.micro_batches_per_step), where
    exported_job, exported_ranks = exporter_figures(viewer)
    assert exported_job == ([shown.samples_per_s] if shown.counted else []), where
    # the words: the status text's run line and the viewer's header say the same figure
    header = RunHeader().build(viewer, ViewOptions(), 400).plain
    printed = RUN_LINE.search(text)
    assert printed is not None, text
    in_header = HEADER_SAMPLES.search(header)
    if shown.counted:
        assert printed.group(1) == format_rate(job["samples_per_s"]), (where, text)
        assert in_header is not None and in_header.group(1) == printed.group(1), (where, header)
        assert job["summary"] in text and job["summary"] in header, (where, job, header)
    # every rank: the JSON, the text's table, the viewer's state, the exporter
    by_rank = {r.rank: r for r in summary.ranks}
    table = {int(m.group(1)): m.group(2) for m in RANK_ROW.finditer(text)}
    for entry in data["ranks"]:
        metrics = entry.get("metrics")
        if not metrics:
            continue
        rank = entry["rank"]
        viewed = by_rank[rank].steps
        assert viewed is not None, (where, rank)
        assert same(metrics["samples_per_s"], viewed.samples_per_s), (where, rank)
        if metrics["samples_counted"]:
            assert same(exported_ranks[rank], viewed.samples_per_s), (where, rank)
        if len(data["ranks"]) > 1:
            assert table[rank] == format_rate(metrics["samples_per_s"]), (where, rank, text)
    counted = [e["metrics"]["samples_per_s"] for e in data["ranks"] if e.get("metrics")]
    if len(data["ranks"]) > 1:  # the job's figure is its ranks' own, summed
        assert same(job["samples_per_s"], sum(counted)), (where, job, counted)
    return {"job": job["samples_per_s"], "ranks": len(counted)}


def replay(path: Path, keep: set[int] | None = None) -> list[dict[str, Any]]:
    """Feed a recording to both sides, comparing every ``EVERY`` frames and at its end."""
    frames = read_recording(path).frames
    decoder = Decoder()
    hooks = HookHistories()
    viewer = RunState()
    compared: list[dict[str, Any]] = []
    for index, frame in enumerate(frames, 1):
        message = decoder.decode(frame.frame)
        assert message is not None, decoder.last_error
        hooks.add(message)
        viewer.apply(ReceivedBatch(events=[message], clock=frame.offset_s))
        if index % EVERY and index != len(frames):
            continue
        if hooks.first is None or viewer.refresh_summary().silent:
            continue  # a silent rank is out of the viewer's sum: status cannot know it is
        if not any(hooks.steps[rank] for rank in hooks.steps):
            continue
        compared.append(compare(hooks, viewer, f"{path.name} frame {index}"))
    return compared


@pytest.mark.parametrize("path", RECORDINGS, ids=[p.stem for p in RECORDINGS])
def test_status_the_viewer_and_the_exporter_show_the_same_samples_per_second(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))
    compared = replay(path)
    assert len(compared) >= 5, f"{path.name}: only {len(compared)} points compared"


def test_the_job_figure_of_several_ranks_is_their_own_summed() -> None:
    """Eight ranks of 32 samples a step at ~0.45 s a step: ~71 samples/s each, ~569 the job
    (``memtui status`` said 71 where the viewer said 569)."""
    compared = replay(RECORDINGS[0].with_name("ranks_8.mtrec"))
    last = compared[-1]
    assert last["ranks"] == 8
    assert 8 * 32 / 0.46 < last["job"] < 8 * 32 / 0.44, last
