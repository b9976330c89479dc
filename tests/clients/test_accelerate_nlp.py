"""Accelerate's ``examples/complete_nlp_example.py`` (a BERT fine-tuned on GLUE MRPC: its own
``collate_fn`` padding each batch to its longest row, dropout, a prepared linear-with-warmup LR
scheduler, ``save_state`` every N steps, its own resume with ``skip_first_batches``), with its
defaults, on one CPU process and on two under ``accelerate launch`` (gloo), offline: local
stand-ins under the names it loads (``bert-base-cased``: a tokenizer trained here and a 2-layer
BERT of width 32; ``nyu-mll/glue`` with its ``mrpc`` config; a ``glue`` metric), no line of it
changed but memtui's documented ones. What it really trains on is read from outside memtui: the
witness hashes every row of every training forward on every rank, and the tests check each
epoch against the data set's own rows.

* With the documented lines and no change, every sample is trained on exactly once per epoch on
  the union of the ranks, and the ``save_state`` directories and every step's LR are those of
  the same script with ``MEMTUI_DISABLE=1`` (memtui there, publishing nothing).
* Unchanged under ``memtui run``: every step, LR and trained row, every file it saves and its
  exit status are those of the script run without memtui.
* Unchanged under ``memtui run``, on one process and on two: a workers change queued with
  ``memtui set`` lands at the next ``save_state``, in the middle of the first epoch, on every
  rank, and every epoch still trains on each sample exactly once.
* With the documented lines on two ranks: a batch change (LR scaled linearly), an accumulation
  change and a workers change queued with ``memtui set`` while the witness holds both ranks
  before a training forward land at the next ``save_state``; the run is killed in the middle of
  an epoch and restarted from its last ``step_N`` with the script's own
  ``--resume_from_checkpoint``: every sample is trained on once per epoch over the two runs, at
  the script's LR times the factor memtui reports, and an accumulation memtui reports is the
  one the optimizer steps show.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.clients import local_data
from tests.clients.harness import (
    ClientRun,
    EpochCoverage,
    Pair,
    client_home,
    client_script,
    continued,
    coverage,
    finished,
    forwards_by_rank,
    job_run_id,
    lr_factors,
    lr_mismatches,
    lrs_by_rank,
    memtui_run,
    run_pair,
    start,
    status_json,
    steps_by_rank,
    trained_epochs,
    unchanged_client_script,
    union_of_ranks,
)
from tests.clients.witness import row_digest
from tests.frameworks.harness import ACCELERATE_CPU, accelerate_launch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")
pytest.importorskip("evaluate")

TRAIN_ROWS = 640
"""A multiple of every global batch the tests train with (16 and 32 a rank, one or two ranks):
no epoch ends with a short batch that a sharded loader pads with repeated samples."""
VALIDATION_ROWS = 64
LR, EPOCHS, BATCH, WARMUP = 2e-5, 3, 16, 100
"""The script's own config (``lr``, ``num_epochs``, ``batch_size``) and warmup."""
TOTAL = math.ceil(TRAIN_ROWS / BATCH) * EPOCHS
"""The schedule's ``num_training_steps``: the script's unprepared loader's length times the
epochs (over its own accumulation: 1 at a batch of 16)."""


def scheduled_lr(opt_step: int, ranks: int) -> float:
    """The script's LR at optimizer step ``opt_step``: ``get_linear_schedule_with_warmup`` as it
    builds it, prepared by the accelerator, which steps it once per process at each optimizer
    step (the schedule is sized in batches of the unsharded loader)."""
    at = (opt_step - 1) * ranks
    if at < WARMUP:
        return LR * at / WARMUP
    return LR * max(0.0, (TOTAL - at) / (TOTAL - WARMUP))


def launcher(ranks: int) -> list[str]:
    """How the script is started: ``python`` for one process, ``accelerate launch`` for two."""
    return [sys.executable] if ranks == 1 else accelerate_launch(ranks)


