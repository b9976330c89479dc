"""karpathy/nanoGPT's ``train.py``, unchanged but for the documented lines (a loop without a
DataLoader: ``get_batch``, module globals, its own LR schedule assigned every iteration), on CPU
with a 2-layer model and local token files, in one process and on two under ``torchrun`` (gloo;
``ddp_cpu.patch`` lets upstream's DDP branch run on the CPU): what the script really trains on
and with which LR, as torch's global hooks see it.

nanoGPT has no epochs: ``get_batch`` draws each micro-batch's rows at random offsets of the
token file (``torch.randint`` from the process's seed, ``1337 + rank``), the prefetch of the next
micro-batch right after each training forward, the evaluation's batches from the same generator
at every ``eval_interval`` on the master rank. Every row the script trains on is therefore fixed
by its own sampling and the batch sizes it asks for: ``replayed_rows`` draws them again in the
test (the model's initialisation, then each ``get_batch`` in the order the witness saw the
forwards), and the tests check that with memtui every training forward trains on exactly those
rows, none drawn and dropped, none trained twice, none in another order.

* No change queued, with the documented lines: ``ckpt.pt`` byte for byte, every step's LR and
  every trained row as with ``MEMTUI_DISABLE=1``, at 1 and 2 ranks.
* Changes queued with ``memtui set`` (a micro-batch change keeping the effective batch, the
  accumulation following; one doubling it with the LR scaled linearly; a workers change, which
  memtui refuses: the script has no DataLoader), a kill after the checkpoint at step 12 and a
  restart with ``init_from=resume``, at 1 and 2 ranks: each micro-batch of the tuned size, the
  rows the script's own sampling draws for those sizes, the LR ``get_lr`` gives times the factor
  memtui reports.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.clients import local_data
from tests.clients.harness import (
    ClientRun,
    Job,
    Plan,
    Scenario,
    applied_changes,
    client_home,
    client_script,
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
    records_by_rank,
    saved_without_run,
    start,
    steps_by_rank,
    steps_of,
)
from tests.clients.upstream import CLIENTS, apply_patch
from tests.clients.witness import row_digest

pytest.importorskip("numpy")

EVERY = 4
"""nanoGPT evaluates, saves ``ckpt.pt`` and reaches memtui's boundary every ``eval_interval``."""
MAX_ITERS = 20
LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2
CONFIG = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--dataset=tiny",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--dropout=0.0",
    "--batch_size=4",
    "--gradient_accumulation_steps=2",
    f"--max_iters={MAX_ITERS}",
    f"--lr_decay_iters={MAX_ITERS}",
    f"--eval_interval={EVERY}",
    "--eval_iters=2",
    f"--warmup_iters={WARMUP}",
    f"--learning_rate={LR}",
    f"--min_lr={MIN_LR}",
]
PLAN = Plan(
    args=CONFIG,
    every=EVERY,
    first_change=["batch_size=2", "--keep-effective-batch"],  # 4 x 2 -> 2 x 4
    second_change=["batch_size=4", "--allow-effective-batch", "--lr-scale", "linear"],  # 8 -> 16
    restart_args=[*CONFIG, "--init_from=resume"],
    kill_at=3 * EVERY + 2,
    last_change=["num_workers=2"],
)
NOT_TUNABLE = "num_workers is not tunable in this run"
"""What memtui says to a workers change on a loop without a DataLoader."""
EVAL_ITERS = 2
BLOCK = 32
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": BLOCK, "bias": False}
"""The model the config builds (nanoGPT's ``bias`` default, the vocabulary of the token files:
64)."""


def get_lr(it: int, decay_iters: int = MAX_ITERS) -> float:
    """nanoGPT's schedule (cosine with warmup) for iteration ``it``, with this config
    (``lr_decay_iters``: ``decay_iters``)."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > decay_iters:
        return MIN_LR
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - WARMUP) / (decay_iters - WARMUP)))
    return MIN_LR + coeff * (LR - MIN_LR)


def expected_lr(step: int) -> float:
    """The LR optimizer step ``step`` (iteration ``step - 1``) must use: the schedule, x2 from
    the second checkpoint's change on (``learning_rate`` and ``min_lr`` doubled)."""
    return get_lr(step - 1) * (2.0 if step > 2 * EVERY else 1.0)


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with client_home() as (base, env):
        script = client_script("nanogpt", base / "run")
        local_data.nanogpt_dataset(script.parent, "tiny")
        yield play(script, env, PLAN)


