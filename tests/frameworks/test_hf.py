"""Hugging Face Trainer with ``hooks.install(trainer)``: a change queued by a real client lands at
the next save; the run resumes in-process from that checkpoint with the optimizer's state and the
LR schedule where they were, and no sample is lost or repeated. A run whose checkpoints cannot be
resumed from refuses changes, with the reason."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.harness import PYTHON, paused_run, recorded_steps
from tests.support.cli import memtui_cli

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("hf_train.py")


def digest_of_file(path: Path) -> dict[str, dict[str, Any]]:
    """The training script's digest of an optimizer's state, from a saved ``optimizer.pt``."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)["state"]
    return {
        str(index): {
            name: [hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest(), float(t.norm())]
            for name, t in tensors.items()
        }
        for index, tensors in state.items()
    }


def audit_of(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "out" / "memtui-audit.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines]


def test_change_lands_at_next_save_and_run_resumes_exactly(tmp_path: Path) -> None:
    with paused_run(tmp_path, PYTHON, SCRIPT) as paused:
        # 4 x 2 -> 6 x 1: 32 samples consumed at step 4 are not a whole number of new steps;
        # no loader workers -> 2 loading 4 batches ahead each; pinned memory: off (use_cpu turns
        # it off) -> on
        paused.queue_and_go(
            "batch_size=6", "grad_accum=1", "num_workers=2", "prefetch_factor=4", "pin_memory=true"
        )
        paused.finish(180)
    report = json.loads(paused.report.read_text())
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
    applied = [entry for entry in audit_of(tmp_path) if entry.get("event") == "applied"]
    assert applied and applied[0]["step"] == 4, applied

    # the optimizer (AdamW) goes on from its state at the save: the resumed train() loaded
    # exactly what the loop had at step 4, which is what checkpoint-4 holds
    (resumed,) = report["resumed"]
    at_save = report["saved"]["4"]
    assert resumed["step"] == 4
    assert (
        resumed["optimizer"]
        == at_save
        == digest_of_file(tmp_path / "out" / "checkpoint-4" / "optimizer.pt")
    )
    for tensors in at_save.values():
        assert tensors["step"][1] == 4.0, "Adam's step count: 4, not restarted"
        assert tensors["exp_avg"][1] > 0 and tensors["exp_avg_sq"][1] > 0
    # the scheduler stepped 4 times; the LR of the first step after the change (step 5) is the
    # schedule's value for step 5
    assert resumed["scheduler_last_epoch"] == 4
    assert resumed["lr"] == pytest.approx(1e-3 * (1 - 4 / 12))

    # the loader: rebuilt by the resumed train() with the new workers and pinning (on a machine
    # with no GPU torch then pins nothing, but the DataLoader is asked to)
    assert report["loader_args"] == {
        "dataloader_num_workers": 2,
        "dataloader_pin_memory": True,
        "dataloader_prefetch_factor": 4,
    }
    assert report["loaders"] == [
        {"num_workers": 0, "pin_memory": False, "prefetch_factor": None},
        {"num_workers": 2, "pin_memory": True, "prefetch_factor": 4},
    ]
    workers = report["workers_at_step"]
    assert [workers[str(s)] for s in range(1, 5)] == [0] * 4, "no worker process before"
    # (at the end of step 10 epoch 0's iterator is spent and its workers are gone; epoch 1 starts
    # two new ones)
    after = [workers[str(s)] for s in (*range(5, 10), 11, 12)]
    assert after == [2] * 7, "two worker processes after"


def test_each_step_counts_the_rows_of_its_own_training_micro_batches(tmp_path: Path) -> None:
    """62 samples in micro-batches of 4, two a step, evaluated at each save: the epoch's 8th step
    trains a full micro-batch and its short last one (4 + 2 rows); no evaluation batch counts."""
    record = tmp_path / "run.mtrec"
    args = ("--samples", "62", "--best")
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, env={"MEMTUI_RECORD": str(record)}) as paused:
        paused.go.touch()
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    assert report["global_step"] == 12 and len(report["seen"]) == 62 + 4 * 8
    (steps,) = recorded_steps(record).values()
    assert [s.step for s in steps] == list(range(1, 13))
    assert [s.samples for s in steps] == [8] * 7 + [6] + [8] * 4
    assert [s.micro_batches for s in steps] == [2] * 12


