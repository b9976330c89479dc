"""Whether the hook's threads delay the training thread through the GIL: how often, how long.

The hook's two threads run Python, so each of their wake-ups needs the GIL. Where the training
thread is inside a torch op (which lets the GIL go) that costs it nothing; where it runs Python
the wake-up waits up to the switch interval (``sys.getswitchinterval()``, 5 ms), the training
thread is made to drop the GIL and waits until the hook's thread lets it go again: at its next
blocking call, or after another switch interval.

**Part 1, the worst case.** A training thread that holds the GIL all the time (pure Python
work, as a Python collate function or tokenizer has): it spins reading the clock, calls
``tuner.step()`` every ``--step-ms`` and records every gap of more than ``--gap-us`` between
two reads. After each gap one ``getrusage(RUSAGE_THREAD)`` (a system call that keeps the GIL)
tells what the gap was: a voluntary context switch (the loop makes no blocking call, so: a wait
for the GIL), or an involuntary one (preempted by another thread or process). Arms: ``bare``,
``unwatched`` and ``watched`` (a viewer-like subscriber in its own process), each at every
``--switch-intervals-ms``, in interleaved rounds of ``--seconds``. Per arm: GIL waits per
second and their length (p50, p99, max), the time lost to them (ms per second of training),
the same for preemptions, and the hook threads' CPU and on-CPU slices.

**Part 2, what a wake-up does** (``--profile``): the hook's threads under ``cProfile`` with
the thread's CPU clock (installed through ``threading.setprofile`` for the threads the hook
starts; nothing in memtui changes) while a watched probe runs: per thread, the calls per
second and CPU per call of what its loop calls, and the functions with the most own CPU.
The profiler slows pure Python by a large factor: read the shares, not the absolute times (the
unprofiled CPU per second is part 1's).

Prints a table on stderr and one JSON line on stdout.

Usage: python benchmarks/hook_gil.py [--rounds N] [--seconds S] [--switch-intervals-ms 5,0.5]
                                      [--profile] [--quick]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import resource
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtb", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtbs", dir="/tmp"))

import benchlib

from memtui import hooks

RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", 1)  # Linux


def probe(tuner: hooks.Tuner | None, seconds: float, step_s: float, gap_s: float) -> dict[str, Any]:
    """Spin in Python for ``seconds``, a ``tuner.step()`` every ``step_s``; classify each gap."""
    clock, usage = time.perf_counter, resource.getrusage
    gil: list[float] = []
    preempted: list[float] = []
    unexplained: list[float] = []
    start = usage(RUSAGE_THREAD)
    voluntary, involuntary = start.ru_nvcsw, start.ru_nivcsw
    steps = 0
    begin = last = clock()
    end = begin + seconds
    next_step = begin + step_s
    while last < end:
        now = clock()
        gap = now - last
        if gap > gap_s:
            ru = usage(RUSAGE_THREAD)
            if ru.ru_nvcsw != voluntary:
                gil.append(gap)
            elif ru.ru_nivcsw != involuntary:
                preempted.append(gap)
            else:
                unexplained.append(gap)
            voluntary, involuntary = ru.ru_nvcsw, ru.ru_nivcsw
            now = clock()  # the system call is not a gap
        if now >= next_step:
            next_step += step_s
            steps += 1
            if tuner is not None:
                tuner.step(1)
        last = now
    elapsed = clock() - begin
    finish = usage(RUSAGE_THREAD)
    return {
        "elapsed": elapsed,
        "steps": steps,
        "gil": gil,
        "preempted": preempted,
        "unexplained": unexplained,
        "voluntary": finish.ru_nvcsw - start.ru_nvcsw,
        "involuntary": finish.ru_nivcsw - start.ru_nivcsw,
    }


def _gap_stats(gaps: list[float], elapsed: float, prefix: str) -> dict[str, float]:
    return {
        f"{prefix}_per_s": len(gaps) / elapsed,
        f"{prefix}_ms_lost_per_s": 1e3 * sum(gaps) / elapsed,
        f"{prefix}_us_p50": 1e6 * statistics.median(gaps) if gaps else 0.0,
        f"{prefix}_us_p99": 1e6 * benchlib.percentile(gaps, 99) if gaps else 0.0,
        f"{prefix}_us_max": 1e6 * max(gaps) if gaps else 0.0,
    }


def run_arm(
    mode: str,
    switch_s: float,
    seconds: float,
    step_s: float,
    gap_s: float,
    watcher: benchlib.Watcher | None,
    profiles: dict[str, cProfile.Profile] | None = None,
) -> dict[str, float]:
    """One round of one arm: install (or not), settle, probe; the round's figures."""
    default_switch = sys.getswitchinterval()
    before = benchlib.task_ids()
    tuner = None
    try:
        if mode != "bare":
            if profiles is not None:
                threading.setprofile(_profile_new_thread(profiles))
            try:
                tuner = hooks.install(
                    SimpleNamespace(batch_size=1, gradient_accumulation_steps=1),
                    state_dir=tempfile.mkdtemp(prefix="mtbd"),
                    name="bench",
                )
            finally:
                threading.setprofile(None)
            if mode == "watched":
                assert watcher is not None
                watcher.watch(tuner.run_id)
        probe(tuner, 0.3, step_s, gap_s)  # settle: the hook's start-up is not measured
        sys.setswitchinterval(switch_s)
        start = benchlib.snapshot()
        hook_tids = set() if tuner is None else set(start) - before
        got = probe(tuner, seconds, step_s, gap_s)
        end = benchlib.snapshot()
        sys.setswitchinterval(default_switch)
        if mode == "watched" and watcher is not None:
            watcher.unwatch()
    finally:
        sys.setswitchinterval(default_switch)
        if tuner is not None:
            tuner.close()
    per = benchlib.deltas(start, end)
    hook = [d for tid, d in per.items() if tid in hook_tids]
    main = per[os.getpid()]
    elapsed = got["elapsed"]
    # the probe makes no blocking call: asleep = waiting for the GIL, wherever the holder was;
    # runnable = waiting for a core (the scheduler's part, which the load decides)
    asleep = max(0.0, elapsed - main.cpu_s - main.runnable_s)
    hook_cpu = sum(d.cpu_s for d in hook)
    slices = sum(d.slices for d in hook)
    result = {
        **_gap_stats(got["gil"], elapsed, "gil_wait"),
        **_gap_stats(got["preempted"], elapsed, "preempted"),
        "gil_asleep_ms_per_s": 1e3 * asleep / elapsed,
        "gil_asleep_us_per_wait": 1e6 * asleep / got["voluntary"] if got["voluntary"] else 0.0,
        "runnable_ms_per_s": 1e3 * main.runnable_s / elapsed,
        "unexplained_per_s": len(got["unexplained"]) / elapsed,
        "voluntary_per_s": got["voluntary"] / elapsed,
        "involuntary_per_s": got["involuntary"] / elapsed,
        "hook_cpu_pct_of_core": 100 * hook_cpu / elapsed,
        "hook_slices_per_s": slices / elapsed,
        "hook_cpu_us_per_slice": 1e6 * hook_cpu / slices if slices else 0.0,
        "steps_per_s": got["steps"] / elapsed,
    }
    for d in hook:
        key = "hook_thread_slices_per_s." + d.name.replace(" ", "_")
        result[key] = result.get(key, 0.0) + d.slices / elapsed
        key = "hook_thread_cpu_us_per_slice." + d.name.replace(" ", "_")
        result[key] = 1e6 * d.cpu_s / d.slices if d.slices else 0.0
    return result


