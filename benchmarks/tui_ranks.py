"""How much CPU the viewer takes watching 64 ranks, each publishing at the hook's real cadence.

A publisher process stands for a 64-rank job (this machine has no GPUs, nor 64 cores to run 64
hooks): ONE PUB SOCKET PER RANK, each sending that rank's telemetry batch every 100 ms (the
hook's flush period) with the step records of ``--rate`` steps/s (1,000 by default: 100 records
a batch), a device sample every 200 ms and a host sample every second, built from memtui's own
wire Structs; plus, per rank, a control socket that answers hello with that rank's Snapshot
(rank 0's lists all 64 ranks' endpoints, as a real run's does). The ranks differ: rank number,
slightly different step and wait times, one straggler (rank 17: 1.4x the step time, so its step
count lags), one near OOM (rank 42: 88% of 80 GiB). It registers the run in the runtime
directory like a hook does, so the real ``memtui attach RUN`` finds it by run id and discovers
the 64 endpoints itself.

The viewer runs in a detached tmux pane (or headless without tmux); after a warm-up its CPU time
is measured over ``--seconds`` with psutil. One JSON line per pane size::

    {"tui_cpu_pct_of_core": 7.9, "ranks": 64, "steps_per_s_per_rank": 998.1, "size": "60x50", ...}

Target: under 10% of one core. Run: ``.venv/bin/python benchmarks/tui_ranks.py [--ranks 64]
[--rate 1000] [--seconds 20] [--size 120x40 --size 60x50]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
FLUSH_S = 0.1
"""The hook's flush period: one telemetry batch per rank every 100 ms."""
SAMPLE_S = 0.2
"""The hook's allocator sampling period."""
STRAGGLER = 17
NEAR_OOM = 42


