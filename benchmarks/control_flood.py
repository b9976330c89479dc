"""What a flood of a run's sockets costs its training: step time, hook CPU and RSS.

A real hooked CPU training loop (an MLP, ``--step-ms`` per step, one torch thread) runs in a
subprocess pinned to CPU 0; after ``--before-s`` seconds a flooder process pinned to CPU 1
floods the run's sockets for ``--flood-s`` seconds (ipc only), then the run trains on for
``--after-s`` seconds. Meanwhile this process asks the run for a snapshot once a second, as
``memtui status`` does. Modes (``--mode``, several with commas):

- ``set``: valid set requests (``batch_size=N``) pipelined on one DEALER;
- ``set-new``: the same, one fresh REQ connection per request (as the CLI connects);
- ``hello``: hellos asking for 2048 steps of history, pipelined on one DEALER;
- ``nul``: ~400 KB set requests whose unknown knob name is NUL bytes (unbounded, they grew every
  snapshot past the clients' limit);
- ``nul-small``: the largest set requests in bounds (8 knob names, values and the client name
  64 NUL bytes each), one fresh connection each;
- ``sub``: 16 subscriptions of 1 MiB, then distinct 800-byte ones, on the telemetry socket.

Printed as one JSON line: the training's median step time before, during and after the
flood, the agent thread's CPU (percent of a core) in each phase, the run's RSS growth, how
many of the once-a-second status requests were answered during the flood, and the run's
counters. Usage: python benchmarks/control_flood.py [--mode set] [--flood-s 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HELLO_HISTORY = 2048


def _pin(cpu: int) -> None:
    """Run on one CPU (when the machine has it): the flood and the training do not share one."""
    with contextlib.suppress(OSError, AttributeError):
        if cpu < (os.cpu_count() or 1):
            os.sched_setaffinity(0, {cpu})


def _thread_cpu_s(tid: int) -> float:
    """CPU seconds of one thread of this process (scheduler statistics)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as stats:
            return int(stats.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


# --------------------------------------------------------------------------- the training


def train(out: Path, seconds: float, step_ms: float) -> None:
    """The hooked training: record each step's end time and duration, and the agent's CPU."""
    _pin(0)
    import torch
    from torch.utils.data import DataLoader

    from memtui import hooks

    torch.set_num_threads(1)
    width = 256
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = [(torch.randn(8, width), torch.randn(8, 1)) for _ in range(32)]

    def step() -> None:
        x, y = data[0]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(200):  # warm up, then calibrate: repeats of the small step in step_ms
        step()
    start = time.perf_counter()
    for _ in range(200):
        step()
    repeats = max(1, round(step_ms / 1e3 / ((time.perf_counter() - start) / 200)))

    def factory(batch_size: int) -> DataLoader[Any]:
        return DataLoader(data, batch_size=1, collate_fn=lambda b: b[0])

    config = {"batch_size": 8, "grad_accum": 1}
    tuner = hooks.install(config=config, state_dir=out.parent / "state", name="flood")
    print(f"run {tuner.run_id}", flush=True)
    agent = tuner.agent
    agent_tid = agent.native_id if agent is not None and agent.native_id else 0
    steps: list[tuple[float, float]] = []
    cpu: list[tuple[float, float]] = []
    deadline = time.time() + seconds
    next_cpu = 0.0
    while time.time() < deadline:
        for x, y in tuner.loader(factory):
            t0 = time.perf_counter()
            for _ in range(repeats):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tuner.step()
            steps.append((time.time(), time.perf_counter() - t0))
            if time.time() >= next_cpu:
                next_cpu = time.time() + 0.5
                cpu.append((time.time(), _thread_cpu_s(agent_tid)))
            if time.time() >= deadline:
                break
    tuner.close()
    out.write_text(json.dumps({"steps": steps, "agent_cpu": cpu}))


# --------------------------------------------------------------------------- the flooder


def flood(mode: str, control: str, pub: str, seconds: float) -> None:
    """Flood the run's sockets in ``mode`` for ``seconds``; print what came back."""
    _pin(1)
    import zmq

    from memtui.wire import Decoder, ErrorReply, Hello, SetRequest, encode

    context = zmq.Context()
    decoder = Decoder()
    counts: dict[str, int] = {"sent": 0, "replies": 0, "rate_limited": 0, "errors": 0}

    def tally(frame: bytes) -> None:
        counts["replies"] += 1
        reply = decoder.decode(frame)
        if isinstance(reply, ErrorReply):
            counts["rate_limited" if "rate limit" in reply.reason else "errors"] += 1

    deadline = time.monotonic() + seconds
    if mode == "sub":
        sock = context.socket(zmq.XSUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(pub)
        for index in range(16):
            sock.send(b"\x01" + bytes([index]) * (1 << 20))
            counts["sent"] += 1
        index = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(zmq.Again):
                sock.send(b"\x01" + (b"%08d" % index) * 100, zmq.NOBLOCK)
                counts["sent"] += 1
                index += 1
                continue
            time.sleep(0.001)
    elif mode in ("set-new", "nul-small"):
        frame = encode(SetRequest(changes={"batch_size": 4}, client="flood"))
        if mode == "nul-small":  # the largest request in bounds, rejected: stored and logged
            names = {"\0" * 60 + f"{i:04d}": "\0" * 64 for i in range(8)}
            frame = encode(SetRequest(changes=names, client="\0" * 64))  # type: ignore[arg-type]
        while time.monotonic() < deadline:
            req = context.socket(zmq.REQ)
            req.setsockopt(zmq.LINGER, 0)
            req.connect(control)
            req.send(frame)
            counts["sent"] += 1
            if req.poll(1000):
                tally(req.recv())
            req.close()
    else:
        if mode == "set":
            frames = [
                encode(SetRequest(changes={"batch_size": 2 + i % 16}, client="flood"))
                for i in range(16)
            ]
        elif mode == "hello":
            frames = [encode(Hello(client="flood", history=HELLO_HISTORY))]
        elif mode == "nul":
            frames = [encode(SetRequest(changes={"\0" * 400_000: 1}, client="flood"))]
        else:
            raise SystemExit(f"unknown mode {mode}")
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, 256 << 20)
        sock.connect(control)
        index = 0
        while time.monotonic() < deadline:
            try:
                sock.send_multipart([b"", frames[index % len(frames)]], zmq.NOBLOCK)
                counts["sent"] += 1
                index += 1
            except zmq.Again:
                sock.poll(10, zmq.POLLIN)
            while True:
                try:
                    reply = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                tally(reply[-1])
    print(json.dumps(counts), flush=True)
    os._exit(0)  # an XSUB's 1 MiB-deep subscription trie, freed recursively, would crash it


# --------------------------------------------------------------------------- the measurement


def _median_ms(steps: list[tuple[float, float]], start: float, end: float) -> float | None:
    times = [dt for t, dt in steps if start <= t < end]
    return round(statistics.median(times) * 1e3, 2) if times else None


def _cpu_pct(cpu: list[tuple[float, float]], start: float, end: float) -> float | None:
    inside = [(t, c) for t, c in cpu if start <= t <= end]
    if len(inside) < 2:
        return None
    (t0, c0), (t1, c1) = inside[0], inside[-1]
    return round(100 * (c1 - c0) / (t1 - t0), 2) if t1 > t0 else None


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the training, flood it in ``mode``, and return the figures."""
    import psutil
    from msgspec.json import encode as encode_json

    from memtui.storage import registry
    from memtui.transport.client import ClientError, ControlClient
    from memtui.wire import to_builtins

    work = Path(tempfile.mkdtemp(prefix="mtflood"))
    env = dict(os.environ)
    env.setdefault("MEMTUI_RUNTIME_DIR", str(work / "rt"))
    env.setdefault("XDG_STATE_HOME", str(work / "xdg"))
    os.environ.update(env)
    out = work / "steps.json"
    total = args.before_s + args.flood_s + args.after_s + 3.0
    script = str(Path(__file__).resolve())
    command = [sys.executable, script, "--role", "train", "--out", str(out)]
    command += ["--train-s", str(total), "--step-ms", str(args.step_ms)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    run_id = line.split()[1]
    target = registry.find_run(run_id)
    client = ControlClient(target.control, timeout_s=3.0)
    process = psutil.Process(proc.pid)
    time.sleep(2.0)  # warm up
    t_before = time.time()
    time.sleep(args.before_s)
    rss_before = process.memory_info().rss
    t_flood = time.time()
    flood_command = [sys.executable, script, "--role", "flood", "--mode", mode]
    flood_command += ["--control", target.control, "--pub", target.ranks[0].pub]
    flooder = subprocess.Popen(
        [*flood_command, "--flood-s", str(args.flood_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    answered = asked = 0
    rss_peak = rss_before
    latencies: list[float] = []
    while time.time() < t_flood + args.flood_s:
        asked += 1
        t0 = time.monotonic()
        with contextlib.suppress(ClientError):
            client.hello(history=512)
            answered += 1
            latencies.append(time.monotonic() - t0)
        rss_peak = max(rss_peak, process.memory_info().rss)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    flood_out, _ = flooder.communicate(timeout=60)
    t_after = time.time()
    time.sleep(1.0)
    counters: dict[str, Any] = {}
    state_bytes = None
    with contextlib.suppress(ClientError):
        snapshot = ControlClient(target.control, timeout_s=5.0).hello(history=0)
        counters = {k: v for k, v in to_builtins(snapshot.counters or {}).items() if v}
        state_bytes = len(encode_json(snapshot.control))
    rss_after = process.memory_info().rss
    time.sleep(args.after_s - 1.0)
    proc.wait(timeout=total + 60)
    data = json.loads(out.read_text())
    steps, cpu = data["steps"], data["agent_cpu"]
    t_end = t_after + args.after_s
    return {
        "mode": mode,
        "step_ms_before": _median_ms(steps, t_before, t_flood),
        "step_ms_during": _median_ms(steps, t_flood, t_after),
        "step_ms_after": _median_ms(steps, t_after, t_end),
        "agent_cpu_pct_before": _cpu_pct(cpu, t_before, t_flood),
        "agent_cpu_pct_during": _cpu_pct(cpu, t_flood, t_after),
        "rss_growth_mb_peak": round((rss_peak - rss_before) / 1e6, 1),
        "rss_growth_mb_after": round((rss_after - rss_before) / 1e6, 1),
        "status_answered": f"{answered}/{asked}",
        "status_latency_ms_max": round(max(latencies) * 1e3, 1) if latencies else None,
        "control_state_bytes": state_bytes,
        "flooder": json.loads(flood_out.strip().splitlines()[-1]) if flood_out.strip() else {},
        "counters": counters,
    }


def main() -> None:
    """Measure each mode asked for and print one JSON line per mode."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="set", help="set, set-new, hello, nul, nul-small, sub")
    parser.add_argument("--flood-s", type=float, default=10.0)
    parser.add_argument("--before-s", type=float, default=5.0)
    parser.add_argument("--after-s", type=float, default=3.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--role", default="measure", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--train-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--pub", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "train":
        train(args.out, args.train_s, args.step_ms)
    elif args.role == "flood":
        flood(args.mode, args.control, args.pub, args.flood_s)
    else:
        for mode in args.mode.split(","):
            print(json.dumps(measure(mode, args)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