def dataset_digests(workdir: Path) -> list[str]:
    """The digest of each training sample as the script tokenizes it (the local tokenizer, the
    pair of sentences, truncated to the model's length), computed from the data set's rows."""
    from transformers import AutoTokenizer

    train = workdir / "nyu-mll" / "glue" / "mrpc" / "train.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(str(workdir / "bert-base-cased"))
    encoded = tokenizer(
        [str(r["sentence1"]) for r in rows],
        [str(r["sentence2"]) for r in rows],
        truncation=True,
        max_length=None,
    )
    return [row_digest(ids) for ids in encoded["input_ids"]]


def coverage_of(run: ClientRun, dataset: list[str]) -> list[EpochCoverage]:
    """Each epoch's coverage of the data set on the union of the run's ranks."""
    return coverage(dataset, union_of_ranks(trained_epochs(run)))


def save_state_files(out: Path) -> dict[str, bytes]:
    """Every file under the ``step_N`` directories ``save_state`` wrote, by relative path."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.glob("step_*/**/*"))
        if p.is_file()
    }


# -------------------------------------------- (a) the documented lines, no change queued


@dataclass
class Unchanged:
    """The patched script run to its end with memtui, then with ``MEMTUI_DISABLE=1``."""

    ranks: int
    tuned: ClientRun
    disabled: ClientRun
    out: Path
    disabled_out: Path
    dataset: list[str]
    listed: str
    """The run ``memtui ls`` listed with every process of the script (memtui on, publishing)."""


ARGS = ["--checkpointing_steps", "7", "--output_dir", "out"]
"""``save_state`` every 7 micro-batches (in the middle of epochs, at a step of each epoch that
changes from one epoch to the next)."""
LISTED = 10
"""The training forward before which the run with memtui waits until ``memtui ls`` lists it."""


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def unchanged(request: pytest.FixtureRequest) -> Iterator[Unchanged]:
    ranks = int(request.param)
    with client_home() as (base, env):
        script = client_script("accelerate_nlp", base / "run")
        local_data.mrpc_inputs(script.parent, TRAIN_ROWS, VALIDATION_ROWS)
        env = {**env, **ACCELERATE_CPU}
        tuned = start(
            script, ARGS, env, [], "tuned", interpreter=launcher(ranks), pause_at_forward=[LISTED]
        )
        try:
            tuned.wait_paused(LISTED, timeout=240, ranks=ranks, forward=True)
            listed = job_run_id(tuned, ranks)
        finally:
            tuned.go(LISTED, forward=True)
        finished(tuned)
        tuned_out = (script.parent / "out").rename(script.parent / "out.tuned")
        disabled_env = {**env, "MEMTUI_DISABLE": "1"}
        disabled = start(script, ARGS, disabled_env, [], "disabled", interpreter=launcher(ranks))
        finished(disabled)
        yield Unchanged(
            ranks,
            tuned,
            disabled,
            tuned_out,
            script.parent / "out",
            dataset_digests(script.parent),
            listed,
        )


def test_documented_lines_train_every_sample_once_per_epoch_on_the_union_of_ranks(
    unchanged: Unchanged,
) -> None:
    """Each of the 3 epochs trains each of the 640 samples exactly once, whichever rank took it."""
    assert unchanged.listed, "memtui listed the run"
    epochs = trained_epochs(unchanged.tuned)
    assert sorted(epochs) == list(range(unchanged.ranks))
    found = coverage(unchanged.dataset, union_of_ranks(epochs))
    assert len(found) == EPOCHS, found
    wrong = [c for c in found if not c.exact]
    assert not wrong, f"epochs not trained on each sample exactly once: {wrong}"


def test_documented_lines_save_the_state_memtui_disabled_saves(unchanged: Unchanged) -> None:
    """Model, optimizer, scheduler and every rank's random states in each ``step_N``, byte for
    byte as with ``MEMTUI_DISABLE=1``."""
    tuned, disabled = save_state_files(unchanged.out), save_state_files(unchanged.disabled_out)
    assert disabled, "save_state wrote nothing"
    assert any(f"random_states_{unchanged.ranks - 1}.pkl" in p for p in disabled), list(disabled)
    assert sorted(tuned) == sorted(disabled)
    differ = [p for p in disabled if tuned[p] != disabled[p] and not memtui_place(p)]
    assert not differ, f"files that differ from MEMTUI_DISABLE=1's: {differ}"
    places = [p for p in disabled if memtui_place(p)]
    saves = {str(Path(p).parent) for p in disabled}
    expected = {f"{d}/memtui_state_{r}.json" for d in saves for r in range(unchanged.ranks)}
    assert set(places) == expected, sorted(places)
    for path in places:  # memtui's own place: the same but for the id of the run that saved it
        assert without_run(tuned[path]) == without_run(disabled[path]), path


def memtui_place(path: str) -> bool:
    """Whether ``path`` is memtui's place in a ``save_state`` directory (one per process)."""
    return Path(path).name.startswith("memtui_state_")


