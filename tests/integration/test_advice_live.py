"""Advice on a live demo run on a CPU: a loader that starves the run, and a doubled micro-batch
that runs out of memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from memtui.advice.predict import fraction, max_batch
from memtui.wire import MemoryModel
from tests.support.cli import memtui_cli, memtui_here, status_json
from tests.support.processes import DemoRun, wait_for

pytestmark = pytest.mark.heavy

MIB = 1 << 20
# a model whose logits dominate memory, so the micro-batch matters (~20 MiB per sample)
HEAVY = [
    "--seq-len",
    "256",
    "--width",
    "64",
    "--vocab",
    "8192",
    "--layers",
    "1",
    "--grad-accum",
    "1",
]


def status(run: str) -> dict[str, Any]:
    return status_json(run)


def until(
    run: str, predicate: Callable[[dict[str, Any]], object], timeout: float, what: str
) -> dict[str, Any]:
    """Poll ``memtui status --json`` until ``predicate`` holds; return that status."""

    def check() -> dict[str, Any] | None:
        data = status(run)
        return data if predicate(data) else None

    return wait_for(check, timeout, 0.3, what)  # type: ignore[return-value]


def test_a_starving_run_gets_more_workers_and_is_measurably_faster(
    start_demo: Callable[..., DemoRun],
) -> None:
    demo = start_demo("--steps", "100000", "--checkpoint-every", "20", "--slow-data-ms", "2")
    run = demo.run_id
    starving = until(
        run,
        lambda s: s["verdict"]["state"] == "STARVED" and s["recommendations"],
        60,
        "a STARVED verdict with recommendations",
    )
    top = starving["recommendations"][0]
    assert "num_workers" in top["changes"] and top["applicable"] and top["speed_delta"] > 0.3
    assert any(r["label"] == "data wait" and r["severity"] for r in starving["verdict"]["reasons"])
    workers = top["changes"]["num_workers"]
    assert memtui_cli("set", run, f"num_workers={workers}").returncode == 0
    measured = until(
        run, lambda s: s["applied"] and s["applied"][0]["effect"], 90, "the measured effect"
    )
    effect = measured["applied"][0]["effect"]
    # the workers stop at the CPUs the run may use (more would compete with the training for
    # them): on 2 cores, 2, whose gain under the suite's load is at times within its own
    # interval; the wait is what drops
    assert workers <= max(1, len(os.sched_getaffinity(0))), top["title"]
    assert effect["samples_per_s_after"] > effect["samples_per_s_before"], effect["summary"]
    assert effect["data_wait_s_after"] < 0.5 * effect["data_wait_s_before"], effect["summary"]
    assert effect["speedup_margin"] is not None, "the effect carries its interval"
    # the hook predicted its speed from the steps before it, as the recommendation did, and
    # status checks that prediction against the measured effect
    applied = measured["applied"][0]
    assert applied["predicted_speed_delta"] > 0.2, applied["speed_note"]
    assert applied["speed_error"] is not None
    assert measured["speed_accuracy"]["changes_measured"] == 1, measured["speed_accuracy"]
    until(run, lambda s: s["verdict"]["state"] != "STARVED", 60, "the starvation to go away")
    check_workers_uss(run, workers)


def test_a_doubled_batch_past_the_danger_band_is_refused_and_its_forced_overshoot_rolls_back(
    start_demo: Callable[..., DemoRun],
) -> None:
    demo = start_demo(
        # the overshoot lands at step 10-20 (the refused sets asked in this process): a step
        # of this model costs 0.3-0.6 CPU-s, and the fixed waits (the model's fit once a
        # second, the CLI's start) span more steps the faster the machine; at 20 steps a
        # 0.3 s step ran out before the change's step, so 10 steps leave room
        "--steps", "30", "--checkpoint-every", "5", "--slow-data-ms", "0", "--batch-size", "8",
        "--memory-limit", "720MiB", *HEAVY, fork=False
    )  # fmt: skip
    run = demo.run_id
    fitted = until(run, lambda s: s["model"] is not None, 60, "the memory model")
    assert fitted["model"]["returns_freed"], "the CPU stand-in fixed glibc's mmap threshold"
    # the dry run and the refusal by click in this process (a subprocess each took a second of
    # wall time from the steps before the overshoot), the forced change by the command line
    dry = memtui_here("set", run, "batch_size=16", "--dry-run")
    assert dry.exit_code == 0 and "it would need --force" in dry.stdout, dry.output
    refused = memtui_here("set", run, "batch_size=16")
    assert refused.exit_code == 2 and "over the 90% danger band" in refused.stderr
    assert "largest micro-batch predicted under 85%" in refused.stderr
    forced = memtui_cli("set", run, "batch_size=16", "--force")
    assert forced.returncode == 0, forced.stderr
    after = until(run, lambda s: s["ooms"], 90, "the out-of-memory error")
    oom = after["ooms"][0]
    assert oom["rolled_back"] and oom["kind"] == "cpu" and oom["config"]["batch_size"] == 16
    assert oom["batch"].startswith("re-queued")
    assert [a["rollback"] for a in after["applied"]] == [False, True]
    assert after["applied"][1]["changes"] == {"batch_size": {"old": 16, "new": 8}}
    assert after["applied"][0]["predicted_peak_bytes"] > 0.9 * 720 * MIB
    assert demo.wait_exit(180) == 0, demo.output()
    said = [line for line in demo.output().splitlines() if "out of memory at step" in line]
    assert len(said) == 1, f"one message for one rollback: {said}"
    assert "rolled it back (batch_size 16 -> 8), training goes on; re-queued" in said[0], said
    tuned = yaml.safe_load((demo.out / "memtui-tuned.yaml").read_text())
    assert tuned["config"]["batch_size"] == 8 and tuned["oom"]["rolled_back"] is True
    assert tuned["oom"]["config"]["batch_size"] == 16
    events = [
        json.loads(line)["event"]
        for line in (demo.out / "memtui-audit.jsonl").read_text().splitlines()
    ]
    assert events.count("oom") == 1 and events.count("applied") == 2


@pytest.mark.slow  # tests/integration/tui/test_advice.py's live demo: the same prediction, through the viewer
def test_prediction_is_within_10_percent_when_the_micro_batch_doubles(
    start_demo: Callable[..., DemoRun],
) -> None:
    demo = start_demo(
        "--steps",
        "100000",
        "--checkpoint-every",
        "5",
        "--slow-data-ms",
        "0",
        "--batch-size",
        "8",
        *HEAVY,
        fork=False,
    )
    run = demo.run_id
    until(run, lambda s: s["model"] is not None, 60, "the memory model")
    assert memtui_cli("set", run, "batch_size=16").returncode == 0
    measured = until(
        run,
        lambda s: s["applied"] and s["applied"][0]["observed_peak_bytes"],
        120,
        "the observed peak",
    )
    applied = measured["applied"][0]
    error = applied["prediction_error"]
    assert abs(error) < 0.10, (applied["predicted_peak_bytes"], applied["observed_peak_bytes"])
    assert applied["observed_peak_bytes"] > 1.2 * applied["effect"]["peak_bytes_before"], (
        "the batch mattered"
    )
    assert measured["prediction_accuracy"]["changes_measured"] == 1
    assert measured["model"]["points"][0][0] == 8 and len(measured["model"]["points"]) == 2

    # the audit log keeps predicted against observed, with the measured effect
    def measured_line() -> dict[str, Any] | None:
        audit = (demo.out / "memtui-audit.jsonl").read_text().splitlines()
        return next((e for e in map(json.loads, audit) if e["event"] == "measured"), None)

    line: dict[str, Any] = wait_for(measured_line, 10, 0.1, "the measured line")  # type: ignore[assignment]
    assert line["ids"] == applied["ids"] and line["step"] == applied["step"]
    assert line["predicted_peak_bytes"] == applied["predicted_peak_bytes"] > 0
    assert line["observed_peak_bytes"] == applied["observed_peak_bytes"] > 0
    assert line["prediction_error"] == error
    assert line["effect"]["peak_bytes_after"] == applied["observed_peak_bytes"]
    assert line["effect"]["samples_per_s_before"] > 0 and line["effect"]["samples_per_s_after"] > 0
    assert line["speed_note"] == applied["speed_note"] != "", "and the speed it was predicted at"
    assert "samples/s" in line["summary"] and "peak" in line["summary"], line["summary"]


@pytest.mark.slow  # test_advice's test_the_danger_gate_and_the_safe_batch_follow_the_config_file
def test_the_bands_of_the_config_file_gate_changes_in_the_run(
    start_demo: Callable[..., DemoRun], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run reads the verdict's memory bands from the YAML config file, as the viewer and
    ``memtui status`` do: a change under 90% but over the file's 80% needs --force."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "verdict:\n  underused_memory_fraction: 0.5\n"
        "  memory_edge_fraction: 0.75\n  memory_danger_fraction: 0.8\n"
    )
    monkeypatch.setenv("MEMTUI_CONFIG", str(config))  # the demo and the command line alike
    demo = start_demo(
        "--steps", "100000", "--checkpoint-every", "5", "--slow-data-ms", "0", "--batch-size", "4",
        "--memory-limit", "720MiB", *HEAVY, fork=False
    )  # fmt: skip
    run = demo.run_id
    data = until(run, lambda s: s["model"] is not None, 60, "the memory model")
    fields = {k: v for k, v in data["model"].items() if k != "confidence"}
    model = msgspec.convert(fields, MemoryModel)
    between = [b for b in range(1, 64) if 0.81 < fraction(model, b) < 0.89]
    assert between, "a micro-batch predicted between the file's danger band and the default's"
    assert data["verdict"]["thresholds"]["memory_danger_fraction"] == 0.8
    assert data["max_safe_batch_size"] == max_batch(model, 0.75) < max_batch(model, 0.85)  # type: ignore[operator]
    refused = memtui_cli("set", run, f"batch_size={between[0]}")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "over the 80% danger band" in refused.stderr, refused.stderr
    assert "largest micro-batch predicted under 75% is" in refused.stderr
    dry = memtui_cli("set", run, f"batch_size={between[0]}", "--dry-run")
    assert "it would need --force: predicted over the 80% danger band" in dry.stdout, dry.stdout
    assert "largest micro-batch under 75%" in memtui_cli("status", run).stdout


def check_workers_uss(run: str, workers: int) -> None:
    """``memtui status`` shows the run's loader workers by their own memory (USS), as the
    device total counts them, less than their RSS (which counts the shared pages again)."""

    shown = re.compile(rf"{workers} loader workers \([\d.]+ [KMG]iB USS\)$")
    lines: list[str] = []

    def host_line() -> str | None:
        text = memtui_here("status", run).stdout
        lines.append(next((x for x in text.splitlines() if x.startswith("host: ")), ""))
        return lines[-1] if shown.search(lines[-1]) else None

    # the workers are listed at the next host sample after they start (under load: seconds)
    try:
        wait_for(host_line, 60, 0.5, f"{workers} workers with their USS in memtui status")
    except BaseException:
        print("the last host lines:", *lines[-3:], sep="\n")
        raise
    data = status(run)
    uss = data["host_memory"]["workers_uss_bytes"]
    assert 0 < uss < data["host_memory"]["workers_rss_bytes"], "USS leaves out the shared pages"


@pytest.mark.slow  # the starving run's test checks the same of the workers it starts
def test_status_shows_the_workers_by_uss_as_the_device_total_counts_them(
    start_demo: Callable[..., DemoRun],
) -> None:
    demo = start_demo("--steps", "100000", "--workers", "2", "--slow-data-ms", "0", fork=False)
    check_workers_uss(demo.run_id, 2)


@pytest.fixture
def two_cpu_hogs() -> Iterator[None]:
    """Two processes that keep two cores busy (``yes > /dev/null``) for the test's length."""
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.slow  # a minute under the hogs; the peak handover itself: tests/integration/test_sampler.py
def test_a_forced_overshoot_is_caught_and_rolled_back_at_once_under_two_cpu_hogs(
    start_demo: Callable[..., DemoRun], two_cpu_hogs: None
) -> None:
    """A busy machine slows the steps: memtui's sampler resets the kernel's peak mark several
    times a step, and the CPU stand-in still sees every peak (``hooks.peak_rss``)."""
    demo = start_demo(
        "--steps", "40", "--checkpoint-every", "5", "--slow-data-ms", "0", "--batch-size", "8",
        "--memory-limit", "720MiB", *HEAVY, fork=False
    )  # fmt: skip
    run = demo.run_id
    until(run, lambda s: s["model"] is not None, 90, "the memory model")
    forced = memtui_here("set", run, "batch_size=16", "--force")
    assert forced.exit_code == 0, forced.output
    after = until(run, lambda s: s["ooms"], 120, "the out-of-memory error")
    oom, changed = after["ooms"][0], after["applied"][0]
    assert oom["rolled_back"] and oom["config"]["batch_size"] == 16
    assert changed["changes"]["batch_size"]["new"] == 16
    # the first micro-batch at the new size ran out: the out-of-memory error is at the step the
    # change landed at (the step it belongs to had not closed)
    assert oom["step"] == changed["step"], (oom["step"], changed["step"])
    assert demo.wait_exit(240) == 0, demo.output()
