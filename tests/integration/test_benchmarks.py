"""The benchmark scripts keep working in quick mode (docs/performance.md quotes full runs)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.clock import patience
from tests.support.processes import ROOT

pytestmark = pytest.mark.heavy


@pytest.mark.slow  # 20 s of timing loops; `make bench` runs the script in full
def test_hook_overhead_quick() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/hook_overhead.py", "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=patience(120),
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"hook_us_per_step", "overhead_pct", "background_cpu_pct", "ab_overhead_pct"} <= set(
        result
    )
    # --quick is a smoke run of the script (4 short rounds): on a busy machine the difference
    # of two noisy timings can even come out negative; the real figures come from `make bench`
    assert abs(result["hook_us_per_step"]) < 50, "the hot path is microseconds"
    assert 0 < result["hook_us_per_step_best"] + 5 < 55
    # the machine's speed is reported with the cost: the fastest bare round is a fast round
    assert result["fast_rounds"] >= 1 and result["bare_us_per_step"] > 0
    assert abs(result["hook_us_per_step_fast_rounds"]) < 50
    # and which machine and code gave it: wall-clock figures differ ~2x between this
    # project's VMs for the same code
    assert result["cpu_model"] and "commit" in result


def _run(*args: str, timeout: float = 180) -> str:
    """Run a benchmark script and return its stdout."""
    out = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        check=True,
    )
    return out.stdout


def _run_json(*args: str, timeout: float = 180) -> dict[str, Any]:
    """Run a benchmark script and return its last stdout line, parsed."""
    result: dict[str, Any] = json.loads(_run(*args, timeout=timeout).strip().splitlines()[-1])
    return result


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _check_arms(result: dict[str, Any], metrics: list[str]) -> None:
    """Every metric has every arm's spread over the rounds and each hooked arm's paired
    difference to the bare arm of the same switch interval (the numbers' size is not checked:
    a quick run on a shared machine is noise)."""
    arms = result["arms"]
    assert any(a.startswith("bare@") for a in arms)
    assert {a.partition("@")[0] for a in arms} == {"bare", "unwatched", "watched"}
    summary = result["summary"]
    for key in metrics:
        for arm in arms:
            spread = summary[key][arm]
            assert spread["n"] == result["rounds"], (key, arm)
            assert _is_number(spread["median"]) and spread["min"] <= spread["median"]
            assert spread["median"] <= spread["max"]
            if arm.startswith("bare@"):
                continue
            diff = summary[key][f"{arm}-bare"]
            assert _is_number(diff["mean"]) and _is_number(diff["median"]), (key, arm)
            assert diff["n"] == result["rounds"]
            assert diff["ci95"] is None or diff["ci95"] >= 0
    for key in ("loadavg_before", "loadavg_after"):
        assert len(result[key]) == 3 and all(_is_number(x) for x in result[key])


def test_hook_cputime_quick() -> None:
    """The nanoGPT-shaped side-by-side: CPU per thread and step time, bare vs hook."""
    result = _run_json("benchmarks/hook_cputime.py", "--quick")
    assert result["benchmark"] == "hook_cputime"
    metrics = [
        "train_cpu_us",
        "hook_cpu_us",
        "process_cpu_us",
        "step_ms_p50",
        "step_ms_p99",
        "offcpu_us_mean",
        "train_gil_waits_per_1k_steps",
        "steps_with_gil_wait_per_1k",
    ]
    _check_arms(result, metrics)
    summary = result["summary"]
    for arm in result["arms"]:
        # a bare round starts no thread of the hook; every round trains on the training thread
        if arm.startswith("bare@"):
            assert summary["hook_cpu_us"][arm]["max"] == 0
        assert summary["train_cpu_us"][arm]["min"] > 0
        assert summary["step_ms_p50"][arm]["min"] > 0
        assert summary["step_ms_p50"][arm]["median"] <= summary["step_ms_p99"][arm]["median"]
    watched = next(a for a in result["arms"] if a.startswith("watched@"))
    assert summary["hook_cpu_us"][watched]["min"] > 0, "a watched hook's threads ran"
    assert set(result["overhead"]) == {a for a in result["arms"] if not a.startswith("bare@")}
    assert result["config"]["torch_threads"] == 1


def test_hook_gil_quick() -> None:
    """The GIL probe: waits and preemptions of a pure-Python training thread, and the profile
    of the hook's threads."""
    result = _run_json("benchmarks/hook_gil.py", "--quick", "--profile")
    assert result["benchmark"] == "hook_gil"
    _check_arms(
        result, ["gil_wait_per_s", "gil_wait_us_p99", "preempted_per_s", "hook_slices_per_s"]
    )
    assert {a.partition("@")[2] for a in result["arms"]} == {"5ms", "0.5ms"}
    threads = result["profile"]["threads"]
    assert threads, "the hook's threads were profiled"
    for report in threads.values():
        assert report["profiled_cpu_ms_per_s"] >= 0
        for row in report["top_own_cpu"]:
            assert row["function"] and _is_number(row["own_cpu_share_pct"])