def without_run(place: bytes) -> dict[str, Any]:
    """memtui's place as saved, less the id of the run that saved it."""
    state = dict(json.loads(place))
    state.pop("run", None)
    return state


def test_documented_lines_train_at_the_lr_memtui_disabled_trains_at(unchanged: Unchanged) -> None:
    """Every rank's LR at every optimizer step is that of ``MEMTUI_DISABLE=1``, and the
    script's schedule."""
    tuned = lrs_by_rank(unchanged.tuned)
    assert tuned == lrs_by_rank(unchanged.disabled)
    steps_per_epoch = TRAIN_ROWS // (BATCH * unchanged.ranks)
    for steps in steps_by_rank(unchanged.tuned).values():
        assert len(steps) == EPOCHS * steps_per_epoch
        wrong = lr_mismatches(steps, lambda n: scheduled_lr(n, unchanged.ranks))
        assert not wrong, f"(step, LR used, LR expected): {wrong}"


# --------------------------------------------------- (b) unchanged under ``memtui run``


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def under_run(request: pytest.FixtureRequest) -> Iterator[Pair]:
    ranks = int(request.param)
    with client_home() as (base, env):
        script = unchanged_client_script("accelerate_nlp", base / "run")
        local_data.mrpc_inputs(script.parent, TRAIN_ROWS, VALIDATION_ROWS)
        outputs = [script.parent / "out", base / "hf"]
        yield run_pair(
            script,
            ["--checkpointing_steps", "10", "--output_dir", "out"],
            {**env, **ACCELERATE_CPU},
            outputs,
            "nlp",
            pause_at=6,
            interpreter=launcher(ranks),
            ranks=ranks,
        )


def test_unchanged_under_memtui_run_trains_every_row_at_every_lr_as_without_memtui(
    under_run: Pair,
) -> None:
    """Every rank's optimizer steps (numbers, LRs, workers), and every forward's shape and
    trained rows, in order: those of the script run without memtui (whose prepared loader
    trains each sample once an epoch on the union of its ranks)."""
    plain, watched = under_run.plain, under_run.watched
    assert len(under_run.registered) == 1, under_run.registered
    assert watched.proc.returncode == plain.proc.returncode == 0
    found = coverage_of(plain, dataset_digests(plain.workdir))
    assert len(found) == EPOCHS and all(c.exact for c in found), found
    assert lrs_by_rank(watched) == lrs_by_rank(plain)
    assert steps_by_rank(watched) == steps_by_rank(plain)
    assert forwards_by_rank(watched) == forwards_by_rank(plain)


def test_unchanged_under_memtui_run_saves_the_state_it_saves_without_memtui(
    under_run: Pair,
) -> None:
    out = under_run.watched.workdir / "out"
    plain = save_state_files(under_run.aside[out])
    assert plain, "save_state wrote nothing"
    watched = save_state_files(out)
    assert sorted(watched) == sorted(plain)
    differ = [p for p in plain if watched[p] != plain[p]]
    assert not differ, f"files that differ from the run without memtui: {differ}"


