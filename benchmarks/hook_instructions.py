"""What the hook's hot path costs in machine instructions: a count that does not vary with the VM.

Wall-clock timings of a few microseconds move by ±1 µs from one block to the next on a shared
2-core VM, so they cannot tell a 10% change of the hook's code. Valgrind's callgrind counts the
instructions (and simulated cache misses) of the training thread alone, in a window opened with
``callgrind_control`` after a warm-up, for four runs: bare DataLoader iteration and iteration
through the tuner's loader with ``tuner.step()``, each at two lengths (``--loop function``: a
batch function bare and through ``tuner.timed_batches`` with ``tuner.step()``, a loop without a
DataLoader; ``both``, the default: eight runs); the difference of the two lengths is the
per-step cost, free of start-up and of the window's own calls. The hook's own threads run under
valgrind too and take the GIL from the training thread now and then, so the figure still moves
by a few percent between runs (against ±30% for the wall clock).

Prints one JSON line: ``instructions_per_step_bare``, ``instructions_per_step_hooked``,
``hook_instructions_per_step`` (the difference) and the same for first-level instruction-cache
and data-cache misses (for the batch function: ``timed_batches_instructions_per_step`` and its
kin). Needs ``valgrind`` on the PATH (not installed by ``make``); without it, says so and exits
0.

Usage: python benchmarks/hook_instructions.py [--steps N] [--loop loader|function|both]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import os, subprocess, sys, tempfile
from types import SimpleNamespace
import torch
from torch.utils.data import DataLoader
from memtui import hooks

torch.set_num_threads(1)
mode, steps = sys.argv[1], int(sys.argv[2])
data = list(range(200_000))


def first(batch):
    return batch[0]


def factory(batch_size):
    return DataLoader(data, batch_size=batch_size, collate_fn=first)


tuner = hooks.install(SimpleNamespace(batch_size=1), state_dir=tempfile.mkdtemp(), name="bench")
wrapped = tuner.loader(factory)
plain = factory(1)
batch = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))


def get_batch(split):
    return batch


timed = tuner.timed_batches(get_batch)


def run(n):
    if mode == "bare":
        for index, _ in enumerate(plain):
            if index == n:
                break
    elif mode == "hooked":
        for index, _ in enumerate(wrapped):
            tuner.step()
            if index == n:
                break
    elif mode == "function-bare":
        for _ in range(n):
            get_batch("train")
    else:  # function-timed
        for _ in range(n):
            timed("train")
            tuner.step()


run(300)  # warm-up: the interpreter's specialisation settles
control = ["callgrind_control", "--instr=on", str(os.getpid())]
subprocess.run(control, capture_output=True, check=False)
run(steps)
control[1] = "--instr=off"
subprocess.run(control, capture_output=True, check=False)
tuner.close()
"""

EVENTS = {"Ir": "instructions", "I1mr": "i1_misses", "D1mr": "d1_read_misses"}
LOOPS = {
    "loader": ("bare", "hooked"),
    "function": ("function-bare", "function-timed"),
    "both": ("bare", "hooked", "function-bare", "function-timed"),
}
"""The runs of each ``--loop``: a bare loop and the same through the hook."""


def _main_thread_totals(mode: str, steps: int, workdir: Path) -> dict[str, int]:
    """Callgrind's event totals of the training thread for one run."""
    out = workdir / f"{mode}-{steps}"
    env = dict(os.environ)
    env.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtbi", dir="/tmp"))
    env.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtbis", dir="/tmp"))
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            "--cache-sim=yes",
            f"--callgrind-out-file={out}.%p",
            sys.executable,
            "-c",
            CHILD,
            mode,
            str(steps),
        ],
        capture_output=True,
        check=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    main = next(workdir.glob(f"{mode}-{steps}.*-01"))  # thread 1: the training thread
    names: list[str] = []
    totals: list[int] = []
    for line in main.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith("totals:"):
            totals = [int(v) for v in line.split()[1:]]
    return dict(zip(names, totals, strict=False))


def main() -> None:
    """Run the four callgrind runs and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="the longer run's extra steps")
    parser.add_argument(
        "--loop",
        choices=["loader", "function", "both"],
        default="both",
        help="the DataLoader wrapper's path, a batch function's through tuner.timed_batches, or both",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print(json.dumps({"skipped": "valgrind is not installed"}))
        return
    short, long = 500, 500 + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        per_step: dict[str, dict[str, float]] = {}
        for mode in LOOPS[args.loop]:
            a = _main_thread_totals(mode, short, workdir)
            b = _main_thread_totals(mode, long, workdir)
            per_step[mode] = {key: (b[key] - a[key]) / (long - short) for key in EVENTS}
    result: dict[str, float | int | str] = {}
    for key, name in EVENTS.items():
        if "hooked" in per_step:
            bare, hooked = per_step["bare"][key], per_step["hooked"][key]
            result[f"{name}_per_step_bare"] = round(bare)
            result[f"{name}_per_step_hooked"] = round(hooked)
            result[f"hook_{name}_per_step"] = round(hooked - bare)
        if "function-timed" in per_step:
            bare, timed = per_step["function-bare"][key], per_step["function-timed"][key]
            result[f"function_{name}_per_step_bare"] = round(bare)
            result[f"function_{name}_per_step_timed"] = round(timed)
            result[f"timed_batches_{name}_per_step"] = round(timed - bare)
    result["steps"] = long - short
    result["python"] = sys.version.split()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
