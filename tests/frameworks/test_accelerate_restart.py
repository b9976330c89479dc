"""An Accelerate loop restarted with ``accelerator.load_state`` and ``resume=True`` after an LR
factor: the optimizer uses the schedule x the factor at every step after the restart, whether the
state it loads carries the factor or not, and memtui says that factor (status, audit log, tuned
YAML), never a withdrawal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtui.hooks.persist import AUDIT_FILE, TUNED_FILE, read_audit
from tests.frameworks.harness import PYTHON, paused_run
from tests.support.cli import status_json

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("accel_restart_train.py")
STEPS, WARMUP, SAVE_EVERY, LR = 16, 3, 4, 1e-3
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def schedule(step: int) -> float:
    """``get_linear_schedule_with_warmup``'s LR at optimizer step ``step`` (1-based: the
    scheduler has stepped ``step - 1`` times)."""
    done = step - 1
    if done < WARMUP:
        return LR * done / WARMUP
    return LR * max(0.0, (STEPS - done) / (STEPS - WARMUP))


def used(report: Path) -> dict[int, list[float]]:
    """Every param group's LR at each optimizer step, as the script's global hook read it."""
    lines = Path(f"{report}.lrs.jsonl").read_text().splitlines()
    return {step: lrs for step, lrs in (json.loads(x) for x in lines)}


def wrong(lrs: dict[int, list[float]], factor_from: int, factor: float) -> list[Any]:
    """(step, LRs used, LR expected) where a group's LR is not the schedule's x the factor."""
    out = []
    for step, groups in sorted(lrs.items()):
        expected = schedule(step) * (factor if step >= factor_from else 1.0)
        if any(lr != pytest.approx(expected, rel=1e-9, abs=1e-15) for lr in groups):
            out.append((step, groups, expected))
    return out


def test_a_restart_from_load_state_runs_the_schedule_times_the_factor_memtui_reports(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = tmp_path / "first"
    first.mkdir()
    common = ("--state-dir", str(state), "--steps", str(STEPS), "--warmup", str(WARMUP))
    # batch 4 -> 8, linear, queued at step 2: it lands at the save of step 4 (the state saved
    # there lacks the factor), the save of step 8 carries it, and the run is killed right after
    with paused_run(first, PYTHON, SCRIPT, *common, "--die-after", "8", env=ENV) as paused:
        paused.queue_and_go("batch_size=8", "--allow-effective-batch", "--lr-scale", "linear")
        assert paused.proc.wait(120) == -9, paused.output()
    assert not wrong(used(paused.report), 5, 2.0)
    assert sorted(used(paused.report)) == list(range(1, 9))

    for checkpoint, wait_at in ((8, 10), (4, 6)):  # carries the factor, then lacks it
        again = tmp_path / f"from{checkpoint}"
        again.mkdir()
        resumed = ("--resume_from_checkpoint", str(first / "out" / f"step_{checkpoint}"))
        with paused_run(
            again, PYTHON, SCRIPT, *common, *resumed, env=ENV, wait_at=wait_at
        ) as restart:
            status = status_json(restart.run_id())
            restart.go.touch()
            restart.finish(120)
        assert status["config"]["batch_size"] == 8
        lr = status["lr"]
        assert lr["factor"] == 2.0 and not lr.get("script_schedule"), lr
        lrs = used(restart.report)
        assert sorted(lrs) == list(range(checkpoint + 1, STEPS + 1))
        mismatches = wrong(lrs, checkpoint + 1, lr["factor"])
        assert not mismatches, f"(step, LRs used, LR expected): {mismatches}"
        assert "no longer holds" not in restart.output()

    audit = read_audit(state / AUDIT_FILE)
    assert not [e for e in audit if e["event"] == "lr_withdrawn"]
    (applied,) = [e for e in audit if e["event"] == "applied"]
    assert applied["lr_factor"] == 2.0
    tuned = yaml.safe_load((state / TUNED_FILE).read_text())
    assert tuned["lr"]["factor"] == 2.0 and "script_schedule" not in tuned["lr"]
    assert tuned["lr"]["starts"] == [[pytest.approx(2 * LR)] * 2]