def publish(ranks: int, rate: float, seconds: float, stats_path: str, late: int = 0) -> int:
    """Stand for a ``ranks``-rank job: publish every rank's telemetry and answer hellos.

    With ``late``, the last ``late`` ranks are listed (in the registry and the snapshots) only
    after two seconds, as ranks that join late: the viewer's tests use it.
    """
    import zmq

    from memtui import registry
    from memtui.wire import (
        ControlState,
        Decoder,
        DeviceSample,
        Hello,
        HostSample,
        Knobs,
        RankInfo,
        RunInfo,
        RunRecord,
        Snapshot,
        StepRecord,
        Telemetry,
        encode,
    )

    run = registry.new_run_id("bench64")
    rundir = registry.run_dir(run)
    rundir.create()
    context = zmq.Context()
    pubs, routers, infos = [], [], []
    for rank in range(ranks):
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 1000)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(rundir.pub_endpoint(rank))
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(rundir.control_endpoint(rank))
        pubs.append(pub)
        routers.append(router)
        infos.append(RankInfo(rank=rank, pub=rundir.pub_endpoint(rank),
                              control=rundir.control_endpoint(rank), local_rank=rank % 8,
                              host="bench-node", pid=os.getpid()))  # fmt: skip
    started = time.time()
    config = Knobs(batch_size=8, grad_accum=4, num_workers=6, pin_memory=True)
    control = ControlState(config=config, tunable=["batch_size", "grad_accum", "num_workers",
                           "pin_memory"], world_size=ranks)  # fmt: skip
    pid = os.getpid()
    listed = infos[: ranks - late]

    def register() -> None:
        rundir.write(RunRecord(run=run, pid=pid, create_time=registry.process_create_time(pid),
                               started=started, host="bench-node",
                               control=rundir.control_endpoint(0), ranks=listed,
                               command=sys.argv, world_size=ranks))  # fmt: skip

    register()

    def step_time(rank: int) -> float:
        base = (1.0 + 0.03 * math.sin(rank)) / rate
        return base * 1.4 if rank == STRAGGLER else base

    def peak(rank: int) -> float:
        return 0.88 if rank == NEAR_OOM else 0.62 + 0.12 * (rank % 7) / 7

    def device(rank: int, t: float, step: int) -> DeviceSample:
        reserved = int(peak(rank) * 80 * GIB) - GIB
        return DeviceSample(time=t, step=step, kind="cuda", index=rank % 8, capacity_bytes=80 * GIB,
                            allocated_bytes=reserved - 2 * GIB, reserved_bytes=reserved,
                            peak_reserved_bytes=reserved, peak_allocated_bytes=reserved - GIB,
                            nvml_used_bytes=reserved + GIB, nvml_total_bytes=80 * GIB)  # fmt: skip

    def host(rank: int, t: float) -> HostSample:
        return HostSample(time=t, ram_total_bytes=2048 * GIB, ram_available_bytes=1200 * GIB,
                          ram_used_bytes=848 * GIB, main_rss_bytes=(6 + rank % 3) * GIB,
                          workers=6, workers_rss_bytes=5 * GIB)  # fmt: skip

    history: list[deque[StepRecord]] = [deque(maxlen=2048) for _ in range(ranks)]
    steps = [0] * ranks
    seqs = [0] * ranks
    next_sample = [started] * ranks
    next_host = [started] * ranks
    next_flush = [time.monotonic() + FLUSH_S * (r / ranks) for r in range(ranks)]
    last_flush = [time.time()] * ranks
    decoder = Decoder()

    def snapshot(rank: int, want: int) -> Snapshot:
        now = time.time()
        info = RunInfo(run=run, pid=pid, host="bench-node", started=started, rank=rank,
                       world_size=ranks, device=f"cuda:{rank % 8} (simulated)", device_kind="cuda",
                       capacity_bytes=80 * GIB)  # fmt: skip
        recent = list(history[rank])[-min(want, 2048) :] if want else []
        return Snapshot(info=info, control=control, ranks=listed, step=steps[rank], seq=seqs[rank],
                        steps=recent, device=[device(rank, now, steps[rank])],
                        host=[host(rank, now)])  # fmt: skip

    stop = False

    def on_term(*_args: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print(f"run {run}", flush=True)
    poller = zmq.Poller()
    for router in routers:
        poller.register(router, zmq.POLLIN)
    begin = time.monotonic()
    try:
        while not stop and time.monotonic() - begin < seconds:
            if len(listed) < ranks and time.monotonic() - begin > 2.0:
                listed = infos
                register()
            for sock, _event in poller.poll(2):
                rank = routers.index(sock)
                frames = sock.recv_multipart()
                request = decoder.decode(frames[-1])
                if isinstance(request, Hello):
                    sock.send_multipart([*frames[:-1], encode(snapshot(rank, request.history))])
            mono = time.monotonic()
            for rank in range(ranks):
                if mono < next_flush[rank]:
                    continue
                next_flush[rank] += FLUSH_S
                now = time.time()
                dt = step_time(rank)
                count = int((now - started) / dt) - steps[rank]
                wait = dt * (0.05 + 0.02 * math.cos(rank))
                first = steps[rank] + 1
                records = [StepRecord(s, last_flush[rank] + (s - first + 1) * dt, dt, wait, 32, 4)
                           for s in range(first, first + count)]  # fmt: skip
                steps[rank] += count
                history[rank].extend(records)
                samples = []
                while next_sample[rank] <= now:
                    samples.append(device(rank, next_sample[rank], steps[rank]))
                    next_sample[rank] += SAMPLE_S
                sample = None
                if next_host[rank] <= now:
                    sample = host(rank, now)
                    next_host[rank] += 1.0
                seqs[rank] += 1
                message = Telemetry(run=run, rank=rank, seq=seqs[rank], time=now, step=steps[rank],
                                    steps=records, device=samples, host=sample)  # fmt: skip
                try:
                    pubs[rank].send(encode(message), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                last_flush[rank] = now
    finally:
        elapsed = time.time() - started
        Path(stats_path).write_text(json.dumps({
            "steps_per_s_per_rank": sum(steps) / ranks / elapsed,
            "straggler_steps_per_s": steps[STRAGGLER % ranks] / elapsed,
            "frames_per_s": sum(seqs) / elapsed,
        }))  # fmt: skip
        for sock in pubs + routers:
            sock.close(0)
        context.term()
        rundir.remove()
    return 0


def headless_viewer(run: str, seconds: float, warmup: float, width: int, height: int) -> int:
    """Run the viewer headless; print its own CPU over the measured window as JSON."""
    from memtui.recording import LiveSource
    from memtui.tui.app import MemtuiApp

    async def main() -> dict[str, float]:
        app = MemtuiApp(LiveSource(run))
        async with app.run_test(size=(width, height)):
            await asyncio.sleep(warmup)
            me = psutil.Process()
            cpu0, wall0 = sum(me.cpu_times()[:2]), time.monotonic()
            await asyncio.sleep(seconds)
            cpu1, wall1 = sum(me.cpu_times()[:2]), time.monotonic()
            return {"cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0,
                    "ranks_seen": len(app.state.series)}  # fmt: skip

    print(json.dumps(asyncio.run(main())), flush=True)
    return 0


def measure(args: argparse.Namespace, size: str) -> dict[str, object]:
    """Start the publisher and the viewer at ``size``, measure, clean up."""
    env = dict(os.environ)
    base = Path(tempfile.mkdtemp(prefix="mtr", dir="/tmp"))
    env["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    env["XDG_STATE_HOME"] = str(base / "state")
    stats = base / "publisher.json"
    total = args.warmup + args.seconds + 20
    publisher = subprocess.Popen(
        [sys.executable, __file__, "--publish", "--ranks", str(args.ranks), "--rate",
         str(args.rate), "--for", str(total), "--stats", str(stats)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    width, height = (int(v) for v in size.split("x"))
    mode = args.mode
    if mode == "auto":
        mode = "tmux" if shutil.which("tmux") else "headless"
    server = f"memtui-ranks-{os.getpid()}"
    pane = ""
    try:
        assert publisher.stdout is not None
        line = publisher.stdout.readline()
        if not line.startswith("run "):
            raise SystemExit(f"the publisher did not start: {line!r}")
        run = line.split()[1]
        if mode == "headless":
            out = subprocess.run(
                [sys.executable, __file__, "--viewer", run, "--seconds", str(args.seconds),
                 "--warmup", str(args.warmup), "--size", size],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=total + 30,
            )  # fmt: skip
            result = json.loads(out.stdout.strip().splitlines()[-1])
            cpu_s, wall_s = result["cpu_s"], result["wall_s"]
        else:
            tmux = ["tmux", "-L", server]
            subprocess.run(
                [*tmux, "new-session", "-d", "-s", "bench", "-x", str(width), "-y", str(height),
                 "-e", f"MEMTUI_RUNTIME_DIR={env['MEMTUI_RUNTIME_DIR']}",
                 "-e", f"XDG_STATE_HOME={env['XDG_STATE_HOME']}",
                 f"exec {sys.executable} -m memtui attach {run}"],
                check=True, cwd=ROOT,
            )  # fmt: skip
            pane_pid = int(
                subprocess.run([*tmux, "list-panes", "-t", "bench", "-F", "#{pane_pid}"],
                               capture_output=True, text=True, check=True).stdout.split()[0]
            )  # fmt: skip
            viewer = psutil.Process(pane_pid)
            time.sleep(args.warmup)
            cpu0, wall0 = sum(viewer.cpu_times()[:2]), time.monotonic()
            time.sleep(args.seconds)
            cpu1, wall1 = sum(viewer.cpu_times()[:2]), time.monotonic()
            cpu_s, wall_s = cpu1 - cpu0, wall1 - wall0
            pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", "bench"],
                                  capture_output=True, text=True).stdout  # fmt: skip
    finally:
        if mode == "tmux":
            subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)
        publisher.terminate()
        publisher.wait(20)
    published = json.loads(stats.read_text()) if stats.exists() else {}
    shutil.rmtree(base, ignore_errors=True)
    result: dict[str, object] = {
        "tui_cpu_pct_of_core": round(100 * cpu_s / wall_s, 2),
        "ranks": args.ranks,
        "steps_per_s_per_rank": round(published.get("steps_per_s_per_rank", 0.0), 1),
        "frames_per_s": round(published.get("frames_per_s", 0.0), 1),
        "mode": mode,
        "size": size,
        "seconds": round(wall_s, 1),
        "target_pct": 10,
    }
    if pane:
        result["pane_shows_all_ranks"] = f"{args.ranks} ranks" in pane
    if args.show and pane:
        print(pane, file=sys.stderr)
    return result


def main() -> int:
    """Parse the command line; run the publisher, the viewer, or the whole measurement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--rate", type=float, default=1000.0, help="steps per second per rank")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=6.0)
    parser.add_argument("--size", action="append", help="terminal WIDTHxHEIGHT (repeatable)")
    parser.add_argument("--mode", choices=("auto", "tmux", "headless"), default="auto")
    parser.add_argument("--show", action="store_true", help="print the pane at the end (stderr)")
    parser.add_argument("--publish", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--for", dest="duration", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--stats", default="/dev/null", help=argparse.SUPPRESS)
    parser.add_argument("--late", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--viewer", metavar="RUN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.size or ["120x40", "60x50"]
    if args.publish:
        return publish(args.ranks, args.rate, args.duration, args.stats, args.late)
    if args.viewer:
        width, height = (int(v) for v in sizes[0].split("x"))
        return headless_viewer(args.viewer, args.seconds, args.warmup, width, height)
    for size in sizes:
        print(json.dumps(measure(args, size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
