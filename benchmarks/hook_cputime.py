"""What the hook adds to a nanoGPT-shaped training loop, as CPU time per thread and as step time.

The comparison a user makes (their loop with and without memtui), measured in what does not
depend on the rest of a shared machine: the CPU time of every thread of the process per
optimizer step (from ``/proc/self/task/*/schedstat``: the training thread, the threads the hook
started, the rest), and the training thread's stall, its step time at p50 and p99 (and how much
of each step it spent off the CPU, split by ``schedstat`` into runnable, waiting for a core that
another thread or process had, and asleep: this loop makes no blocking call, so asleep is
waiting for the GIL). Each step also counts the training thread's voluntary context switches
(``getrusage(RUSAGE_THREAD)``, which keeps the GIL): the steps that waited for the GIL, how
many, and how much later they ended than a step that did not.

The training thread's own CPU per step cannot resolve the hook's hot path (a few microseconds
in a ~6 ms step; the rounds differ by ~2%): ``hook_overhead.py`` measures that part. What
this benchmark resolves is the CPU of the hook's threads and the GIL waits they cause.

The loop is nanoGPT's ``train.py`` in small: the config is module globals (``batch_size``,
``gradient_accumulation_steps``, ``block_size``, ... found by ``hooks.install(globals())``), a
micro-step accumulation loop with gradient clipping and AdamW, a ``torch.utils.data.DataLoader``
over a synthetic token dataset (wrapped by ``tuner.loader``), a 2-layer GPT, one torch thread.

Arms, one round each in a rotating order (so drift and other processes hit every arm alike):

- ``bare``: the loop without memtui;
- ``unwatched``: ``hooks.install(globals())`` and ``tuner.loader``, ``tuner.step()``,
  ``tuner.checkpoint()`` every ``eval_interval`` steps, nobody watching;
- ``watched``: the same with a viewer attached: a separate process that does what
  ``memtui attach`` does (hello on the control socket, a SUB on the telemetry socket, every
  frame decoded), so the hook runs at its watched rates.

Every hooked round installs a fresh hook, warms up, then measures; ``--switch-intervals-ms``
repeats every arm at other GIL switch intervals (``sys.setswitchinterval``). For each metric
the output gives every arm's median over the rounds with min-max, and each hooked arm's
difference from the bare arm of the same round: mean with its 95% t-interval, median with a
bootstrap interval. The load average before and after is part of the output.

Prints a table on stderr and one JSON line on stdout.

Usage: python benchmarks/hook_cputime.py [--rounds N] [--steps N] [--quick]
                                          [--switch-intervals-ms 5,0.5]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtb", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtbs", dir="/tmp"))

import benchlib
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from memtui import hooks

RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", 1)  # Linux

# ------------------------------------------------------------------ config (nanoGPT-style globals)
batch_size = 4
gradient_accumulation_steps = 2
block_size = 32
n_layer = 2
n_head = 4
n_embd = 64
vocab_size = 256
dropout = 0.0
bias = False
learning_rate = 6e-4
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
num_workers = 0
pin_memory = False
eval_interval = 250  # the checkpoint boundary (nothing is saved here)
dataset_tokens = 200_000
seed = 1337

torch.set_num_threads(1)


# ------------------------------------------------------------------ the model (nanoGPT's, small)
class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q = q.view(b, t, n_head, c // n_head).transpose(1, 2)
        k = k.view(b, t, n_head, c // n_head).transpose(1, 2)
        v = v.view(b, t, n_head, c // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A synthetic token stream; item ``i`` is the block at ``i`` and its shift by one."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (dataset_tokens,), generator=generator)

    def __len__(self) -> int:
        return len(self.data) - block_size - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i : i + block_size], self.data[i + 1 : i + 1 + block_size]


DATASET = Tokens()


def make_loader(batch_size: int, num_workers: int, pin_memory: bool) -> DataLoader[Any]:
    """The loader factory (memtui rebuilds the loader through it when a knob changes)."""
    return DataLoader(
        DATASET,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )


# ------------------------------------------------------------------ the training loop
def train(
    model: GPT,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    tuner: hooks.Tuner | None,
    steps: int,
    walls: list[float],
    cpus: list[float],
    waits: list[int],
) -> None:
    """``steps`` optimizer steps of nanoGPT's loop; each step's wall and training-thread CPU
    seconds go to ``walls`` and ``cpus``, and the training thread's voluntary context switches
    in the step to ``waits`` (the loop makes no blocking call: each one is a wait for the GIL).
    The same code in every arm."""
    clock, cpu_clock = time.perf_counter, time.thread_time
    micro = done = 0
    t_prev, c_prev, s_prev = clock(), cpu_clock(), _switches()
    while done < steps:
        for x, y in loader:
            _, loss = model(x, y)
            loss = loss / gradient_accumulation_steps  # read each time: the hook may change it
            loss.backward()
            micro += 1
            if micro < gradient_accumulation_steps:
                continue
            micro = 0
            if grad_clip != 0.0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if tuner is not None:
                tuner.step()
                if tuner.step_count % eval_interval == 0:
                    tuner.checkpoint()  # nanoGPT saves here; nothing is pending
            now, cpu, switched = clock(), cpu_clock(), _switches()
            walls[done] = now - t_prev
            cpus[done] = cpu - c_prev
            waits[done] = switched - s_prev
            t_prev, c_prev, s_prev = now, cpu, switched
            done += 1
            if done == steps:
                break


def _switches() -> int:
    """This thread's voluntary context switches so far (one system call; it keeps the GIL)."""
    return resource.getrusage(RUSAGE_THREAD).ru_nvcsw