@pytest.mark.slow  # its own training of 20 s; full runs are the evidence (docs/performance.md)
def test_advice_truth_quick(tmp_path: Path) -> None:
    """One script through two changes: the benchmark completes and prints its table (the
    accuracy is measured by the full run, not asserted here)."""
    rows = tmp_path / "rows.json"
    out = _run("benchmarks/advice_truth.py", "--scripts", "cnn", "--quick", "--json", str(rows))
    assert "predicted" in out and "observed" in out, out
    assert "verdict against the accuracy bar" in out
    result = json.loads(rows.read_text())
    assert [r["kind"] for r in result["rows"]] == ["batch=16", "max_safe"]
    assert result["rows"][0]["outcome"] in ("measured", "refused", "rejected"), result["rows"][0]


@pytest.mark.slow  # a demo training to ask (torch's import alone is ~7 s of CPU)
def test_cli_startup_runs() -> None:
    """The startup benchmark times both commands against its own demo run and prints them."""
    out = _run("benchmarks/cli_startup.py", "--runs", "2")
    for command in ("memtui --version", "memtui status --json", "python -c pass"):
        assert re.search(
            re.escape(command) + r" +wall median +\d+ ms .* cpu median +\d+ ms", out
        ), out
    assert "load average before" in out and "load average after" in out


@pytest.mark.slow  # a minute under valgrind; `make bench-instructions` runs it in full
def test_hook_instructions_one_process() -> None:
    """Every loop is counted in one process, so the hook's figure is its own process's
    difference (another process's layout moves the bare loop by ~1.5k instructions)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        pytest.skip("valgrind is not installed")
    result = _run_json(
        "benchmarks/hook_instructions.py",
        *("--repeat", "1", "--rounds", "1", "--steps", "200"),
        timeout=patience(600),
    )
    per_step = result["instructions_per_step"]
    assert set(per_step) == {"bare", "loader", "hooked", "floor"}
    hook = result["hook_instructions_per_step"]["median"]
    # each figure is rounded on its own: the difference of two rounded ones may be 1 off
    assert abs(hook - (per_step["hooked"]["median"] - per_step["bare"]["median"])) <= 1
    # the floor does less than the loader wrapper, which does less than the wrapper and a step
    assert 0 < result["floor_instructions_per_step"]["median"] < hook
    assert 0 < result["loader_only_instructions_per_step"]["median"] < hook


@pytest.mark.slow  # 4 training processes of a few seconds each
def test_peer_overhead_quick() -> None:
    """The side-by-side benchmark runs the plain loop bare and with memtui (the peer only where
    its launcher is installed) and says which it left out."""
    result = _run_json("benchmarks/peer_overhead.py", "--quick", "--traceml", "", timeout=300)
    assert result["peer"] == "not installed" and "traceml" not in result
    assert result["bare"]["median_step_us"]["n"] == 2
    assert result["memtui"]["overhead_pct"]["n"] == 2
    assert result["commit"] and result["machine"]


@pytest.mark.slow  # a few seconds of timing loops; `make bench` runs the script in full
def test_auto_overhead_quick() -> None:
    """The no-code watch's benchmark times the three loops and counts the watch's steps."""
    result = _run_json("benchmarks/auto_overhead.py", "--quick", timeout=120)
    assert result["rounds"] == 4 and result["bare_us_per_step"]["n"] == 4
    assert abs(result["watch_us_per_step"]["median"]) < 50, "the hot path is microseconds"
    assert result["watch_steps_counted"] >= 4 * 300, "the watch counted its loops' steps"