def test_the_lr_follows_the_effective_batch_across_the_in_process_resume(tmp_path: Path) -> None:
    """4 x 2 -> 6 x 1 with the linear rule: the optimizer and scheduler the resumed ``train()``
    loads from checkpoint-4 (saved before the change) get the factor too, so the schedule goes on
    at 0.75 of its values from step 5."""
    with paused_run(tmp_path, PYTHON, SCRIPT) as paused:
        paused.queue_and_go(
            "batch_size=6", "grad_accum=1", "--allow-effective-batch", "--lr-scale", "linear"
        )
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    assert report["restarts"] == 1 and report["steps"] == list(range(1, 13))
    expected = [1e-3 * (1 - (s - 1) / 12) * (0.75 if s > 4 else 1.0) for s in range(1, 13)]
    assert report["lrs"] == pytest.approx(expected)
    applied = [entry for entry in audit_of(tmp_path) if entry.get("event") == "applied"]
    assert applied[0]["lr_note"] == "lr x0.75 (linear)"


@pytest.mark.parametrize("checkpoint", [8, 4], ids=["saved-after-the-change", "saved-before"])
def test_a_restart_from_a_checkpoint_runs_the_tuned_lr_once(
    tmp_path: Path, checkpoint: int
) -> None:
    """A run tuned with the linear rule (x0.75 at step 4), started again from its own checkpoint
    with ``resume=True``: the LR the Trainer logs from then on is the schedule's x0.75, whether
    the checkpoint's optimizer and scheduler state carry the factor (saved after the change) or
    not (saved before it), never x0.75 twice."""
    with paused_run(tmp_path, PYTHON, SCRIPT) as paused:
        paused.queue_and_go(
            "batch_size=6", "grad_accum=1", "--allow-effective-batch", "--lr-scale", "linear"
        )
        paused.finish(180)
    restart = tmp_path / "restart"
    restart.mkdir()
    with paused_run(
        restart,
        PYTHON,
        SCRIPT,
        "--resume-from",
        str(tmp_path / "out" / f"checkpoint-{checkpoint}"),
        "--out",  # the first run's output dir: its checkpoints and memtui's tuned YAML
        str(tmp_path / "out"),
        wait_at=checkpoint + 1,
    ) as again:
        again.go.touch()
        again.finish(180)
    report = json.loads(again.report.read_text())
    assert report["args"] == {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 1}
    # the Trainer's log history: the first run's up to the checkpoint, then the restart's
    logged = [
        (s, lr) for s, lr in zip(report["steps"], report["lrs"], strict=True) if s > checkpoint
    ]
    assert [s for s, _ in logged] == list(range(checkpoint + 1, 13))
    expected = [1e-3 * (1 - (s - 1) / 12) * 0.75 for s, _ in logged]
    assert [lr for _, lr in logged] == pytest.approx(expected), "the schedule's LR x0.75, once"


def test_the_place_is_counted_in_samples_not_in_steps_of_the_config_resumed_with() -> None:
    """A restart's place: run_clm's checkpoint-12 is 16 of epoch 1's 48 blocks in (4 x 1, 2 x 2,
    then 4 x 2), where the Trainer alone, at 4 x 2 (6 steps an epoch), starts epoch 12 // 6 = 2;
    56 samples of 64 at 6 x 1 are 9 whole micro-batches and 2 samples memtui's sampler leaves
    out; the epoch the Trainer reports is counted in those samples."""
    from memtui.hooks.adapters.hf import EpochOrderSampler, epoch_of, place_in_epoch, whole_groups

    assert place_in_epoch(1, 16, 48) == (1, 16)
    assert whole_groups(16, per_batch=4, accumulation=2) == (16, 4)
    assert place_in_epoch(0, 48, 48) == (1, 0), "an epoch consumed whole: the next one's start"
    assert place_in_epoch(0, 50, None) == (0, 50), "no length known: the count as it is"
    assert whole_groups(56, per_batch=6, accumulation=1) == (54, 9)
    assert whole_groups(20, per_batch=2 * 2, accumulation=2) == (16, 4), "2 ranks: 2 batches each"
    sampler = EpochOrderSampler(64, shuffle=True, seed=7)
    sampler.cut = (0, 54, 56)
    assert list(sampler) == sampler.order(0)[:54] + sampler.order(0)[56:] and len(sampler) == 62
    assert epoch_of(0, 62, 64) == pytest.approx(0.96875)
    assert epoch_of(1, 68, 64) == 2.0, "a last batch padded past the epoch's end: its end"


