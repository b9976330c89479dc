"""Lightning's ``examples/pytorch/basics/transformer.py``, unchanged but for the documented lines,
with the Trainer's defaults (Rich progress bar when Rich is installed, as memtui's own
dependencies make it, TensorBoard logger, ModelCheckpoint), on a local WikiText2 file: what it
really trains on, with how many loader workers and which LR, as torch's global hooks see it.

The script has no resume of its own (``fit`` without ``ckpt_path``): there is no restart to test.
Its Trainer is kept short with Lightning's own ``PL_TRAINER_*`` defaults from the environment
(``max_steps``, ``limit_val_batches``, ``limit_test_batches``), which leave its arguments as
written; the same defaults run it on two CPU processes under ``torchrun``
(``PL_TRAINER_DEVICES=2``: Lightning's DDP over gloo, its own ``DistributedSampler`` in the
loader memtui builds).

What it trains on is checked against the data set's own rows: the training part of the demo's
``random_split`` after the script's ``seed_everything(42)``, each epoch (ended by the validation
at its end) training each sample exactly once on the union of the ranks:

* no change queued: ModelCheckpoint's file and ``hparams.yaml`` byte for byte, every step's LR
  and every trained row as with ``MEMTUI_DISABLE=1``, at 1 and 2 ranks;
* with batch, accumulation and workers changes queued with ``memtui set`` at 1 and 2 ranks: each
  sample once per epoch, the script's LR times the factor memtui reports at every step."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.clients import local_data
from tests.clients.harness import (
    ClientRun,
    EpochCoverage,
    Job,
    Plan,
    Scenario,
    applied_changes,
    client_home,
    client_script,
    coverage,
    factor_at,
    finished,
    forwards_by_rank,
    job_run_id,
    lr_factors,
    lr_mismatches,
    lrs_by_rank,
    play,
    play_job,
    python_or_torchrun,
    start,
    steps_by_rank,
    steps_of,
    trained_epochs,
    union_of_ranks,
)
from tests.clients.witness import row_digest

pytest.importorskip("lightning")
pytest.importorskip("requests")  # WikiText2 requires it, even for a file already there

EVERY = 4
"""80 training samples in batches of 20: an epoch is 4 steps, ModelCheckpoint saves at its end."""
MAX_STEPS = 14
PLAN = Plan(
    args=[],
    every=EVERY,
    # 20 x 1 -> 10 x 2, two loader workers: 4 steps an epoch again (the checkpoint at step 8)
    first_change=["batch_size=10", "--keep-effective-batch", "num_workers=2"],
    # 10 x 2 -> 20 x 2 (effective 20 -> 40): 2 steps an epoch, the LR x2
    second_change=["batch_size=20", "--allow-effective-batch", "--lr-scale", "linear"],
    restart_args=None,
    kill_at=2 * EVERY + 2,
)


def expected_lr(step: int) -> float:
    """The script's SGD LR (0.1), x2 after the second change."""
    return 0.1 * (2.0 if step > 2 * EVERY else 1.0)


def short_trainer(
    env: dict[str, str], max_steps: int = MAX_STEPS, bar: bool = True
) -> dict[str, str]:
    """``env`` with Lightning's own ``PL_TRAINER_*`` defaults keeping the Trainer short, and (with
    ``bar``) Rich drawing its live bar as on a terminal (into the log)."""
    short = dict(
        env,
        PL_TRAINER_MAX_STEPS=str(max_steps),
        PL_TRAINER_LIMIT_VAL_BATCHES="2",
        PL_TRAINER_LIMIT_TEST_BATCHES="2",
    )
    return dict(short, TTY_COMPATIBLE="1", TTY_INTERACTIVE="1") if bar else short


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=20 * EVERY)
        yield play(script, short_trainer(env), PLAN)


