"""Lightning with two CPU processes (``strategy="ddp"``, gloo) and ``hooks.install(trainer)``:
Lightning starts ``torch.distributed`` inside ``fit``, after install; the ranks start coordinating
at ``setup``, and a change queued by a real client lands at the same step on both ranks. Under
Lightning's own launcher and torchrun, with ``lightning.pytorch`` and ``pytorch_lightning``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtui.storage import registry
from memtui.transport.client import hello_many
from tests.frameworks.harness import PYTHON, paused_run, torchrun

SCRIPT = Path(__file__).with_name("lightning_train.py")
SAMPLES = 96


@pytest.mark.parametrize(
    ("launcher", "package"),
    [
        ("lightning", "lightning.pytorch"),
        ("torchrun", "lightning.pytorch"),
        ("lightning", "pytorch_lightning"),
    ],
)
def test_two_ranks_apply_the_same_change_at_the_same_step(
    tmp_path: Path, launcher: str, package: str
) -> None:
    pytest.importorskip(package)
    # Lightning's own launcher starts rank 1 inside fit
    prefix = torchrun(2) if launcher == "torchrun" else PYTHON
    args = ("--samples", str(SAMPLES), "--devices", "2", "--package", package)
    with paused_run(tmp_path, prefix, SCRIPT, *args, ranks=2) as paused:
        run = paused.run_id()
        target = registry.find_run(run)
        assert target.record is not None and target.record.world_size == 2
        assert [r.rank for r in target.ranks] == [0, 1], "rank 1 joined rank 0's run at setup"
        answers = hello_many([r.control for r in target.ranks], timeout_s=5)
        assert [a.info.run if a else None for a in answers] == [run, run]
        paused.queue_and_go("batch_size=6", "grad_accum=3")
        paused.finish()
    report = paused.report
    ranks = [json.loads(Path(f"{report}.rank{r}").read_text()) for r in (0, 1)]
    for rank, rep in enumerate(ranks):
        assert rep["rank"] == rank and rep["world_size"] == 2 and rep["run"] == run
        assert all(rep["coordinated"]), "coordinated from the first epoch on"
        assert rep["applied"] == [[4, ["batch_size", "grad_accum"]]], "same change, same step"
        assert rep["global_step"] == rep["tuner_step"] == 12
        assert rep["accumulate_grad_batches"] == 3 and rep["batch_size"] == 6
        assert rep["lrs"] == pytest.approx([0.1 * (1 - s / 12) for s in range(12)])
    assert ranks[0]["accum_per_step"] == ranks[1]["accum_per_step"], "the same steps on both"
    # per rank: 8 micro-batches of 4 before the boundary, then micro-batches of 6 (the global
    # batch of 12 split over the two ranks): the 32 samples left of epoch 0 make one group of 3
    # (6, 6 and the last 4); every later epoch has 8 micro-batches of 6, two groups of 3 and the
    # epoch's last, short one
    assert ranks[0]["accum_per_step"] == [2] * 4 + [3] + [3, 3, 2] * 2 + [3]
    seen = [rep["seen"] for rep in ranks]
    starts = [[*rep["epoch_starts"], len(rep["seen"])] for rep in ranks]
    assert starts[0] == starts[1] == [0, 8 * 4 + 6 + 6 + 4, 96, 144, 162]
    for epoch in range(4):
        both = [x for r in (0, 1) for x in seen[r][starts[r][epoch] : starts[r][epoch + 1]]]
        assert len(set(both)) == len(both), f"epoch {epoch}: no sample twice across the ranks"
        if epoch < 3:
            assert sorted(both) == list(range(SAMPLES)), f"epoch {epoch}: every sample once"
