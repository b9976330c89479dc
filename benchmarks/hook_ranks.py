"""Does the hook's per-step cost grow with the world size? Measured under torchrun at 1 and 2 ranks.

Each rank runs the hot-path measurement of ``hook_overhead.py`` (interleaved blocks of bare
DataLoader steps and steps through the tuner's loader wrapper plus ``tuner.step()``) with the
hook installed in a real gloo process group, timed with the training thread's own CPU clock
(``time.thread_time``, so waiting for a core does not count). Nothing in the per-step path
depends on the world size; what two ranks change on a 2-core machine is that every core is
busy, so caches are shared and every instruction gets slower, the bare loop's as much as the
hook's. The report gives both, and the hook's cost relative to the bare loop.

Prints one JSON line. Usage: python benchmarks/hook_ranks.py [--rounds N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def worker(rounds: int, steps: int) -> None:
    """One rank: measure, gather the medians on rank 0, print them there."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from hook_overhead import hot_path

    dist.init_process_group("gloo")
    bare, hooked = hot_path(rounds, steps, clock=time.thread_time)
    mine = {
        "hook_us": statistics.median(h - b for h, b in zip(hooked, bare, strict=True)),
        "bare_us": statistics.median(bare),
    }
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "ranks": everyone}), flush=True)
    dist.destroy_process_group()


def launch(ranks: int, rounds: int, steps: int) -> dict[str, Any]:
    """Run the worker under torchrun with ``ranks`` processes; return rank 0's report."""
    env = dict(os.environ)
    env.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtr", dir="/tmp"))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
    ]
    command += [__file__, "--worker", "--rounds", str(rounds), "--steps", str(steps)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def summary(report: dict[str, Any]) -> tuple[float, float]:
    """(median hook µs per step, median bare µs per step) over the ranks."""
    hook = statistics.median(r["hook_us"] for r in report["ranks"])
    bare = statistics.median(r["bare_us"] for r in report["ranks"])
    return hook, bare


def main() -> None:
    """Measure at 1 and 2 ranks and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.steps)
        return
    hook1, bare1 = summary(launch(1, args.rounds, args.steps))
    hook2, bare2 = summary(launch(2, args.rounds, args.steps))
    result = {
        "hook_us_per_step_1_rank": round(hook1, 3),
        "hook_us_per_step_2_ranks": round(hook2, 3),
        "bare_loader_us_per_step_1_rank": round(bare1, 3),
        "bare_loader_us_per_step_2_ranks": round(bare2, 3),
        "hook_vs_bare_pct_1_rank": round(100 * hook1 / bare1, 1),
        "hook_vs_bare_pct_2_ranks": round(100 * hook2 / bare2, 1),
        "rounds": args.rounds,
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
