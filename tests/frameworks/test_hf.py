"""Hugging Face Trainer with ``hooks.install(trainer)``: a change queued by a real client lands at
the next save; the run resumes in-process and nothing is lost or repeated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, memtui_cli, wait_for

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("hf_train.py")


def start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path, Path, Path]:
    report, go, log = tmp_path / "report.json", tmp_path / "go", tmp_path / "train.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "--out",
                str(tmp_path / "out"),
                "--report",
                str(report),
                "--go",
                str(go),
                *args,
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    return proc, report, go, log


def test_change_lands_at_next_save_and_run_resumes_exactly(tmp_path: Path) -> None:
    proc, report_path, go, log = start(tmp_path)
    try:
        wait_for(
            lambda: "waiting at step 2" in log.read_text() or proc.poll() is not None,
            120,
            what="the trainer to reach step 2",
        )
        assert proc.poll() is None, log.read_text()
        run = next(
            line.split()[1] for line in log.read_text().splitlines() if line.startswith("run ")
        )
        # 4 x 2 -> 6 x 1: 32 samples consumed at step 4 are not a whole number of new steps
        setting = memtui_cli("set", run, "batch_size=6", "grad_accum=1")
        assert setting.returncode == 0, setting.stderr
        go.touch()
        assert proc.wait(180) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
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