def test_the_run_registers(scenario: Scenario) -> None:
    listed = scenario.listed
    assert listed["cwd"] == str(scenario.first.workdir)
    assert "train.py" in str(listed["command"])
    for reply in scenario.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout


def test_batch_and_accumulation_land_at_the_next_checkpoint(scenario: Scenario) -> None:
    """4 x 2 until the checkpoint at step 4, 2 x 4 after it (the first micro-batch of step 5
    is the one the script prefetched during step 4), 4 x 4 after the one at step 8."""
    steps = steps_of(scenario.first)
    batches = {s.number: s.batches for s in steps}
    assert [batches[n] for n in range(1, 5)] == [[4, 4]] * 4
    assert batches[5] == [4, 2, 2, 2], "prefetched before the boundary, then the new size"
    assert [batches[n] for n in range(6, 9)] == [[2, 2, 2, 2]] * 3
    assert batches[9] == [2, 4, 4, 4]
    assert [batches[n] for n in range(10, PLAN.kill_at)] == [[4, 4, 4, 4]] * (PLAN.kill_at - 10)


def test_the_lr_follows_the_effective_batch_on_every_following_step(scenario: Scenario) -> None:
    """memtui says x2 for the change at step 8, and the optimizer uses the schedule x2 on every
    step after it, not only the first (the script assigns ``get_lr(iter_num)`` each iteration)."""
    (first, second) = applied_changes(scenario.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    assert "x2" in scenario.replies[1].stdout + scenario.replies[1].stderr
    wrong = lr_mismatches(steps_of(scenario.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_a_restart_from_the_scripts_checkpoint_resumes_the_tuned_knobs(scenario: Scenario) -> None:
    """Killed after the checkpoint at step 12 and restarted with ``init_from=resume``: 4 x 4
    from its first step (13), the LR of the schedule x2 (``learning_rate`` and ``min_lr`` scaled
    again from the tuned config)."""
    assert scenario.restart is not None
    steps = steps_of(scenario.restart)
    assert steps[0].number == 3 * EVERY + 1
    assert [s.number for s in steps] == list(range(13, MAX_ITERS + 2))
    assert all(s.batches == [4, 4, 4, 4] for s in steps), [s.batches for s in steps]
    wrong = lr_mismatches(steps, expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"
    config = scenario.status_after_restart["config"]
    assert (config["batch_size"], config["grad_accum"]) == (4, 4)


def test_the_scripts_checkpoint_keeps_the_tuned_config_beside_its_startup_config(
    scenario: Scenario,
) -> None:
    """nanoGPT's ``ckpt.pt`` keeps the config it started with; memtui's entry in it keeps what
    memtui set (4 x 4 over the script's 4 x 2, the LR x2), loadable as nanoGPT loads it."""
    import torch

    assert scenario.restart is not None
    saved = torch.load(Path(scenario.restart.workdir) / "out" / "ckpt.pt", weights_only=True)
    assert (saved["config"]["batch_size"], saved["config"]["gradient_accumulation_steps"]) == (4, 2)
    entry = saved["memtui"]
    assert entry["step"] == MAX_ITERS and entry["config"] == {"grad_accum": 4}, entry
    assert entry["lr"]["factor"] == pytest.approx(2.0), entry
    assert entry["lr"]["fields"] == ["learning_rate", "min_lr"], entry


def test_after_the_restart_memtui_counts_the_scripts_steps(scenario: Scenario) -> None:
    """Paused before the restarted process's second step (nanoGPT's 14th): memtui's step is the
    13 nanoGPT counts (``tuner.load_state_dict({"step": iter_num})``), not this process's 1."""
    assert scenario.restart_paused["opt_step"] == 14
    assert scenario.status_after_restart["step"] == 13


def test_the_scripts_own_logging_evaluation_and_checkpoints_keep_working(
    scenario: Scenario,
) -> None:
    import torch

    first = scenario.first.output()
    for line in ("step 4: train loss", "step 12: train loss", "saving checkpoint to out"):
        assert line in first
    assert "iter 12: loss" in first
    assert scenario.restart is not None
    restart = scenario.restart.output()
    assert "Resuming training from out" in restart
    assert f"iter {MAX_ITERS}: loss" in restart and f"step {MAX_ITERS}: train loss" in restart
    saved = torch.load(Path(scenario.restart.workdir) / "out" / "ckpt.pt", weights_only=False)
    assert saved["iter_num"] == MAX_ITERS


def test_a_boundary_inside_the_master_s_save_gives_up_in_seconds_under_torchrun() -> None:
    """nanoGPT's natural spot for ``tuner.checkpoint()`` is inside its master-only save, where it
    must not be. Under torchrun (two ranks, gloo) rank 1 goes on into the next step and waits in
    DDP's gradient all-reduce; rank 0 names it within seconds (the boundary's bound is half of
    gloo's 30 minutes), and the job trains to its end."""
    with client_home() as (base, env):
        script = client_script("nanogpt", base / "run")
        # on top of the documented lines: CPU ranks under torchrun (upstream sets a CUDA device)
        # and the boundary moved into the master's save
        patch = CLIENTS / "nanogpt" / "checkpoint_on_master.patch"
        apply_patch(patch.read_text(), script.parent)
        local_data.nanogpt_dataset(script.parent, "tiny")
        env.pop("MEMTUI_BOUNDARY_TIMEOUT", None)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        started = time.monotonic()
        result = subprocess.run(
            [*launcher, "--nproc_per_node=2", str(script), *CONFIG, "--backend=gloo"],
            cwd=script.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"iter {MAX_ITERS}: loss" in output, "trained to its end\n" + output
    assert (
        f"rank 1 went past step {EVERY} without calling tuner.checkpoint() "
        f"(it is in the backward pass of step {EVERY + 1})"
    ) in output, output
    assert took < 90, f"{took:.0f} s: the boundary waited\n{output}"


# ------------------------------------------------------------- the script's own sampling


def replayed_rows(run: ClientRun) -> dict[int, list[list[str]]]:
    """Each rank's training forwards' rows as the script's own sampling draws them for the batch
    sizes the witness saw: ``torch.manual_seed(1337 + rank)``, the model's initialisation (the
    same draws, from ``model.py`` in the run's directory), the first ``get_batch('train')``,
    then in the order of the rank's forwards: each evaluation forward's own batch (``eval_iters``
    of ``train``, then as many of ``val``), and after each training forward the prefetch of the
    next one (of the size that forward has)."""
    import numpy as np
    import torch

    spec = importlib.util.spec_from_file_location("nanogpt_model", run.workdir / "model.py")
    assert spec is not None and spec.loader is not None
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    data = {
        split: np.memmap(run.workdir / "data" / "tiny" / f"{split}.bin", dtype=np.uint16, mode="r")
        for split in ("train", "val")
    }

    def get_batch(split: str, size: int) -> list[str]:
        offsets = torch.randint(len(data[split]) - BLOCK, (size,))
        return [row_digest(data[split][i : i + BLOCK].astype(np.int64).tolist()) for i in offsets]

    replayed = {}
    for rank, forwards in records_by_rank(run, "forward").items():
        sizes = [f["shape"][0] for f in forwards if f["training"]]
        rows: list[list[str]] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1337 + rank)
            model.GPT(model.GPTConfig(**MODEL, vocab_size=64, dropout=0.0))
            prefetched = get_batch("train", sizes[0])
            evaluated = 0
            for forward in forwards:
                if not forward["training"]:
                    split = "train" if evaluated % (2 * EVAL_ITERS) < EVAL_ITERS else "val"
                    get_batch(split, forward["shape"][0])
                    evaluated += 1
                    continue
                rows.append(prefetched)
                following = len(rows)
                prefetched = get_batch("train", sizes[following] if following < len(sizes) else 1)
        replayed[rank] = rows
    return replayed


def trained_rows(run: ClientRun) -> dict[int, list[list[str]]]:
    """Each rank's training forwards' rows as the witness saw them."""
    return {
        rank: [f["rows"] for f in forwards if f["training"]]
        for rank, forwards in records_by_rank(run, "forward").items()
    }


def sampling_differences(run: ClientRun) -> dict[int, list[tuple[int, int]]]:
    """Where each rank trained on rows its own sampling did not draw there: (training forward,
    rows of it that differ)."""
    replayed, trained = replayed_rows(run), trained_rows(run)
    assert sorted(replayed) == sorted(trained)
    found = {}
    for rank, rows in trained.items():
        found[rank] = [
            (n, sum(a != b for a, b in zip(got, want, strict=True)) + abs(len(got) - len(want)))
            for n, (got, want) in enumerate(zip(rows, replayed[rank], strict=True), start=1)
            if got != want
        ]
    return {rank: wrong for rank, wrong in found.items() if wrong}


def tuned_lr(factors: list[tuple[int, float]], decay_iters: int = MAX_ITERS) -> Any:
    """The LR optimizer step ``step`` must use: ``get_lr(step - 1)`` times the factors memtui
    reports applied before it (``learning_rate`` and ``min_lr`` scaled together)."""
    return lambda step: get_lr(step - 1, decay_iters) * factor_at(factors, step)


def test_a_workers_change_is_refused_with_its_reason(scenario: Scenario) -> None:
    """nanoGPT has no DataLoader: ``num_workers=2`` is refused, saying why, and never reported
    applied."""
    reply = scenario.last_reply
    assert reply is not None and reply.returncode == 2, reply
    assert NOT_TUNABLE in reply.stderr + reply.stdout
    applied = applied_changes(scenario.status_before_kill)
    assert all("num_workers" not in a["changes"] for a in applied), applied


def test_every_row_is_the_one_the_scripts_own_sampling_draws(scenario: Scenario) -> None:
    """The killed run (micro-batches of 4, then 2, then 4) and its restart: each training
    forward's rows are those ``get_batch`` draws from the process's seed for the sizes it asked
    for: memtui neither drops nor repeats a draw at a boundary or a resume."""
    assert scenario.restart is not None
    for run in (scenario.first, scenario.restart):
        wrong = sampling_differences(run)
        assert not wrong, f"{run.log.stem}: (training forward, rows not drawn there): {wrong}"


def test_every_step_trains_at_get_lr_times_the_factor_memtui_reports(scenario: Scenario) -> None:
    factors = lr_factors(scenario.status_before_kill)
    assert [f for _, f in factors] == [1.0, 2.0], factors
    assert scenario.restart is not None
    for run in (scenario.first, scenario.restart):
        wrong = lr_mismatches(steps_of(run), tuned_lr(factors))
        assert not wrong, f"{run.log.stem}: (step, LR used, LR expected): {wrong}"


# ------------------------------------------------ no change queued: the documented lines


@dataclass
class Unchanged:
    """The patched script run to its end with memtui (listed by ``memtui ls``), then with
    ``MEMTUI_DISABLE=1``."""

    ranks: int
    tuned: ClientRun
    disabled: ClientRun
    out: dict[str, Path]
    listed: str


UNCHANGED_ITERS = 12
UNCHANGED = [
    *(a for a in CONFIG if not a.startswith(("--max_iters=", "--lr_decay_iters="))),
    f"--max_iters={UNCHANGED_ITERS}",
    f"--lr_decay_iters={UNCHANGED_ITERS}",
]
"""The config, 12 iterations long."""
LISTED = 6
"""The step before which the run with memtui waits until ``memtui ls`` lists every rank."""


def ranks_args(ranks: int) -> list[str]:
    """The script's own arguments for a job of ``ranks`` processes (gloo on the CPU)."""
    return [] if ranks == 1 else ["--backend=gloo"]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def unchanged(request: pytest.FixtureRequest) -> Iterator[Unchanged]:
    ranks = int(request.param)
    with client_home() as (base, env):
        runs, out, listed = {}, {}, ""
        for label, extra in (("tuned", {}), ("disabled", {"MEMTUI_DISABLE": "1"})):
            script = client_script("nanogpt", base / label, ["ddp_cpu.patch"] if ranks > 1 else [])
            local_data.nanogpt_dataset(script.parent, "tiny")
            run = start(
                script,
                [*UNCHANGED, *ranks_args(ranks)],
                {**env, **extra},
                [LISTED] if label == "tuned" else [],
                label,
                interpreter=python_or_torchrun(ranks),
            )
            if label == "tuned":
                try:
                    run.wait_paused(LISTED, ranks=ranks)
                    listed = job_run_id(run, ranks)
                finally:
                    run.go(LISTED)
            runs[label] = finished(run, 150)
            out[label] = script.parent / "out"
        yield Unchanged(ranks, runs["tuned"], runs["disabled"], out, listed)


def test_no_change_saves_the_checkpoint_memtui_disabled_saves(unchanged: Unchanged) -> None:
    """``ckpt.pt`` entry for entry, byte for byte once saved again, but for the id of the run
    in memtui's entry."""
    assert unchanged.listed, "memtui listed the run"
    tuned, disabled = (unchanged.out[k] / "ckpt.pt" for k in ("tuned", "disabled"))
    assert saved_without_run(tuned) == saved_without_run(disabled)


def test_no_change_trains_every_row_at_every_lr_as_memtui_disabled(unchanged: Unchanged) -> None:
    """Every rank's steps, LRs, forwards and rows as with ``MEMTUI_DISABLE=1``; the rows those
    the script's own sampling draws, the LRs ``get_lr``'s."""
    tuned, disabled = unchanged.tuned, unchanged.disabled
    assert sorted(forwards_by_rank(tuned)) == list(range(unchanged.ranks))
    assert lrs_by_rank(tuned) == lrs_by_rank(disabled)
    assert steps_by_rank(tuned) == steps_by_rank(disabled)
    assert forwards_by_rank(tuned) == forwards_by_rank(disabled)
    assert not sampling_differences(disabled), "the replay draws what the script draws"
    for rank, steps in steps_by_rank(tuned).items():
        assert [s.number for s in steps] == list(range(1, UNCHANGED_ITERS + 2)), rank
        wrong = lr_mismatches(steps, tuned_lr([], UNCHANGED_ITERS))
        assert not wrong, f"rank {rank}: (step, LR used, LR expected): {wrong}"


# ------------------------ two ranks: changes queued, a kill after a checkpoint, a restart


RANKS2_CHANGES = {
    EVERY: ["batch_size=2", "--keep-effective-batch"],
    2 * EVERY: ["batch_size=4", "--allow-effective-batch", "--lr-scale", "linear"],
    3 * EVERY: ["num_workers=2"],
}
"""Each rank: 4 x 1 (the script's accumulation of 2 divided by its 2 ranks), 2 x 2 from the
checkpoint at step 4 (the same effective batch), 4 x 2 from the one at step 8 (twice it: the
LR x2); the workers change refused."""


@pytest.fixture(scope="module")
def restarted() -> Iterator[Job]:
    with client_home() as (base, env):
        script = client_script("nanogpt", base / "run", ["ddp_cpu.patch"])
        local_data.nanogpt_dataset(script.parent, "tiny")
        args = [*CONFIG, "--backend=gloo"]
        yield play_job(
            script,
            args,
            env,
            RANKS2_CHANGES,
            PLAN.kill_at,
            [*args, "--init_from=resume"],
            2,
            interpreter=python_or_torchrun(2),
            audit=script.parent / "out" / "memtui-audit.jsonl",
        )


def test_two_ranks_take_batch_and_accumulation_and_refuse_workers(restarted: Job) -> None:
    """The two loader-free changes are taken; the workers change refused, saying why, and never
    reported applied."""
    replies = restarted.replies
    assert replies[EVERY].returncode == 0, replies[EVERY].stderr
    assert replies[2 * EVERY].returncode == 0, replies[2 * EVERY].stderr
    refused = replies[3 * EVERY]
    assert refused.returncode == 2 and NOT_TUNABLE in refused.stderr + refused.stdout, refused
    applied = applied_changes(restarted.status_before_kill)
    assert [a["step"] for a in applied] == [EVERY, 2 * EVERY], applied


def test_two_ranks_train_the_tuned_micro_batches(restarted: Job) -> None:
    """Each rank: 4 until the checkpoint at step 4; the prefetched 4, then 2s; the prefetched 2,
    then 4s after step 8; 4 x 2 in the restart (steps 13 to 20)."""
    for rank, steps in steps_by_rank(restarted.first).items():
        batches = [s.batches for s in steps]
        expected = [[4]] * 4 + [[4, 2]] + [[2, 2]] * 3 + [[2, 4]] + [[4, 4]] * 4
        assert batches == expected, f"rank {rank}"
    assert restarted.restart is not None
    for rank, steps in steps_by_rank(restarted.restart).items():
        assert [s.number for s in steps] == list(range(13, MAX_ITERS + 2)), f"rank {rank}"
        assert all(s.batches == [4, 4] for s in steps), f"rank {rank}"


def test_two_ranks_train_every_row_the_scripts_own_sampling_draws(restarted: Job) -> None:
    for run in restarted.runs():
        wrong = sampling_differences(run)
        assert not wrong, f"{run.log.stem}: (training forward, rows not drawn there): {wrong}"


def test_two_ranks_train_at_get_lr_times_the_factor_memtui_reports(restarted: Job) -> None:
    """On every rank, in the killed run and its restart; the audit log reports the same."""
    factors = lr_factors(restarted.status_before_kill)
    assert [f for _, f in factors] == [1.0, 2.0], factors
    audit = [
        (int(e["step"]), float(e.get("lr_factor") or 1.0))
        for e in restarted.audit
        if e.get("event") == "applied"
    ]
    assert audit == factors, (audit, factors)
    for run in restarted.runs():
        for rank, steps in steps_by_rank(run).items():
            wrong = lr_mismatches(steps, tuned_lr(factors))
            assert not wrong, f"{run.log.stem}, rank {rank}: (step, LR used, LR expected): {wrong}"