def make_model() -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, betas=(beta1, beta2), weight_decay=weight_decay
    )
    return model, optimizer


# ------------------------------------------------------------------ one round of one arm
def run_arm(
    mode: str,
    switch_s: float,
    steps: int,
    warmup: int,
    model: GPT,
    optimizer: torch.optim.Optimizer,
    watcher: benchlib.Watcher | None,
) -> dict[str, float]:
    """Install (or not), warm up, measure ``steps`` steps; the round's per-step figures."""
    default_switch = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    walls, cpus, waits = [0.0] * steps, [0.0] * steps, [0] * steps
    before_install = benchlib.task_ids()
    tuner = None
    frames = 0
    try:
        if mode == "bare":
            loader: Any = make_loader(batch_size, num_workers, pin_memory)
        else:
            state = tempfile.mkdtemp(prefix="mtbd")
            tuner = hooks.install(globals(), state_dir=state, name="bench")
            loader = tuner.loader(make_loader)
            if mode == "watched":
                assert watcher is not None
                watcher.watch(tuner.run_id)
        train(model, optimizer, loader, tuner, warmup, [0.0] * warmup, [0.0] * warmup, [0] * warmup)
        gc.collect()
        start = benchlib.snapshot()
        # the threads the hook started (install, the loader, the viewer's arrival, the warm-up)
        hook_tids = set() if tuner is None else set(start) - before_install
        t0 = time.perf_counter()
        train(model, optimizer, loader, tuner, steps, walls, cpus, waits)
        elapsed = time.perf_counter() - t0
        end = benchlib.snapshot()
        if mode == "watched" and watcher is not None:
            frames = int(watcher.unwatch()["frames"])
    finally:
        if tuner is not None:
            tuner.close()
        sys.setswitchinterval(default_switch)
    per = benchlib.deltas(start, end)
    main = per[os.getpid()]
    hook = [d for tid, d in per.items() if tid in hook_tids]
    other = [d for tid, d in per.items() if tid != os.getpid() and tid not in hook_tids]
    hook_cpu = sum(d.cpu_s for d in hook)
    hook_slices = sum(d.slices for d in hook)
    off = [w - c for w, c in zip(walls, cpus, strict=True)]
    calm = [o for o, n in zip(off, waits, strict=True) if n == 0]
    base_off = statistics.median(calm) if calm else 0.0
    # what a GIL wait costs the step it falls in: its off-CPU time beyond a calm step's
    waited = [o - base_off for o, n in zip(off, waits, strict=True) if n > 0]
    us = 1e6 / steps
    result = {
        "train_cpu_us": main.cpu_s * us,
        "hook_cpu_us": hook_cpu * us,
        "other_cpu_us": sum(d.cpu_s for d in other) * us,
        "process_cpu_us": sum(d.cpu_s for d in per.values()) * us,
        "step_ms_p50": 1e3 * statistics.median(walls),
        "step_ms_p99": 1e3 * benchlib.percentile(walls, 99),
        "step_ms_max": 1e3 * max(walls),
        "step_ms_mean": 1e3 * elapsed / steps,
        "offcpu_us_mean": 1e6 * statistics.fmean(off),
        # off the CPU: runnable and waiting for a core (another thread or process had it), or
        # asleep (this loop makes no blocking call: waiting for the GIL)
        "train_runnable_us": main.runnable_s * us,
        "train_asleep_us": max(0.0, elapsed - main.cpu_s - main.runnable_s) * us,
        "offcpu_us_p99": 1e6 * benchlib.percentile(off, 99),
        "train_gil_waits_per_1k_steps": 1000 * main.voluntary / steps,
        "steps_with_gil_wait_per_1k": 1000 * len(waited) / steps,
        "gil_wait_step_delay_us_median": 1e6 * statistics.median(waited) if waited else 0.0,
        "gil_wait_step_delay_us_max": 1e6 * max(waited) if waited else 0.0,
        "train_preempted_per_1k_steps": 1000 * main.involuntary / steps,
        "hook_wakeups_per_s": hook_slices / elapsed,
        "hook_cpu_pct_of_core": 100 * hook_cpu / elapsed,
        "hook_cpu_us_per_wakeup": 1e6 * hook_cpu / hook_slices if hook_slices else 0.0,
        "frames_per_s": frames / elapsed,
    }
    for d in hook:  # per hook thread: which one costs what
        key = "hook_thread_cpu_us." + d.name.replace(" ", "_")
        result[key] = result.get(key, 0.0) + d.cpu_s * us
    return result


