"""A Lightning Fabric loop with no memtui line (``fabric_save_train.py``: ``fabric.save`` every
three steps on every rank, Fabric's ``setup_dataloaders`` loader), started as ``memtui run --
torchrun`` on two CPU processes: a workers change queued before step 2 lands at the save after
step 3, in the middle of the epoch, on both ranks, and every rank trains on the rows, in the
order, the same script trains on without memtui, as the script's own forward pre-hook sees them:
every row of each epoch once over the two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from memtui.hooks import auto
from tests.support.cli import memtui_here
from tests.support.processes import ROOT, logged_subprocess, wait_for

pytestmark = pytest.mark.frameworks

SCRIPT = Path(__file__).with_name("fabric_save_train.py")
RANKS, ROWS, MICRO_BATCH, EPOCHS, EVERY = 2, 64, 4, 2, 3
STEPS_PER_EPOCH = ROWS // RANKS // MICRO_BATCH


def command(gate: Path) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += [f"--nproc_per_node={RANKS}", str(SCRIPT), "--gate", str(gate)]
    torchrun += ["--rows", str(ROWS), "--micro-batch", str(MICRO_BATCH)]
    return [*torchrun, "--epochs", str(EPOCHS), "--every", str(EVERY)]


def environment() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("MEMTUI_DISABLE", None)
    return env


def lines(text: str) -> list[dict[str, Any]]:
    """The script's ROWS, HELD and DONE lines, as dicts with their ``kind``."""
    found = []
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind in ("ROWS", "HELD", "DONE"):
            found.append({"kind": kind, **json.loads(rest)})
    return found


def of_rank(printed: list[dict[str, Any]], kind: str, rank: int) -> list[dict[str, Any]]:
    return [r for r in printed if r["kind"] == kind and r["rank"] == rank]


def test_a_workers_change_lands_at_the_next_fabric_save_in_the_middle_of_the_epoch(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning.fabric")
    plain_gate, gate = tmp_path / "plain", tmp_path / "watched"
    plain_gate.mkdir()
    gate.mkdir()
    plain = subprocess.run(
        command(plain_gate), env=environment(), capture_output=True, text=True, timeout=180
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    expected = lines(plain.stdout)

    hold = gate / "hold-2"
    hold.touch()
    log = tmp_path / "watched.log"
    memtui = [sys.executable, "-m", "memtui.cli", "run", "--name", "fabric-saves", "--state-dir"]
    memtui += [str(tmp_path / "state"), "--"]
    proc = logged_subprocess([*memtui, *command(gate)], environment(), tmp_path, log)
    try:

        def held() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the job ended early:\n{log.read_text()}")
            return len([r for r in lines(log.read_text()) if r["kind"] == "HELD"]) == RANKS

        wait_for(held, 120, 0.05, "both ranks held before step 2")

        def listed() -> str | None:
            runs = json.loads(memtui_here("ls", "--json").stdout)
            return str(runs[0]["run"]) if runs and runs[0]["ranks"] == RANKS else None

        run = str(wait_for(listed, 30, 0.05, "the job to register"))
        queued = memtui_here("set", run, "num_workers=2")
        assert queued.exit_code == 0, queued.output
        assert f"applies at {auto.WHEN_SAVED}" in queued.output
        hold.unlink()
        assert proc.wait(180) == 0, log.read_text()
    finally:
        hold.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    printed = lines(log.read_text())
    for rank in range(RANKS):
        rows = of_rank(printed, "ROWS", rank)
        assert [r["ids"] for r in rows] == [r["ids"] for r in of_rank(expected, "ROWS", rank)]
        assert of_rank(printed, "DONE", rank) == of_rank(expected, "DONE", rank)
        # steps 1 to 3 loaded in the training process, the rest by the two new workers
        assert [r["pids"] for r in rows[:EVERY]] == [[0]] * EVERY, rows
        for epoch in range(EPOCHS):
            workers = {p for r in rows[EVERY:] if r["epoch"] == epoch for p in r["pids"]}
            assert len(workers) == 2 and 0 not in workers, (rank, epoch, rows)
    for epoch in range(EPOCHS):
        ids = Counter(i for r in printed if r["kind"] == "ROWS" and r["epoch"] == epoch
                      for i in r["ids"])  # fmt: skip
        assert ids == Counter(range(ROWS)), (epoch, ids)
    audit = (tmp_path / "state" / "memtui-audit.jsonl").read_text().splitlines()
    applied = [json.loads(line) for line in audit if '"applied"' in line]
    assert [(e["step"], e["changes"]["num_workers"]) for e in applied] == [(EVERY, [0, 2])]
    assert applied[0]["note"] == auto.CONTINUED
