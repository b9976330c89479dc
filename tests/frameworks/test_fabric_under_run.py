"""A Lightning Fabric pretraining loop shaped as litgpt's ``pretrain`` (``fabric_train.py``: a
validation pass before training and after every third optimizer step, gradient accumulation of
two micro-batches), with no memtui line, started as ``memtui run -- torchrun`` on two CPU
processes: every step counts the samples and the wait of its own training micro-batches, none of
a validation pass's, and ``memtui status`` (its text and its JSON) gives the job's samples/s as
the two ranks' own summed, with what one of its steps is."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtui.core.stats import format_rate
from memtui.storage import registry
from memtui.transport.client import ControlClient
from tests.support.cli import memtui_here, status_json
from tests.support.processes import ROOT, logged_subprocess, wait_for

pytestmark = pytest.mark.frameworks

SCRIPT = Path(__file__).with_name("fabric_train.py")
MICRO_BATCH, ACCUM, STEPS, EVAL_EVERY, EVAL_ROW_S = 4, 2, 12, 3, 0.01
RANKS = 2


class Launched:
    """The job under ``memtui run``, held alive after its training until released."""

    def __init__(self, tmp_path: Path) -> None:
        self.held = tmp_path / "held"
        self.held.touch()
        self.log = tmp_path / "train.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("MEMTUI_DISABLE", None)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        torchrun += [f"--nproc_per_node={RANKS}", str(SCRIPT), "--held", str(self.held)]
        torchrun += ["--micro-batch", str(MICRO_BATCH), "--accum", str(ACCUM)]
        torchrun += ["--steps", str(STEPS), "--eval-every", str(EVAL_EVERY)]
        torchrun += ["--eval-row-s", str(EVAL_ROW_S)]
        memtui = [sys.executable, "-m", "memtui.cli", "run", "--name", "fabric", "--"]
        self.proc = logged_subprocess([*memtui, *torchrun], env, tmp_path, self.log)

    def done(self) -> list[dict[str, Any]]:
        """Every rank's account of its training, once both are over."""

        def both() -> list[dict[str, Any]] | None:
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended early:\n{self.log.read_text()}")
            records = re.findall(r"DONE (\{[^\n]*?\})", self.log.read_text())
            return [json.loads(record) for record in records] if len(records) == RANKS else None

        found = wait_for(both, 180, 0.1, "both ranks' training")
        assert isinstance(found, list)
        return sorted(found, key=lambda d: d["rank"])

    def release(self) -> int:
        self.held.unlink(missing_ok=True)
        return self.proc.wait(60)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Launched, dict[str, Any]]]:
    """The job trained and held: its ranks' accounts, the run, each rank's step records and
    ``memtui status`` as JSON and text."""
    pytest.importorskip("lightning.fabric")
    launched = Launched(tmp_path_factory.mktemp("fabric"))
    try:
        done = launched.done()
        runs = wait_for(registry.list_runs, 30, 0.1, "the run to register")
        assert isinstance(runs, list) and len(runs) == 1, runs
        run = runs[0]
        wait_for(
            lambda: [r["step"] for r in status_json(run.run)["ranks"]] == [STEPS] * RANKS,
            30,
            0.1,
            "both ranks' last step",
        )
        steps = {
            rank.rank: ControlClient(registry.rank_control(rank), timeout_s=10).hello().steps
            for rank in run.ranks
        }
        status = status_json(run.run)
        text = memtui_here("status", run.run).stdout
        yield launched, {"done": done, "steps": steps, "status": status, "text": text}
    finally:
        assert launched.release() == 0, launched.log.read_text()


def test_every_step_counts_its_own_training_micro_batches_on_each_rank(
    job: tuple[Launched, dict[str, Any]],
) -> None:
    _launched, seen = job
    for account in seen["done"]:
        assert account["steps"] == STEPS and account["micro"] == STEPS * ACCUM, account
        assert account["evaluations"] == STEPS // EVAL_EVERY
    for rank in range(RANKS):
        records = seen["steps"][rank]
        assert [r.step for r in records] == list(range(1, STEPS + 1)), rank
        # the sanity pass before training and the validation passes between steps: not counted
        assert [r.samples for r in records] == [MICRO_BATCH * ACCUM] * STEPS, rank
        assert [r.micro_batches for r in records] == [ACCUM] * STEPS, rank


def test_a_validation_pass_adds_no_data_wait_to_the_step_it_runs_in(
    job: tuple[Launched, dict[str, Any]],
) -> None:
    """A validation pass reads 6 batches of 4 slow rows (0.24 s); a training step's two
    micro-batches are in memory."""
    _launched, seen = job
    pass_s = 6 * MICRO_BATCH * EVAL_ROW_S
    for rank in range(RANKS):
        waits = [r.data_wait_s for r in seen["steps"][rank]]
        assert max(waits) < pass_s / 3, (rank, waits)


def test_status_gives_the_job_samples_per_second_as_its_ranks_own_summed(
    job: tuple[Launched, dict[str, Any]],
) -> None:
    _launched, seen = job
    status, text = seen["status"], seen["text"]
    ranks = [entry["metrics"] for entry in status["ranks"]]
    job_rate = status["throughput"]
    assert job_rate["ranks"] == RANKS == job_rate["world_size"]
    assert job_rate["samples_per_s"] == pytest.approx(sum(m["samples_per_s"] for m in ranks))
    assert job_rate["samples_per_step"] == MICRO_BATCH * ACCUM * RANKS
    assert job_rate["micro_batches_per_step"] == ACCUM
    for metrics in ranks:
        assert metrics["samples_per_step"] == MICRO_BATCH * ACCUM
        assert metrics["micro_batches_per_step"] == ACCUM
    # the text says the same figure, over both ranks, and what a step is (litgpt prints its
    # "iter time" per micro-batch)
    line = next(ln for ln in text.splitlines() if ln.startswith(f"step {STEPS} "))
    assert f"  {format_rate(job_rate['samples_per_s'])} samples/s (2 ranks)  " in line, text
    assert "step = one optimizer step of 2 micro-batches a rank, 16 samples over 2 ranks" in text, (
        text
    )
    rows = re.findall(r"^\s+(\d)  \S+\s+12\s+.+?\s+\d+%\s+([\d,.]+)\s+", text, re.M)
    assert dict(rows) == {
        str(e["rank"]): format_rate(e["metrics"]["samples_per_s"]) for e in status["ranks"]
    }, text
