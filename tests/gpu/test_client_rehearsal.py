"""The client step of ``run_on_device.sh`` rehearsed on the CPU (``make test-slow``): the driver
that runs on a CUDA machine finds the run, changes it with ``memtui set`` and sees the change
land, with the corpus's nanoGPT and with the training that stands in for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("client", ["nanogpt", "serve"])
def test_the_client_step_passes_its_checks_on_the_cpu(tmp_path: Path, client: str) -> None:
    env = dict(
        os.environ, MEMTUI_GPU_TEST_DEVICE="cpu", MEMTUI_GPU_TEST_BATCH="4", OMP_NUM_THREADS="1"
    )
    if client == "nanogpt":
        pytest.importorskip("numpy")
        from tests.clients.upstream import Manifest, missing

        reason = missing(Manifest.load("nanogpt"))
        if reason:
            pytest.skip(reason)
    else:  # no corpus files: the stand-in runs
        env["MEMTUI_CLIENTS_UPSTREAM"] = str(tmp_path / "no-cache")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu.client_on_cuda", str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    report = json.loads((out / "client.json").read_text())
    assert done.returncode == 0 and not report["failed"], done.stdout + done.stderr
    assert report["client"].startswith("nanogpt" if client == "nanogpt" else "cuda_train.py")
    assert "memtui status says batch_size" in " ".join(report["passed"])
    assert (out / "status.txt").read_text().startswith(f"run {report['seen']['run']}")
