"""``memtui run`` on the client corpus's unchanged scripts beside the same scripts with the
explicit integration lines: step time and data wait as memtui records them, per client.

For each client of ``tests/clients`` (nanoGPT ``train.py``, transformers ``run_clm.py``,
Lightning's transformer example, Accelerate's GPT loop) whose upstream files are cached, interleaved
rounds whose order alternates run the script with the integration patch (``python SCRIPT``,
explicit) and unchanged under ``memtui run -- python SCRIPT`` (automatic), the same arguments and
steps, each with ``MEMTUI_RECORD`` set and under the corpus's witness (torch's global optimizer
hooks, the same in both). From each recording: the median step time and data wait of the steps
after the warm-up (data wait over the steps whose batches memtui timed; none timed is "not
measured", not 0); from the witness, outside memtui, the median interval between optimizer steps
over the same steps. Reported per client: both ways, the median over the rounds of the per-run
medians with their min-max and IQR, the ratio automatic / explicit and whether it is within 5%;
the load average before and after.

Each run has its own output directory and memtui state (no run resumes another's); the Hugging Face
datasets cache is shared (it holds the tokenised text, prepared before training starts).

Prints one JSON line, then a Markdown table with ``--table``.
Usage: python benchmarks/run_vs_explicit.py [--rounds N] [--steps N] [--warmup N] [--clients A,B]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the corpus lives in tests/
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as the suite's trainings and torchrun run torch

import benchlib

from memtui.transport.recording import read_recording
from memtui.wire import Decoder, Telemetry
from tests.clients import local_data
from tests.clients.harness import INTEGRATION_PATCH, WITNESS
from tests.clients.upstream import CLIENTS, Manifest, apply_patch, cached, missing


@dataclass
class Client:
    """How one client script is prepared and run for the comparison."""

    name: str
    prepare: Callable[[Path, int], object]
    """Writes the script's local data into its directory, for ``steps`` steps."""
    args: Callable[[int], list[str]]
    """The script's arguments for ``steps`` optimizer steps."""
    outputs: tuple[str, ...]
    """What a run writes into the script's directory (removed before each run)."""
    env: dict[str, str] = field(default_factory=dict)


def nanogpt_args(steps: int) -> list[str]:
    # evaluation (and so a checkpoint) only at the first and the last iteration: the steps
    # compared are training steps
    return [
        "--device=cpu", "--compile=False", "--dtype=float32", "--dataset=tiny",
        "--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--dropout=0.0",
        "--batch_size=8", "--gradient_accumulation_steps=2", f"--max_iters={steps}",
        f"--lr_decay_iters={steps}", f"--eval_interval={steps}", "--eval_iters=2",
        "--warmup_iters=2", "--log_interval=10",
    ]  # fmt: skip


def run_clm_args(steps: int) -> list[str]:
    return [
        "--config_name", "config", "--tokenizer_name", "tokenizer", "--train_file", "train.txt",
        "--validation_file", "val.txt", "--block_size", "32", "--do_train",
        "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
        "--max_steps", str(steps), "--save_steps", str(steps), "--logging_steps", "10",
        "--learning_rate", "1e-3", "--output_dir", "out", "--use_cpu", "--seed", "0",
    ]  # fmt: skip


def accelerate_args(steps: int) -> list[str]:
    return [
        "--config_name", "config", "--tokenizer_name", "tokenizer", "--train_file", "train.txt",
        "--validation_file", "val.txt", "--block_size", "32",
        "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--learning_rate", "1e-3",
        "--max_train_steps", str(steps), "--output_dir", "out", "--seed", "0",
    ]  # fmt: skip


def causal_lm(directory: Path, steps: int) -> None:
    # 263 blocks of 32 tokens: 16 steps of 16 an epoch (the Accelerate loop evaluates at each
    # epoch's end, in the step that follows: an outlier the medians leave out)
    local_data.causal_lm_inputs(directory)


