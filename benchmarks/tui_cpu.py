"""How much CPU the viewer takes from the training host while a run steps fast.

A tiny training loop with the real hook (``memtui.hooks``, no torch) steps at ``--rate`` steps
per second (checkpoint every 1,000 steps) in one subprocess; the viewer (``memtui attach``)
watches it, in a real terminal (a detached tmux session, the way it runs in a side pane) or, if
tmux is absent, headless (``App.run_test``). After a warm-up, the viewer process's CPU time is
measured over ``--seconds`` with psutil. Prints one JSON line::

    {"tui_cpu_pct_of_core": 6.1, "steps_per_s": 998.7, "mode": "tmux", "size": "120x40", ...}

Target: under 10% of one core at 1,000 steps/s (the viewer shares the host with the data-loader
workers it diagnoses). Run: ``.venv/bin/python benchmarks/tui_cpu.py [--rate 1000 --seconds 20]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

ROOT = Path(__file__).resolve().parent.parent


def hook_loop(rate: float, seconds: float, checkpoint_every: int) -> int:
    """The fast 'training': the hook's step() at ``rate`` steps/s, in bursts every 10 ms.

    Also the viewer tests' light real hook (no torch to import): ``--loop --rate R --seconds S``.
    """
    from memtui import hooks

    config = SimpleNamespace(batch_size=32, gradient_accumulation_steps=1, num_workers=0,
                             pin_memory=False)  # fmt: skip
    tuner = hooks.install(config, name="bench")
    print(f"run {tuner.run_id}", flush=True)
    start = time.perf_counter()
    burst = max(1, round(rate / 100))
    steps = 0
    try:
        while time.perf_counter() - start < seconds:
            for _ in range(burst):
                tuner.step(samples=32)
                steps += 1
                if steps % checkpoint_every == 0:
                    tuner.checkpoint()
            ahead = start + steps / rate - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
    finally:
        tuner.close()
    return 0


def headless_viewer(run: str, seconds: float, warmup: float, width: int, height: int) -> int:
    """Run the viewer headless; print its own CPU over the measured window as JSON."""
    from memtui.transport.sources import LiveSource
    from memtui.tui.app import MemtuiApp

    async def main() -> dict[str, float]:
        app = MemtuiApp(LiveSource(run))
        async with app.run_test(size=(width, height)):
            await asyncio.sleep(warmup)
            me = psutil.Process()
            cpu0, wall0, step0 = sum(me.cpu_times()[:2]), time.monotonic(), app.state.step
            await asyncio.sleep(seconds)
            cpu1, wall1, step1 = sum(me.cpu_times()[:2]), time.monotonic(), app.state.step
            return {
                "cpu_s": cpu1 - cpu0,
                "wall_s": wall1 - wall0,
                "steps": step1 - step0,
                "batches": app.batches_folded,
                "repaints": app.repaints,
            }

    print(json.dumps(asyncio.run(main())), flush=True)
    return 0


def _wait_run_id(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("run "):
        raise SystemExit(f"the hook loop did not start: {line!r}")
    return line.split()[1]


def _status_step(run: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "memtui", "status", run, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(json.loads(out.stdout)["step"]) if out.returncode == 0 else 0


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Start the loop and the viewer, measure, clean up."""
    env = dict(os.environ)
    base = Path(tempfile.mkdtemp(prefix="mtb", dir="/tmp"))
    env.setdefault("MEMTUI_RUNTIME_DIR", str(base / "rt"))
    env.setdefault("XDG_STATE_HOME", str(base / "state"))
    os.environ.update({k: env[k] for k in ("MEMTUI_RUNTIME_DIR", "XDG_STATE_HOME")})
    total = args.warmup + args.seconds + 15
    loop = subprocess.Popen(
        [sys.executable, __file__, "--loop", "--rate", str(args.rate), "--seconds", str(total)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    width, height = (int(v) for v in args.size.split("x"))
    mode = args.mode
    if mode == "auto":
        mode = "tmux" if shutil.which("tmux") else "headless"
    session = f"memtui-bench-{os.getpid()}"
    try:
        run = _wait_run_id(loop)
        if mode == "headless":
            out = subprocess.run(
                [sys.executable, __file__, "--viewer", run, "--seconds", str(args.seconds),
                 "--warmup", str(args.warmup), "--size", args.size],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=total + 30,
            )  # fmt: skip
            result = json.loads(out.stdout.strip().splitlines()[-1])
            cpu_s, wall_s, steps = result["cpu_s"], result["wall_s"], result["steps"]
        else:
            command = f"exec {sys.executable} -m memtui attach {run}"
            subprocess.run(
                ["tmux", "new-session", "-d", "-s", session, "-x", str(width), "-y", str(height),
                 "-e", f"MEMTUI_RUNTIME_DIR={env['MEMTUI_RUNTIME_DIR']}",
                 "-e", f"XDG_STATE_HOME={env['XDG_STATE_HOME']}", command],
                check=True, cwd=ROOT,
            )  # fmt: skip
            pane_pid = int(
                subprocess.run(
                    ["tmux", "list-panes", "-t", session, "-F", "#{pane_pid}"],
                    capture_output=True, text=True, check=True,
                ).stdout.split()[0]
            )  # fmt: skip
            viewer = psutil.Process(pane_pid)
            time.sleep(args.warmup)
            step0, cpu0, wall0 = _status_step(run), sum(viewer.cpu_times()[:2]), time.monotonic()
            time.sleep(args.seconds)
            step1, cpu1, wall1 = _status_step(run), sum(viewer.cpu_times()[:2]), time.monotonic()
            cpu_s, wall_s, steps = cpu1 - cpu0, wall1 - wall0, step1 - step0
    finally:
        if mode == "tmux":
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        loop.terminate()
        loop.wait(10)
        shutil.rmtree(base, ignore_errors=True)
    return {
        "tui_cpu_pct_of_core": round(100 * cpu_s / wall_s, 2),
        "steps_per_s": round(steps / wall_s, 1),
        "mode": mode,
        "size": args.size,
        "seconds": round(wall_s, 1),
        "target_pct": 10,
    }


def main() -> int:
    """Parse the command line; run the loop, the viewer, or the whole measurement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="steps per second")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--size", default="120x40", help="terminal WIDTHxHEIGHT")
    parser.add_argument("--mode", choices=("auto", "tmux", "headless"), default="auto")
    parser.add_argument("--checkpoint-every", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--viewer", metavar="RUN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        return hook_loop(args.rate, args.seconds, checkpoint_every=args.checkpoint_every)
    if args.viewer:
        width, height = (int(v) for v in args.size.split("x"))
        return headless_viewer(args.viewer, args.seconds, args.warmup, width, height)
    print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
