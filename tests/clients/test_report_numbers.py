"""``memtui report`` says the numbers the training itself logged: two scripts of the corpus,
unchanged, run to their end under ``memtui run --state-dir DIR``, then the summary they left
there read back with ``memtui report DIR --json`` and held against the script's own log
(nanoGPT prints every iteration's number and wall time) and against what the witness read from
outside memtui (every optimizer step, its wall time, the process's resident memory then).

The same steps timed by two clocks a few calls apart agree within a millisecond or 10%; memtui's
peak is the process's high-water mark (it sees inside a step), the witness's the most it read at
a step's start: the peak lies between that and 15% above it."""

from __future__ import annotations

import itertools
import json
import re
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clients import local_data
from tests.clients.harness import ClientRun, client_home, finished, start, unchanged_client_script
from tests.clients.test_nanogpt import CONFIG as NANOGPT_CONFIG

NANOGPT_ITERS = 60
NANOGPT = [
    *(a for a in NANOGPT_CONFIG if not a.startswith(("--max_iters=", "--lr_decay_iters="))),
    f"--max_iters={NANOGPT_ITERS}",
    f"--lr_decay_iters={NANOGPT_ITERS}",
    "--log_interval=1",
]
"""The nanoGPT tests' tiny config, 60 iterations long, each one printed."""
WARMUP = 3
"""The first steps the summary leaves out of its step times (allocations, the loader's start)."""
ITER_LINE = re.compile(r"^iter (\d+): loss [0-9.]+, time ([0-9.]+)ms", re.M)


def memtui_run_into(state: Path, name: str) -> list[str]:
    """``memtui run --name NAME --state-dir STATE --``, to put before a command."""
    return [sys.executable, "-m", "memtui", "run", "--name", name, "--state-dir", str(state), "--"]


def reported(run: ClientRun, state: Path) -> dict[str, Any]:
    """``memtui report STATE --json`` once the run ended."""
    result = run.memtui("report", str(state), "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    return dict(json.loads(result.stdout))


def witnessed_step_times(run: ClientRun) -> list[float]:
    """The wall time between each optimizer step and the next, as the witness timed them (the
    first ``WARMUP`` left out, as the summary leaves them)."""
    starts = [r["t"] for r in run.records("step")]
    return [b - a for a, b in itertools.pairwise(starts)][WARMUP:]


def witnessed_peak(run: ClientRun) -> int:
    """The most resident memory the witness read at any optimizer step."""
    return max(r["rss"] for r in run.records("step"))


def assert_same_median(memtui_s: float, own: list[float]) -> None:
    """memtui's median step time is the script's own, within a millisecond or 10%."""
    median = statistics.median(own)
    assert abs(memtui_s - median) <= max(1e-3, 0.1 * median), (memtui_s, median)


def assert_peak_of(got: dict[str, Any], run: ClientRun) -> None:
    """memtui's peak lies between the most the witness read and 15% above it."""
    peak = got["memory"]["device_peak_bytes"]
    witnessed = witnessed_peak(run)
    assert witnessed * 0.97 <= peak <= witnessed * 1.15, (peak, witnessed)


@pytest.fixture(scope="module")
def nanogpt() -> Iterator[tuple[ClientRun, dict[str, Any]]]:
    pytest.importorskip("numpy")
    with client_home() as (base, env):
        script = unchanged_client_script("nanogpt", base / "run")
        local_data.nanogpt_dataset(script.parent, "tiny")
        state = base / "summary"
        run = start(script, NANOGPT, env, [], "report", memtui_run_into(state, "nanoreport"))
        finished(run)
        yield run, reported(run, state)


def test_nanogpt_report_says_the_iterations_and_step_time_it_printed(
    nanogpt: tuple[ClientRun, dict[str, Any]],
) -> None:
    """nanoGPT prints ``iter N: loss ..., time T ms`` for each of its iterations 0 to 60: the
    report's last step is its 61st optimizer step, every one after the first timed, and its
    median step time is the median of the printed times."""
    run, got = nanogpt
    printed = [(int(n), float(ms) / 1000) for n, ms in ITER_LINE.findall(run.output())]
    assert [n for n, _ in printed] == list(range(NANOGPT_ITERS + 1)), run.tail()
    assert got["ended"] == "ended"
    assert len(printed) == len(run.records("step")) == NANOGPT_ITERS + 1
    # the watch starts at the first optimizer step: the first step has no start to time it from
    times = got["time"]
    assert (times["first_step"], times["last_step"]) == (2, NANOGPT_ITERS + 1)
    assert times["steps"] == NANOGPT_ITERS
    assert_same_median(got["time"]["step_time"]["median_s"], [s for _, s in printed][WARMUP:])
    assert_same_median(got["time"]["step_time"]["median_s"], witnessed_step_times(run))
    assert got["time"]["data_wait_fraction"] is None, "get_batch is no DataLoader: not measured"


def test_nanogpt_report_says_the_peak_the_process_reached(
    nanogpt: tuple[ClientRun, dict[str, Any]],
) -> None:
    _run, got = nanogpt
    assert_peak_of(got, nanogpt[0])
    assert got["memory"]["kind"] == "cpu"


@pytest.fixture(scope="module")
def accelerate_nlp() -> Iterator[tuple[ClientRun, dict[str, Any]]]:
    pytest.importorskip("accelerate")
    pytest.importorskip("datasets")
    pytest.importorskip("evaluate")
    from tests.clients.test_accelerate_nlp import TRAIN_ROWS, VALIDATION_ROWS

    with client_home() as (base, env):
        script = unchanged_client_script("accelerate_nlp", base / "run")
        local_data.mrpc_inputs(script.parent, TRAIN_ROWS, VALIDATION_ROWS)
        state = base / "summary"
        args = ["--checkpointing_steps", "20", "--output_dir", "out"]
        run = start(script, args, env, [], "report", memtui_run_into(state, "nlpreport"))
        finished(run)
        yield run, reported(run, state)


def test_accelerate_nlp_report_says_its_steps_step_time_and_peak(
    accelerate_nlp: tuple[ClientRun, dict[str, Any]],
) -> None:
    """The example's 3 epochs of 40 optimizer steps (640 rows in batches of 16), as many as
    the witness saw; the median of the witnessed step times; the peak it reached; its loader's
    waits measured and its samples counted (16 a step)."""
    from tests.clients.test_accelerate_nlp import BATCH, EPOCHS, TRAIN_ROWS

    run, got = accelerate_nlp
    steps = EPOCHS * TRAIN_ROWS // BATCH
    assert got["ended"] == "ended"
    assert got["time"]["steps"] == len(run.records("step")) == steps
    assert (got["time"]["first_step"], got["time"]["last_step"]) == (1, steps)
    assert_same_median(got["time"]["step_time"]["median_s"], witnessed_step_times(run))
    assert got["time"]["data_wait_fraction"] is not None
    assert got["time"]["samples_per_s"] == pytest.approx(
        steps * BATCH / got["time"]["training_s"], rel=1e-6
    )
    assert_peak_of(got, run)
