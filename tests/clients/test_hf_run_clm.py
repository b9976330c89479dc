"""transformers' ``examples/pytorch/language-modeling/run_clm.py`` (the HF ``Trainer``), unchanged
but for the documented two lines, training a 2-layer GPT-2 from a local config with a tokenizer
trained here, on local text files, offline, in one process and on two under ``torchrun`` (the
Trainer's DDP on the CPU, gloo): what the Trainer really trains on, with how many loader workers
and which LR, as torch's global hooks see it.

The script's own ``--max_train_samples`` keeps 48 blocks of 32 tokens per rank (its data set: the
first ones of the text, tokenized and grouped as the script groups them), and
``--eval_strategy epoch`` evaluates at the end of each of the Trainer's loops. memtui ends that
loop too where it applies a change (and resumes it in-process), so each rank's blocks are cut in
epochs of its 48: every epoch is checked against the data set's own blocks, on the union of the
ranks.

* No change queued: the checkpoints' files (``trainer_state.json`` but for its runtimes and
  rates) byte for byte, every step's LR and every trained block as with ``MEMTUI_DISABLE=1``,
  each epoch training each block exactly once, at 1 and 2 ranks.
* A micro-batch change keeping the effective batch (the accumulation follows) with two loader
  workers, then one doubling the effective batch with the LR scaled linearly, queued with
  ``memtui set``; the run killed after step 13 (in the middle of epoch 1) and restarted with
  ``--resume_from_checkpoint out/checkpoint-12``, at 1 and 2 ranks: every block once per epoch
  over the killed run (up to ``checkpoint-12``) and the restart, at the Trainer's linear
  schedule times the factor memtui reports.
"""

from __future__ import annotations

import json
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
    epochs_of,
    factor_at,
    finished,
    forwards_by_rank,
    job_run_id,
    joined,
    lr_factors,
    lr_mismatches,
    lrs_by_rank,
    play,
    play_job,
    python_or_torchrun,
    records_by_rank,
    rows_by_rank,
    start,
    steps_by_rank,
    steps_of,
    trained_epochs,
    union_of_ranks,
)
from tests.clients.witness import row_digest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("evaluate")

EVERY = 4
"""``--save_steps``: the Trainer's save is memtui's boundary."""
MAX_STEPS = 20
LR = 1e-3
ARGS = [
    "--config_name", "config",
    "--tokenizer_name", "tokenizer",
    "--train_file", "train.txt",
    "--validation_file", "val.txt",
    "--block_size", "32",
    "--do_train",
    "--do_eval",
    "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "4",
    "--max_eval_samples", "8",
    "--max_train_samples", "48",
    "--gradient_accumulation_steps", "1",
    "--max_steps", str(MAX_STEPS),
    "--save_steps", str(EVERY),
    "--eval_strategy", "epoch",
    "--logging_steps", "1",
    "--learning_rate", str(LR),
    "--output_dir", "out",
    "--use_cpu",
    "--seed", "0",
]  # fmt: skip
PLAN = Plan(
    args=ARGS,
    every=EVERY,
    first_change=["batch_size=2", "--keep-effective-batch", "num_workers=2"],  # 4 x 1 -> 2 x 2
    second_change=["batch_size=4", "--allow-effective-batch", "--lr-scale", "linear"],  # 4 -> 8
    restart_args=[*ARGS, "--resume_from_checkpoint", f"out/checkpoint-{3 * EVERY}"],
    kill_at=3 * EVERY + 2,
)


def scheduled_lr(step: int, max_steps: int = MAX_STEPS) -> float:
    """The Trainer's linear schedule (no warm-up) at optimizer step ``step``."""
    return LR * (max_steps - (step - 1)) / max_steps


