"""The hook's hot path in machine instructions: a count that the machine's speed does not move.

Wall-clock timings of a few microseconds move by ±1 µs from one block to the next on a shared
2-core VM (which also runs the same code at two speeds, ~1.8x apart), so they cannot tell a 10%
change of the hook's code. Valgrind's callgrind counts the instructions (and simulated cache
misses) of the training thread alone.

**Every loop in one process.** CPython's method cache is indexed by the addresses of the type
and of the attribute's name, so how many of torch's hot lookups miss it differs from one
process's memory layout to the next: in one comparison a bare process against a hooked one put
8.3k instructions a step on the hook where the same code, counted in one process, gives
6.7-7.1k. Here one process runs, in turn,
the bare loop, the tuner's loader alone, the loader with ``tuner.step()`` (the hook), and a
*floor*: a plain DataLoader through the least a hook could do (two clock reads
and two additions per batch, one clock read and a tuple appended per step: no delivery
accounting, no re-queue, no knob switch; not memtui's code), each in a window opened and closed
with ``callgrind_control`` and dumped on its own, at two lengths: the difference of the two is
the per-step cost, free of the window's own calls. ``--repeat`` processes give the median and
the spread; each first makes a random number of classes, names and allocations, because
valgrind lays every process out the same way (no address randomisation) and the spread would
otherwise hide the layout luck that every real run draws (the same code once counted 6.9k
a step in unrandomised processes and 6.5k-8.2k over randomised ones). After the warm-up the heap
is frozen (``gc.freeze()``), so that a full collection falling in one window does not charge its
steps with all of torch's heap. The hook's own threads run under valgrind too and take the GIL
now and then, so a figure still moves by a few percent.

Prints one JSON line: per loop, the median instructions per step and its spread over the
processes (``instructions_per_step``: bare, loader, hooked, floor), the hook's (hooked minus
bare, each process's own difference), the loader wrapper's and the step call's shares, the
floor's, and first-level instruction- and data-cache misses of the hook. ``--loop function``
measures a batch function bare and through ``tuner.timed_batches`` with ``tuner.step()``
instead. Needs ``valgrind`` on the PATH (not installed by ``make``); without it, says so and
exits 0.

Usage: python benchmarks/hook_instructions.py [--steps N] [--repeat N] [--loop loader|function]
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import benchlib

CHILD = r"""
import gc, os, random
# a layout of its own for each process: valgrind places every process's memory the same way (no
# address randomisation), so without this the processes' spread would hide the method cache's
# layout luck that a real run (randomised) draws: type version tags and interned names shift by
# a random number of classes, names and allocations made before anything else is imported
_draw = random.Random(int.from_bytes(os.urandom(8), "little"))
_layout = (
    [type(f"_L{i}", (), {f"a{i}_{j}": j for j in range(_draw.randrange(30))})
     for i in range(_draw.randrange(1, 400))],
    [bytes(_draw.randrange(1, 2000)) for _ in range(_draw.randrange(1, 300))],
    [f"n{_draw.randrange(10**6)}_{i}" for i in range(_draw.randrange(1, 3000))],
)
import subprocess, sys, tempfile, time
from collections import deque
from types import SimpleNamespace
import torch
from torch.utils.data import DataLoader
from memtui import hooks

torch.set_num_threads(1)
loops = sys.argv[1].split(",")
short, long, rounds = (int(arg) for arg in sys.argv[2:5])
data = list(range(long + 1000))  # every loop starts a fresh epoch


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
perf = time.perf_counter


class Tally:
    __slots__ = ("micro", "step", "wait")

    def __init__(self):
        self.wait, self.micro, self.step = 0.0, 0, 0


tally = Tally()
post = deque(maxlen=16384).append


def floor_batches(loader):
    t0 = perf()
    for item in loader:
        tally.wait += perf() - t0
        tally.micro += 1
        yield item
        t0 = perf()


def floor_step():
    now = perf()
    step = tally.step + 1
    tally.step = step
    post((step, now, tally.wait, tally.micro))


def run(loop, n):
    if loop == "bare":
        for index, _ in enumerate(plain):
            if index == n:
                break
    elif loop == "loader":
        for index, _ in enumerate(wrapped):
            if index == n:
                break
    elif loop == "hooked":
        for index, _ in enumerate(wrapped):
            tuner.step()
            if index == n:
                break
    elif loop == "floor":
        for index, _ in enumerate(floor_batches(plain)):
            floor_step()
            if index == n:
                break
    elif loop == "function-bare":
        for _ in range(n):
            get_batch("train")
    else:  # function-timed
        for _ in range(n):
            timed("train")
            tuner.step()


def control(*args):
    subprocess.run(["callgrind_control", *args, str(os.getpid())], capture_output=True, check=False)


