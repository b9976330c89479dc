"""What the hook costs a training loop, measured in one process with interleaved A/B runs.

Three measurements, printed as one JSON line:

1. ``hook_us_per_step``: the training thread's hot path. Interleaved rounds of one-micro-batch
   steps over a cheap DataLoader, bare (A) and through the tuner's loader wrapper with
   ``tuner.step()`` (B); the median per-step difference. ``hook_us_per_step_best`` is the
   difference of the fastest blocks (timeit's convention: the rest is interference), which on
   a noisy VM is the steadier estimate of what the hook's code itself costs.
   ``bare_us_per_step`` is the bare loop's median step, which says how fast the machine ran;
   ``hook_share_of_bare_pct`` the hook's cost as a share of it (round by round, median);
   ``hook_us_per_step_fast_rounds`` the median over the ``fast_rounds`` rounds whose bare loop
   ran within 1.2x of its fastest (``fast_rounds_cost`` says why).
   ``timed_batches_us_per_step`` (and ``_best``): the same for a loop without a DataLoader, a
   batch function bare (A) and through ``tuner.timed_batches`` with ``tuner.step()`` (B).
   ``batch_samples_ns_<kind>``: what counting one batch's samples costs (``batch_samples``, run
   wherever memtui has a batch in hand: a timed batch function, a DataLoader under ``memtui
   run``, the Trainer's micro-batches), ns a call, median of rounds interleaved over the kinds:
   a tensor, a tuple and a list of two, a dict, a dict led by ``input_ids`` and a ``UserDict``
   (a tokenizer's ``BatchEncoding``).
2. ``background_cpu_pct``: CPU time of the hook's two Python threads (agent and sampler) while
   a real training loop runs for ``--background-s`` seconds under one hook, in percent of one
   core (per thread, from /proc's schedstat), with nobody watching (the threads wake once a
   second); ``background_cpu_pct_watched`` the same with a viewer attached (a subscriber in
   its own process that does what ``memtui attach`` does: a hello, then every telemetry frame
   received and decoded; two flushes and one device sample a second). The subscriber is not
   this process's child (``benchlib.Watcher``): the hook counts the training's children as its
   loader workers and samples each, which it never does to a real viewer. Charged in full to
   the training, as if every microsecond of it held the GIL (worst case). ``_all``: every
   thread the hook started, libzmq's I/O threads included (they do not take the GIL). The
   threads are found as those that appeared at ``hooks.install`` (public API only).
3. A real small training loop on the CPU (an MLP, about 1 ms per step), without the hook (A)
   and with it installed the one-line way (B: a fresh ``install`` per block, threads and
   all), in ABBA-ordered blocks: ``loop_samples_per_s_without``/``_with`` and the wall-clock
   ``ab_overhead_pct`` with its 95% confidence interval. On a shared 2-core VM the speed of the
   same block varies by ~10%, so this comparison cannot resolve 0.5%; the interval says so.

``overhead_pct`` = hot path over the loop's step time + background CPU: what the hook takes
from a loop whose step is ``loop_step_ms_without`` long, nobody watching (``_watched``: with a
viewer attached). Targets:
``hook_us_per_step`` <= 2 and ``overhead_pct`` <= 0.5.

**Reproducible figures.** By default the script runs the whole measurement three times
(``--repeat N``), each run a fresh process, and prints every figure as the median of the runs
(the same keys as one run), with ``spread`` (median, min, max, interquartile range of the
runs), ``per_run`` and ``loadavg`` (the 1/5/15-minute load average before and after each
run: a figure taken at a load over 1 on a 2-core machine shares the CPU with something
else). ``--quick`` is one short run.

Usage: python benchmarks/hook_overhead.py [--rounds N] [--repeat N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtb", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtbs", dir="/tmp"))

import benchlib
import psutil
import torch
from torch.utils.data import DataLoader

from memtui import hooks

torch.set_num_threads(1)


def _first(batch: list[Any]) -> Any:
    """The cheapest collate: a loader of ready-made batches, one per step."""
    return batch[0]


def _state_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="mtbd"))


def hot_path(
    rounds: int, steps: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[float], list[float]]:
    """Per-step microseconds of bare iteration (A) and iteration through the hook (B).

    ``clock`` is wall time by default; ``time.thread_time`` counts only the training thread's
    own CPU, which does not depend on what else runs on the machine.
    """
    data = list(range(steps * 4))

    def factory(batch_size: int) -> DataLoader[Any]:
        return DataLoader(data, batch_size=batch_size, collate_fn=_first)

    bare: list[float] = []
    hooked: list[float] = []
    tuner = hooks.install(SimpleNamespace(batch_size=1), state_dir=_state_dir(), name="bench")
    wrapped = tuner.loader(factory)
    plain = factory(1)
    try:
        for _ in range(rounds):
            t0 = clock()
            for index, _batch in enumerate(plain):
                if index == steps:
                    break
            bare.append((clock() - t0) / steps * 1e6)
            t0 = clock()
            for index, _batch in enumerate(wrapped):
                tuner.step()
                if index == steps:
                    break
            hooked.append((clock() - t0) / steps * 1e6)
    finally:
        tuner.close()
    return bare, hooked


FAST_ROUND = 1.2
"""A round is a fast one when its bare loop ran within this factor of the fastest bare round."""


def fast_rounds_cost(bare: list[float], hooked: list[float]) -> tuple[float, int]:
    """The hook's median cost over the rounds whose bare loop ran at this machine's usual
    speed (within ``FAST_ROUND`` of the fastest), and how many rounds those were.

    A shared VM can run the same bare loop at two speeds (on a 2-core one, ~11-13 µs a step or
    ~21-26 µs: its host's contention, which the load average does not show), and the hook's cost
    moves with it (15-20% of the bare step either way), so the median over all rounds says which
    speed the machine ran at as much as what the hook costs. Conditioning on the bare round can only
    overstate the cost: a hooked round after a fast bare one is sometimes already slow, never
    faster.
    """
    limit = FAST_ROUND * min(bare)
    diffs = [h - b for h, b in zip(hooked, bare, strict=True) if b <= limit]
    return (statistics.median(diffs) if diffs else float("nan")), len(diffs)


def batch_function_path(
    rounds: int, steps: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[float], list[float]]:
    """Per-step microseconds of a bare batch function (A) and of the same function through
    ``tuner.timed_batches`` with ``tuner.step()`` (B): nanoGPT's ``get_batch`` loop, one
    micro-batch a step, the batch a ready-made pair of tensors."""
    batch = (torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long))

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        return batch

    bare: list[float] = []
    hooked: list[float] = []
    tuner = hooks.install(SimpleNamespace(batch_size=8), state_dir=_state_dir(), name="bench")
    timed = tuner.timed_batches(get_batch)
    try:
        for _ in range(rounds):
            t0 = clock()
            for _ in range(steps):
                get_batch("train")
            bare.append((clock() - t0) / steps * 1e6)
            t0 = clock()
            for _ in range(steps):
                timed("train")
                tuner.step()
            hooked.append((clock() - t0) / steps * 1e6)
    finally:
        tuner.close()
    return bare, hooked


def count_path(rounds: int, calls: int = 20_000) -> dict[str, float]:
    """ns a ``batch_samples`` call for each kind of batch, the median of ``rounds`` rounds that
    each time every kind in turn (the order reversed every other round)."""
    import collections

    from memtui.hooks.batches import batch_samples

    rows = torch.zeros(16, 32, dtype=torch.long)
    kinds: dict[str, Any] = {
        "tensor": rows,
        "tuple": (rows, rows),
        "list": [rows, rows],
        "dict": {"x": rows, "y": rows},
        "dict_input_ids": {"input_ids": rows, "attention_mask": rows},
        "userdict": collections.UserDict({"input_ids": rows, "attention_mask": rows}),
    }
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    order = list(kinds)
    for index in range(rounds):
        for kind in order if index % 2 == 0 else reversed(order):
            batch = kinds[kind]
            t0 = time.perf_counter()
            for _ in range(calls):
                batch_samples(batch)
            times[kind].append((time.perf_counter() - t0) / calls * 1e9)
    return {kind: statistics.median(found) for kind, found in times.items()}


def _thread_cpu_s(native_ids: set[int]) -> float:
    """CPU seconds used so far by the threads with these native ids.

    Linux's scheduler statistics count on-CPU nanoseconds; the clock-tick counters (psutil's
    per-thread times, 10 ms ticks) miss threads that wake for ~100 us at 10 Hz, so they are only
    the fallback.
    """
    total = 0.0
    for tid in native_ids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stats:
                total += int(stats.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            return sum(
                t.user_time + t.system_time
                for t in psutil.Process().threads()
                if t.id in native_ids
            )
    return total


class Loop:
    """A small MLP trained on in-memory batches: about 1 ms per optimizer step on one core.

    ``calibrated`` picks the batch that makes a step last ``step_ms`` on this machine (the
    targets are stated for a ~1 ms step; a faster CPU would otherwise halve the step and double
    every percentage).
    """

    @classmethod
    def calibrated(cls, step_ms: float = 1.0) -> Loop:
        """A loop whose step takes about ``step_ms`` here (batch scaled from a trial run)."""
        batch = 64
        for _ in range(3):
            loop = cls(batch=batch)
            loop.run(30, False)
            measured_ms = 1e3 * min(loop.run(200, False) for _ in range(3))
            if abs(measured_ms / step_ms - 1) < 0.1:
                break
            batch = max(8, min(4096, round(batch * step_ms / measured_ms)))
        return loop

    def __init__(self, width: int = 256, batch: int = 64) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.batches = [(torch.randn(batch, width), torch.randn(batch, 1)) for _ in range(64)]
        self.batch = batch

    def factory(self, batch_size: int) -> DataLoader[Any]:
        return DataLoader(self.batches, batch_size=batch_size, collate_fn=_first)

    def run(self, steps: int, with_hook: bool) -> float:
        """Seconds per step over ``steps`` timed steps (after a short untimed warm-up)."""
        tuner = None
        if with_hook:
            tuner = hooks.install(
                SimpleNamespace(batch_size=1), state_dir=_state_dir(), name="bench"
            )
            loader: Any = tuner.loader(self.factory)
        else:
            loader = self.factory(1)
        warmup = 20
        done = -warmup
        t0 = time.perf_counter()
        while done < steps:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(self.model(x), y)
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                if tuner is not None:
                    tuner.step()
                done += 1
                if done == 0:
                    t0 = time.perf_counter()
                if done == steps:
                    break
        elapsed = time.perf_counter() - t0
        if tuner is not None:
            tuner.close()
        return elapsed / steps


def background(loop: Loop, seconds: float, watcher: benchlib.Watcher | None) -> tuple[float, float]:
    """The hook threads' CPU in percent of a core over ``seconds`` of training under one hook:
    its Python threads (agent and sampler), and all the threads it started (with libzmq's).

    The threads are found as those that appeared when the hook was installed (the public API
    only: the figure does not depend on how the hook stores them). ``watcher``: a viewer-like
    subscriber in its own process is attached for the measurement.
    """
    python_before = {t.native_id for t in threading.enumerate()}
    tasks_before = benchlib.task_ids()
    tuner = hooks.install(SimpleNamespace(batch_size=1), state_dir=_state_dir(), name="bench")
    loader: Any = tuner.loader(loop.factory)
    try:
        if watcher is not None:
            watcher.watch(tuner.run_id)
        python_ids = {
            t.native_id
            for t in threading.enumerate()
            if t.native_id is not None and t.native_id not in python_before
        }
        ids = benchlib.task_ids() - tasks_before
        start = time.perf_counter()
        cpu0, all0 = _thread_cpu_s(python_ids), _thread_cpu_s(ids)
        while time.perf_counter() - start < seconds:
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(loop.model(x), y)
                loss.backward()
                loop.optimizer.step()
                loop.optimizer.zero_grad(set_to_none=True)
                tuner.step()
        cpu, cpu_all = _thread_cpu_s(python_ids) - cpu0, _thread_cpu_s(ids) - all0
        elapsed = time.perf_counter() - start
        if watcher is not None:
            watcher.unwatch()
        return 100 * cpu / elapsed, 100 * cpu_all / elapsed
    finally:
        tuner.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One run of the three measurements."""
    rounds = 4 if args.quick else args.rounds
    hot_steps = 500  # short blocks, many of them: a block hit by interference is one of many
    loop_steps = 100 if args.quick else 1000

    bare, hooked = hot_path(rounds * 10, hot_steps)
    hot_us = statistics.median(h - b for h, b in zip(hooked, bare, strict=True))
    best_us = min(hooked) - min(bare)
    fast_us, fast_rounds = fast_rounds_cost(bare, hooked)
    bare_fn, timed_fn = batch_function_path(rounds * 10, hot_steps)
    timed_us = statistics.median(h - b for h, b in zip(timed_fn, bare_fn, strict=True))
    counts = count_path(rounds * 2)

    loop = Loop.calibrated(1.0)
    loop.run(50, False)
    loop.run(50, True)
    pairs: list[tuple[float, float]] = []
    for index in range(rounds):
        order = (False, True) if index % 2 == 0 else (True, False)
        times = {flag: loop.run(loop_steps, flag) for flag in order}
        pairs.append((times[False], times[True]))
    without = [a for a, _ in pairs]
    with_hook = [b for _, b in pairs]
    ratios = [b / a - 1 for a, b in pairs]
    mean = statistics.fmean(ratios)
    half = 1.96 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    step_s = statistics.median(without)
    seconds = 3.0 if args.quick else args.background_s
    background_pct, background_all = background(loop, seconds, None)
    with benchlib.Watcher() as watcher:
        watched_pct, watched_all = background(loop, seconds, watcher)
    hot_pct = 100 * hot_us * 1e-6 / step_s
    result = {
        "hook_us_per_step": round(hot_us, 3),
        "hook_us_per_step_best": round(best_us, 3),
        "hook_us_per_step_fast_rounds": round(fast_us, 3),
        "fast_rounds": fast_rounds,
        "bare_us_per_step": round(statistics.median(bare), 3),
        "hook_share_of_bare_pct": round(
            100 * statistics.median(h / b - 1 for h, b in zip(hooked, bare, strict=True)), 2
        ),
        "timed_batches_us_per_step": round(timed_us, 3),
        "timed_batches_us_per_step_best": round(min(timed_fn) - min(bare_fn), 3),
        **{f"batch_samples_ns_{kind}": round(ns, 1) for kind, ns in counts.items()},
        "background_cpu_pct": round(background_pct, 3),
        "background_cpu_pct_watched": round(watched_pct, 3),
        "background_cpu_pct_all": round(background_all, 3),
        "background_cpu_pct_all_watched": round(watched_all, 3),
        "loop_step_ms_without": round(step_s * 1e3, 4),
        "hot_path_pct": round(hot_pct, 3),
        "overhead_pct": round(hot_pct + background_pct, 3),
        "overhead_pct_watched": round(hot_pct + watched_pct, 3),
        "loop_samples_per_s_without": round(loop.batch / step_s, 1),
        "loop_samples_per_s_with": round(loop.batch / statistics.median(with_hook), 1),
        "ab_overhead_pct": round(100 * mean, 2),
        "ab_overhead_ci95_pct": round(100 * half, 2),
        "rounds": rounds,
        "loop_steps_per_block": loop_steps,
        "loop_batch": loop.batch,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": benchlib.cpu_model(),
        "commit": benchlib.commit(),
    }
    return result


def repeated(args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    """``repeat`` runs, each a fresh process, one after the other; every figure as the median
    of the runs (the same keys as one run) with its spread, and the load each run ran under."""
    forwarded = ["--rounds", str(args.rounds), "--background-s", str(args.background_s)]
    if args.quick:
        forwarded.append("--quick")
    runs: list[dict[str, Any]] = []
    for index in range(repeat):
        load_before = benchlib.loadavg()
        out = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *forwarded, "--repeat", "1"],
            capture_output=True,
            text=True,
            check=True,
        )
        run = json.loads(out.stdout.strip().splitlines()[-1])
        run["loadavg_before"], run["loadavg_after"] = load_before, benchlib.loadavg()
        runs.append(run)
        print(
            f"run {index + 1}/{repeat}: hook {run['hook_us_per_step']} us/step"
            f" (best {run['hook_us_per_step_best']}, fast rounds"
            f" {run['hook_us_per_step_fast_rounds']} in {run['fast_rounds']}; bare"
            f" {run['bare_us_per_step']}, +{run['hook_share_of_bare_pct']}%), timed batch function"
            f" {run['timed_batches_us_per_step']} (best {run['timed_batches_us_per_step_best']}),"
            f" overhead {run['overhead_pct']}%"
            f" / watched {run['overhead_pct_watched']}%, A/B {run['ab_overhead_pct']}%"
            f" +- {run['ab_overhead_ci95_pct']}; load {load_before[0]} -> {run['loadavg_after'][0]}",
            file=sys.stderr,
            flush=True,
        )
    numeric = [k for k, v in runs[0].items() if isinstance(v, int | float) and k != "cpus"]
    result: dict[str, Any] = {k: v for k, v in runs[0].items() if k not in numeric}
    result.update({k: round(statistics.median(r[k] for r in runs), 4) for k in numeric})
    result["runs"] = repeat
    result["spread"] = {k: benchlib.spread([r[k] for r in runs]) for k in SPREAD_KEYS}
    result["loadavg"] = [[r["loadavg_before"], r["loadavg_after"]] for r in runs]
    result["per_run"] = [{k: r[k] for k in SPREAD_KEYS} for r in runs]
    for key in ("loadavg_before", "loadavg_after"):
        result.pop(key, None)
    return result


SPREAD_KEYS = [
    "hook_us_per_step",
    "hook_us_per_step_best",
    "hook_us_per_step_fast_rounds",
    "fast_rounds",
    "bare_us_per_step",
    "hook_share_of_bare_pct",
    "timed_batches_us_per_step",
    "timed_batches_us_per_step_best",
    "background_cpu_pct",
    "background_cpu_pct_watched",
    "background_cpu_pct_all",
    "background_cpu_pct_all_watched",
    "overhead_pct",
    "overhead_pct_watched",
    "loop_step_ms_without",
    "ab_overhead_pct",
    "ab_overhead_ci95_pct",
]


def main() -> None:
    """Run the measurements (``--repeat`` times) and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (numbers are noisy)")
    parser.add_argument("--background-s", type=float, default=20.0)
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="runs, each in a fresh process, summarised by their median and spread"
        " (default: 3; 1 with --quick)",
    )
    args = parser.parse_args()
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if repeat > 1:
        result = repeated(args, repeat)
    else:
        load_before = benchlib.loadavg()
        result = measure(args)
        result["loadavg_before"], result["loadavg_after"] = load_before, benchlib.loadavg()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
