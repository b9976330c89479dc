"""A Lightning run stopped after a batch-size change and restarted from its checkpoint
(``hooks.install(trainer, resume=True)``, ``trainer.fit(..., ckpt_path=...)``): memtui's state is
in the Trainer's ``default_root_dir``, the restart trains at the tuned batch size, says where
that value came from, and finishes the epoch it stopped in exactly, at its real length."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.frameworks.harness import PYTHON, paused_run
from tests.support.processes import ROOT

SCRIPT = Path(__file__).with_name("lightning_train.py")
SAMPLES = 96


def restart(out: Path, report: Path, *args: str) -> str:
    """Run the script again from the checkpoint of step 8 with ``resume=True``; its output."""
    resume = ("--resume", "--ckpt-path", str(out / "epoch=0-step=8.ckpt"))  # its own restart
    done = subprocess.run(
        [*PYTHON, str(SCRIPT), "--out", str(out), "--report", str(report), *args, *resume],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("bound", ["max_steps", "max_epochs"])
def test_a_restart_resumes_the_tuned_batch_size_and_its_epoch(tmp_path: Path, bound: str) -> None:
    """Bounded by 12 steps (a linear LR decay) or by 2 epochs (whose ``configure_optimizers``
    reads ``trainer.estimated_stepping_batches``, as the script's does either way)."""
    pytest.importorskip("lightning.pytorch")
    args: tuple[str, ...] = ("--samples", str(SAMPLES), "--validate")
    if bound == "max_epochs":
        args += ("--max-epochs", "2", "--constant-lr")
    # batch_size 4 -> 6 lands at step 4 (8 batches, 32 samples); the process ends right after
    # the checkpoint of step 8 (8 batches of 6 later: 80 samples of epoch 0)
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, "--die-at", "8") as paused:
        paused.queue_and_go("batch_size=6")
        paused.finish(180)
    first = json.loads(paused.report.read_text())
    assert first["global_step"] == 8 and first["batch_size"] == 6 and len(first["seen"]) == 80
    out = tmp_path / "out"
    assert (out / "memtui-tuned.yaml").exists(), "the state is in default_root_dir"

    output = restart(out, tmp_path / "restart.json", *args)
    said = [line for line in output.splitlines() if "resumed the tuned config" in line]
    # the factory's own batch size is not known when install reads the tuned config: the line
    # names what the loader is built with, not an unknown old value shown as "-"
    assert len(said) == 1 and said[0].endswith(
        "memtui-tuned.yaml: the training loader is built with batch_size 6, num_workers 0, "
        "pin_memory false, prefetch_factor 2 (instead of its own values)"
    ), said
    # once the factory is given, its own value is known and named
    assert "the training loader is built with the tuned config: batch_size 4 -> 6" in output, output
    second = json.loads((tmp_path / "restart.json").read_text())
    assert second["batch_size"] == 6
    # epoch 0 goes on from its 16 batches with its 16 samples left (6, 6, 4), its short last
    # group stepped and validated at its 19th batch; then epoch 1, 16 batches of 6
    assert second["validations"][0] == [0, 19]
    assert second["counts_at_epoch_start"] == [[16, 16]]
    epoch0 = first["seen"] + second["seen"][:16]
    assert sorted(epoch0) == list(range(SAMPLES)), "epoch 0: every sample once"
    assert second["epoch_starts"] == [16]
    if bound == "max_steps":  # up to step 12, 4 batches into epoch 1
        assert second["global_step"] == second["tuner_step"] == 12
        assert second["epoch_batches"] == [19, 4] and second["accum_per_step"] == [2, 1, 2, 2]
        assert len(set(second["seen"][16:])) == 24
        assert second["lrs"] == pytest.approx([0.1 * (1 - s / 12) for s in range(8, 12)])
    else:  # epoch 1 whole
        assert second["global_step"] == second["tuner_step"] == 18
        assert second["epoch_batches"] == [19, 16] and second["validations"][1] == [1, 16]
        assert second["accum_per_step"] == [2, 1] + [2] * 8
        assert sorted(second["seen"][16:]) == list(range(SAMPLES)), "epoch 1: every sample once"


def test_a_restart_from_the_last_batch_of_an_epoch_trains_the_next_one(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    args = ("--samples", str(SAMPLES))
    # batch_size 4 -> 8 at step 4: the checkpoint of step 8 is saved at epoch 0's last batch
    # (8 batches of 4, 8 of 8), where the loader has delivered all of the epoch's samples
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, "--die-at", "8") as paused:
        paused.queue_and_go("batch_size=8")
        paused.finish(180)
    first = json.loads(paused.report.read_text())
    assert first["epoch_batches"] == [16] and sorted(first["seen"]) == list(range(SAMPLES))
    restart(tmp_path / "out", tmp_path / "restart.json", *args)
    second = json.loads((tmp_path / "restart.json").read_text())
    # epoch 1 from its first sample (the rest of epoch 0 is empty: fit stopped there, at step 8
    # of 12), at 8 a batch: the 8 batches up to step 12
    assert second["global_step"] == second["tuner_step"] == 12
    assert second["accum_per_step"] == [2] * 4 and second["epoch_batches"] == [8]
    assert len(second["seen"]) == 64 and len(set(second["seen"])) == 64
    assert second["lrs"] == pytest.approx([0.1 * (1 - s / 12) for s in range(8, 12)])


def test_a_restart_runs_the_tuned_lr_once(tmp_path: Path) -> None:
    """batch_size 4 -> 6 with the linear rule at step 4 (LR x1.5), killed after step 8: the
    checkpoint's optimizer and scheduler state carry the factor, and the restart (which loads them
    inside ``fit``, after ``install``) runs the schedule x1.5, not x1.5 twice."""
    pytest.importorskip("lightning.pytorch")
    args = ("--samples", str(SAMPLES))
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, "--die-at", "8") as paused:
        paused.queue_and_go("batch_size=6", "--allow-effective-batch", "--lr-scale", "linear")
        paused.finish(180)
    first = json.loads(paused.report.read_text())
    assert first["lrs"] == pytest.approx(
        [0.1 * (1 - s / 12) * (1.5 if s >= 4 else 1) for s in range(8)]
    )
    restart(tmp_path / "out", tmp_path / "restart.json", *args)
    second = json.loads((tmp_path / "restart.json").read_text())
    assert second["global_step"] == 12
    assert second["lrs"] == pytest.approx([0.1 * (1 - s / 12) * 1.5 for s in range(8, 12)])
