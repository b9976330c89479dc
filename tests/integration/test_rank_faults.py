"""One rank's failure never stalls the job: two ranks over gloo on the CPU, a nanoGPT-shaped loop
(under real torchrun, numpy blocked before torch is imported; the install fault's ranks forked).

memtui coordinates ranks through the job's c10d store only (no collective), and a rank whose
memtui fails says so there at once, so the others switch changes off in seconds instead of
waiting for a timeout. The boundary wait here is the default (half of gloo's 30 minutes): a job
that finishes in well under a minute did not wait for it.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.clock import patience
from tests.support.processes import ROOT, run_ranks

pytestmark = pytest.mark.heavy

NANOGPT = textwrap.dedent(
    """
    # nanoGPT's shape: module-global config, get_batch() with no DataLoader, an accumulation loop
    import os, sys, time
    if os.environ.get("BLOCK_NUMPY"):  # as where numpy is not installed (memtui must not need it)
        sys.modules["numpy"] = None
    import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    batch_size = 4
    gradient_accumulation_steps = 2
    block_size = 16
    max_iters = 40
    checkpoint_every = 10

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fault = os.environ.get("FAULT", "")
    if fault == "install" and rank == 1:
        from memtui.hooks.coordinate import Coordinator

        def boom(self, mine):
            raise RuntimeError("injected install failure")

        Coordinator.post_endpoints = boom
    if fault == "boundary" and rank == 1:
        from memtui.hooks.coordinate import Coordinator

        decide = Coordinator._decide

        def flaky(self, k, step, pending):
            if k == 2:
                raise RuntimeError("injected boundary failure")
            return decide(self, k, step, pending)

        Coordinator._decide = flaky

    from memtui import hooks
    from memtui.wire import SetRequest

    tuner = None if (fault == "no-install" and rank == 1) else hooks.install(globals(), name="gpt")
    if rank == 0:
        print("run", tuner.run_id, flush=True)
        assert tuner.control.queue(SetRequest(changes={"grad_accum": 3})).ok

    torch.manual_seed(0)
    data = torch.randint(0, 64, (4096,))

    def get_batch():
        ix = torch.randint(len(data) - block_size - 1, (batch_size,))
        x = torch.stack([data[i : i + block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
        return x, y

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.block = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)
            self.head = nn.Linear(32, 64)

        def forward(self, x):
            return self.head(self.block(self.emb(x)))

    model = DDP(GPT())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for it in range(1, max_iters + 1):
        for micro in range(gradient_accumulation_steps):
            x, y = get_batch()
            loss = F.cross_entropy(model(x).view(-1, 64), y.view(-1)) / gradient_accumulation_steps
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if tuner is not None:
            tuner.step(samples=batch_size * gradient_accumulation_steps)
        if it % checkpoint_every == 0 and tuner is not None:
            tuner.checkpoint()
            if rank == 0 and it == checkpoint_every:
                tuner.control.queue(SetRequest(changes={"batch_size": 6}))
    disabled = tuner.control.state().disabled if tuner is not None else "no memtui"
    # one write: the ranks share the launcher's stdout, and print() writes the newline apart
    os.write(1, f"rank {rank} accum {gradient_accumulation_steps} batch {batch_size} "
                f"disabled {disabled!r}\\n".encode())
    if tuner is not None:
        tuner.close()
    dist.destroy_process_group()
    """
)


def run_job(
    tmp_path: Path, python: str = sys.executable, fault: str = "", forked: bool = False
) -> tuple[str, float]:
    """Run the nanoGPT-shaped job on two ranks under torchrun (``forked``: its ranks forked with
    torchrun's environment, ``launch_ranks``); its output (asserted exit 0) and its duration."""
    script = tmp_path / "train_gpt.py"
    script.write_text(NANOGPT)
    env = {k: v for k, v in os.environ.items() if k != "MEMTUI_BOUNDARY_TIMEOUT"}
    # numpy blocked in every job: memtui's own dependencies do without it (the runtime venv
    # test proves the package's declared dependencies suffice, with no numpy installed at all;
    # a forked rank blocks it only after the fork server's torch imported it)
    env.update(FAULT=fault, OMP_NUM_THREADS="1", BLOCK_NUMPY="1")
    started = time.monotonic()
    if forked:
        code, output = run_ranks(script, env, tmp_path, tmp_path / "job.log", timeout=180)
        assert code == 0, output
        return output, time.monotonic() - started
    launcher = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(
        [*launcher, str(script)],
        capture_output=True,
        text=True,
        timeout=patience(180),
        cwd=tmp_path,
        env=env,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output, time.monotonic() - started


def finals(output: str) -> dict[int, tuple[int, int, str]]:
    """Each rank's last line: (grad_accum, batch_size, why changes are off)."""
    line = r"rank (\d) accum (\d+) batch (\d+) disabled ('[^'\n]*'|\"[^\"\n]*\")"
    found = re.findall(line, output)
    ranks = {int(r): (int(a), int(b), why[1:-1]) for r, a, b, why in found}
    assert set(ranks) == {0, 1}, "every rank ends\n" + output
    return ranks


def runtime_python() -> str:
    """A venv with torch and memtui's own dependencies only (no numpy), built once (~30 s)."""
    venv = ROOT / ".venv-runtime"
    python = venv / "bin" / "python"
    stamp = venv / ".installed"
    lock = ROOT / ".venv-runtime.lock"
    with open(lock, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not stamp.exists():
            import torch

            version = torch.__version__.split("+")[0]
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run(
                [
                    str(python),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    f"torch=={version}",
                    "-e",
                    str(ROOT),
                ],
                check=True,
                capture_output=True,
            )
            stamp.touch()
    return str(python)


@pytest.mark.slow  # builds a venv (~30 s on a fresh clone); the default jobs run with numpy blocked
def test_only_the_package_s_own_dependencies_two_ranks_one_decision(tmp_path: Path) -> None:
    python = runtime_python()
    probe = subprocess.run([python, "-c", "import numpy"], capture_output=True)
    assert probe.returncode != 0, "the runtime environment must not have numpy"
    output, took = run_job(tmp_path, python)
    assert finals(output) == {0: (3, 6, ""), 1: (3, 6, "")}, output
    assert "could not coordinate" not in output and "Traceback" not in output, output
    assert took < patience(60), f"{took:.0f} s\n{output}"


def test_a_rank_failing_at_install_switches_changes_off_everywhere_at_once(
    tmp_path: Path,
) -> None:
    """Its ranks forked (the next test's job is the file's torchrun, numpy blocked from the start)."""
    output, took = run_job(tmp_path, fault="install", forked=True)
    ranks = finals(output)
    assert ranks[0][:2] == (2, 4) and ranks[1][:2] == (2, 4), "nothing applied anywhere\n" + output
    assert "rank 1 could not coordinate (RuntimeError: injected install failure)" in ranks[1][2]
    assert "rank 1 could not coordinate" in ranks[0][2], output
    assert "memtui: changes are OFF for this run" in output, output
    assert took < patience(60), f"{took:.0f} s\n{output}"


def test_a_rank_failing_at_a_boundary_is_known_to_the_others_in_seconds(tmp_path: Path) -> None:
    output, took = run_job(tmp_path, fault="boundary")
    ranks = finals(output)
    # the first boundary applied on both ranks; the second failed on rank 1: nothing more applied
    assert ranks[0][:2] == (3, 4) and ranks[1][:2] == (3, 4), output
    for rank in (0, 1):
        assert (
            "rank 1 failed at checkpoint #2 (RuntimeError: injected boundary failure)"
            in (ranks[rank][2])
        ), output
    assert took < patience(60), f"{took:.0f} s\n{output}"


@pytest.mark.slow
def test_a_rank_without_memtui_is_named_after_a_short_grace(tmp_path: Path) -> None:
    output, took = run_job(tmp_path, fault="no-install")
    ranks = finals(output)
    assert ranks[0][:2] == (2, 4), output
    assert "rank(s) 1 never installed memtui" in ranks[0][2], output
    assert took < patience(60), f"{took:.0f} s\n{output}"
