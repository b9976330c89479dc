"""Hugging Face Trainer with ``hooks.install(trainer)``: a change queued by a real client lands at
the next save; the run resumes in-process and nothing is lost or repeated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks.harness import PYTHON, paused_run

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("hf_train.py")


def test_change_lands_at_next_save_and_run_resumes_exactly(tmp_path: Path) -> None:
    with paused_run(tmp_path, PYTHON, SCRIPT) as paused:
        # 4 x 2 -> 6 x 1: 32 samples consumed at step 4 are not a whole number of new steps
        paused.queue_and_go("batch_size=6", "grad_accum=1")
        paused.finish(180)
    report_path = paused.report
    report = json.loads(report_path.read_text())
    assert report["restarts"] == 1
    assert report["global_step"] == report["output_step"] == report["tuner_step"] == 12
    assert report["steps"] == list(range(1, 13)), "global step continued, never reset"
    expected_lrs = [1e-3 * (1 - (s - 1) / 12) for s in range(1, 13)]
    assert report["lrs"] == pytest.approx(expected_lrs), "the LR schedule went on where it was"
    assert report["args"] == {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 1}
    seen, orders = report["seen"], report["orders"]
    # steps 1-4: 8 samples each; steps 5-10 finish epoch 0 (5 x 6 + 2); steps 11-12: 6 each
    assert len(seen) == 4 * 8 + 32 + 2 * 6
    assert sorted(seen[:64]) == list(range(64)), "epoch 0: every sample exactly once"
    assert seen[:32] == orders[0][:32]
    assert seen[32:64] == orders[0][32:], "epoch 0 continued exactly after the resume"
    assert seen[64:] == orders[1][:12]
    audit = [
        json.loads(x) for x in (tmp_path / "out" / "memtui-audit.jsonl").read_text().splitlines()
    ]
    applied = [entry for entry in audit if entry.get("event") == "applied"]
    assert applied and applied[0]["step"] == 4, audit