CORPUS = [
    Client("nanogpt", lambda d, s: local_data.nanogpt_dataset(d, "tiny"), nanogpt_args, ("out",)),
    Client("hf_run_clm", causal_lm, run_clm_args, ("out",)),
    Client(
        "lightning_transformer",
        # one epoch of 20-sample batches holds every step: no validation between them
        lambda d, s: local_data.wikitext2(d, train_samples=20 * (s + 1)),
        lambda s: [],
        ("lightning_logs",),
        {"PL_TRAINER_LIMIT_VAL_BATCHES": "2", "PL_TRAINER_LIMIT_TEST_BATCHES": "2"},
    ),
    Client("accelerate_clm", causal_lm, accelerate_args, ("out",)),
]


def script_copy(manifest: Manifest, directory: Path, explicit: bool) -> Path:
    """The client's files in ``directory``: with every patch of the manifest (``explicit``), or
    with its compatibility patches only."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in manifest.files:
        shutil.copyfile(cached(manifest, file), directory / Path(file.path).name)
    for patch in manifest.patches:
        if explicit or patch != INTEGRATION_PATCH:
            apply_patch((CLIENTS / manifest.name / patch).read_text(), directory)
    return directory / manifest.entry


@dataclass
class Measured:
    """One run's figures (seconds; None: not measured)."""

    step_s: float
    data_wait_s: float | None
    witness_step_s: float
    steps: int
    wall_s: float


def recorded_steps(path: Path) -> dict[int, Any]:
    """The step records of rank 0 in a recording, by step number."""
    decoder = Decoder()
    steps: dict[int, Any] = {}
    for frame in read_recording(path).frames:
        message = decoder.decode(frame.frame)
        if isinstance(message, Telemetry) and message.rank == 0:
            for record in message.steps:
                steps[record.step] = record
    return steps


def witness_intervals(path: Path, warmup: int) -> list[float]:
    """Seconds between the witness's consecutive optimizer steps, after ``warmup`` steps."""
    times = [
        record["t"]
        for record in map(json.loads, path.read_text().splitlines())
        if record["kind"] == "step"
    ]
    return [b - a for a, b in zip(times[warmup:], times[warmup + 1 :], strict=False)]