def test_unchanged_under_memtui_run_counts_each_batch_by_its_rows_not_its_keys(
    under_run: Pair,
) -> None:
    """The script's ``collate_fn`` returns the tokenizer's ``BatchEncoding`` (a ``UserDict`` of
    4 keys): a step of one micro-batch of 16 rows trains 16 samples on each rank, and the job's
    samples/s is the ranks' own summed, in the JSON and the text."""
    from memtui.wire import StepRecord

    status = under_run.status
    last = StepRecord(*status["last_step"])  # a JSON array, in the record's order
    assert (last.samples, last.micro_batches) == (BATCH, 1), last
    ranks = [entry["metrics"] for entry in status["ranks"]]
    for metrics in ranks:
        # Accelerate's loader fetches one batch ahead: the first step drew two, the others one
        steps = metrics["window_steps"]
        assert metrics["samples_per_step"] * steps == BATCH * (steps + 1), metrics
    job = status["throughput"]
    assert job["ranks"] == len(ranks)
    assert job["samples_per_s"] == pytest.approx(sum(m["samples_per_s"] for m in ranks))
    assert f"  {job['summary']}  " in under_run.status_text, under_run.status_text


# ------------------------- (c) the documented lines, changes queued, a kill and a restart


EVERY = 4
"""``--checkpointing_steps``: ``save_state`` after every 4th micro-batch of each rank."""
TUNED_ARGS = ["--checkpointing_steps", str(EVERY), "--output_dir", "out"]
CHANGES = {
    EVERY: ["batch_size=32", "--allow-effective-batch", "--lr-scale", "linear"],
    2 * EVERY: ["grad_accum=2", "--allow-effective-batch"],
    3 * EVERY: ["num_workers=2"],
}
"""What is queued (while both ranks wait before that training forward) before each of the first
three saves. Two ranks of 16 take 128 samples in 4 micro-batches; global batches of 64 then
finish epoch 0 at micro-batch 12, the third save."""
RESUME_FROM = 4 * EVERY
"""The last save before the kill: micro-batch 16, the 4th of epoch 1 (a restart from it resumes
epoch 1, as the script computes: 16 // 10 batches of 64 an epoch is 1)."""
KILL_AT = RESUME_FROM + 2
"""The training forward before which both ranks are killed, in the middle of epoch 1."""


@dataclass
class Restarted:
    """The tuned two-rank run, killed, and its restart from ``step_16``."""

    first: ClientRun
    restart: ClientRun
    dataset: list[str]
    replies: dict[int, Any] = field(default_factory=dict)
    status_before_kill: dict[str, Any] = field(default_factory=dict)
    status_after_restart: dict[str, Any] = field(default_factory=dict)
    audit: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def restarted() -> Iterator[Restarted]:
    with client_home() as (base, env):
        script = client_script("accelerate_nlp", base / "run")
        local_data.mrpc_inputs(script.parent, TRAIN_ROWS, VALIDATION_ROWS)
        env = {**env, **ACCELERATE_CPU}
        two = launcher(2)
        pauses = [*CHANGES, KILL_AT]
        first = start(
            script, TUNED_ARGS, env, [], "first", interpreter=two, pause_at_forward=pauses
        )
        scenario = Restarted(first, first, dataset_digests(script.parent))
        try:
            run_id = ""
            for at, change in CHANGES.items():
                first.wait_paused(at, timeout=240, ranks=2, forward=True)
                run_id = run_id or job_run_id(first, 2)
                scenario.replies[at] = first.memtui("set", run_id, *change)
                first.go(at, forward=True)
            first.wait_paused(KILL_AT, timeout=240, ranks=2, forward=True)
            scenario.status_before_kill = status_json(first, run_id)
        finally:
            first.kill_job()
        audit = script.parent / "out" / "memtui-audit.jsonl"
        if audit.exists():
            scenario.audit = [json.loads(line) for line in audit.read_text().splitlines()]
        resume = [*TUNED_ARGS, "--resume_from_checkpoint", f"out/step_{RESUME_FROM}"]
        restart = start(script, resume, env, [], "restart", interpreter=two)
        scenario.restart = restart
        try:
            restart.finish(240)
        except BaseException:
            restart.kill_job()
            raise
        yield scenario