def test_a_restart_resumes_the_epoch_at_memtuis_place_with_the_epochs_the_run_logged(
    tmp_path: Path,
) -> None:
    """4 x 2 -> 6 x 1 at step 4, then started again from checkpoint-8, which keeps memtui's
    place (56 of epoch 0's 64 samples: not a whole number of 6-sample steps; the Trainer alone
    would skip 8 steps of 6): the restart trains exactly what the first run trained after step
    8, and the Trainer logs the same epochs, epoch 0's counted in its samples."""
    with paused_run(tmp_path, PYTHON, SCRIPT) as paused:
        paused.queue_and_go("batch_size=6", "grad_accum=1")
        paused.finish(180)
    first = json.loads(paused.report.read_text())
    out = tmp_path / "out"
    place = json.loads((out / "checkpoint-8" / "memtui_state.json").read_text())
    assert place["step"] == 8 and place["config"] == {"batch_size": 6, "grad_accum": 1}
    where = {k: place["trainer"][k] for k in ("epoch", "samples_in_epoch", "samples_per_epoch")}
    assert where == {"epoch": 0, "samples_in_epoch": 56, "samples_per_epoch": 64}
    assert (out / "checkpoint-4" / "memtui_state.json").exists(), "saved where the change landed"
    saved = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    restart = tmp_path / "restart"
    restart.mkdir()
    resume = ("--resume-from", str(out / "checkpoint-8"), "--out", str(out))
    with paused_run(restart, PYTHON, SCRIPT, *resume, wait_at=9) as again:
        again.go.touch()
        again.finish(180)
    report = json.loads(again.report.read_text())
    assert report["args"] == {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 1}
    assert report["seen"] == first["seen"][first["seen_at_step"]["8"] :]
    assert report["steps"] == first["steps"] == list(range(1, 13))
    assert report["epochs"] == pytest.approx(first["epochs"])
    assert report["epochs"][8:10] == pytest.approx([62 / 64, 1.0]), "epoch 0 in samples"
    resaved = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    assert (resaved["global_step"], resaved["epoch"]) == (saved["global_step"], saved["epoch"])
    assert report["epoch"] == pytest.approx(first["epoch"])


def test_a_checkpoint_memtui_never_changed_resumes_as_the_trainer_and_is_counted_from_there(
    tmp_path: Path,
) -> None:
    """80 samples (10 steps of 4 x 2 an epoch), no change: no checkpoint gets memtui's place.
    Started again from checkpoint-4 (the Trainer's own resume: 32 samples in), with 6 x 1 queued
    and applied at the save at step 8: memtui counts its place from where the Trainer resumed
    (64 samples), so the in-process resume there trains the 16 samples left of epoch 0."""
    with paused_run(tmp_path, PYTHON, SCRIPT, "--samples", "80") as paused:
        paused.go.touch()
        paused.finish(180)
    first = json.loads(paused.report.read_text())
    out = tmp_path / "out"
    assert not list(out.glob("checkpoint-*/memtui_state.json")), "memtui changed nothing"
    restart = tmp_path / "restart"
    restart.mkdir()
    resume = ("--resume-from", str(out / "checkpoint-4"), "--out", str(out), "--samples", "80")
    with paused_run(restart, PYTHON, SCRIPT, *resume, wait_at=6) as again:
        again.queue_and_go("batch_size=6", "grad_accum=1")
        again.finish(180)
    report = json.loads(again.report.read_text())
    assert report["restarts"] == 1 and report["steps"] == list(range(1, 13))
    seen, order = report["seen"], report["orders"][0]
    assert seen[:32] == first["seen"][32:64], "steps 5-8: the Trainer's own resume"
    assert seen[32:48] == order[64:80], "after the change: the 16 samples left of epoch 0"
    assert sorted(first["seen"][:32] + seen[:48]) == list(range(80))
    place = json.loads((out / "checkpoint-8" / "memtui_state.json").read_text())["trainer"]
    assert (place["epoch"], place["samples_in_epoch"]) == (0, 64)