# ---------------------------------------------------------------------------- profiling


def _profile_new_thread(profiles: dict[str, cProfile.Profile]) -> Any:
    """A ``threading.setprofile`` function that puts each new thread under its own cProfile."""

    def start(_frame: Any, _event: str, _arg: Any) -> None:
        sys.setprofile(None)
        profile = cProfile.Profile(time.thread_time)
        profiles[threading.current_thread().name] = profile
        profile.enable()

    return start


def _name(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name  # a builtin
    parts = path.split(os.sep)
    short = "/".join(parts[parts.index("memtui") :]) if "memtui" in parts else parts[-1]
    return f"{short}:{line}({name})"


def profile_report(profiles: dict[str, cProfile.Profile], seconds: float) -> dict[str, Any]:
    """Per profiled thread: what its loop calls (calls/s, CPU per call), the top own-CPU
    functions, and the total profiled CPU."""
    report: dict[str, Any] = {}
    for thread, profile in profiles.items():
        stats: dict[Any, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        total = sum(tt for _cc, _nc, tt, _ct, _callers in stats.values())
        # the thread's run() was entered before its profiler started: what it calls has no
        # profiled caller (or run itself, where the profiler saw it)
        runs = {f for f in stats if f[2] == "run"}
        loop: list[dict[str, Any]] = []
        for func, (_cc, nc, _tt, ct, callers) in stats.items():
            if not callers or any(caller in runs for caller in callers):
                loop.append(
                    {
                        "function": _name(func),
                        "calls_per_s": round(nc / seconds, 2),
                        "cpu_us_per_call": round(1e6 * ct / nc, 1) if nc else 0.0,
                        "cpu_share_pct": round(100 * ct / total, 1) if total else 0.0,
                    }
                )
        loop.sort(key=lambda row: -row["cpu_share_pct"])
        own = sorted(stats.items(), key=lambda item: -item[1][2])[:15]
        report[thread] = {
            "profiled_cpu_ms_per_s": round(1e3 * total / seconds, 3),
            "loop_calls": loop[:15],
            "top_own_cpu": [
                {
                    "function": _name(func),
                    "calls_per_s": round(nc / seconds, 2),
                    "own_cpu_share_pct": round(100 * tt / total, 1) if total else 0.0,
                    "own_cpu_us_per_call": round(1e6 * tt / nc, 2) if nc else 0.0,
                }
                for func, (_cc, nc, tt, _ct, _callers) in own
            ],
        }
    return report


# ---------------------------------------------------------------------------- main

METRICS = [
    ("gil_wait_per_s", "training thread GIL waits /s"),
    ("gil_wait_us_p50", "  their length p50, us"),
    ("gil_wait_us_p99", "  their length p99, us"),
    ("gil_wait_us_max", "  their length max, us"),
    ("gil_wait_ms_lost_per_s", "  training time lost to them, ms per s"),
    ("gil_asleep_ms_per_s", "  of which asleep on the GIL (schedstat), ms per s"),
    ("gil_asleep_us_per_wait", "  asleep per GIL wait, us"),
    ("runnable_ms_per_s", "training thread runnable, waiting for a core, ms per s"),
    ("preempted_per_s", "training thread preemptions (gaps) /s"),
    ("preempted_us_p99", "  their length p99, us"),
    ("preempted_ms_lost_per_s", "  training time lost to them, ms per s"),
    ("hook_slices_per_s", "hook threads on-CPU slices /s"),
    ("hook_cpu_us_per_slice", "hook CPU per slice, us"),
    ("hook_cpu_pct_of_core", "hook threads, % of a core"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=6.0, help="probe time per arm per round")
    parser.add_argument("--step-ms", type=float, default=1.0, help="tuner.step() period")
    parser.add_argument("--gap-us", type=float, default=30.0, help="a gap longer than this counts")
    parser.add_argument("--switch-intervals-ms", default="5,0.5")
    parser.add_argument("--modes", default="bare,unwatched,watched")
    parser.add_argument("--profile", action="store_true", help="part 2: profile the wake-ups")
    parser.add_argument("--profile-seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run (<20 s, noisy)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.profile_seconds = 1, 0.5, 1.5
    intervals = [float(x) / 1e3 for x in args.switch_intervals_ms.split(",") if x.strip()]
    modes = ["bare", *[m for m in args.modes.split(",") if m and m != "bare"]]
    arms = [f"{m}@{1e3 * s:g}ms" for s in intervals for m in modes]
    step_s, gap_s = args.step_ms / 1e3, args.gap_us / 1e6

    load_before = benchlib.loadavg()
    started = time.time()
    rounds: list[dict[str, dict[str, float]]] = []
    profile: dict[str, Any] = {}
    with benchlib.Watcher() as watcher:
        for index in range(args.rounds):
            shift = index % len(arms)
            results = {}
            for arm in arms[shift:] + arms[:shift]:
                mode, _, interval = arm.partition("@")
                switch_s = float(interval.removesuffix("ms")) / 1e3
                results[arm] = run_arm(mode, switch_s, args.seconds, step_s, gap_s, watcher)
            rounds.append(results)
            print(
                f"round {index + 1}/{args.rounds}: "
                + ", ".join(
                    f"{arm} {results[arm]['gil_wait_per_s']:.1f} GIL waits/s"
                    f" p99 {results[arm]['gil_wait_us_p99']:.0f} us"
                    for arm in arms
                ),
                file=sys.stderr,
                flush=True,
            )
        if args.profile:
            profiles: dict[str, cProfile.Profile] = {}
            began = time.perf_counter()
            got = run_arm("watched", 0.005, args.profile_seconds, step_s, gap_s, watcher, profiles)
            lifetime = time.perf_counter() - began  # the profiled threads' life: rates per s
            profile = {"seconds": round(lifetime, 2), "switch_interval_ms": 5}
            profile["threads"] = profile_report(profiles, lifetime)
            profile["profiled_probe"] = {k: round(v, 2) for k, v in got.items()}
    load_after = benchlib.loadavg()

    keys = [k for k, _ in METRICS] + sorted(
        {k for r in rounds for a in r.values() for k in a if k.startswith("hook_thread_")}
    )
    summary: dict[str, dict[str, Any]] = {}
    for key in keys:
        entry: dict[str, Any] = {}
        for arm in arms:
            entry[arm] = benchlib.spread([r[arm].get(key, 0.0) for r in rounds])
            mode, _, interval = arm.partition("@")
            if mode != "bare":
                base = f"bare@{interval}"
                entry[f"{arm}-bare"] = benchlib.paired(
                    [r[arm].get(key, 0.0) - r[base].get(key, 0.0) for r in rounds]
                )
        summary[key] = entry
    lines = []
    for key, title in METRICS:
        lines.append(title)
        for arm in arms:
            s = summary[key][arm]
            lines.append(f"  {arm:<16} {s['median']:>10.3f}  [{s['min']:.3f} - {s['max']:.3f}]")
    print("\n".join(lines), file=sys.stderr)
    if profile:
        for thread, report in profile["threads"].items():
            print(f"{thread}: {report['profiled_cpu_ms_per_s']} ms CPU/s profiled", file=sys.stderr)
            for row in report["loop_calls"][:8]:
                print(
                    f"  {row['cpu_share_pct']:5.1f}%  {row['calls_per_s']:7.2f}/s"
                    f"  {row['cpu_us_per_call']:9.1f} us/call  {row['function']}",
                    file=sys.stderr,
                )
    result = {
        "benchmark": "hook_gil",
        "arms": arms,
        "summary": summary,
        "profile": profile,
        "rounds": args.rounds,
        "seconds_per_arm": args.seconds,
        "step_ms": args.step_ms,
        "gap_us": args.gap_us,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "seconds": round(time.time() - started, 1),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": benchlib.cpu_model(),
        "commit": benchlib.commit(),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
