"""Lightning with ``hooks.install(trainer)`` (``lightning.pytorch`` and ``pytorch_lightning``): a
change queued by a real client lands right after the next checkpoint, inside ``fit``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, memtui_cli, wait_for

SCRIPT = Path(__file__).with_name("lightning_train.py")
SAMPLES = 96


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_change_lands_after_the_next_checkpoint(tmp_path: Path, package: str) -> None:
    pytest.importorskip(package)
    report_path, go, log = tmp_path / "report.json", tmp_path / "go", tmp_path / "train.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "--out",
                str(tmp_path / "out"),
                "--report",
                str(report_path),
                "--go",
                str(go),
                "--samples",
                str(SAMPLES),
                "--package",
                package,
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    try:
        wait_for(
            lambda: "waiting at step 2" in log.read_text() or proc.poll() is not None,
            120,
            what="fit to reach step 2",
        )
        assert proc.poll() is None, log.read_text()
        run = next(
            line.split()[1] for line in log.read_text().splitlines() if line.startswith("run ")
        )
        setting = memtui_cli("set", run, "batch_size=6", "grad_accum=3")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        go.touch()
        assert proc.wait(180) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads(report_path.read_text())
    assert report["global_step"] == report["tuner_step"] == 12
    accum = report["accum_per_step"]
    assert accum[:7] == [2] * 4 + [3] * 3, "whole groups of 3 from step 5 on"
    # epoch 0 ends with 2 micro-batches of a group: Lightning carries them into the next step
    assert accum[7] == 5 and accum[8:] == [3] * 4
    assert report["accumulate_grad_batches"] == 3 and report["batch_size"] == 6
    assert report["lrs"] == pytest.approx([0.1 * (1 - s / 12) for s in range(12)])
    seen = report["seen"]
    # 8 batches of 4, one more of 4 that Lightning had prefetched, then batches of 6
    assert sorted(seen[:SAMPLES]) == list(range(SAMPLES)), "epoch 0: every sample once"
    assert len(set(seen[SAMPLES:])) == len(seen) - SAMPLES, "epoch 1: no sample twice"