def expected_lr(step: int) -> float:
    """The Trainer's linear schedule at optimizer step ``step``, x2 after the second change."""
    return scheduled_lr(step) * (2.0 if step > 2 * EVERY else 1.0)


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("hf_run_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        local_data.accuracy_metric(script.parent)
        yield play(script, env, PLAN)


def workers_while_loading(run: ClientRun) -> dict[int, dict[int, int]]:
    """Each rank's loader workers at each optimizer step, but at the steps an evaluation follows:
    the Trainer's loop ended there (at an epoch's end, or stopped by memtui to resume with a
    change) and its loader, read one batch ahead, has its workers gone already."""
    found = {}
    forwards = records_by_rank(run, "forward")
    for rank, steps in records_by_rank(run, "step").items():
        evaluated = {r["step"] - 1 for r in forwards.get(rank, []) if not r["training"]}
        found[rank] = {
            r["opt_step"] or r["call"]: r["workers"] for r in steps if r["call"] not in evaluated
        }
    return found


def with_arg(args: list[str], name: str, value: str) -> list[str]:
    """``args`` with ``name``'s value replaced by ``value``."""
    at = args.index(name) + 1
    return [*args[:at], value, *args[at + 1 :]]


def dataset_digests(workdir: Path, ranks: int) -> list[str]:
    """The digest of each training block the script keeps (``--max_train_samples``: 48 a rank):
    ``train.txt`` read by the ``text`` builder (each line with its line break), tokenized line by line, concatenated and cut in
    blocks of 32 tokens, as ``run_clm.py`` does."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    rows = load_dataset(
        "text",
        data_files={"train": str(workdir / "train.txt")},
        keep_linebreaks=True,  # the script's default
        cache_dir=str(workdir / "cache"),
    )["train"]
    lines = [str(row["text"]) for row in rows]
    tokenizer = AutoTokenizer.from_pretrained(str(workdir / "tokenizer"))
    tokens = [t for ids in tokenizer(lines)["input_ids"] for t in ids]
    blocks = [tokens[i : i + 32] for i in range(0, len(tokens) // 32 * 32, 32)]
    assert len(blocks) >= 48 * ranks, len(blocks)
    return [row_digest(block) for block in blocks[: 48 * ranks]]


def coverage_over_restart(
    dataset: list[str], first: ClientRun, restart: ClientRun | None, ranks: int
) -> list[EpochCoverage]:
    """Each epoch's coverage of the data set on the union of the ranks: each rank's blocks up
    to ``checkpoint-12``, then its restart's, cut in epochs of 48 (its share of the data set).
    The Trainer evaluates at the end of each of its loops, which memtui also ends where it
    applies a change: evaluations do not mark the epochs here."""
    rows = rows_by_rank(first, until_step=3 * EVERY)
    if restart is not None:
        rows = joined(rows, rows_by_rank(restart))
    assert sorted(rows) == list(range(ranks)), sorted(rows)
    return coverage(dataset, epochs_of(rows, 48))


def assert_each_block_once_per_epoch(
    found: list[EpochCoverage], last_rows: int, restart: ClientRun | None = None
) -> None:
    """Every epoch trains each block exactly once, but the last, which ``max_steps`` ends after
    ``last_rows`` of its blocks: none of those twice (``restart``: its log's resume line and the
    blocks it trained before each of its evaluations, said when it fails)."""
    detail = ""
    if restart is not None:
        resumed = [line for line in restart.output().splitlines() if "Resuming training" in line]
        loops = [len(e) for e in union_of_ranks(trained_epochs(restart))]
        detail = f"; the restart: {resumed[-1:]}, blocks before each evaluation: {loops}"
    assert found, "no epoch"
    *whole, last = found
    wrong = [c for c in whole if not c.exact]
    assert not wrong, f"epochs not trained on each block exactly once: {found}{detail}"
    assert (last.trained, last.duplicates, last.unknown) == (last_rows, 0, 0), f"{found}{detail}"


def test_the_run_registers(scenario: Scenario) -> None:
    assert scenario.listed["cwd"] == str(scenario.first.workdir)
    assert "run_clm.py" in str(scenario.listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_accumulation_and_workers_land_at_the_next_save(scenario: Scenario) -> None:
    """4 x 1 with no worker until the save at step 4; 2 x 2 with two loader worker processes
    after it; 4 x 2 after the save at step 8."""
    steps = {s.number: s for s in steps_of(scenario.first)}
    assert [steps[n].batches for n in range(1, 5)] == [[4]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[2, 2]] * 4
    assert [steps[n].batches for n in range(9, PLAN.kill_at)] == [[4, 4]] * (PLAN.kill_at - 9)
    (workers,) = workers_while_loading(scenario.first).values()
    assert {workers[n] for n in workers if n <= 4} == {0}
    assert {workers[n] for n in workers if n > 4} == {2}


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_a_restart_from_the_scripts_checkpoint_resumes_the_tuned_knobs(scenario: Scenario) -> None:
    """Killed after checkpoint-12 and restarted with ``--resume_from_checkpoint``: 4 x 2 with
    two workers from its first step (13), the schedule's LR x2 (the checkpoint's optimizer and
    scheduler state already carry the factor: not x4)."""
    assert scenario.restart is not None
    steps = steps_of(scenario.restart)
    assert [s.number for s in steps] == list(range(13, MAX_STEPS + 1))
    assert all(s.batches == [4, 4] for s in steps), [s.batches for s in steps]
    (workers,) = workers_while_loading(scenario.restart).values()
    assert set(workers.values()) == {2}, [s.workers for s in steps]
    wrong = lr_mismatches(steps, expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"
    config = scenario.status_after_restart["config"]
    assert (config["batch_size"], config["grad_accum"], config["num_workers"]) == (4, 2, 2)


def test_after_the_restart_memtui_counts_the_scripts_steps(scenario: Scenario) -> None:
    """Paused before the restarted process's second step (the Trainer's 14th): memtui's step is
    the Trainer's global step, 13."""
    assert scenario.restart_paused["opt_step"] == 14
    assert scenario.status_after_restart["step"] == 13


