"""The benchmark scripts keep working (quick mode; the figures in the README come from full runs)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_hook_overhead_quick() -> None:
    out = subprocess.run(
        [sys.executable, "benchmarks/hook_overhead.py", "--quick"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
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
