"""The run's summary and what is read from it: bounded whatever the run's length, a uniform
sample of its steps; two runs judged from their steps' distributions (a rank test), never two
means; the bounds of ``memtui check``; the config the next run starts with; the reports' JSON
keys, and their text drawn from the report alone, over every recording."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from memtui.advice.compare import Bounds, check, compare, spread_of
from memtui.advice.summary import (
    KEPT_STEPS,
    MAX_SPANS,
    MAX_WINDOWS,
    SummaryBuilder,
    start_with,
)
from memtui.core.stats import mann_whitney
from memtui.runs.after import (
    AfterReport,
    after_json,
    build_after,
    build_check,
    build_compare,
    command_with,
    render_after,
    render_check,
    render_compare,
)
from memtui.runs.summaries import Found, read_recording_summary
from memtui.wire import (
    AppliedChange,
    Ceiling,
    ControlState,
    DeviceSample,
    Effect,
    HostSample,
    KnobDiff,
    Knobs,
    OomEvent,
    RunInfo,
    RunSummary,
    Snapshot,
    StepRecord,
)
from tests.unit.test_verdict_parity import RECORDINGS

DATA = Path(__file__).resolve().parents[1] / "data"
INFO = RunInfo(run="t-000001", pid=1, host="h", started=1000.0, state_dir="/tmp/state-t")


def steps(
    count: int, *, start: float = 1000.0, step_s: float = 0.1, wait_s: float = 0.01, seed: int = 1,
    spread: float = 0.1, first: int = 1,
) -> list[tuple[int, float, float, float, int, int, int]]:  # fmt: skip
    """``count`` steps as the ledger records them, each ``step_s`` long give or take ``spread``."""
    rng = random.Random(seed)
    out, end = [], start
    for number in range(first, first + count):
        took = step_s * (1 + rng.uniform(-spread, spread))
        end += took
        out.append((number, end, took, wait_s, 16, 1, 0))
    return out


def summary_of(
    raw: list[tuple[int, float, float, float, int, int, int]], peak: int = 1 << 30
) -> RunSummary:
    """A finished run's summary of ``raw`` steps, its device sampled every 10 s at ``peak``."""
    builder = SummaryBuilder(seed="t")
    builder.add_steps(raw)
    t0, t1 = raw[0][1], raw[-1][1]
    builder.add_device(
        DeviceSample(time=t0 + i * 10, step=1, kind="cpu", capacity_bytes=8 << 30,
                     peak_reserved_bytes=peak, reserved_bytes=peak // 2)
        for i in range(int((t1 - t0) // 10) + 1)
    )  # fmt: skip
    control = ControlState(config=Knobs(batch_size=16, num_workers=0), tunable=["batch_size"])
    return builder.summary(INFO, control, t1, ended="ended")


# ---------------------------------------------------------------------------- bounded


def test_a_two_day_run_keeps_a_bounded_summary_whose_stretches_add_up() -> None:
    builder = SummaryBuilder(seed="long")
    raw = steps(200_000, step_s=0.86)  # two days at 0.86 s a step
    for start in range(0, len(raw), 5000):
        builder.add_steps(raw[start : start + 5000])
    builder.add_host(
        HostSample(time=1000.0 + i * 60, ram_total_bytes=64 << 30, ram_available_bytes=1,
                   ram_used_bytes=8 << 30, main_rss_bytes=(2 << 30) + i)
        for i in range(2900)
    )  # fmt: skip
    summary = builder.summary(INFO, None, raw[-1][1])
    assert len(summary.windows) <= MAX_WINDOWS
    assert summary.window_s >= 2 * 86400 / MAX_WINDOWS
    assert len(summary.kept) == KEPT_STEPS and summary.kept_of == 200_000 - 3
    assert sum(w.steps for w in summary.windows) == summary.steps == 200_000
    assert sum(w.step_time_s for w in summary.windows) == pytest.approx(summary.step_time_s)
    assert summary.memory is not None and summary.memory.host_peak_bytes == (2 << 30) + 2899
    assert len(msgspec.json.encode(summary)) < 160_000


def test_the_kept_steps_are_a_uniform_sample_of_the_run() -> None:
    builder = SummaryBuilder(seed="uniform")
    builder.add_steps(steps(100_000))
    kept = [k.step for k in builder.kept()]
    first_half = sum(step <= 50_000 for step in kept) / len(kept)
    assert 0.45 < first_half < 0.55
    assert min(kept) < 500 and max(kept) > 99_500
    assert all(step > 3 for step in kept)  # the first steps are not kept


def _look(builder: SummaryBuilder, wait_s: float, now: float, first: int) -> None:
    """A look at 60 steps that waited ``wait_s`` of each 0.1 s step."""
    records = [StepRecord(s, now - (first + 60 - s) * 0.1, 0.1, wait_s, 16, 1) for s in
               range(first, first + 60)]  # fmt: skip
    control = ControlState(config=Knobs(batch_size=16, num_workers=0), tunable=["num_workers"])
    builder.look(Snapshot(info=INFO, control=control, steps=records), None, now)


def test_the_verdicts_the_run_went_through_are_spans_bounded_in_number() -> None:
    builder = SummaryBuilder(seed="spans")
    builder.origin = 0.0
    for look in range(200):
        _look(builder, 0.08 if (look // 2) % 2 else 0.0, 30.0 * (look + 1), 60 * look + 1)
    summary = builder.summary(INFO, None, 6000.0)
    states = [span.state for span in summary.verdicts]
    assert len(states) == MAX_SPANS and summary.verdicts_dropped == 100 - MAX_SPANS
    assert set(states) == {"STARVED", "BALANCED"}
    assert states[0] == "BALANCED" and states[-1] == "STARVED"  # the run's start and end stay
    assert summary.verdict_seconds == {"BALANCED": 3000.0, "STARVED": 3000.0}
    assert summary.verdicts[0].looks == 2 and summary.verdicts[0].first_step == 60


# ---------------------------------------------------------------------------- two runs


def test_the_rank_test_gives_the_textbook_values() -> None:
    apart = mann_whitney([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])
    assert apart.superiority == 1.0
    assert apart.p_value == pytest.approx(0.0122, abs=5e-4)  # normal, continuity-corrected
    same = mann_whitney([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert same.superiority == 0.5 and same.p_value == 1.0
    tied = mann_whitney([1, 1, 1, 2], [2, 2, 2, 3])
    assert 0.5 < tied.superiority < 1 and tied.p_value < 0.1


def test_the_same_distribution_is_within_the_noise_and_a_slower_one_is_slower() -> None:
    base = summary_of(steps(3000, seed=1))
    again = summary_of(steps(3000, seed=2))
    slower = summary_of(steps(3000, seed=3, step_s=0.12))
    faster = summary_of(steps(3000, seed=4, step_s=0.09))
    same = {f.key: f for f in compare(base, again)}
    assert same["step_time_s"].verdict == "within the noise"
    assert abs(same["step_time_s"].change or 0) < 0.02
    worse = {f.key: f for f in compare(base, slower)}
    assert worse["step_time_s"].verdict == "slower"
    assert worse["step_time_s"].change == pytest.approx(0.2, abs=0.03)
    assert worse["samples_per_s"].verdict == "slower"
    low, high = worse["step_time_s"].change_low, worse["step_time_s"].change_high
    assert low is not None and high is not None and low < 0.2 < high
    assert {f.key: f for f in compare(base, faster)}["step_time_s"].verdict == "faster"


def test_two_means_apart_but_one_outlier_are_not_called_slower() -> None:
    """A verdict from the steps, not from two means: one stalled step moves a mean by 30% and
    the rank test not at all."""
    base = steps(600, seed=5)
    stalled = steps(600, seed=6)
    number, end, _took, wait, samples, micro, flags = stalled[300]
    stalled[300] = (number, end, 18.0, wait, samples, micro, flags)
    a, b = summary_of(base), summary_of(stalled)
    assert b.step_time_s / a.step_time_s > 1.25
    assert {f.key: f for f in compare(a, b)}["step_time_s"].verdict == "within the noise"


def test_steps_that_differ_in_spread_but_not_in_median_are_no_clear_change() -> None:
    """A run that sped up halfway (60% of its steps at 100 ms, then 40% at 30 ms) against one
    whose steps spread around 95 ms: the rank test tells them apart, but neither median is
    the slower, so neither run is called slower or faster."""
    rng = random.Random(7)
    halves = [0.1 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(600)]
    halves += [0.03 * (1 + rng.uniform(-0.05, 0.05)) for _ in range(400)]
    wide = [0.097 * (1 + rng.uniform(-0.4, 0.4)) for _ in range(1000)]

    def summary(times: list[float]) -> RunSummary:
        end, raw = 1000.0, []
        for number, took in enumerate(times, 1):
            end += took
            raw.append((number, end, took, 0.001, 16, 1, 0))
        return summary_of(raw)

    figure = {f.key: f for f in compare(summary(halves), summary(wide))}["step_time_s"]
    assert figure.p_value is not None and figure.p_value < 0.05
    assert figure.verdict == "no clear change", figure
    assert figure.change_low is not None and figure.change_low < 0
    assert figure.change_high is not None and figure.change_high > 0
    assert "spread differs" in figure.note
    assert check(summary(wide), Bounds(step_time_regression=0.0), summary(halves))[0].passed


def test_peaks_are_judged_against_their_own_noise() -> None:
    base = summary_of(steps(600), peak=1 << 30)
    close = summary_of(steps(600, seed=2), peak=(1 << 30) + (1 << 20))
    hungrier = summary_of(steps(600, seed=3), peak=3 << 29)
    assert {f.key: f for f in compare(base, close)}["device_peak_bytes"].verdict == (
        "within the noise"
    )
    more = {f.key: f for f in compare(base, hungrier)}["device_peak_bytes"]
    assert more.verdict == "more" and more.change == pytest.approx(0.5)


def test_too_few_steps_are_not_judged() -> None:
    figure = compare(summary_of(steps(6)), summary_of(steps(6, seed=2)))[0]
    assert figure.verdict == "too few steps" and not figure.judged
    assert spread_of([]) is None


# ---------------------------------------------------------------------------- check


def test_check_fails_each_bound_passed_with_one_line_and_holds_the_others() -> None:
    base = summary_of(steps(800, seed=1), peak=1 << 30)
    worse = summary_of(steps(800, seed=2, step_s=0.15, wait_s=0.05), peak=3 << 30)
    bounds = Bounds(
        step_time_regression=0.1, peak_memory=0.3, peak_memory_regression=0.1, data_wait=0.2
    )
    results = check(worse, bounds, base)
    assert [r.bound for r in results if not r.passed] == [
        "step time", "peak memory", "peak memory growth", "data wait",
    ]  # fmt: skip
    assert all(r.passed for r in check(base, bounds, summary_of(steps(800, seed=3))))
    text = render_check(build_check(Found(worse, "w"), bounds, Found(base, "b")))
    assert text.count("\nFAIL ") + text.startswith("FAIL ") == 4
    assert text.splitlines()[-1].endswith("FAILED")


def test_a_bound_that_cannot_be_checked_fails_saying_why() -> None:
    short = summary_of(steps(5))
    no_wait = summary_of([(s, e, t, w, n, 0, f) for s, e, t, w, n, _m, f in steps(100)])
    results = check(short, Bounds(step_time_regression=0.1), short)
    assert not results[0].passed and "too few steps" in results[0].line
    waited = check(no_wait, Bounds(data_wait=0.1), None)
    assert not waited[0].passed and "not measured" in waited[0].line


# ---------------------------------------------------------------------------- the next run


def _control(**fields: object) -> ControlState:
    return ControlState(config=Knobs(batch_size=32, num_workers=4), tunable=["batch_size"],
                        **fields)  # type: ignore[arg-type]  # fmt: skip


def test_the_next_run_starts_with_the_changes_that_held_and_says_what_they_bought() -> None:
    effect = Effect(steps_before=40, steps_after=40, samples_per_s_before=100.0,
                    samples_per_s_after=250.0, step_time_s_before=0.2, step_time_s_after=0.08,
                    data_wait_s_before=0.1, data_wait_s_after=0.01, speedup_margin=0.05)  # fmt: skip
    applied = AppliedChange(ids=[1], step=120, time=1.0,
                            changes={"num_workers": KnobDiff(0, 4)}, effect=effect)  # fmt: skip
    summary = summary_of(steps(200))
    summary.control = _control(applied=[applied])
    summary.first_step = 1
    chosen = start_with(summary)
    assert chosen is not None
    assert chosen.config == {"batch_size": 32, "num_workers": 4}
    assert chosen.changed == {"num_workers": (0, 4)}
    assert chosen.reasons[0].startswith(
        "num_workers 0 -> 4: applied at step 120 by an operator: +150%"
    )


def test_a_run_dead_of_an_oom_starts_the_next_from_its_safe_config_under_the_ceiling() -> None:
    oom = OomEvent(time=1.0, step=77, kind="cuda", message="CUDA out of memory",
                   config=Knobs(batch_size=32), safe_config=Knobs(batch_size=16))  # fmt: skip
    summary = summary_of(steps(100))
    summary.control = _control(ooms=[oom], ceiling=Ceiling(batch_size=12, step=77))
    summary.ended = "out of memory"
    chosen = start_with(summary)
    assert chosen is not None
    assert chosen.config["batch_size"] == 11
    assert "safe config" in chosen.source and "(12)" in chosen.source


def test_the_command_gets_its_own_flags_set_and_nothing_else() -> None:
    hf = ["python", "run_clm.py", "--per_device_train_batch_size", "8", "--do_train"]
    assert command_with(hf, {"batch_size": 16, "num_workers": 2}) == [
        "python", "run_clm.py", "--per_device_train_batch_size", "16", "--do_train",
    ]  # fmt: skip
    nano = ["python", "train.py", "--batch_size=12", "--gradient_accumulation_steps=4"]
    assert command_with(nano, {"batch_size": 6, "grad_accum": 8}) == [
        "python", "train.py", "--batch_size=6", "--gradient_accumulation_steps=8",
    ]  # fmt: skip
    assert command_with(["python", "train.py"], {"batch_size": 6}) == []
    assert command_with(nano, {"batch_size": 12}) == []  # nothing to change


# ---------------------------------------------------------------------------- recordings


AFTER_KEYS = {
    "run", "source", "live", "ended", "note", "written", "started", "command", "host", "pid",
    "world_size", "device", "state_dir", "verdict", "time", "memory", "changes", "ooms",
    "rollbacks", "rejected", "cancelled", "unapplied", "next", "ranks", "records_dropped",
}  # fmt: skip
"""The keys of ``memtui report --json``: added to, never renamed or removed."""


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.stem)
def test_every_recording_reports_with_its_keys_and_its_text_from_the_report_alone(
    path: Path,
) -> None:
    found = read_recording_summary(path)
    report = build_after(found)
    text = after_json(report)
    assert set(json.loads(text)) >= AFTER_KEYS
    again = msgspec.json.decode(text, type=AfterReport)
    assert render_after(again) == render_after(report)
    assert len(render_after(report).splitlines()) <= 45
    assert found.summary.steps > 0 and found.summary.verdicts
    compared = build_compare(found, found)
    assert {f.verdict for f in compared.figures} <= {"within the noise", "not measured"}
    assert "B against A" in render_compare(compared)


def test_the_starving_demo_went_from_starved_to_balanced_and_keeps_its_workers() -> None:
    report = build_after(read_recording_summary(DATA / "demo_starving.mtrec"))
    assert [span.state for span in report.verdict.spans] == ["STARVED", "BALANCED"]
    assert report.verdict.state == "STARVED" and report.verdict.at_end == "BALANCED"
    change = report.changes[0]
    assert change.who == "an operator" and change.changes["num_workers"].new == 4
    assert change.effect is not None and change.effect.samples_per_s_after > 2 * (
        change.effect.samples_per_s_before
    )
    assert report.next is not None and report.next.config["num_workers"] == 4
    assert report.next.changed["num_workers"].old == 0
    assert report.next.tuned_path.endswith("memtui-tuned.yaml")
    assert "--workers" in report.next.command and "4" in report.next.command
    assert "num_workers: 4" in report.next.yaml


def test_the_page_marks_each_change_and_rollback_on_its_charts() -> None:
    """The advice demo's page: its three charts inline, the operator's two changes and the
    rollback after the out-of-memory error marked on them, the memory chart's limit line."""
    pytest.importorskip("matplotlib")
    from memtui.runs.page import render_page

    found = read_recording_summary(DATA / "demo_advice.mtrec")
    page = render_page(build_after(found), found.summary)
    assert page.count("<svg") == 3
    # each chart's labels, as matplotlib names its drawn text (escaped) in the SVG
    assert page.count("<!-- batch_size 22-&gt;8 -->") == 3  # the rollback
    assert page.count("<!-- batch_size 4-&gt;8 -->") == 3
    assert "limit 900 MiB" in page


def test_the_page_without_matplotlib_is_one_line_that_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import sys

    from tests.support.cli import memtui_here

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # an import of it fails
    page = tmp_path / "report.html"
    result = memtui_here("report", str(DATA / "demo_starving.mtrec"), "--html", str(page))
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "memtui: --html draws its charts with matplotlib: pip install 'memtui[report]'"
    ]
    assert not page.exists()


def test_the_text_of_a_large_job_lists_rank_0_its_slowest_and_its_hungriest_ranks() -> None:
    from memtui.runs.after import MAX_RANK_LINES, shown_ranks
    from memtui.wire import RankFigures

    ranks = [
        RankFigures(rank=r, host="h", time=1.0, steps=100, step_time_s=0.1 + (0.5 if r == 41 else 0),
                    data_wait_fraction=0.0, data_wait_measured=True, samples_per_s=10.0,
                    device_peak_bytes=(9 << 30) if r == 17 else (1 << 30), capacity_bytes=16 << 30,
                    host_peak_bytes=0, ooms=0)
        for r in range(64)
    ]  # fmt: skip
    shown = [r.rank for r in shown_ranks(ranks)]
    assert len(shown) == MAX_RANK_LINES and shown == sorted(shown)
    assert {0, 17, 41} <= set(shown)


def test_a_directory_taken_from_the_script_gets_no_summary_where_memtui_changed_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Trainer's output_dir, taken as the state directory because none was given, keeps
    what the script writes there: the summary goes to the run's own directory under the state
    home (where ``memtui report RUN`` finds a finished run), a state_dir the user gave holds it."""
    from memtui.hooks.persist import ScriptDir, StateFiles

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    taken = StateFiles(lambda: "run-1", ScriptDir(tmp_path / "out"))
    assert taken.state_dir == tmp_path / "out"
    assert taken.summary_path == tmp_path / "state" / "memtui" / "runs" / "run-1" / SUMMARY
    given = StateFiles(lambda: "run-1", tmp_path / "out")
    assert given.summary_path == tmp_path / "out" / SUMMARY


SUMMARY = "memtui-summary.json"