# ------------------------------------------------------------------ summary
METRICS = [
    ("train_cpu_us", "training thread CPU, us/step"),
    ("hook_cpu_us", "hook threads CPU, us/step"),
    ("other_cpu_us", "other threads CPU, us/step"),
    ("process_cpu_us", "process CPU (all threads), us/step"),
    ("step_ms_p50", "step time p50, ms"),
    ("step_ms_p99", "step time p99, ms"),
    ("step_ms_max", "step time max, ms"),
    ("offcpu_us_mean", "training thread off-CPU, us/step (mean)"),
    ("offcpu_us_p99", "training thread off-CPU, us/step (p99)"),
    ("train_runnable_us", "training thread runnable, waiting for a core, us/step"),
    ("train_asleep_us", "training thread asleep (waiting for the GIL), us/step"),
    ("train_gil_waits_per_1k_steps", "training thread GIL waits (voluntary switches) /1k steps"),
    ("steps_with_gil_wait_per_1k", "steps with a GIL wait /1k steps"),
    ("gil_wait_step_delay_us_median", "such a step's extra off-CPU time, us (median)"),
    ("gil_wait_step_delay_us_max", "such a step's extra off-CPU time, us (max)"),
    ("train_preempted_per_1k_steps", "training thread preemptions /1k steps"),
    ("hook_wakeups_per_s", "hook threads on-CPU slices /s"),
    ("hook_cpu_us_per_wakeup", "hook CPU per slice, us"),
    ("hook_cpu_pct_of_core", "hook threads, % of a core"),
]


def summarize(
    rounds: list[dict[str, dict[str, float]]], arms: list[str]
) -> dict[str, dict[str, Any]]:
    """Per metric: each arm's spread over rounds, each hooked arm's paired difference to bare."""
    keys = [k for k, _ in METRICS] + sorted(
        {k for r in rounds for a in r.values() for k in a if k.startswith("hook_thread_cpu_us.")}
    )
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        entry: dict[str, Any] = {}
        for arm in arms:
            entry[arm] = benchlib.spread([r[arm].get(key, 0.0) for r in rounds])
            mode, _, interval = arm.partition("@")
            if mode != "bare":
                base = f"bare@{interval}"
                diffs = [r[arm].get(key, 0.0) - r[base].get(key, 0.0) for r in rounds]
                entry[f"{arm}-bare"] = benchlib.paired(diffs)
        out[key] = entry
    return out


