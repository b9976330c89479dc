"""``memtui status``'s report: one typed schema; its JSON keeps every key scripts read and
decodes back into the schema; the text is rendered from the report alone."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from memtui.runs.events import ReceivedBatch
from memtui.runs.report import StatusReport, build_status, render_status, status_json
from memtui.runs.state import RunState, ViewOptions
from memtui.storage.userconfig import load_thresholds
from memtui.transport.recording import read_recording
from memtui.tui.widgets.config import ConfigPanel
from memtui.wire import Decoder
from tests.unit.test_verdict_parity import RECORDINGS, HookHistories

STABLE_KEYS = {
    "applied", "audit_path", "breakdown", "checkpoints", "command", "config", "counters",
    "device", "disabled", "effective_batch", "host", "host_memory", "last_step",
    "max_safe_batch_size", "memory", "metrics", "model", "ooms", "pending", "pid",
    "prediction_accuracy", "ranks", "recommendations", "rejected", "requeue", "run", "started",
    "state_dir", "static_memory", "step", "tunable", "tuned_path", "tuned_unsaved_step",
    "verdict", "world_size",
}  # fmt: skip
"""The keys of ``memtui status --json`` before the schema was typed: never removed or renamed."""
RANK_KEYS = {
    "applied", "config", "counters", "host", "host_memory", "local_rank", "memory", "metrics",
    "pid", "rank", "reachable", "step",
}  # fmt: skip
ALWAYS_COUNTED = {"requests_refused", "requests_rate_limited", "auth_failures"}


def _reports(path: object) -> list[StatusReport]:
    """The report at every 40th frame of a recording and at its end."""
    histories, decoder, out = HookHistories(), Decoder(), []
    frames = read_recording(path).frames  # type: ignore[arg-type]
    for index, frame in enumerate(frames):
        histories.add(decoder.decode(frame.frame))
        if histories.first is None or (index % 40 and index != len(frames) - 1):
            continue
        snapshots = [histories.hello(rank) for rank in sorted(histories.info)]
        ranks = snapshots if len(snapshots) > 1 else None
        out.append(build_status(snapshots[0], ranks, load_thresholds()))
    return out


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_status_json_keeps_its_keys_and_round_trips(path: object) -> None:
    reports = _reports(path)
    assert reports
    for report in reports:
        text = status_json(report)
        data = json.loads(text)
        assert set(data) >= STABLE_KEYS
        assert set(data["counters"]) >= ALWAYS_COUNTED
        assert data["verdict"]["state"] == report.verdict.state
        assert set(data["verdict"]["thresholds"]) >= {"memory_edge_fraction", "hysteresis"}
        for rank in data["ranks"]:
            assert {"rank", "host", "reachable"} <= set(rank)
            if rank["reachable"]:
                assert set(rank) >= RANK_KEYS
        again = msgspec.json.decode(text, type=StatusReport)
        assert render_status(again, now=report.started + 60) == render_status(
            report, now=report.started + 60
        )
        assert status_json(again) == text


def test_status_text_names_what_the_report_holds() -> None:
    report = _reports(RECORDINGS[0])[-1]
    text = render_status(report, now=report.started + 3600)
    assert text.splitlines()[0].startswith(f"run {report.run}  pid {report.pid}")
    assert text.splitlines()[0].endswith("up 1h00m")
    assert f"verdict: {report.verdict.state}: {report.verdict.headline}" in text
    for applied in report.applied[-5:]:
        assert f"applied at step {applied.step}:" in text


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_status_says_one_largest_micro_batch(path: object) -> None:
    """The model line and the options quote the same largest micro-batch under the edge band:
    past 4x the largest micro-batch measured, only that floor (``> 64``), never the size a line
    fitted on small micro-batches extrapolates to (a CPU run's option said 18606 beside it)."""
    for report in _reports(path):
        text = render_status(report, now=report.started + 60)
        figures = set(re.findall(r"largest (?:micro-batch )?under \d+%: (> \d+|\d+)", text))
        assert len(figures) <= 1, text
        if report.max_safe.startswith(">"):
            assert figures == {report.max_safe.split(" (")[0]}, text


def test_prefetch_factor_without_loader_workers_is_shown_unused() -> None:
    """A loader without workers ignores ``prefetch_factor`` (torch uses it only with workers):
    the text, the JSON and the viewer's config panel give the one value it holds (the one workers
    would use) and say it is unused now and why; the panel says a pending change of workers
    starts using it."""
    path = next(p for p in RECORDINGS if p.stem == "demo_autopilot")
    reports = _reports(path)
    without = next(r for r in reports if r.config["num_workers"] == 0)
    with_workers = next(r for r in reports if r.config["num_workers"])
    text = render_status(without, now=without.started + 60)
    assert "num_workers=0 pin_memory=false prefetch_factor=2 (unused: no loader workers)" in text
    data = json.loads(status_json(without))
    assert data["config"]["prefetch_factor"] == 2
    assert data["config_unused"] == {"prefetch_factor": "no loader workers"}
    assert with_workers.config_unused == {}
    assert "prefetch_factor=2" in render_status(with_workers, now=with_workers.started + 60)

    state, decoder = RunState(), Decoder()
    for frame in read_recording(path).frames:
        state.apply(ReceivedBatch(events=[decoder.decode(frame.frame)], clock=frame.offset_s))
        if state.knob_value("num_workers") == 0 and state.pending_values().get("num_workers"):
            break
    panel = str(ConfigPanel().build(state, ViewOptions(), 60)).splitlines()
    assert re.search(r"^num_workers +0  → 1 ", panel[3]), panel
    assert re.search(r"^prefetch_factor +2  → used ", panel[5]), panel


def test_a_change_pending_when_the_run_ended_is_said_never_applied() -> None:
    """The last word of a run that ended with a change queued: the JSON's ``unapplied`` and one
    text line, beside the knobs the run has but memtui cannot change, with their values."""
    path = next(p for p in RECORDINGS if p.stem == "watched_stream")
    report = _reports(path)[-1]
    data = json.loads(status_json(report))
    assert [(c["id"], c["changes"]) for c in data["unapplied"]] == [(2, {"pin_memory": True})]
    assert data["pending"] == []
    text = render_status(report, now=report.started + 60)
    assert "never applied #2: pin_memory=true (queued at step " in text
    assert "pending at exit: the run ended before its next boundary" in text
    assert "config: batch_size=4 grad_accum=2 (measured) num_workers=2 " in text
    assert "2 loader workers (" in text, "the workers each epoch starts anew are listed"
    assert (data["config_measured"], data["effective_batch"]) == (["grad_accum"], 8)


def test_status_reads_each_prediction_next_to_its_measurement_in_words() -> None:
    """An applied change reads ``predicted speed +118%, measured +233%`` and ``predicted peak 430
    MiB (2% high)``, says who asked for it, and names a knob the run had not set as its default
    (before: ``(off by -115 points)``, ``(+2%)`` and ``prefetch_factor - -> 2``)."""
    from memtui.runs.report import Applied, Diff, EffectReport

    report = _reports(RECORDINGS[0])[-1]
    measured = EffectReport(20, 20, 100.0, 333.0, 0.3, 0.09, 0.2, 0.01, summary="+233% samples/s")
    mib = 1 << 20
    applied = Applied(
        ids=[3], step=50, time=0.0,
        changes={"num_workers": Diff(0, 2), "prefetch_factor": Diff(None, 2)}, note="",
        rollback=False, predicted_peak_bytes=430 * mib, observed_peak_bytes=420 * mib,
        prediction_error=430 / 420 - 1, effect=measured, predicted_speed_delta=1.18,
        speed_error=1.18 - 2.33,
    )  # fmt: skip
    text = render_status(msgspec.structs.replace(report, applied=[applied]))
    line = next(line for line in text.splitlines() if line.startswith("applied at step 50"))
    assert line.startswith(
        "applied at step 50: num_workers 0 -> 2, prefetch_factor default -> 2 (#3) by an operator"
    ), line
    assert "predicted peak 430 MiB (2% high); predicted speed +118%, measured +233%" in line
    assert "off by" not in line and " - -> " not in line and "points" not in line


def test_status_says_why_a_change_has_no_effect() -> None:
    """A change that cannot act on the run (pinning without an accelerator) is never measured:
    its line says why instead of an effect, in the text and the JSON."""
    from memtui.runs.report import Applied, Diff

    report = _reports(RECORDINGS[0])[-1]
    note = "pin_memory does nothing without an accelerator: its effect is not measured"
    applied = Applied(
        ids=[4], step=60, time=0.0, changes={"pin_memory": Diff(False, True)}, note="",
        rollback=False, predicted_peak_bytes=None, observed_peak_bytes=None,
        prediction_error=None, effect=None, effect_note=note,
    )  # fmt: skip
    shown = msgspec.structs.replace(report, applied=[applied])
    line = next(line for line in render_status(shown).splitlines() if "step 60" in line)
    assert line.endswith(f"by an operator: {note}"), line
    assert json.loads(status_json(shown))["applied"][0]["effect_note"] == note
