"""The client corpus's scripts with none of memtui's lines, launched as their users launch them
but under ``memtui run --name NAME --``: each registers with all its ranks, its own output,
checkpoints and exit status are those of the same script run without memtui (the two runs in
the same directory, one after the other, so that every path they print or save is the same), and
the Hugging Face Trainer found in ``run_clm.py`` takes changes queued with ``memtui set`` at its
next save and resumes them from its own checkpoint; what the scripts really do is read from
outside memtui, by the witness (torch's global hooks) and from the files they write.

Fields that hold wall-clock measurements differ between any two runs, with or without memtui,
and are masked before the comparison (each mask says which): nanoGPT's ``time ...ms`` and
``mfu ...%``, the Hugging Face logs' timestamps and ``*_runtime`` / ``*_per_second`` figures,
Lightning's and tqdm's elapsed times and rates. stderr is compared byte for byte where nothing
redraws on it (nanoGPT, each torchrun rank); tqdm's bars redraw on a timer, a different number
of frames in any two runs: there it is compared as the script's own log records (Accelerate's
loop), or only for holding no ``memtui`` line (``run_clm.py``, Lightning)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clients import local_data
from tests.clients.harness import (
    Pair,
    Scenario,
    applied_changes,
    client_home,
    forwards_by_rank,
    lr_mismatches,
    lrs_by_rank,
    memtui_run,
    play,
    run_pair,
    steps_of,
    unchanged_client_script,
)
from tests.clients.test_nanogpt import CONFIG as NANOGPT_CONFIG

TORCHRUN = [
    str(Path(sys.executable).with_name("torchrun")),
    "--standalone",
    "--nproc_per_node",
    "2",
    # each rank's stdout and stderr in its own file (logs/<id>/attempt_0/<rank>/): two ranks
    # printing to one pipe interleave their writes differently in any two runs
    "--log-dir",
    "logs",
    "--redirects",
    "3",
]
NANOGPT = [
    *(a for a in NANOGPT_CONFIG if not a.startswith(("--max_iters=", "--lr_decay_iters="))),
    "--max_iters=10",
    "--lr_decay_iters=10",
]
"""The explicit nanoGPT test's tiny config, 10 iterations long."""
PAUSE_AT = 6
"""The step before which the run under ``memtui run`` waits while memtui's command line is read
(after the script's first checkpoint, at step 4 in every client here)."""

MEMTUI_LINE = re.compile(r"^memtui", re.MULTILINE)


def nanogpt_masked(text: str) -> str:
    """nanoGPT's output with its wall-clock figures masked (``time 12.34ms, mfu 0.00%``)."""
    return re.sub(r"time -?[0-9.]+ms, mfu -?[0-9.]+%", "time <ms>, mfu <%>", text)


def hf_masked(text: str) -> str:
    """``run_clm.py``'s stdout with its timestamps, runtimes (the datasets library's ``took 0.0
    min`` too) and rates masked, and the metrics tables' column padding (sized to the widest
    value, a rate among them) collapsed."""
    text = re.sub(r"\d\d/\d\d/\d{4} \d\d:\d\d:\d\d", "<time>", text)
    text = re.sub(r" took [0-9.]+ min$", " took <min>", text, flags=re.M)
    text = re.sub(r"'(\w*runtime|\w*per_second)': '[^']*'", r"'\1': <masked>", text)
    text = re.sub(r"^(  \w*(?:runtime|per_second)\s+=).*$", r"\1 <masked>", text, flags=re.M)
    return re.sub(r"^(  \w+) +=  *", r"\1 = ", text, flags=re.M)


def accelerate_log_records(stderr: str) -> list[str]:
    """The script's own log records (``%m/%d/%Y %H:%M:%S - LEVEL - logger - message``, the format
    it sets), their timestamps and the datasets library's ``took 0.0 min`` masked; the rest of its stderr is tqdm's and the libraries'
    (a record may follow a tqdm frame on its line: tqdm ends a frame with no newline)."""
    stamp = re.compile(r"\d\d/\d\d/\d{4} \d\d:\d\d:\d\d - ")
    found = (stamp.search(line) for line in re.split(r"[\r\n]", stderr))
    records = [f"<time> - {m.string[m.end() :]}" for m in found if m]
    return [re.sub(r" took [0-9.]+ min$", " took <min>", record) for record in records]