def test_the_loader_changes_are_taken_and_the_accumulation_refused_with_its_reason(
    restarted: Restarted,
) -> None:
    """``memtui set`` takes batch 16 -> 32 with the LR scaled and two loader workers; the
    accumulation is refused, with why: the script steps its optimizer on a count of its own (a
    local ``gradient_accumulation_steps``, no ``accelerator.accumulate``), which memtui cannot
    change, so it never reports an accumulation the training would not run."""
    taken = {
        at: reply for at, reply in restarted.replies.items() if "grad_accum=2" not in CHANGES[at]
    }
    for at, reply in taken.items():
        assert reply.returncode == 0, f"before save {at}: {reply.stderr}{reply.stdout}"
    ((at, refused),) = [(at, r) for at, r in restarted.replies.items() if at not in taken]
    assert refused.returncode == 2, f"before save {at}: {refused.stderr}{refused.stdout}"
    assert "grad_accum is not tunable in this run" in refused.stderr + refused.stdout
    applied = restarted.status_before_kill["applied"]
    assert [a["step"] for a in applied] == list(taken), applied


def test_the_changes_land_at_their_save_state_on_both_ranks(restarted: Restarted) -> None:
    """Micro-batches of 16 until the save at micro-batch 4, of 32 after it, two loader workers
    after the save at 12, on each rank."""
    for rank, steps in steps_by_rank(restarted.first).items():
        batches = [b for s in steps for b in s.batches]
        assert len(batches) == KILL_AT - 1, (rank, batches)
        assert batches == [BATCH] * EVERY + [2 * BATCH] * (KILL_AT - 1 - EVERY), (rank, batches)
        workers = [s.workers for s in steps for _ in s.batches]
        assert workers == [0] * 3 * EVERY + [2] * (KILL_AT - 1 - 3 * EVERY), (rank, workers)


def test_the_restart_trains_with_the_tuned_batch_and_workers(restarted: Restarted) -> None:
    """``resume=True`` reads the tuned config ``state_dir`` kept beside the checkpoints: the
    restart's micro-batches are of 32 with two loader workers, on each rank."""
    ranks = steps_by_rank(restarted.restart)
    assert sorted(ranks) == [0, 1], "both ranks of the restart stepped"
    for rank, steps in ranks.items():
        batches = [(b, s.workers) for s in steps for b in s.batches]
        assert batches and set(batches) == {(2 * BATCH, 2)}, (rank, batches)


def test_an_accumulation_memtui_reports_is_the_one_trained(restarted: Restarted) -> None:
    """Where memtui reports accumulation 2 from the save at micro-batch 8, each optimizer step
    after it trains on two micro-batches (the script steps its optimizer at every micro-batch
    its own ``gradient_accumulation_steps`` lets through)."""
    reported = {
        a["step"]: a["changes"]["grad_accum"]
        for a in restarted.status_before_kill.get("applied", [])
        if "grad_accum" in a.get("changes", {})
    }
    if not reported:
        pytest.skip("memtui applied no accumulation change")
    ((at, (_old, new)),) = reported.items()
    for rank, steps in steps_by_rank(restarted.first).items():
        after = [len(s.batches) for s in steps if s.number > at]
        assert after and set(after) == {new}, (
            f"rank {rank}: micro-batches a step after {at}: {after}"
        )


def test_every_sample_once_per_epoch_over_the_killed_run_and_its_restart(
    restarted: Restarted,
) -> None:
    """The killed run's micro-batches up to ``step_16`` and the restart's: each of the 3 epochs
    trains each sample exactly once on the union of the ranks."""
    before = union_of_ranks(trained_epochs(restarted.first, limit=RESUME_FROM))
    after = union_of_ranks(trained_epochs(restarted.restart))
    found = coverage(restarted.dataset, continued(before, after))
    assert len(found) == EPOCHS and all(c.exact for c in found), (
        f"epochs (killed run up to step_{RESUME_FROM}: {[len(e) for e in before]} rows, "
        f"restart: {[len(e) for e in after]} rows): {found}"
    )


def test_every_step_trains_at_the_scripts_lr_times_the_factor_memtui_reports(
    restarted: Restarted,
) -> None:
    """The LR at every optimizer step of both runs, on each rank: the script's linear schedule
    with warmup (the prepared scheduler stepping twice a step) times the product of the factors
    of the changes memtui reports applied before that step."""
    factors = lr_factors(restarted.status_before_kill)
    assert factors, "memtui reported no applied change"

    def expected(step: int) -> float:
        return scheduled_lr(step, 2) * math.prod(f for at, f in factors if step > at)

    for run in (restarted.first, restarted.restart):
        for rank, steps in steps_by_rank(run).items():
            assert steps, f"rank {rank} made no optimizer step"
            wrong = lr_mismatches(steps, expected)
            assert not wrong, f"rank {rank}: (step, LR used, LR expected): {wrong}"
    audit_factors = [
        (int(e["step"]), float(e.get("lr_factor") or 1.0))
        for e in restarted.audit
        if e.get("event") == "applied"
    ]
    assert not audit_factors or audit_factors == factors, (audit_factors, factors)


