"""The real CUDA paths, on a machine with a CUDA device (``make test-gpu``); skipped elsewhere.

Each test runs ``cuda_train.py`` (a hooked training on ``cuda:0``) in a fresh interpreter, never
forked from the test process: CUDA does not survive a fork. The CPU-runnable halves of what they
check (the OOM message parsed, the peak-reset switch, the expandable_segments check) are in
tests/unit/test_advice.py, tests/integration/test_tuner.py and tests/unit/test_hook_parts.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.cuda_train import HUGE_BATCH
from tests.support.processes import ROOT, launch_script

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).with_name("cuda_train.py")
GIB = 1 << 30
MIB = 1 << 20


def run_scenario(
    scenario: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str] | None = None,
    timeout: float = 200,
) -> dict[str, Any]:
    """Run one scenario of cuda_train.py to the end; what it wrote to result.json."""
    monkeypatch.setenv("MEMTUI_TEST_FORK", "0")  # a fresh interpreter: CUDA does not fork
    out = tmp_path / scenario
    log = tmp_path / f"{scenario}.log"
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = launch_script(SCRIPT, [scenario, str(out)], full_env, ROOT, log)
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, log.read_text()[-4000:]
    return dict(json.loads((out / "result.json").read_text()))


def test_a_real_cuda_oom_is_caught_rolled_back_and_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A micro-batch far past device memory, queued in a live run: torch's OutOfMemoryError in
    ``tuner.guard()`` is caught, the change rolled back, training goes on, and the event carries
    the numbers of torch's message."""
    result = run_scenario("oom", tmp_path, monkeypatch)
    assert result["errors"] == 0
    assert result["rollbacks"] >= 1 and result["batch_after"] == result["safe_batch"]
    assert result["steps"] > 0
    event = result["ooms"][0]
    assert event["kind"] == "cuda" and event["rolled_back"]
    assert event["config"]["batch_size"] == HUGE_BATCH
    assert event["safe_config"]["batch_size"] == result["safe_batch"]
    capacity = result["capacity"]
    # torch prints sizes to two decimals of their unit (GiB here): within 1% of the exact bytes
    assert event["capacity_bytes"] == pytest.approx(capacity, rel=0.01)
    assert event["tried_bytes"] > event["free_bytes"] >= 0, "it asked for more than was free"
    assert 0 < event["allocated_bytes"] < capacity
    assert event["reserved_unallocated_bytes"] is not None
    assert event["reserved_unallocated_bytes"] >= 0


@pytest.mark.timeout(600)
def test_predicted_peaks_of_two_increases_within_ten_percent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """256 -> 512 -> 1024: each change's predicted peak (from the model fitted before it) against
    the peak observed after it (reserved plus what NVML sees beyond torch)."""
    result = run_scenario("predict", tmp_path, monkeypatch, timeout=540)
    assert result["errors"] == 0
    changes = result["changes"]
    assert [c["batch"] for c in changes] == [512, 1024], changes
    for change in changes:
        assert change["predicted"] and change["observed"], change
        error = change["predicted"] / change["observed"] - 1
        assert abs(error) <= 0.10, f"micro-batch {change['batch']}: {error:+.1%} ({change})"


def test_the_hook_never_synchronises_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``set_sync_debug_mode("error")`` over a hooked run: steps, guard, boundaries, an applied
    change (loader rebuilt, peaks reset) and the sampler every 20 ms; the same loop without the
    hook first, so a failure is memtui's and not the loop's."""
    result = run_scenario("sync", tmp_path, monkeypatch)
    assert result["bare_error"] is None, f"the test's own loop synchronises: {result['bare_error']}"
    assert result["hooked_error"] is None, result["hooked_error"]
    # the hook's threads report what they raise instead of raising it: a synchronising call in
    # the sampler or the agent shows up here
    assert result["errors"] == 0, result["last_error"]
    assert result["cuda_samples"] > 10, "the sampler read the CUDA device meanwhile"
    assert result["batch_after"] == 128


def test_nvml_agrees_with_cuda_mem_get_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """memtui's probe finds our device in NVML (by UUID): its free memory is what CUDA says is
    free, and 2 GiB allocated through torch show up in NVML's used memory."""
    result = run_scenario("nvml", tmp_path, monkeypatch)
    before, after = result["before"], result["after"]
    for seen in (before, after):
        nvml_free = seen["nvml_total"] - seen["nvml_used"]
        # NVML's total counts memory the driver keeps for itself; CUDA's does not
        assert seen["cuda_total"] <= seen["nvml_total"] <= seen["cuda_total"] * 1.05, seen
        assert abs(nvml_free - seen["cuda_free"]) <= 256 * MIB + 0.01 * seen["cuda_total"], seen
        assert seen["capacity"] == seen["cuda_total"]
    grew = after["nvml_used"] - before["nvml_used"]
    assert abs(grew - 2 * GIB) <= 128 * MIB, (before, after)
    assert abs((before["cuda_free"] - after["cuda_free"]) - 2 * GIB) <= 128 * MIB


@pytest.mark.parametrize(
    ("reset", "kept"), [("", True), ("1", False)], ids=["default", "MEMTUI_RESET_PEAKS=1"]
)
def test_the_trainings_own_peak_reading_is_not_clobbered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reset: str, kept: bool
) -> None:
    """The training resets its peak, allocates 8 GiB and frees them, trains for 2 s (about a
    hundred samples of the hook): by default ``max_memory_allocated()`` still says 8 GiB; with
    ``MEMTUI_RESET_PEAKS=1`` the hook's resets took it (the switch does what it says). Either
    way the hook saw the spike."""
    result = run_scenario("peaks", tmp_path, monkeypatch, env={"MEMTUI_RESET_PEAKS": reset})
    assert result["errors"] == 0 and result["cuda_samples"] > 20
    assert result["reset_peaks"] is not kept
    assert result["mine"] >= 8 * GIB
    if kept:
        assert result["later"] >= result["mine"]
    else:
        assert result["later"] < result["mine"]
    assert result["hook_peak"] >= result["mine"]