def trained(steps: list[Any]) -> list[tuple[int, list[int], list[float], int]]:
    """What each optimizer step trained on, as the witness saw it: its number, micro-batch
    sizes, LRs and loader workers (sorted: the ranks of one run write to one file)."""
    return sorted((s.number, s.batches, s.lrs, s.workers) for s in steps)


def same_files(plain: Path, watched: Path, compare: Callable[[Path, Path], bool]) -> list[str]:
    """The files under two output directories that differ: present in one only, or ``compare``
    false for them."""
    left = {p.relative_to(plain) for p in plain.rglob("*") if p.is_file()}
    right = {p.relative_to(watched) for p in watched.rglob("*") if p.is_file()}
    differ = [f"only without memtui: {p}" for p in sorted(left - right)]
    differ += [f"only under memtui run: {p}" for p in sorted(right - left)]
    differ += [str(p) for p in sorted(left & right) if not compare(plain / p, watched / p)]
    return differ


def identical(a: Path, b: Path) -> bool:
    return a.read_bytes() == b.read_bytes()


def torch_load(path: Path) -> dict[str, Any]:
    """A checkpoint file's contents."""
    import torch

    return dict(torch.load(path, map_location="cpu", weights_only=False))


def differences(expected: Any, got: Any, where: str = "") -> list[str]:
    """Where two loaded checkpoints differ (tensors compared by value, exactly)."""
    import torch

    if isinstance(expected, dict) and isinstance(got, dict):
        found = [f"{where}/{k}: only one has it" for k in set(expected) ^ set(got)]
        for key in set(expected) & set(got):
            found += differences(expected[key], got[key], f"{where}/{key}")
        return found
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(expected) != len(got):
            return [f"{where}: {len(expected)} items, {len(got)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(expected, got, strict=True))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return [] if torch.equal(expected, got) else [f"{where}: tensors differ"]
    return [] if expected == got else [f"{where}: {expected!r} != {got!r}"]


def assert_registered(pair: Pair, script: str, ranks: int) -> None:
    """One run listed, with ``ranks`` ranks: the witness's processes, each stepping."""
    (listed,) = pair.registered
    assert listed["cwd"] == str(pair.watched.workdir)
    assert script in " ".join(listed["command"])
    assert listed["ranks"] == ranks
    pids = sorted(r["pid"] for r in pair.watched.records("start"))
    assert sorted(e["pid"] for e in listed["endpoints"]) == pids, "every process of the script"
    assert sorted(r["pid"] for r in pair.status["ranks"]) == pids
    assert all(r["step"] == PAUSE_AT - 1 for r in pair.status["ranks"]), pair.status["ranks"]


def assert_no_memtui_line(pair: Pair) -> None:
    """Nothing of memtui's on the command's stderr (no warning that the hook did not start)."""
    for run in (pair.plain, pair.watched):
        assert run.errors is not None
        errors = run.errors.read_text(errors="replace")
        assert not MEMTUI_LINE.search(errors), errors


# ------------------------------------------------------------------------------------ nanoGPT


@pytest.fixture(scope="module")
def nanogpt() -> Iterator[Pair]:
    pytest.importorskip("numpy")
    with client_home() as (base, env):
        script = unchanged_client_script("nanogpt", base / "run")
        local_data.nanogpt_dataset(script.parent, "tiny")
        yield run_pair(script, NANOGPT, env, [script.parent / "out"], "nanogpt", PAUSE_AT)


def test_nanogpt_unchanged_registers_and_says_its_data_wait_is_not_measured(
    nanogpt: Pair,
) -> None:
    """``get_batch`` is no DataLoader: memtui counts the optimizer's steps and says that it did
    not measure the data wait, never a number for it."""
    assert_registered(nanogpt, "train.py", ranks=1)
    metrics = nanogpt.status["metrics"]
    assert metrics["data_wait_measured"] is False, metrics
    assert metrics["step_time_s"] > 0
    assert "data wait not measured" in nanogpt.status_text
    assert "samples not counted" in nanogpt.status_text
    assert "data wait not measured" in json.dumps(nanogpt.status["verdict"])


def test_nanogpt_unchanged_prints_trains_and_saves_as_without_memtui(nanogpt: Pair) -> None:
    """stdout byte for byte but for ``time``/``mfu``, stderr byte for byte, the same batches,
    LRs and rows at every step, the same ``ckpt.pt`` (both runs exit 0)."""
    plain, watched = nanogpt.plain, nanogpt.watched
    assert nanogpt_masked(watched.output()) == nanogpt_masked(plain.output())
    assert "iter 10: loss" in watched.output()
    assert watched.errors and plain.errors
    assert watched.errors.read_bytes() == plain.errors.read_bytes()
    assert trained(steps_of(watched)) == trained(steps_of(plain))
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every forward's rows"
    ckpt = watched.workdir / "out" / "ckpt.pt"
    assert ckpt.read_bytes() == nanogpt.aside[ckpt.parent].joinpath("ckpt.pt").read_bytes()


def test_nanogpt_unchanged_fails_as_without_memtui() -> None:
    """A script that fails mid-training (its checkpoint path is a directory: ``torch.save``
    raises at the first save, after 4 optimizer steps, once memtui watches): the same exit
    status, the same traceback on stderr, the same stdout but for ``time``/``mfu``."""
    pytest.importorskip("numpy")
    with client_home() as (base, env):
        script = unchanged_client_script("nanogpt", base / "run")
        local_data.nanogpt_dataset(script.parent, "tiny")
        args = [*NANOGPT, "--max_iters=6"]
        ends = []
        for launcher in ([], memtui_run("failing")):
            shutil.rmtree(script.parent / "out", ignore_errors=True)
            (script.parent / "out" / "ckpt.pt").mkdir(parents=True)
            ends.append(
                subprocess.run(
                    [*launcher, sys.executable, str(script), *args],
                    cwd=script.parent,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
            )
    plain, watched = ends
    assert plain.returncode == 1 and "Is a directory" in plain.stderr, plain.stderr
    assert watched.returncode == plain.returncode
    assert watched.stderr == plain.stderr
    assert nanogpt_masked(watched.stdout) == nanogpt_masked(plain.stdout)
    assert "iter 3: loss" in watched.stdout


@pytest.fixture(scope="module")
def nanogpt_torchrun() -> Iterator[Pair]:
    pytest.importorskip("numpy")
    with client_home() as (base, env):
        # upstream sets device cuda:<local rank> and DDP(device_ids=...) under torchrun, which
        # cannot run on a machine without CUDA: the one compatibility patch
        script = unchanged_client_script("nanogpt", base / "run", ["ddp_cpu.patch"])
        local_data.nanogpt_dataset(script.parent, "tiny")
        outputs = [script.parent / "out", script.parent / "logs"]
        args = [*NANOGPT, "--backend=gloo"]
        yield run_pair(script, args, env, outputs, "nanoddp", PAUSE_AT, TORCHRUN, ranks=2)


def rank_logs(logs: Path, stream: str) -> list[bytes]:
    """What each rank wrote to ``stream`` (stdout, stderr), by local rank."""
    return [next(logs.glob(f"*/attempt_0/{rank}/{stream}.log")).read_bytes() for rank in (0, 1)]


def test_nanogpt_under_torchrun_registers_both_ranks_in_one_run(nanogpt_torchrun: Pair) -> None:
    """``memtui run -- torchrun --nproc_per_node 2 train.py``: the two ranks (not torchrun) in one
    run; memtui says its data wait is not measured."""
    assert_registered(nanogpt_torchrun, "train.py", ranks=2)
    assert nanogpt_torchrun.status["world_size"] == 2
    assert nanogpt_torchrun.status["metrics"]["data_wait_measured"] is False


def test_nanogpt_under_torchrun_prints_trains_and_saves_as_without_memtui(
    nanogpt_torchrun: Pair,
) -> None:
    """Each rank's stdout (``time``/``mfu`` masked) and stderr, torchrun's own output, the
    batches, LRs and rows of every step of both ranks, rank 0's ``ckpt.pt``: as without memtui."""
    plain, watched = nanogpt_torchrun.plain, nanogpt_torchrun.watched
    logs = watched.workdir / "logs"
    plain_logs = nanogpt_torchrun.aside[logs]
    outs = [nanogpt_masked(b.decode()) for b in rank_logs(logs, "stdout")]
    assert outs == [nanogpt_masked(b.decode()) for b in rank_logs(plain_logs, "stdout")]
    assert "iter 10: loss" in outs[0]
    assert rank_logs(logs, "stderr") == rank_logs(plain_logs, "stderr")
    assert watched.output() == plain.output()
    steps = trained(steps_of(watched))
    assert steps == trained(steps_of(plain)) and len(steps) == 2 * 11
    assert sorted(forwards_by_rank(watched)) == [0, 1]
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every rank's forwards and rows"
    ckpt = watched.workdir / "out" / "ckpt.pt"
    assert ckpt.read_bytes() == nanogpt_torchrun.aside[ckpt.parent].joinpath("ckpt.pt").read_bytes()
    assert_no_memtui_line(nanogpt_torchrun)


# --------------------------------------------------------------------------- transformers' run_clm


def hf_args(steps: int) -> list[str]:
    """``run_clm.py``'s arguments of the explicit line's test, for ``steps`` optimizer steps."""
    from tests.clients.test_hf_run_clm import ARGS

    at = ARGS.index("--max_steps") + 1
    return [*ARGS[:at], str(steps), *ARGS[at + 1 :]]


@pytest.fixture(scope="module")
def hf_pair() -> Iterator[Pair]:
    pytest.importorskip("transformers")
    with client_home() as (base, env):
        script = unchanged_client_script("hf_run_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        local_data.accuracy_metric(script.parent)
        # the datasets cache under HF_HOME set aside too: the second run prepares its data as
        # the first did, rather than saying it loaded them from the cache
        outputs = [script.parent / "out", base / "hf"]
        yield run_pair(script, hf_args(8), env, outputs, "clm", PAUSE_AT)


def hf_json(a: Path, b: Path) -> bool:
    """Files equal; JSON files equal but for their runtimes and rates."""
    if a.suffix != ".json":
        return identical(a, b)

    def timeless(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: timeless(v)
                for k, v in value.items()
                if not k.endswith(("runtime", "per_second"))
            }
        if isinstance(value, list):
            return [timeless(v) for v in value]
        return value

    return bool(timeless(json.loads(a.read_text())) == timeless(json.loads(b.read_text())))


def test_run_clm_unchanged_registers_with_its_trainers_knobs(hf_pair: Pair) -> None:
    assert_registered(hf_pair, "run_clm.py", ranks=1)
    status = hf_pair.status
    assert status["config"]["batch_size"] == 4 and status["config"]["num_workers"] == 0
    assert {"batch_size", "grad_accum", "num_workers"} <= set(status["tunable"])
    assert status["metrics"]["data_wait_measured"] is True


def test_run_clm_unchanged_prints_trains_and_saves_as_without_memtui(hf_pair: Pair) -> None:
    """stdout (the script's log and the Trainer's metrics) byte for byte but for timestamps,
    runtimes and rates; every step's batches and LRs; every file of ``out`` (JSON files but for
    their runtimes and rates)."""
    plain, watched = hf_pair.plain, hf_pair.watched
    assert hf_masked(watched.output()) == hf_masked(plain.output())
    assert "***** eval metrics *****" in watched.output()
    assert trained(steps_of(watched)) == trained(steps_of(plain))
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every forward's rows"
    out = watched.workdir / "out"
    assert not same_files(hf_pair.aside[out], out, hf_json)
    assert_no_memtui_line(hf_pair)


def test_run_clm_unchanged_trains_every_block_once_per_epoch_over_the_kill_and_restart(
    hf_tuned: Scenario,
) -> None:
    """With no line: the killed run's blocks up to ``checkpoint-12`` (2 steps into epoch 1),
    then its restart's, each epoch every block exactly once."""
    from tests.clients.test_hf_run_clm import (
        LAST_EPOCH_ROWS,
        assert_each_block_once_per_epoch,
        coverage_over_restart,
        dataset_digests,
    )

    dataset = dataset_digests(hf_tuned.first.workdir, 1)
    found = coverage_over_restart(dataset, hf_tuned.first, hf_tuned.restart, 1)
    assert_each_block_once_per_epoch(found, LAST_EPOCH_ROWS, hf_tuned.restart)


@pytest.fixture(scope="module")
def hf_torchrun() -> Iterator[Pair]:
    pytest.importorskip("transformers")
    with client_home() as (base, env):
        script = unchanged_client_script("hf_run_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        local_data.accuracy_metric(script.parent)
        outputs = [script.parent / "out", script.parent / "logs", base / "hf"]
        yield run_pair(script, hf_args(8), env, outputs, "clmddp", PAUSE_AT, TORCHRUN, ranks=2)


def test_run_clm_under_torchrun_trains_and_saves_as_without_memtui(hf_torchrun: Pair) -> None:
    """``memtui run -- torchrun --nproc_per_node 2 run_clm.py``: both ranks in one run; every
    rank's steps, LRs, forwards and rows, every file of ``out`` (JSON files but for their
    runtimes and rates) and the exit status as without memtui."""
    assert_registered(hf_torchrun, "run_clm.py", ranks=2)
    plain, watched = hf_torchrun.plain, hf_torchrun.watched
    assert watched.proc.returncode == plain.proc.returncode == 0
    assert sorted(forwards_by_rank(watched)) == [0, 1]
    assert lrs_by_rank(watched) == lrs_by_rank(plain)
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every rank's forwards and rows"
    out = watched.workdir / "out"
    assert (out / "checkpoint-8" / "rng_state_1.pth").exists()
    assert not same_files(hf_torchrun.aside[out], out, hf_json)


@pytest.fixture(scope="module")
def hf_tuned() -> Iterator[Scenario]:
    pytest.importorskip("transformers")
    from tests.clients.test_hf_run_clm import PLAN

    with client_home() as (base, env):
        script = unchanged_client_script("hf_run_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        local_data.accuracy_metric(script.parent)
        yield play(script, env, PLAN, memtui_run("clm"))


def test_run_clm_unchanged_takes_batch_size_and_workers_at_its_next_save(
    hf_tuned: Scenario,
) -> None:
    """The explicit line's scenario, with no line: 4 x 1 with no worker until the save at step
    4; 2 x 2 with two loader worker processes after it; 4 x 2 after the save at step 8; the
    LR x2 from then on."""
    from tests.clients.test_hf_run_clm import PLAN as plan
    from tests.clients.test_hf_run_clm import expected_lr, workers_while_loading

    for reply in hf_tuned.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout
    steps = {s.number: s for s in steps_of(hf_tuned.first)}
    assert [steps[n].batches for n in range(1, 5)] == [[4]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[2, 2]] * 4
    assert [steps[n].batches for n in range(9, plan.kill_at)] == [[4, 4]] * (plan.kill_at - 9)
    (workers,) = workers_while_loading(hf_tuned.first).values()
    assert {workers[n] for n in workers if n <= 4} == {0}
    assert {workers[n] for n in workers if n > 4} == {2}
    (first, second) = applied_changes(hf_tuned.status_before_kill)[-2:]
    assert first["lr_factor"] in (None, 1.0), first
    assert second["lr_factor"] == pytest.approx(2.0), second
    wrong = lr_mismatches(steps_of(hf_tuned.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_run_clm_unchanged_resumes_the_tuned_knobs_from_its_checkpoint(hf_tuned: Scenario) -> None:
    """Killed after checkpoint-12 and restarted with ``--resume_from_checkpoint`` (under
    ``memtui run`` again): 4 x 2 with two workers from its first step (13), memtui counting the
    Trainer's steps."""
    from tests.clients.test_hf_run_clm import MAX_STEPS, expected_lr, workers_while_loading

    assert hf_tuned.restart is not None
    steps = steps_of(hf_tuned.restart)
    assert [s.number for s in steps] == list(range(13, MAX_STEPS + 1))
    assert all(s.batches == [4, 4] for s in steps), [s.batches for s in steps]
    (workers,) = workers_while_loading(hf_tuned.restart).values()
    assert set(workers.values()) == {2}, [s.workers for s in steps]
    wrong = lr_mismatches(steps, expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"
    config = hf_tuned.status_after_restart["config"]
    assert (config["batch_size"], config["grad_accum"], config["num_workers"]) == (4, 2, 2)
    assert hf_tuned.restart_paused["opt_step"] == 14
    assert hf_tuned.status_after_restart["step"] == 13


# ------------------------------------------------------------------------- Lightning's example


@pytest.fixture(scope="module")
def lightning_pair() -> Iterator[Pair]:
    pytest.importorskip("lightning")
    pytest.importorskip("requests")  # WikiText2 requires it, even for a file already there
    from tests.clients.test_lightning_transformer import short_trainer

    with client_home() as (base, env):
        script = unchanged_client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=80)
        outputs = [script.parent / "lightning_logs"]
        env = short_trainer(env, max_steps=8, bar=False)
        yield run_pair(script, [], env, outputs, "lightning", PAUSE_AT)


def lightning_masked(text: str) -> str:
    """Lightning's stdout with the progress bar's elapsed and remaining times and its rate masked,
    and the bar's length and the padding of its columns (Rich sizes them to the width these
    figures leave) collapsed."""
    text = re.sub(r"\d+:\d\d:\d\d", "<h:mm:ss>", text)
    text = re.sub(r"[0-9.]+(it/s|s/it)", r"<rate>\1", text)
    text = re.sub(r"[━╸╺]+", "<bar>", text)
    return re.sub(r" +", " ", text)


def test_lightning_example_unchanged_registers(lightning_pair: Pair) -> None:
    assert_registered(lightning_pair, "transformer.py", ranks=1)
    assert lightning_pair.status["metrics"]["data_wait_measured"] is True
    assert "grad_accum" in lightning_pair.status["tunable"]


def test_lightning_example_unchanged_prints_trains_and_saves_as_without_memtui(
    lightning_pair: Pair,
) -> None:
    """stdout (the Rich progress bar's last frame, the test table) but for times and rates,
    every step's batches and LR, ``hparams.yaml`` byte for byte, ModelCheckpoint's file entry for
    entry (tensors by value) but for memtui's own entry, as many TensorBoard event files (they
    hold wall-clock times)."""
    plain, watched = lightning_pair.plain, lightning_pair.watched
    assert lightning_masked(watched.output()) == lightning_masked(plain.output())
    assert "test_loss" in watched.output()
    assert trained(steps_of(watched)) == trained(steps_of(plain))
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every forward's rows"
    assert_same_lightning_logs(lightning_pair)
    assert_no_memtui_line(lightning_pair)


def assert_same_lightning_logs(pair: Pair) -> None:
    """``hparams.yaml`` byte for byte, ModelCheckpoint's file entry for entry (tensors by
    value) but for memtui's own entry, as many TensorBoard event files (they hold wall-clock
    times)."""
    watched = pair.watched
    logs = watched.workdir / "lightning_logs"
    plain_logs = pair.aside[logs]

    def same_but_events_and_checkpoint(a: Path, b: Path) -> bool:
        return a.name.startswith("events.out.tfevents.") or a.suffix == ".ckpt" or identical(a, b)

    differ = same_files(plain_logs, logs, same_but_events_and_checkpoint)
    # the event files' names hold their wall time and pid: the same number of them, each run
    assert all("events.out.tfevents." in d for d in differ), differ
    assert len(list(logs.rglob("events.out.tfevents.*"))) == len(
        list(plain_logs.rglob("events.out.tfevents.*"))
    )
    (checkpoint,) = logs.rglob("*.ckpt")
    saved, expected = torch_load(checkpoint), torch_load(plain_logs / checkpoint.relative_to(logs))
    # the adapter may keep the position of the training loader it took over in the checkpoint
    # (its ``memtui`` entry: what a resume of that loader needs); the rest is the framework's
    assert set(saved) - set(expected) <= {"memtui"}
    saved.pop("memtui", None)
    assert not differences(expected, saved)


@pytest.fixture(scope="module")
def lightning_torchrun() -> Iterator[Pair]:
    pytest.importorskip("lightning")
    pytest.importorskip("requests")  # WikiText2 requires it, even for a file already there
    from tests.clients.test_lightning_transformer import short_trainer

    with client_home() as (base, env):
        script = unchanged_client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=2 * 80)
        outputs = [script.parent / "lightning_logs", script.parent / "logs"]
        # Lightning's own default for two devices: its DDP over gloo on the two CPU processes
        env = dict(short_trainer(env, max_steps=8, bar=False), PL_TRAINER_DEVICES="2")
        yield run_pair(script, [], env, outputs, "ltddp", PAUSE_AT, TORCHRUN, ranks=2)


def test_lightning_example_under_torchrun_trains_and_saves_as_without_memtui(
    lightning_torchrun: Pair,
) -> None:
    """``memtui run -- torchrun --nproc_per_node 2 transformer.py`` with Lightning's DDP: both
    ranks in one run; every rank's steps, LRs, forwards and rows, the checkpoint, the hparams
    and the exit status as without memtui."""
    assert_registered(lightning_torchrun, "transformer.py", ranks=2)
    plain, watched = lightning_torchrun.plain, lightning_torchrun.watched
    assert watched.proc.returncode == plain.proc.returncode == 0
    assert sorted(forwards_by_rank(watched)) == [0, 1]
    assert lrs_by_rank(watched) == lrs_by_rank(plain)
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every rank's forwards and rows"
    assert any(r["rows"] for r in watched.records("forward") if r["training"])
    assert_same_lightning_logs(lightning_torchrun)


# ---------------------------------------------------------------------- Accelerate's GPT loop


@pytest.fixture(scope="module")
def lightning_tuned() -> Iterator[Scenario]:
    pytest.importorskip("lightning")
    pytest.importorskip("requests")  # WikiText2 requires it, even for a file already there
    from tests.clients.test_lightning_transformer import EVERY, PLAN, short_trainer

    with client_home() as (base, env):
        script = unchanged_client_script("lightning_transformer", base / "run")
        local_data.wikitext2(script.parent, train_samples=20 * EVERY)
        yield play(script, short_trainer(env), PLAN, memtui_run("lt"))


def test_lightning_example_unchanged_takes_batch_size_and_workers_at_its_next_checkpoint(
    lightning_tuned: Scenario,
) -> None:
    """The explicit lines' scenario with none: Lightning's own DataLoader, taken over by memtui,
    trains 20 x 1 with no worker until the checkpoint at the end of epoch 0 (step 4); 10 x 2 with
    two loader worker processes after it; 20 x 2 after the one at step 8, the LR x2 from there
    (the example has no resume of its own: there is no restart to test)."""
    from tests.clients.test_lightning_transformer import MAX_STEPS, expected_lr

    for reply in lightning_tuned.replies:
        assert reply.returncode == 0, reply.stderr + reply.stdout
    steps = {s.number: s for s in steps_of(lightning_tuned.first)}
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert [steps[n].batches for n in range(1, 5)] == [[20]] * 4
    assert [steps[n].batches for n in range(5, 9)] == [[10, 10]] * 4
    assert [steps[n].batches for n in range(9, MAX_STEPS + 1)] == [[20, 20]] * (MAX_STEPS - 8)
    assert [steps[n].workers for n in range(1, 5)] == [0] * 4
    assert [steps[n].workers for n in range(5, MAX_STEPS + 1)] == [2] * (MAX_STEPS - 4)
    wrong = lr_mismatches(steps_of(lightning_tuned.first), expected_lr)
    assert not wrong, f"(step, LR used, LR expected): {wrong}"


def test_lightning_example_unchanged_trains_every_sample_once_per_epoch_through_the_changes(
    lightning_tuned: Scenario,
) -> None:
    """With no line, through the batch, accumulation and workers changes: each of the 5 epochs
    trains each of the 80 samples exactly once."""
    from tests.clients.test_lightning_transformer import epochs_covered

    found = epochs_covered(lightning_tuned.first)
    assert len(found) == 5, found
    wrong = [c for c in found if not c.exact]
    assert not wrong, f"epochs not trained on each sample exactly once: {found}"


def accelerate_args(steps: int) -> list[str]:
    """The script's arguments of the explicit line's test, for ``steps`` optimizer steps."""
    from tests.clients.test_accelerate_clm import ARGS

    at = ARGS.index("--max_train_steps") + 1
    return [*ARGS[:at], str(steps), *ARGS[at + 1 :]]


@pytest.fixture(scope="module")
def accelerate_pair() -> Iterator[Pair]:
    pytest.importorskip("accelerate")
    with client_home() as (base, env):
        # the manifest's compatibility patch only (transformers 5 removed a telemetry import)
        script = unchanged_client_script("accelerate_clm", base / "run")
        local_data.causal_lm_inputs(script.parent)
        outputs = [script.parent / "out", base / "hf"]
        yield run_pair(script, accelerate_args(8), env, outputs, "gptloop", PAUSE_AT)


def test_accelerate_loop_unchanged_registers_with_its_loader_timed(accelerate_pair: Pair) -> None:
    """A plain loop (an ``Accelerator``, no Trainer): the optimizer's steps and the prepared
    DataLoader's waits."""
    assert_registered(accelerate_pair, "megatron_lm_gpt_pretraining.py", ranks=1)
    metrics = accelerate_pair.status["metrics"]
    assert metrics["data_wait_measured"] is True and metrics["samples_per_s"] > 0, metrics


def test_accelerate_loop_unchanged_logs_trains_and_saves_as_without_memtui(
    accelerate_pair: Pair,
) -> None:
    """Its log records but for timestamps (all on stderr: its stdout is empty both ways), every
    step's batches and LRs, every file ``save_state`` and ``save_pretrained`` wrote byte for byte,
    as many files of its TensorBoard tracker."""
    plain, watched = accelerate_pair.plain, accelerate_pair.watched
    assert watched.output() == plain.output()
    assert watched.errors and plain.errors
    records = accelerate_log_records(watched.errors.read_text())
    assert records == accelerate_log_records(plain.errors.read_text())
    assert any("Saving current state to out/step_8" in r for r in records)
    assert trained(steps_of(watched)) == trained(steps_of(plain))
    assert forwards_by_rank(watched) == forwards_by_rank(plain), "every forward's rows"
    out = watched.workdir / "out"
    plain_out = accelerate_pair.aside[out]
    differ = same_files(plain_out, out, identical)
    # the TensorBoard tracker's directory: its event files and the directory of its hparams are
    # named by wall time and pid; the same files of each kind, each run
    assert all(d.split(": ")[-1].startswith("clm_no_trainer/") for d in differ), differ
    for pattern in ("events.out.tfevents.*", "hparams.yml"):
        tracked = list((out / "clm_no_trainer").rglob(pattern))
        assert tracked and len(tracked) == len(list((plain_out / "clm_no_trainer").rglob(pattern)))
    assert (out / "step_8" / "optimizer.bin").exists() and (out / "model.safetensors").exists()
    assert_no_memtui_line(accelerate_pair)