# ------------------------- (d) unchanged under ``memtui run``, a workers change at the next save


SAVE_EVERY = 10
"""``--checkpointing_steps`` under ``memtui run``: ``save_state`` after every 10th micro-batch."""
QUEUED_AT, READ_AT = 4, 15
"""The training forwards before which every rank waits: ``num_workers=2`` queued before the 4th,
``memtui status`` read before the 15th (after the save at micro-batch 10)."""


@dataclass
class WorkersUnderRun:
    """The script without memtui's lines under ``memtui run``, a workers change queued."""

    ranks: int
    run: ClientRun
    reply: Any
    status: dict[str, Any]
    dataset: list[str]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def workers_under_run(request: pytest.FixtureRequest) -> Iterator[WorkersUnderRun]:
    ranks = int(request.param)
    with client_home() as (base, env):
        script = unchanged_client_script("accelerate_nlp", base / "run")
        local_data.mrpc_inputs(script.parent, TRAIN_ROWS, VALIDATION_ROWS)
        args = ["--checkpointing_steps", str(SAVE_EVERY), "--output_dir", "out"]
        run = start(
            script,
            args,
            {**env, **ACCELERATE_CPU},
            [],
            "workers",
            memtui_run("nlpw"),
            launcher(ranks),
            pause_at_forward=[QUEUED_AT, READ_AT],
        )
        try:
            run.wait_paused(QUEUED_AT, timeout=240, ranks=ranks, forward=True)
            run_id = job_run_id(run, ranks)
            reply = run.memtui("set", run_id, "num_workers=2")
            run.go(QUEUED_AT, forward=True)
            run.wait_paused(READ_AT, timeout=240, ranks=ranks, forward=True)
            status = status_json(run, run_id)
            run.go(READ_AT, forward=True)
        finally:
            run.go(QUEUED_AT, forward=True)
            run.go(READ_AT, forward=True)
        finished(run)
        yield WorkersUnderRun(ranks, run, reply, status, dataset_digests(script.parent))


def test_a_workers_change_lands_at_the_next_save_state_under_memtui_run(
    workers_under_run: WorkersUnderRun,
) -> None:
    """Queued before micro-batch 4, ``num_workers=2`` is applied at the save after micro-batch
    10 on every rank (listed as a checkpoint there): from the step after it two loader workers
    feed each rank, in the middle of the first epoch (40 micro-batches on one rank, 20 on two),
    and in every epoch after it."""
    reply, status = workers_under_run.reply, workers_under_run.status
    assert reply.returncode == 0, reply.stderr + reply.stdout
    assert [(a["step"], a["changes"]["num_workers"]) for a in status["applied"]] == [
        (SAVE_EVERY, {"old": 0, "new": 2})
    ]
    assert [c["step"] for c in status["checkpoints"]] == [SAVE_EVERY]
    per_epoch = TRAIN_ROWS // (BATCH * workers_under_run.ranks)
    for rank, steps in steps_by_rank(workers_under_run.run).items():
        workers = [s.workers for s in steps]
        assert len(workers) == EPOCHS * per_epoch
        assert workers[:SAVE_EVERY] == [0] * SAVE_EVERY, (rank, workers)
        # an epoch's last step: the prepared loader, a batch ahead, has ended its workers
        within = [w for n, w in enumerate(workers) if n >= SAVE_EVERY and (n + 1) % per_epoch]
        assert set(within) == {2}, (rank, str(workers))


def test_every_sample_once_per_epoch_through_a_workers_change_under_memtui_run(
    workers_under_run: WorkersUnderRun,
) -> None:
    found = coverage_of(workers_under_run.run, workers_under_run.dataset)
    assert len(found) == EPOCHS and all(c.exact for c in found), found