def one_run(
    client: Client, script: Path, steps: int, warmup: int, automatic: bool, base: Path, tag: str
) -> Measured:
    """Run the script once (with its lines, or unchanged under ``memtui run``); its figures."""
    directory = script.parent
    for output in client.outputs:
        shutil.rmtree(directory / output, ignore_errors=True)
    recording, witness = base / f"{tag}.mtrec", base / f"{tag}.witness.jsonl"
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        MEMTUI_RUNTIME_DIR=str(base / "rt"),
        XDG_STATE_HOME=str(base / f"{tag}.state"),
        HF_HOME=str(base / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        PL_TRAINER_MAX_STEPS=str(steps),
        MEMTUI_RECORD=str(recording),
        MEMTUI_WITNESS_OUT=str(witness),
        **client.env,
    )
    launcher = [sys.executable, "-m", "memtui", "run", "--name", tag, "--"] if automatic else []
    command = [*launcher, sys.executable, str(WITNESS), str(script), *client.args(steps)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{tag}: exit status {done.returncode}\n{done.stderr[-3000:]}")
    records = [r for n, r in sorted(recorded_steps(recording).items()) if n > warmup]
    if not records:
        raise SystemExit(f"{tag}: no steps after the warm-up in {recording}")
    timed = [r.data_wait_s for r in records if r.micro_batches > 0]
    return Measured(
        step_s=statistics.median(r.step_time_s for r in records),
        data_wait_s=statistics.median(timed) if timed else None,
        witness_step_s=statistics.median(witness_intervals(witness, warmup)),
        steps=len(records),
        wall_s=wall,
    )


def summary(explicit: list[float | None], automatic: list[float | None]) -> dict[str, Any]:
    """Both ways in ms (median over rounds, min-max, IQR), the ratio and the 5% verdict."""
    sides: dict[str, Any] = {}
    medians: dict[str, float | None] = {}
    for side, values in (("explicit", explicit), ("automatic", automatic)):
        measured = [v * 1e3 for v in values if v is not None]
        sides[f"{side}_ms"] = benchlib.spread(measured, 3) if measured else "not measured"
        medians[side] = statistics.median(measured) if measured else None
    low, high = medians["explicit"], medians["automatic"]
    ratio = round(high / low, 4) if low and high is not None else None
    sides["ratio"] = ratio
    # the two runs of a round ran back to back: their ratio cancels the load drifting over rounds
    paired = [b / a for a, b in zip(explicit, automatic, strict=True) if a and b is not None]
    sides["ratio_per_round"] = benchlib.spread(paired, 4) if paired else None
    sides["within_5pct"] = None if ratio is None else abs(ratio - 1) <= 0.05
    return sides


def markdown(report: dict[str, Any]) -> str:
    """The per-client figures as a Markdown table."""

    def cell(figures: Any) -> str:
        if not isinstance(figures, dict):
            return str(figures)
        return f"{figures['median']:.2f} ({figures['min']:.2f}-{figures['max']:.2f})"

    lines = [
        "| client | metric | explicit ms, median (min-max) | memtui run ms | ratio | "
        "ratio per round (min-max) | within 5% |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in report["clients"].items():
        for metric in ("step_time", "data_wait", "witness_step_interval"):
            figures = result[metric]
            per_round = figures["ratio_per_round"]
            rounds = (
                f"{per_round['min']:.3f}-{per_round['max']:.3f}" if per_round else "not measured"
            )
            lines.append(
                f"| {name} | {metric} | {cell(figures['explicit_ms'])} | "
                f"{cell(figures['automatic_ms'])} | {figures['ratio']} | {rounds} | "
                f"{figures['within_5pct']} |"
            )
    return "\n".join(lines)


def main() -> None:
    """Interleaved rounds per client; one JSON line (and the table with ``--table``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of each run")
    parser.add_argument("--clients", default=",".join(c.name for c in CORPUS))
    parser.add_argument("--table", action="store_true", help="also print a Markdown table")
    args = parser.parse_args()
    wanted = args.clients.split(",")
    base = Path(tempfile.mkdtemp(prefix="mtrve", dir="/tmp"))  # ipc paths must stay short
    report: dict[str, Any] = {
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "machine": benchlib.cpu_model(),
        "cpus": os.cpu_count(),
        "commit": benchlib.commit(),
        "clients": {},
        "skipped": {},
    }
    load_before = benchlib.loadavg()
    try:
        for client in [c for c in CORPUS if c.name in wanted]:
            manifest = Manifest.load(client.name)
            reason = missing(manifest)
            if reason:
                report["skipped"][client.name] = reason
                continue
            scripts = {
                automatic: script_copy(manifest, base / client.name / side, explicit=not automatic)
                for automatic, side in ((False, "explicit"), (True, "automatic"))
            }
            for script in scripts.values():
                client.prepare(script.parent, args.steps)
            runs: dict[bool, list[Measured]] = {False: [], True: []}
            for number in range(args.rounds):
                order = [False, True] if number % 2 == 0 else [True, False]
                for automatic in order:
                    tag = f"{client.name[:8]}-{'auto' if automatic else 'expl'}-{number}"
                    measured = one_run(
                        client, scripts[automatic], args.steps, args.warmup, automatic, base, tag
                    )
                    runs[automatic].append(measured)
            explicit, automatic_runs = runs[False], runs[True]
            report["clients"][client.name] = {
                "step_time": summary(
                    [m.step_s for m in explicit], [m.step_s for m in automatic_runs]
                ),
                "data_wait": summary(
                    [m.data_wait_s for m in explicit], [m.data_wait_s for m in automatic_runs]
                ),
                "witness_step_interval": summary(
                    [m.witness_step_s for m in explicit],
                    [m.witness_step_s for m in automatic_runs],
                ),
                "steps_compared": [m.steps for m in explicit + automatic_runs],
                "wall_s": {
                    "explicit": [round(m.wall_s, 2) for m in explicit],
                    "automatic": [round(m.wall_s, 2) for m in automatic_runs],
                },
            }
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report["loadavg_before_after"] = [load_before, benchlib.loadavg()]
    print(json.dumps(report))
    if args.table:
        print(markdown(report))


if __name__ == "__main__":
    main()