def test_the_scripts_own_progress_bar_logging_evaluation_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    first = scenario.first.output()
    assert f"/{MAX_STEPS} [" in first, "the Trainer's tqdm progress bar"
    assert "{'loss': " in first and "'learning_rate': " in first
    assert "'eval_accuracy': " in first, "evaluation with the script's metric"
    assert scenario.restart is not None
    restart = scenario.restart.output()
    for line in ("***** train metrics *****", "***** eval metrics *****", "perplexity"):
        assert line in restart
    out = Path(scenario.restart.workdir) / "out"
    for name in (*(f"checkpoint-{n}" for n in (4, 8, 12, 16, 20)), "model.safetensors"):
        assert (out / name).exists(), name
    assert (out / "checkpoint-20" / "trainer_state.json").exists()
    assert (out / "eval_results.json").exists() and (out / "train_results.json").exists()


# ------------------------------------------- changes, a kill in the middle of an epoch, a restart


LAST_EPOCH_ROWS = 32
"""A rank's blocks of epoch 2 that steps 17 to 20 train (4 steps of 4 x 2): epoch 0 ends at step
10 (4 x 4, 4 x 4, 2 x 8 blocks), epoch 1 at 16."""


def test_every_block_once_per_epoch_over_the_killed_run_and_its_restart(
    scenario: Scenario,
) -> None:
    """The killed run's blocks up to ``checkpoint-12`` (2 steps into epoch 1), then the
    restart's."""
    dataset = dataset_digests(scenario.first.workdir, 1)
    found = coverage_over_restart(dataset, scenario.first, scenario.restart, 1)
    assert_each_block_once_per_epoch(found, LAST_EPOCH_ROWS, scenario.restart)


