"""The median step of the documented plain loop bare, with memtui, and with a peer profiler.

Each variant runs in a fresh process (its own imports, threads and memory layout) for
``--steps`` timed optimizer steps after a warm-up; a round runs every variant once, in an order
that rotates from round to round, so that a slow minute of the machine falls on each variant
alike. Per variant and round the child reports its median step (wall clock, from the steps'
own end times), its training thread's CPU time per step, and every other thread's CPU time
(``/proc``'s ``schedstat``): the hook's agent and sampler, libzmq's I/O threads, torch's pool.
Each round's overhead is the variant's median step over the bare loop's in the same round; the
output gives the median over the rounds and its spread.

The loop is the plain-loop guide's (``docs/guides/plain-loop.md``): a two-layer MLP, AdamW,
a shuffling ``DataLoader`` over a ``TensorDataset``, two micro-batches per optimizer step; the
hook is installed as that guide does (``hooks.install(args, model=..., optimizer=...)``,
``tuner.loader``, ``tuner.step()``), with nobody attached. The peer is TraceML
(``pip install traceml-ai``), launched the way its documentation says (``traceml run
script``) with its step context (``traceml.trace_step(model)``) around each optimizer step;
without its launcher on the PATH (or ``--traceml``), it is left out and the output says so.

Prints one JSON line. Usage:
    python benchmarks/peer_overhead.py [--rounds N] [--steps N] [--traceml PATH] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib

VARIANTS = ("bare", "memtui", "traceml")


def child(variant: str, steps: int, warmup: int, out: str) -> None:
    """Run the loop in this process and write its figures to ``out`` as JSON."""
    import argparse as _argparse

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    args = _argparse.Namespace(
        batch_size=32, gradient_accumulation_steps=2, num_workers=0, pin_memory=False
    )
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = TensorDataset(torch.randn(10_000, 32), torch.randn(10_000, 1))

    def factory(batch_size: int = 32, num_workers: int = 0, pin_memory: bool = False) -> Any:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=num_workers,
            pin_memory=pin_memory,
        )

    before = benchlib.task_ids()
    tuner: Any = None
    trace_step: Any = None
    if variant == "memtui":
        from memtui import hooks

        state_dir = tempfile.mkdtemp(prefix="peer-overhead-")
        tuner = hooks.install(args, model=model, optimizer=optimizer, state_dir=state_dir)
        loader: Any = tuner.loader(factory)
    else:
        loader = factory()
        if variant == "traceml":
            import traceml_ai

            trace_step = traceml_ai.trace_step
    started = benchlib.snapshot()
    ends: list[float] = []
    cpu_start = 0.0
    micro = done = 0
    step_context: Any = None
    while done < warmup + steps:
        for x, y in loader:
            if trace_step is not None and micro == 0:
                step_context = trace_step(model)
                step_context.__enter__()
            loss = torch.nn.functional.mse_loss(model(x), y) / args.gradient_accumulation_steps
            loss.backward()
            micro += 1
            if micro < args.gradient_accumulation_steps:
                continue
            micro = 0
            optimizer.step()
            optimizer.zero_grad()
            if step_context is not None:
                step_context.__exit__(None, None, None)
            if tuner is not None:
                tuner.step()
            done += 1
            if done == warmup:
                cpu_start = time.thread_time()
                started = benchlib.snapshot()
            if done >= warmup:
                ends.append(time.perf_counter())
            if done >= warmup + steps:
                break
    cpu_s = time.thread_time() - cpu_start
    threads = benchlib.deltas(started, benchlib.snapshot())
    main_tid = os.getpid()  # the training thread is the main thread: its tid is the pid
    others = {
        f"{delta.name}{'' if tid in before else ' (new)'}": round(delta.cpu_s * 1e3, 2)
        for tid, delta in threads.items()
        if tid != main_tid and delta.cpu_s > 0
    }
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    figures = {
        "median_step_us": round(statistics.median(gaps) * 1e6, 2),
        "mean_step_us": round((ends[-1] - ends[0]) / (len(ends) - 1) * 1e6, 2),
        "train_thread_cpu_us_per_step": round(cpu_s / steps * 1e6, 2),
        "other_threads_cpu_ms": others,
    }
    if tuner is not None:
        tuner.close()
    Path(out).write_text(json.dumps(figures))


def run_variant(variant: str, args: argparse.Namespace, traceml: str | None) -> dict[str, Any]:
    """One fresh process of ``variant``; its figures."""
    with tempfile.TemporaryDirectory(prefix="peer-overhead-") as work:
        out = os.path.join(work, "figures.json")
        inner = [
            "--child", variant, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--out", out,
        ]  # fmt: skip
        script = str(Path(__file__).resolve())
        env = dict(os.environ)  # torch's own thread count, as the user's loop would have it
        if variant == "traceml":
            assert traceml is not None
            logs = os.path.join(work, "traceml-logs")
            command = [traceml, "run", script, "--mode", "summary", "--logs-dir", logs,
                       "--args", *inner]  # fmt: skip
        else:
            command = [sys.executable, script, *inner]
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"{variant} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return dict(json.loads(Path(out).read_text()))


def main() -> None:
    """Interleaved rounds of every variant; one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--traceml", default=shutil.which("traceml"))
    parser.add_argument("--quick", action="store_true", help="2 rounds of 300 steps")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup, args.out)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 300, 50
    variants = [v for v in VARIANTS if v != "traceml" or args.traceml]
    load_before = benchlib.loadavg()
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        order = variants[number % len(variants) :] + variants[: number % len(variants)]
        rounds.append({v: run_variant(v, args, args.traceml) for v in order})
    result: dict[str, Any] = {
        "loop": "docs/guides/plain-loop.md: MLP 32-64-1, AdamW, batch 32 x 2 micro-batches",
        "rounds": args.rounds,
        "steps": args.steps,
        "machine": benchlib.cpu_model(),
        "cpus": os.cpu_count(),
        "commit": benchlib.commit(),
        "loadavg_before_after": [load_before, benchlib.loadavg()],
        "torch_threads": os.environ.get("OMP_NUM_THREADS", "torch's default"),
        "peer": "traceml-ai (traceml run, trace_step)" if args.traceml else "not installed",
    }
    for variant in variants:
        steps = [r[variant]["median_step_us"] for r in rounds]
        cpu = [r[variant]["train_thread_cpu_us_per_step"] for r in rounds]
        entry: dict[str, Any] = {
            "median_step_us": benchlib.spread(steps),
            "train_thread_cpu_us_per_step": benchlib.spread(cpu),
            "other_threads_cpu_ms_last_round": rounds[-1][variant]["other_threads_cpu_ms"],
        }
        if variant != "bare":
            over = [
                100 * (r[variant]["median_step_us"] / r["bare"]["median_step_us"] - 1)
                for r in rounds
            ]
            cpu_over = [
                r[variant]["train_thread_cpu_us_per_step"]
                - r["bare"]["train_thread_cpu_us_per_step"]
                for r in rounds
            ]
            entry["overhead_pct"] = benchlib.spread(over, 2)
            entry["train_thread_cpu_extra_us_per_step"] = benchlib.spread(cpu_over, 2)
        result[variant] = entry
    print(json.dumps(result))


if __name__ == "__main__":
    main()