for loop in loops:  # warm-up: the interpreter's specialisation settles
    run(loop, 300)
tuner.step()
# the heap so far (torch's, the layout's) out of the collector's reach: a full collection that
# falls in one window would otherwise charge its steps with traversing all of it (a 200-step
# window of the loader alone once counted 12.2k a step against 4.1k over 1,000)
gc.collect()
gc.freeze()
for index in range(rounds):
    for loop in loops:
        for n in (short, long):
            control("--instr=on")
            run(loop, n)
            control("--instr=off")
            control(f"--dump={loop}-{n}-{index}")
        tuner.step()  # the loader-only loop's open step closes outside the windows
tuner.close()
"""

EVENTS = {"Ir": "instructions", "I1mr": "i1_misses", "D1mr": "d1_read_misses"}
LOOPS = {
    "loader": ("bare", "loader", "hooked", "floor"),
    "function": ("function-bare", "function-timed"),
}
"""The loops each ``--loop`` runs in one process, bare first."""


def _dump(part: Path) -> tuple[str, dict[str, int]]:
    """The window one callgrind dump holds (``dump NAME``) and its event totals."""
    names: list[str] = []
    window = ""
    totals: list[int] = []
    for line in part.read_text().splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith("desc: Trigger: dump "):
            window = line.rsplit(" ", 1)[-1]
        elif line.startswith("totals:"):
            totals = [int(v) for v in line.split()[1:]]
    return window, dict(zip(names, totals, strict=False))


def _one_process(
    loops: tuple[str, ...], short: int, long: int, rounds: int, workdir: Path
) -> dict[str, dict[str, float]]:
    """Per-step events of each loop in one process (the median of its rounds)."""
    env = dict(os.environ)
    env.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtbi", dir="/tmp"))
    env.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtbis", dir="/tmp"))
    out = workdir / "cg.out"
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            "--cache-sim=yes",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-c",
            CHILD,
            ",".join(loops),
            str(short),
            str(long),
            str(rounds),
        ],
        capture_output=True,
        check=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    windows: dict[str, dict[str, int]] = {}
    for part in workdir.glob("cg.out.*-01"):  # thread 1: the training thread
        window, totals = _dump(part)
        if window:
            windows[window] = totals
    per_step: dict[str, dict[str, float]] = {}
    for loop in loops:
        values: dict[str, list[float]] = {key: [] for key in EVENTS}
        for index in range(rounds):
            a, b = windows[f"{loop}-{short}-{index}"], windows[f"{loop}-{long}-{index}"]
            for key in EVENTS:
                values[key].append((b[key] - a[key]) / (long - short))
        per_step[loop] = {key: statistics.median(v) for key, v in values.items()}
    return per_step


def main() -> None:
    """Run ``--repeat`` callgrind processes and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="the longer window's extra steps")
    parser.add_argument("--repeat", type=int, default=4, help="processes (each its own layout)")
    parser.add_argument("--rounds", type=int, default=2, help="windows of each loop per process")
    parser.add_argument(
        "--loop",
        choices=sorted(LOOPS),
        default="loader",
        help="the DataLoader wrapper's path (with the floor) or a batch function's",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print(json.dumps({"skipped": "valgrind is not installed"}))
        return
    loops = LOOPS[args.loop]
    short, long = 300, 300 + args.steps

    def one(_: int) -> dict[str, dict[str, float]]:
        with tempfile.TemporaryDirectory() as tmp:
            return _one_process(loops, short, long, args.rounds, Path(tmp))

    # the processes side by side, one per CPU: instruction counts do not depend on the sharing
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = list(pool.map(one, range(args.repeat)))

    def summary(values: list[float]) -> dict[str, object]:
        return benchlib.spread(values, digits=0)

    result: dict[str, object] = {}
    bare = loops[0]
    result["instructions_per_step"] = {
        loop: summary([r[loop]["Ir"] for r in runs]) for loop in loops
    }
    if args.loop == "loader":
        parts = {"hook": "hooked", "loader_only": "loader", "floor": "floor"}
        for name, loop in parts.items():
            result[f"{name}_instructions_per_step"] = summary(
                [r[loop]["Ir"] - r[bare]["Ir"] for r in runs]
            )
        result["step_call_instructions"] = summary(
            [r["hooked"]["Ir"] - r["loader"]["Ir"] for r in runs]
        )
        for key in ("I1mr", "D1mr"):
            result[f"hook_{EVENTS[key]}_per_step"] = summary(
                [r["hooked"][key] - r[bare][key] for r in runs]
            )
    else:
        result["timed_batches_instructions_per_step"] = summary(
            [r["function-timed"]["Ir"] - r[bare]["Ir"] for r in runs]
        )
    result["steps"] = long - short
    result["processes"] = args.repeat
    result["rounds"] = args.rounds
    result["python"] = sys.version.split()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