def test_the_run_registers(scenario: Scenario) -> None:
    assert scenario.listed["cwd"] == str(scenario.first.workdir)
    assert "transformer.py" in str(scenario.listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_accumulation_and_workers_land_at_the_next_checkpoint(scenario: Scenario) -> None:
    """20 x 1 with no worker until the checkpoint at the end of epoch 0 (step 4); 10 x 2 with two
    loader worker processes after it; 20 x 2 after the one at step 8; the run ends at 14."""
    steps = {s.number: s for s in steps_of(scenario.first)}
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert [steps[n].batches for n in range(1, 5)] == [[20]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[10, 10]] * 4
    assert [steps[n].batches for n in range(9, MAX_STEPS + 1)] == [[20, 20]] * (MAX_STEPS - 8)
    assert [steps[n].workers for n in range(1, 5)] == [0] * 4
    assert [steps[n].workers for n in range(5, MAX_STEPS + 1)] == [2] * (MAX_STEPS - 4)


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_the_scripts_own_progress_bar_logging_validation_test_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    """The run survives its validations after the changes with the default (Rich) progress bar,
    and its own outputs are there: the bar, the logged losses, the test table, the checkpoint
    and the TensorBoard events."""
    output = scenario.first.output()
    for epoch in range(5):  # 4 steps an epoch, 4 again, then 2: the last at step 14
        assert f"Epoch {epoch}/19" in output, f"the progress bar of epoch {epoch}"
    assert "Validation" in output and "val_loss" in output and "train_loss" in output
    assert "Test metric" in output and "test_loss" in output
    version = Path(scenario.first.workdir) / "lightning_logs" / "version_0"
    assert list((version / "checkpoints").glob("*.ckpt")), "ModelCheckpoint's file"
    assert list(version.glob("events.out.tfevents.*")), "the TensorBoard logger's events"


# ------------------------------------------------------- what each epoch trains on, and at which LR


def dataset_digests(workdir: Path) -> list[str]:
    """The digest of each training sample's input (35 tokens): the first part of the demo's
    ``random_split`` of ``WikiText2`` after ``seed_everything(42)``, as the script splits it."""
    import torch
    from lightning.pytorch.demos import WikiText2
    from torch.utils.data import random_split

    dataset = WikiText2(data_dir=workdir / "data")
    n = len(dataset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        train, _, _ = random_split(dataset, [n - 4000, 2000, 2000])
    return [row_digest(dataset[i][0].tolist()) for i in train.indices]


def epochs_covered(run: ClientRun) -> list[EpochCoverage]:
    """Each epoch's coverage of the training part on the union of the run's ranks (the
    validation before training is Lightning's sanity check, not an epoch's end)."""
    epochs = union_of_ranks(trained_epochs(run, sanity_check=True))
    return coverage(dataset_digests(run.workdir), epochs)


def reported_lr(status: dict[str, object]) -> tuple[list[tuple[int, float]], object]:
    """The factors memtui reports, and the LR each step must use with them (the script's 0.1)."""
    factors = lr_factors(status)
    return factors, lambda step: 0.1 * factor_at(factors, step)


def test_every_sample_once_per_epoch_through_the_changes(scenario: Scenario) -> None:
    """5 epochs (4 steps of 20, 4 of 10 x 2, three of 2 steps of 20 x 2): each trains each of the
    80 samples exactly once."""
    found = epochs_covered(scenario.first)
    assert len(found) == 5, found
    wrong = [c for c in found if not c.exact]
    assert not wrong, f"epochs not trained on each sample exactly once: {found}"


def test_every_step_trains_at_the_scripts_lr_times_the_factor_memtui_reports(
    scenario: Scenario,
) -> None:
    factors, expected = reported_lr(scenario.status_before_kill)
    assert [f for _, f in factors] == [1.0, 2.0], factors
    wrong = lr_mismatches(steps_of(scenario.first), expected)  # type: ignore[arg-type]
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def two_ranks_env(env: dict[str, str], max_steps: int) -> dict[str, str]:
    """The short Trainer's environment, with Lightning's own default for two devices (its DDP
    over gloo on two CPU processes, as torchrun starts them)."""
    return dict(short_trainer(env, max_steps), PL_TRAINER_DEVICES="2")


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Job]:
    with client_home() as (base, env):
        script = client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=2 * 20 * EVERY)
        yield play_job(
            script,
            [],
            two_ranks_env(env, MAX_STEPS),
            {EVERY: PLAN.first_change, 2 * EVERY: PLAN.second_change},
            PLAN.kill_at,
            None,
            2,
            interpreter=python_or_torchrun(2),
        )


def test_two_ranks_take_batch_accumulation_and_workers_at_the_next_checkpoint(
    two_ranks: Job,
) -> None:
    """Each rank (80 samples an epoch): 20 x 1 with no worker for epoch 0, 10 x 2 with two
    workers for epoch 1, 20 x 2 after it; the run ends at 14."""
    for at, reply in two_ranks.replies.items():
        assert reply.returncode == 0, f"before step {at}: {reply.stderr}{reply.stdout}"
    assert [a["step"] for a in applied_changes(two_ranks.status_before_kill)] == [4, 8]
    ranks = steps_by_rank(two_ranks.first)
    assert sorted(ranks) == [0, 1]
    for rank, steps in ranks.items():
        shapes = [(s.number, s.batches, s.workers) for s in steps]
        expected = [(n, [20], 0) for n in range(1, 5)] + [(n, [10, 10], 2) for n in range(5, 9)]
        expected += [(n, [20, 20], 2) for n in range(9, MAX_STEPS + 1)]
        assert shapes == expected, f"rank {rank}"