def test_every_step_trains_at_the_schedule_times_the_factor_memtui_reports(
    scenario: Scenario,
) -> None:
    factors = lr_factors(scenario.status_before_kill)
    assert scenario.restart is not None
    for run in (scenario.first, scenario.restart):
        wrong = lr_mismatches(steps_of(run), lambda n: scheduled_lr(n) * factor_at(factors, n))
        assert not wrong, f"{run.log.stem}: (step, LR used, LR expected): {wrong}"


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[tuple[Job, list[str]]]:
    with client_home() as (base, env):
        script = client_script("hf_run_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        local_data.accuracy_metric(script.parent)
        args = with_arg(ARGS, "--max_train_samples", "96")
        resume = [*args, "--resume_from_checkpoint", f"out/checkpoint-{3 * EVERY}"]
        job = play_job(
            script,
            args,
            env,
            {EVERY: PLAN.first_change, 2 * EVERY: PLAN.second_change},
            PLAN.kill_at,
            resume,
            2,
            interpreter=python_or_torchrun(2),
            audit=script.parent / "out" / "memtui-audit.jsonl",
        )
        yield job, dataset_digests(script.parent, 2)


def test_two_ranks_take_the_changes_at_the_next_save(two_ranks: tuple[Job, list[str]]) -> None:
    """Each rank: 4 x 1 with no worker until the save at step 4, 2 x 2 with two workers after
    it, 4 x 2 after the one at 8; the restart 4 x 2 with two workers from step 13 to 20 (but at
    the steps that end an epoch, whose loader is already read to its end)."""
    job, _ = two_ranks
    for at, reply in job.replies.items():
        assert reply.returncode == 0, f"before step {at}: {reply.stderr}{reply.stdout}"
    assert [a["step"] for a in applied_changes(job.status_before_kill)] == [EVERY, 2 * EVERY]
    for rank, steps in steps_by_rank(job.first).items():
        shapes = [(s.number, s.batches) for s in steps]
        expected = [(n, [4]) for n in range(1, 5)] + [(n, [2, 2]) for n in range(5, 9)]
        expected += [(n, [4, 4]) for n in range(9, PLAN.kill_at)]
        assert shapes == expected, f"rank {rank}"
    for rank, workers in workers_while_loading(job.first).items():
        assert workers == {n: 0 if n <= 4 else 2 for n in workers}, f"rank {rank}"
    assert job.restart is not None
    restart = steps_by_rank(job.restart)
    assert sorted(restart) == [0, 1]
    for rank, steps in restart.items():
        shapes = [(s.number, s.batches) for s in steps]
        assert shapes == [(n, [4, 4]) for n in range(13, MAX_STEPS + 1)], f"rank {rank}"
    for rank, workers in workers_while_loading(job.restart).items():
        assert set(workers.values()) == {2}, f"rank {rank}"


def test_two_ranks_train_every_block_once_per_epoch_over_the_kill_and_restart(
    two_ranks: tuple[Job, list[str]],
) -> None:
    job, dataset = two_ranks
    found = coverage_over_restart(dataset, job.first, job.restart, 2)
    assert_each_block_once_per_epoch(found, 2 * LAST_EPOCH_ROWS, job.restart)


def test_two_ranks_train_at_the_schedule_times_the_factor_memtui_reports(
    two_ranks: tuple[Job, list[str]],
) -> None:
    job, _ = two_ranks
    factors = lr_factors(job.status_before_kill)
    assert [f for _, f in factors] == [1.0, 2.0], factors
    audit = [
        (int(e["step"]), float(e.get("lr_factor") or 1.0))
        for e in job.audit
        if e.get("event") == "applied"
    ]
    assert audit == factors, (audit, factors)
    for run in job.runs():
        for rank, steps in steps_by_rank(run).items():
            wrong = lr_mismatches(steps, lambda n: scheduled_lr(n) * factor_at(factors, n))
            assert not wrong, f"{run.log.stem}, rank {rank}: (step, LR used, LR expected): {wrong}"


# ------------------------------------------------ no change queued: the documented lines


UNCHANGED_STEPS = 24
"""Two epochs of 12 steps of 4 blocks a rank."""


@dataclass
class Unchanged:
    """The patched script run to its end with memtui (listed by ``memtui ls``), then with
    ``MEMTUI_DISABLE=1``."""

    ranks: int
    tuned: ClientRun
    disabled: ClientRun
    dataset: list[str]
    listed: str


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def unchanged(request: pytest.FixtureRequest) -> Iterator[Unchanged]:
    ranks = int(request.param)
    args = with_arg(ARGS, "--max_steps", str(UNCHANGED_STEPS))
    args = with_arg(args, "--max_train_samples", str(48 * ranks))
    with client_home() as (base, env):
        runs, listed = {}, ""
        for label, extra in (("tuned", {}), ("disabled", {"MEMTUI_DISABLE": "1"})):
            script = client_script("hf_run_clm", base / label)
            local_data.causal_lm_inputs(script.parent)
            local_data.accuracy_metric(script.parent)
            run = start(
                script,
                args,
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
        dataset = dataset_digests(base / "tuned", ranks)
        yield Unchanged(ranks, runs["tuned"], runs["disabled"], dataset, listed)


def timeless(value: object) -> object:
    """A JSON value without its runtimes and rates (wall-clock figures)."""
    if isinstance(value, dict):
        return {
            k: timeless(v) for k, v in value.items() if not k.endswith(("runtime", "per_second"))
        }
    if isinstance(value, list):
        return [timeless(v) for v in value]
    return value


def checkpoint_files(out: Path) -> dict[str, object]:
    """Every file of every ``checkpoint-N``: its bytes (a JSON file: its value, timeless)."""
    return {
        str(p.relative_to(out)): timeless(json.loads(p.read_text()))
        if p.suffix == ".json"
        else p.read_bytes()
        for p in sorted(out.glob("checkpoint-*/*"))
        if p.is_file()
    }


def test_no_change_saves_the_checkpoints_memtui_disabled_saves(unchanged: Unchanged) -> None:
    """Model, optimizer, scheduler, every rank's RNG states, the Trainer's state and args."""
    assert unchanged.listed, "memtui listed the run"
    tuned = checkpoint_files(unchanged.tuned.workdir / "out")
    disabled = checkpoint_files(unchanged.disabled.workdir / "out")
    assert (
        f"checkpoint-{UNCHANGED_STEPS}/rng_state{'_1' if unchanged.ranks > 1 else ''}.pth"
        in disabled
    )
    assert sorted(tuned) == sorted(disabled)
    differ = [name for name in disabled if tuned[name] != disabled[name]]
    assert not differ, f"files that differ from MEMTUI_DISABLE=1's: {differ}"


def test_no_change_trains_every_block_at_every_lr_as_memtui_disabled(
    unchanged: Unchanged,
) -> None:
    """Every rank's steps, LRs, forwards and blocks as with ``MEMTUI_DISABLE=1``, each epoch
    every block exactly once, the LR the Trainer's schedule."""
    tuned, disabled = unchanged.tuned, unchanged.disabled
    assert sorted(forwards_by_rank(tuned)) == list(range(unchanged.ranks))
    assert lrs_by_rank(tuned) == lrs_by_rank(disabled)
    assert steps_by_rank(tuned) == steps_by_rank(disabled)
    assert forwards_by_rank(tuned) == forwards_by_rank(disabled)
    found = coverage(unchanged.dataset, epochs_of(rows_by_rank(tuned), 48))
    assert len(found) == 2 and all(c.exact for c in found), found
    for rank, steps in steps_by_rank(tuned).items():
        assert [s.number for s in steps] == list(range(1, UNCHANGED_STEPS + 1)), rank
        wrong = lr_mismatches(steps, lambda n: scheduled_lr(n, UNCHANGED_STEPS))
        assert not wrong, f"rank {rank}: (step, LR used, LR expected): {wrong}"
