"""Two CPU ranks under Accelerate with the documented lines and ``shuffle=True``: every sample is
trained exactly once per epoch on the union of the ranks, though dropout over batches of other
lengths moves each rank's global RNG on by its own amount; a run that died in the middle of
epoch 1 and restarts as Accelerate's ``complete_nlp_example.py`` does (``load_state``, then
``skip_first_batches``) trains the rest of that epoch exactly once. The training batches are
recorded by a forward pre-hook in the script, outside memtui."""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from tests.frameworks.harness import ACCELERATE_CPU, accelerate_launch, torchrun
from tests.support.processes import ROOT

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("accel_order_train.py")
SAMPLES = 64
BATCHES = SAMPLES // (4 * 2)
"""Batches of an epoch on each rank: global batches of 4 x 2 ranks."""


def launch(
    tmp_path: Path, launcher: list[str], name: str, *args: str, env: dict[str, str] | None = None
) -> str:
    """Run the script on two ranks to its end (exit 0); what it printed."""
    command = [*launcher, str(SCRIPT), "--out", str(tmp_path / "out")]
    command += ["--record", str(tmp_path / "record"), "--samples", str(SAMPLES), *args]
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **ACCELERATE_CPU, **(env or {})
    )
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    (tmp_path / f"{name}.log").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def trained(tmp_path: Path) -> tuple[dict[int, list[int]], list[set[float]]]:
    """The ids trained in each epoch on both ranks, and each epoch's end draw of every rank's
    global RNG."""
    ids: dict[int, list[int]] = defaultdict(list)
    draws: dict[int, set[float]] = defaultdict(set)
    for rank in (0, 1):
        for line in (tmp_path / f"record.{rank}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            if "ids" in entry:
                ids[entry["epoch"]] += entry["ids"]
            else:
                draws[entry["epoch"]].add(entry["rng"])
    return dict(ids), [draws[e] for e in sorted(draws)]


def test_two_ranks_train_every_sample_once_per_epoch(tmp_path: Path) -> None:
    launch(tmp_path, accelerate_launch(2), "train", "--epochs", "3")
    ids, draws = trained(tmp_path)
    assert sorted(ids) == [0, 1, 2]
    for epoch, seen in ids.items():
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: each sample exactly once"
    assert ids[0] != ids[1] != ids[2], "each epoch its own order"
    assert all(len(d) == 2 for d in draws), "the ranks' global RNGs went their own ways"


@pytest.mark.parametrize(
    ("workers", "disabled"), [(0, False), (2, False), (0, True)], ids=["0", "2", "disabled"]
)
def test_a_restart_in_the_middle_of_an_epoch_trains_its_rest_exactly_once(
    tmp_path: Path, workers: int, disabled: bool
) -> None:
    """Under ``MEMTUI_DISABLE=1`` too: memtui publishes nothing, and the training is the same.
    With 2 workers the script skips one batch too many: memtui's restored place wins, and the
    disagreement is said in one line."""
    stop = BATCHES + 3  # the save at micro-step 11: 3 batches into epoch 1
    common = ("--epochs", "3", "--num_workers", str(workers))
    env = {"MEMTUI_DISABLE": "1"} if disabled else {}
    died = ("--save-at", str(stop), "--stop-at", str(stop))
    launch(tmp_path, torchrun(2), "died", *common, *died, env=env)
    saved = tmp_path / "out" / f"step_{stop}"
    assert (saved / "memtui_state_1.json").stat().st_mode & 0o777 == 0o600
    place = json.loads((saved / "memtui_state_1.json").read_text())
    assert place["step"] == stop and place["loaders"][0]["epoch"] == 1
    assert place["loaders"][0]["samples_in_epoch"] == 3 * 4 * 2
    skew = ("--skew", "1") if workers == 2 else ()
    resume = ("--resume", str(saved), *skew)
    output = launch(tmp_path, torchrun(2), "resumed", *common, *resume, env=env)
    skipped = [line for line in output.splitlines() if "memtui: the script skips" in line]
    if skew:
        assert len(skipped) == 2, output  # once on each rank
        assert "skips 4 batches (32 samples)" in skipped[0]
        assert "is sample 24 of epoch 1: the loader resumes there" in skipped[0]
    else:
        assert not skipped, "memtui's place and the script's skip agree"
    ids, _ = trained(tmp_path)
    assert sorted(ids) == [0, 1, 2]
    for epoch, seen in ids.items():
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: each sample exactly once"