def test_save_only_model_refuses_changes_with_the_reason(tmp_path: Path) -> None:
    with paused_run(tmp_path, PYTHON, SCRIPT, "--save-only-model") as paused:
        refused = memtui_cli("set", paused.run_id(), "batch_size=6")
        paused.go.touch()
        paused.finish(180)
    assert refused.returncode != 0
    assert "save_only_model=True" in refused.stderr + refused.stdout
    report = json.loads(paused.report.read_text())
    assert report["restarts"] == 0 and report["applied"] == []
    assert report["global_step"] == 12 and report["steps"] == list(range(1, 13))
    assert "optimizer and the LR schedule afresh" in report["disabled"]
    assert report["rejected"] and "save_only_model=True" in report["rejected"][0][1]


def test_checkpoint_without_scheduler_state_refuses_the_change(tmp_path: Path) -> None:
    with paused_run(tmp_path, PYTHON, SCRIPT, "--drop-scheduler") as paused:
        paused.queue_and_go("batch_size=6")
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    assert report["restarts"] == 0 and report["applied"] == []
    assert report["rejected"] == [
        [
            4,
            "checkpoint-4 holds no LR scheduler state: resuming from it to apply the change "
            "would start that state afresh",
        ]
    ]
    assert report["args"]["per_device_train_batch_size"] == 4
    assert report["global_step"] == 12 and report["steps"] == list(range(1, 13))
    rejected = [entry for entry in audit_of(tmp_path) if entry.get("event") == "rejected"]
    assert [entry["step"] for entry in rejected] == [4]


def test_missing_resume_state_names_what_is_missing(tmp_path: Path) -> None:
    from memtui.hooks.adapters.hf import missing_resume_state

    checkpoint = tmp_path / "checkpoint-4"
    assert "checkpoint-4 is not there" in missing_resume_state(str(checkpoint))
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").touch()
    assert "no optimizer or LR scheduler state" in missing_resume_state(str(checkpoint))
    assert missing_resume_state(str(checkpoint), deepspeed=True) == ""
    (checkpoint / "scheduler.pt").touch()
    assert "no optimizer state" in missing_resume_state(str(checkpoint))
    (checkpoint / "optimizer_0").mkdir()  # FSDP's sharded optimizer
    assert missing_resume_state(str(checkpoint)) == ""


def test_change_survives_save_total_limit_and_best_model_at_end(tmp_path: Path) -> None:
    # save and evaluate every 2 steps, keep 1 checkpoint (and the best: the first one): the end of
    # the stopped train() would delete checkpoint-4, the one the change resumes from
    args = ("--save-steps", "2", "--save-total-limit", "1", "--best")
    with paused_run(tmp_path, PYTHON, SCRIPT, *args, wait_at=3) as paused:
        paused.queue_and_go("batch_size=6", "grad_accum=1")
        paused.finish(180)
    report = json.loads(paused.report.read_text())
    assert report["applied"] == [[4, ["batch_size", "grad_accum"]]]
    assert report["restarts"] == 1
    assert report["resumed"][0]["optimizer"] == report["saved"]["4"]
    assert report["global_step"] == 12 and report["steps"] == list(range(1, 13))
    # at the run's real end the Trainer keeps only the best checkpoint, as it was asked to
    assert report["checkpoints"] == ["checkpoint-2"]
