"""Hugging Face Trainer with two CPU processes (gloo) under torchrun and under ``accelerate
launch`` with ``hooks.install(trainer)``: a change queued by a real client lands at the same save
on both ranks; both resume in-process at the same step with the optimizer's state of the save,
and every sample of an epoch is trained on exactly once across the ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtui.storage import registry
from memtui.transport.client import hello_many
from tests.frameworks.harness import ACCELERATE_CPU, accelerate_launch, paused_run, torchrun

pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("hf_train.py")
SAMPLES = 96


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_ranks_apply_at_the_same_save_and_resume_exactly(tmp_path: Path, launcher: str) -> None:
    args = ("--samples", str(SAMPLES))
    prefix, env = (
        (torchrun(2), None) if launcher == "torchrun" else (accelerate_launch(2), ACCELERATE_CPU)
    )
    with paused_run(tmp_path, prefix, SCRIPT, *args, ranks=2, env=env) as paused:
        lines = paused.output().splitlines()
        runs = {line.split()[1] for line in lines if line.startswith("run ")}
        assert len(runs) == 1, f"one run id on both ranks: {runs}"
        run = runs.pop()
        target = registry.find_run(run)
        assert [r.rank for r in target.ranks] == [0, 1]
        answers = hello_many([r.control for r in target.ranks], timeout_s=5)
        assert all(a is not None for a in answers), "both ranks answer"
        # 2 ranks x 4 x 2 = 16 samples a step: at step 4, 64 of the 96 of epoch 0 are consumed;
        # 2 ranks x 2 x 3 = 12 a step: 64 is not a whole number of new steps
        paused.queue_and_go("batch_size=2", "grad_accum=3")
        paused.finish()
    report = paused.report
    ranks = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in (0, 1)]
    for rank, rep in enumerate(ranks):
        assert rep["rank"] == rank and rep["world_size"] == 2 and rep["coordinated"]
        assert rep["applied"] == [[4, ["batch_size", "grad_accum"]]], "same change, same step"
        assert rep["restarts"] == 1
        assert rep["global_step"] == rep["output_step"] == rep["tuner_step"] == 12
        assert rep["args"] == {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3}
        (resumed,) = rep["resumed"]
        assert resumed["optimizer"] == rep["saved"]["4"], "the optimizer goes on from the save"
        assert resumed["scheduler_last_epoch"] == 4
        if rep["steps"]:  # the Trainer logs on the main process
            assert rep["steps"] == list(range(1, 13)), "global step continued, never reset"
            expected = [1e-3 * (1 - (s - 1) / 12) for s in range(1, 13)]
            assert rep["lrs"] == pytest.approx(expected), "the LR schedule went on where it was"
    assert ranks[0]["steps"] == list(range(1, 13))
    assert ranks[0]["orders"] == ranks[1]["orders"], "one order per epoch on every rank"
    order = ranks[0]["orders"]
    seen = [rep["seen"] for rep in ranks]
    # per rank: steps 1-4 take 4 x 2 x 4 = 32 samples; steps 5-7 finish epoch 0 with the 32 left
    # (8 micro-batches of 2: two steps of 3 and the epoch's last step of 2); steps 8-12 take
    # 5 x 3 x 2 = 30 samples of epoch 1
    assert [len(s) for s in seen] == [32 + 16 + 30] * 2
    per_step = [8] * 4 + [6, 6, 4] + [6] * 5
    for rep in ranks:
        counts = [rep["seen_at_step"][str(s)] for s in range(1, 13)]
        assert [b - a for a, b in zip([0, *counts[:-1]], counts, strict=True)] == per_step, (
            "the resumed epoch ends with its own (shorter) last step; epoch 1 starts whole"
        )
    before = seen[0][:32] + seen[1][:32]
    after = seen[0][32:48] + seen[1][32:48]
    assert sorted(before) == sorted(order[0][:64]), "steps 1-4: the first 64 of the epoch"
    assert sorted(after) == sorted(order[0][64:]), "after the resume: exactly the 32 left"
    assert sorted(before + after) == list(range(SAMPLES)), "epoch 0: every sample exactly once"
    epoch1 = seen[0][48:] + seen[1][48:]
    assert sorted(epoch1) == sorted(order[1][:60]), "epoch 1 starts at its beginning"
    audit = [
        json.loads(x) for x in (tmp_path / "out" / "memtui-audit.jsonl").read_text().splitlines()
    ]
    applied = [entry for entry in audit if entry.get("event") == "applied"]
    assert [entry["step"] for entry in applied] == [4], audit