def _fmt(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def table(summary: dict[str, dict[str, Any]], arms: list[str]) -> str:
    """A text table: median [min-max] of each arm, and hook - bare with its 95% CI."""
    lines = []
    for key, title in METRICS:
        entry = summary[key]
        lines.append(title)
        for arm in arms:
            s = entry[arm]
            text = f"  {arm:<16} {_fmt(s['median']):>8}  [{_fmt(s['min'])} - {_fmt(s['max'])}]"
            diff = entry.get(f"{arm}-bare")
            if diff is not None:
                text += (
                    f"   diff {_fmt(diff['mean'])} +- {_fmt(diff['ci95'])}"
                    f" (median {_fmt(diff['median'])})"
                )
            lines.append(text)
    return "\n".join(lines)


def _pct(x: float | None, of: float) -> float | None:
    return None if x is None or not of else round(100 * x / of, 3)


QUICK_WINDOW_S = 1.0
"""The shortest measured window of a ``--quick`` arm, in seconds."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=500, help="measured steps per arm per round")
    parser.add_argument("--warmup", type=int, default=30, help="untimed steps after install")
    parser.add_argument(
        "--switch-intervals-ms",
        default="",
        help="GIL switch intervals to try, comma-separated (default: the interpreter's, 5)",
    )
    parser.add_argument(
        "--modes", default="bare,unwatched,watched", help="arms (bare is always included)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (<20 s, noisy)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 30, 5
    intervals = [float(x) / 1e3 for x in args.switch_intervals_ms.split(",") if x.strip()] or [
        sys.getswitchinterval()
    ]
    modes = ["bare", *[m for m in args.modes.split(",") if m and m != "bare"]]
    arms = [f"{m}@{1e3 * s:g}ms" for s in intervals for m in modes]

    load_before = benchlib.loadavg()
    started = time.time()
    model, optimizer = make_model()
    watcher = benchlib.Watcher() if "watched" in modes else None
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        warm = make_loader(batch_size, num_workers, pin_memory)
        warm_walls = [0.0] * 20
        train(model, optimizer, warm, None, 20, warm_walls, [0.0] * 20, [0] * 20)
        if args.quick:
            # each window at least a second long: the hook's threads wake once or twice a
            # second, so a shorter window (30 steps of 7 ms on a fast VM) can hold no wake-up
            args.steps = max(args.steps, math.ceil(QUICK_WINDOW_S / statistics.median(warm_walls)))
        for index in range(args.rounds):
            shift = index % len(arms)
            order = arms[shift:] + arms[:shift]
            results = {}
            for arm in order:
                mode, _, interval = arm.partition("@")
                switch_s = float(interval.removesuffix("ms")) / 1e3
                results[arm] = run_arm(
                    mode, switch_s, args.steps, args.warmup, model, optimizer, watcher
                )
            rounds.append(results)
            print(
                f"round {index + 1}/{args.rounds}: "
                + ", ".join(
                    f"{arm} p50 {results[arm]['step_ms_p50']:.2f} ms"
                    f" hook {results[arm]['hook_cpu_us']:.1f} us"
                    for arm in arms
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        if watcher is not None:
            watcher.close()
    load_after = benchlib.loadavg()
    summary = summarize(rounds, arms)
    bare = arms[0]
    step_ms = summary["step_ms_p50"][bare]["median"]
    overhead = {}
    for arm in arms:
        if arm.startswith("bare@"):
            continue
        base = "bare@" + arm.partition("@")[2]
        cpu_base = summary["process_cpu_us"][base]["median"]
        step_base = summary["step_ms_p50"][base]["median"]
        cpu_diff = summary["process_cpu_us"][f"{arm}-bare"]
        step_diff = summary["step_ms_p50"][f"{arm}-bare"]

        overhead[arm] = {
            # what the hook's own threads took, against the bare process's CPU per step
            "hook_threads_cpu_pct": _pct(summary["hook_cpu_us"][arm]["median"], cpu_base),
            # the process's CPU per step, hook minus bare: mean of the rounds and its 95% CI
            "process_cpu_pct": _pct(cpu_diff["mean"], cpu_base),
            "process_cpu_pct_ci95": _pct(cpu_diff["ci95"], cpu_base),
            # the median step time, hook minus bare: median of the rounds, mean and its CI
            "step_p50_pct_median": _pct(step_diff["median"], step_base),
            "step_p50_pct_mean": _pct(step_diff["mean"], step_base),
            "step_p50_pct_ci95": _pct(step_diff["ci95"], step_base),
            # the training thread asleep on the GIL, hook minus bare, per step
            "gil_asleep_pct": _pct(summary["train_asleep_us"][f"{arm}-bare"]["mean"], cpu_base),
        }
    print(table(summary, arms), file=sys.stderr)
    for arm, figures in overhead.items():
        print(
            f"{arm}: hook threads {figures['hook_threads_cpu_pct']}% of the process CPU;"
            f" process CPU {figures['process_cpu_pct']}% +- {figures['process_cpu_pct_ci95']};"
            f" step p50 {figures['step_p50_pct_median']}% (median; mean"
            f" {figures['step_p50_pct_mean']} +- {figures['step_p50_pct_ci95']});"
            f" asleep on the GIL {figures['gil_asleep_pct']}%",
            file=sys.stderr,
        )
    result = {
        "benchmark": "hook_cputime",
        "arms": arms,
        "overhead": overhead,
        "summary": summary,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "bare_step_ms": step_ms,
        "config": {
            "batch_size": batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "block_size": block_size,
            "n_layer": n_layer,
            "n_embd": n_embd,
            "num_workers": num_workers,
            "torch_threads": torch.get_num_threads(),
        },
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "seconds": round(time.time() - started, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu_model": benchlib.cpu_model(),
        "commit": benchlib.commit(),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
