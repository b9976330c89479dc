"""The no-code watch's hot path (``memtui run``) beside the explicit hook's, in one process.

Three loops over the same cheap ``DataLoader`` (one ready tensor a batch) with a one-parameter
SGD step, in interleaved rounds whose order alternates: bare (A), the explicit hook
(``tuner.loader`` and ``tuner.step()``, B), and the automatic watch (a plain ``DataLoader``
whose iterator the watch times, and torch's global optimizer step hook, C). One process, so
that the three share a memory layout (separate processes differ by more than the figure); the
watch is armed before each of its rounds and stood down after it through ``memtui.hooks.auto``'s
own internals, which a script never calls. Prints one JSON line: per loop the median per-step
difference from the bare loop over the rounds, its spread, and the automatic minus the explicit.

``--cpu`` times the training thread's CPU (``time.thread_time``) instead of the wall clock: the
steadier figure on a machine shared with other work.

Usage: python benchmarks/auto_overhead.py [--rounds N] [--steps N] [--quick] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtb", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtbs", dir="/tmp"))

import benchlib
import torch
from torch.utils.data import DataLoader

import memtui.hooks.auto as auto
from memtui import hooks

torch.set_num_threads(1)


def _first(batch: list[Any]) -> Any:
    return batch[0]


def main() -> None:
    """Interleaved rounds of the three loops; one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="4 rounds of 300 steps")
    parser.add_argument("--cpu", action="store_true", help="the training thread's CPU time")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 4, 300
    steps = args.steps
    data = [torch.zeros(8, 4)] * (steps * 4)

    def factory(batch_size: int) -> DataLoader[Any]:
        return DataLoader(data, batch_size=batch_size, collate_fn=_first)

    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1)
    explicit = hooks.install(
        SimpleNamespace(batch_size=1), state_dir=tempfile.mkdtemp(), name="bench-explicit"
    )
    wrapped = explicit.loader(factory)
    plain = factory(1)
    clock = time.thread_time if args.cpu else time.perf_counter

    def bare() -> float:
        start = clock()
        for i, _batch in enumerate(plain):
            optimizer.step()
            if i == steps:
                break
        return (clock() - start) / steps * 1e6

    def with_explicit() -> float:
        start = clock()
        for i, _batch in enumerate(wrapped):
            optimizer.step()
            explicit.step()
            if i == steps:
                break
        return (clock() - start) / steps * 1e6

    def with_watch() -> float:
        auto._watch.stood_down = False
        auto._watch.timing = False  # standing down put torch's own __next__ back: time it again
        auto._on_torch(torch)  # the global step hook and the DataLoader.__iter__ wrapper
        iterator = iter(plain)  # the first iteration: the watch's Tuner, its timed __next__
        start = clock()
        for i, _batch in enumerate(iterator):
            optimizer.step()
            if i == steps:
                break
        took = (clock() - start) / steps * 1e6
        auto._stand_down()
        return took

    for loop in (bare, with_explicit, with_watch):  # warm-up
        loop()
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    load_before = benchlib.loadavg()
    for number in range(args.rounds):
        order = [(bare, a), (with_explicit, b), (with_watch, c)]
        if number % 2:
            order.reverse()
        for loop, out in order:
            out.append(loop())
    watch_tuner = auto._watch.tuner
    explicit_cost = [y - x for x, y in zip(a, b, strict=True)]
    watch_cost = [z - x for x, z in zip(a, c, strict=True)]
    print(
        json.dumps(
            {
                "rounds": args.rounds,
                "steps": steps,
                "clock": "thread CPU" if args.cpu else "wall",
                "machine": benchlib.cpu_model(),
                "commit": benchlib.commit(),
                "loadavg_before_after": [load_before, benchlib.loadavg()],
                "bare_us_per_step": benchlib.spread(a),
                "explicit_us_per_step": benchlib.spread(explicit_cost),
                "watch_us_per_step": benchlib.spread(watch_cost),
                "watch_minus_explicit_us": benchlib.spread(
                    [z - y for y, z in zip(b, c, strict=True)]
                ),
                "explicit_share_of_bare_pct": round(
                    statistics.median(d / x * 100 for d, x in zip(explicit_cost, a, strict=True)),
                    2,
                ),
                "watch_share_of_bare_pct": round(
                    statistics.median(d / x * 100 for d, x in zip(watch_cost, a, strict=True)), 2
                ),
                "watch_steps_counted": watch_tuner.step_count if watch_tuner else None,
            }
        )
    )
    explicit.close()
    if watch_tuner is not None:
        watch_tuner.close()


if __name__ == "__main__":
    main()