def test_two_ranks_train_every_sample_once_per_epoch_through_the_changes(two_ranks: Job) -> None:
    found = epochs_covered(two_ranks.first)
    assert len(found) == 5, found
    wrong = [c for c in found if not c.exact]
    assert not wrong, f"epochs not trained on each sample exactly once: {found}"


def test_two_ranks_train_at_the_scripts_lr_times_the_factor_memtui_reports(
    two_ranks: Job,
) -> None:
    factors, expected = reported_lr(two_ranks.status_before_kill)
    assert [f for _, f in factors] == [1.0, 2.0], factors
    for rank, steps in steps_by_rank(two_ranks.first).items():
        wrong = lr_mismatches(steps, expected)  # type: ignore[arg-type]
        assert not wrong, f"rank {rank}: (step, LR used, LR expected): {wrong}"


# ------------------------------------------------ no change queued: the documented lines


@dataclass
class Unchanged:
    """The patched script run to its end with memtui (listed by ``memtui ls``), then with
    ``MEMTUI_DISABLE=1`` in the same directory (ModelCheckpoint keeps its directory's path)."""

    ranks: int
    tuned: ClientRun
    disabled: ClientRun
    logs: dict[str, Path]
    listed: str


UNCHANGED_STEPS = 8
"""Two epochs."""


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def unchanged(request: pytest.FixtureRequest) -> Iterator[Unchanged]:
    ranks = int(request.param)
    with client_home() as (base, env):
        script = client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=ranks * 20 * EVERY)
        env = short_trainer(env, UNCHANGED_STEPS, bar=False)
        if ranks > 1:
            env = two_ranks_env(env, UNCHANGED_STEPS)
        runs, logs, listed = {}, {}, ""
        for label, extra in (("tuned", {}), ("disabled", {"MEMTUI_DISABLE": "1"})):
            run = start(
                script,
                [],
                {**env, **extra},
                [6] if label == "tuned" else [],
                label,
                interpreter=python_or_torchrun(ranks),
            )
            if label == "tuned":
                try:
                    run.wait_paused(6, ranks=ranks)
                    listed = job_run_id(run, ranks)
                finally:
                    run.go(6)
            runs[label] = finished(run)
            logs[label] = (script.parent / "lightning_logs").rename(script.parent / label)
        yield Unchanged(ranks, runs["tuned"], runs["disabled"], logs, listed)


def test_no_change_saves_the_checkpoint_and_hparams_memtui_disabled_saves(
    unchanged: Unchanged,
) -> None:
    """ModelCheckpoint's file and ``hparams.yaml`` byte for byte (the TensorBoard event files
    hold wall-clock times)."""
    assert unchanged.listed, "memtui listed the run"

    def saved(logs: Path) -> dict[str, bytes]:
        return {
            str(p.relative_to(logs)): p.read_bytes()
            for p in sorted(logs.rglob("*"))
            if p.is_file() and not p.name.startswith("events.out.tfevents.")
        }

    tuned, disabled = saved(unchanged.logs["tuned"]), saved(unchanged.logs["disabled"])
    assert any(name.endswith(".ckpt") for name in disabled), sorted(disabled)
    assert sorted(tuned) == sorted(disabled)
    differ = [name for name in disabled if tuned[name] != disabled[name]]
    assert not differ, f"files that differ from MEMTUI_DISABLE=1's: {differ}"


def test_no_change_trains_every_row_at_every_lr_as_memtui_disabled(unchanged: Unchanged) -> None:
    """Every rank's steps, LRs, forwards and rows as with ``MEMTUI_DISABLE=1``; each of the 2
    epochs trains each sample exactly once."""
    tuned, disabled = unchanged.tuned, unchanged.disabled
    assert sorted(forwards_by_rank(tuned)) == list(range(unchanged.ranks))
    assert lrs_by_rank(tuned) == lrs_by_rank(disabled)
    assert steps_by_rank(tuned) == steps_by_rank(disabled)
    assert forwards_by_rank(tuned) == forwards_by_rank(disabled)
    found = epochs_covered(tuned)
    assert len(found) == 2 and all(c.exact for c in found), found
