"""An Accelerate loop with no memtui line, started as ``memtui run -- accelerate launch`` on two
CPU processes: both ranks are one run, a workers change lands on each rank's own training
DataLoader at the same epoch start, as the script itself sees it, and the evaluation pass it
runs between steps (a second prepared DataLoader, slow to load) adds nothing to the steps'
samples and data wait."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from memtui.storage import registry
from memtui.transport.client import ControlClient
from tests.frameworks.harness import ACCELERATE_CPU, accelerate_launch
from tests.support.cli import memtui_here, status_json
from tests.support.processes import ROOT, logged_subprocess, wait_for

pytestmark = pytest.mark.frameworks

SCRIPT = """
import json, os, sys, time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset


class Numbers(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, index):
        time.sleep(0.002)
        info = torch.utils.data.get_worker_info()
        return torch.randn(4), torch.tensor(index % 2), torch.tensor(os.getpid() if info else 0)


class SlowToEvaluate(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        time.sleep(0.02)
        return torch.randn(4), torch.tensor(index % 2), torch.tensor(0)


gate = Path(sys.argv[1])
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Numbers(), batch_size=4, shuffle=True)
evaluation = DataLoader(SlowToEvaluate(), batch_size=4)
model, optimizer, loader, evaluation = accelerator.prepare(model, optimizer, loader, evaluation)
steps = 0
for epoch in range(3):
    pids, first = set(), steps + 1
    for x, y, pid in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        steps += 1
        pids.update(int(p) for p in pid)
        if steps % 4 == 2:  # an evaluation pass in the middle of each epoch
            model.eval()
            with torch.no_grad():
                for x, y, _pid in evaluation:
                    model(x)
            model.train()
    seen = {"rank": accelerator.process_index, "epoch": epoch, "first_step": first,
            "worker_pids": len(pids - {0}), "in_main": 0 in pids}
    sys.stdout.write("EPOCH " + json.dumps(seen) + "\\n")
    sys.stdout.flush()
    deadline = time.monotonic() + 60
    while (gate / f"hold-{epoch}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
"""


def test_both_ranks_are_one_run_and_take_a_workers_change_at_the_same_epoch(
    tmp_path: Path,
) -> None:
    pytest.importorskip("accelerate")
    (tmp_path / "train.py").write_text(SCRIPT)
    hold = tmp_path / "hold-0"
    hold.touch()
    env = {**os.environ, **ACCELERATE_CPU, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MEMTUI_DISABLE", None)
    command = [*accelerate_launch(2), "train.py", str(tmp_path)]
    memtui = [sys.executable, "-m", "memtui.cli", "run"]
    log = tmp_path / "train.log"
    proc = logged_subprocess([*memtui, "--state-dir", "state", "--", *command], env, tmp_path, log)

    def epochs(count: int) -> list[dict[str, object]] | None:
        if proc.poll() not in (None, 0):
            pytest.fail(f"the script failed:\n{log.read_text()}")
        lines = [ln[6:] for ln in log.read_text().splitlines() if ln.startswith("EPOCH ")]
        return [json.loads(line) for line in lines] if len(lines) >= count else None

    try:
        wait_for(lambda: epochs(2), 120, 0.1, "both ranks' first epoch")
        runs = json.loads(memtui_here("ls", "--json").stdout)
        assert len(runs) == 1 and runs[0]["ranks"] == 2, runs
        run = runs[0]["run"]
        wait_for(lambda: status_json(run)["world_size"] == 2, 30, 0.1, "both ranks")
        # each rank's first epoch: 4 training batches of 4 rows (its half of 32), in 4 steps,
        # and an evaluation pass after the second (a batch of 4 rows, 80 ms to load): none of
        # it counted (Accelerate's loader fetches one batch ahead: the counts per step shift)
        for record in registry.list_runs()[0].ranks:
            steps = ControlClient(registry.rank_control(record), timeout_s=10).hello().steps
            assert [s.step for s in steps] == [1, 2, 3, 4], steps
            assert sum(s.samples for s in steps) == 16, steps
            assert sum(s.micro_batches for s in steps) == 4, steps
            assert max(s.data_wait_s for s in steps) < 0.06, steps
        queued = memtui_here("set", run, "num_workers=1")
        assert queued.exit_code == 0, queued.output
        hold.unlink()
        assert proc.wait(120) == 0, log.read_text()
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
    seen = epochs(6) or []
    for rank in (0, 1):
        mine = [e for e in seen if e["rank"] == rank]
        assert [e["worker_pids"] for e in mine] == [0, 1, 1], mine
        assert [e["first_step"] for e in mine] == [1, 5, 9], mine
    audit = (tmp_path / "state" / "memtui-audit.jsonl").read_text().splitlines()
    applied = [json.loads(line) for line in audit if '"applied"' in line]
    assert [(e["step"], e["changes"]["num_workers"]) for e in applied] == [(4, [0, 1])]
