"""What a flood of a run's sockets costs its training: resident memory, step time and hook CPU.

A real hooked CPU training (``tests/support/flood.py``: an MLP, ``--step-ms`` per step, one torch
thread, bound over ipc and, read-only, over plain loopback TCP as ``--tcp 127.0.0.1 --insecure``
binds it) runs with its training thread pinned to CPU 0 (memtui's threads and ZeroMQ's go where
the kernel puts them). After ``--before-s`` seconds a flooder process pinned to CPU 1 floods one
of its sockets for ``--flood-s`` seconds, then the training runs on for ``--after-s`` seconds. Meanwhile this process reads the training's RSS from ``/proc`` once a
second and asks the run for a snapshot over ipc once a second, as ``memtui status`` does.

Each case is ``TRANSPORT:MODE`` (``--cases``, comma-separated): TRANSPORT is ``ipc`` or ``tcp``
(the plain loopback TCP twin), MODE one of the flooder's (``hello``, ``set``, ``junk``,
``connect``, ``sub``, ``hello-pipelined``, ``set-pipelined``, ``hold``: see
``tests/support/flood.py``; ``sub`` floods the telemetry socket, the others the control socket).

Printed: one JSON line per case (the RSS before the flood, its peak during it, at its end and
``--after-s`` later; the median step before, during and after, in wall time and in time on a CPU,
which leaves out the step's waits for a CPU on a loaded host, the flooder's own work included;
the agent thread's and ZeroMQ's I/O thread's CPU during the flood; the snapshots answered; what
the flooder sent and got), then a Markdown table of them all with the machine, the commit and
the load average. Usage:
python benchmarks/control_flood.py [--cases tcp:hello,ipc:set] [--flood-s 300] [--after-s 300]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib

from memtui.transport.client import ClientError, ControlClient
from tests.support.flood import ROOT, RssCurve, Training, median_step_ms

DEFAULT_CASES = "tcp:hello,tcp:set,tcp:connect,tcp:sub,ipc:hello,ipc:set"
"""Fresh connections with hellos, refused sets and nothing, and viewers, over plain TCP; hellos
and refused sets over ipc (each case about 11 minutes with the defaults)."""
MIB = 1 << 20


def _pin(pid: int, cpu: int) -> None:
    """Run ``pid`` on one CPU where the machine has it (the flood and the training apart)."""
    with contextlib.suppress(OSError, AttributeError):
        if cpu < (os.cpu_count() or 1):
            os.sched_setaffinity(pid, {cpu})


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each named thread of ``pid`` (summed by name)."""
    found: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    text = stat.read()
            except OSError:
                continue
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return found


def measure(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the training, flood it with ``case``, and return the figures."""
    transport, mode = case.split(":", 1)
    work = Path(tempfile.mkdtemp(prefix="mtflood", dir="/tmp"))
    # memtui from $PYTHONPATH where it is set (another checkout's, to compare), else this one's
    code = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    env = dict(os.environ, PYTHONPATH=code, MEMTUI_RUNTIME_DIR=str(work / "rt"))
    env.update(XDG_STATE_HOME=str(work / "xdg"), MEMTUI_KEYS=str(work / "nokeys"))
    total = args.warmup_s + args.before_s + args.flood_s + args.after_s + 5.0
    training = Training.start(work, total, step_ms=args.step_ms, tcp="127.0.0.1", env=env)
    _pin(training.proc.pid, 0)
    ends = training.endpoints
    socket = "pub" if mode == "sub" else "control"
    endpoint = ends[f"{socket}_tcp"] if transport == "tcp" else ends[socket]
    client = ControlClient(ends["control"], timeout_s=2.0)
    curve = RssCurve(time.monotonic())

    def wait(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            curve.sample(training)
            time.sleep(max(0.0, min(1.0, end - time.monotonic())))

    wait(args.warmup_s)  # the first steps grow a fresh process (allocator pools): not the flood's
    t_before = time.time()
    wait(args.before_s)
    rss_before = curve.sample(training)
    cpu_before = thread_cpu(training.proc.pid)
    t_flood = time.time()
    command = [sys.executable, "-m", "tests.support.flood", "flood", mode, endpoint]
    flooder = subprocess.Popen(
        [*command, str(args.flood_s), "--inflight", str(args.inflight)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    _pin(flooder.pid, 1)
    flood_start = time.monotonic() - curve.started
    asked = answered = 0
    while flooder.poll() is None:
        began = time.monotonic()
        asked += 1
        with contextlib.suppress(ClientError):
            client.hello(history=64)
            answered += 1
        curve.sample(training)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
    flood_out = flooder.communicate(timeout=60)[0].strip().splitlines()
    t_after = time.time()
    cpu_after = thread_cpu(training.proc.pid)
    flood_end = time.monotonic() - curve.started
    rss_end = curve.sample(training)
    wait(args.after_s)
    rss_later = curve.sample(training)
    load = benchlib.loadavg()
    steps = training.steps(timeout=120)
    during = curve.between(flood_start, flood_end)
    seconds = max(1e-9, t_after - t_flood)

    def cpu_pct(name: str) -> float:
        spent = sum(v for k, v in cpu_after.items() if k.startswith(name))
        spent -= sum(v for k, v in cpu_before.items() if k.startswith(name))
        return round(100 * spent / seconds, 2)

    result = {
        "case": case,
        "flood_s": round(seconds),
        "rss_mib_before": round(rss_before / MIB, 1),
        "rss_mib_peak_during": round(max(during, default=rss_end) / MIB, 1),
        "rss_mib_end_of_flood": round(rss_end / MIB, 1),
        "rss_mib_after": round(rss_later / MIB, 1),
        "after_s": args.after_s,
        "growth_mib_peak": round((max(during, default=rss_end) - rss_before) / MIB, 1),
        "growth_mib_after": round((rss_later - rss_before) / MIB, 1),
        "step_ms_before": round(median_step_ms(steps, t_before, t_flood), 2),
        "step_ms_during": round(median_step_ms(steps, t_flood, t_after), 2),
        "step_ms_after": round(median_step_ms(steps, t_after, t_after + args.after_s), 2),
        **{
            f"step_{part}_ms_{phase}": round(median_step_ms(steps, start, end, part), 2)
            for part in ("cpu", "queued", "active", "blocked")
            for phase, start, end in (
                ("before", t_before, t_flood),
                ("during", t_flood, t_after),
                ("after", t_after, t_after + args.after_s),
            )
        },
        "agent_cpu_pct_during": cpu_pct("memtui-agent"),
        "zmq_io_cpu_pct_during": cpu_pct("ZMQbg/IO"),
        "status_answered": f"{answered}/{asked}",
        "flooder": json.loads(flood_out[-1]) if flood_out else {},
        "rss_curve_mib": [(round(t), round(rss / MIB, 1)) for t, rss in curve.samples[::10]],
        "load_average": load,
    }
    training.stop()
    return result


def table(results: list[dict[str, Any]]) -> str:
    """The cases as one Markdown table."""
    head = (
        "| case | connections | RSS before | peak during | end of flood | after | "
        "median step, wall: before / during / after | on a CPU: before / during / after | "
        "agent CPU | ZeroMQ I/O CPU | status answered |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = []
    for r in results:
        grown = f"{r['growth_mib_peak']:+.0f}"
        after = f"{r['growth_mib_after']:+.0f}"
        wall = f"{r['step_ms_before']} / {r['step_ms_during']} / {r['step_ms_after']} ms"
        active = (
            f"{r['step_active_ms_before']} / {r['step_active_ms_during']} / "
            f"{r['step_active_ms_after']} ms"
        )
        rows.append(
            f"| `{r['case']}` | {r['flooder'].get('connections', '?'):,} | "
            f"{r['rss_mib_before']:.0f} MiB | {r['rss_mib_peak_during']:.0f} MiB ({grown}) | "
            f"{r['rss_mib_end_of_flood']:.0f} MiB | {r['rss_mib_after']:.0f} MiB ({after}) | "
            f"{wall} | {active} | {r['agent_cpu_pct_during']}% | "
            f"{r['zmq_io_cpu_pct_during']}% | {r['status_answered']} |"
        )
    return head + "\n".join(rows) + "\n"


def main() -> None:
    """Measure each case asked for: one JSON line each, then the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="TRANSPORT:MODE, comma-separated")
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--before-s", type=float, default=30.0)
    parser.add_argument("--flood-s", type=float, default=300.0)
    parser.add_argument("--after-s", type=float, default=300.0)
    parser.add_argument("--inflight", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=20.0)
    args = parser.parse_args()
    results = []
    load = benchlib.loadavg()
    for case in args.cases.split(","):
        result = measure(case, args)
        print(json.dumps(result), flush=True)
        results.append(result)
    print(
        f"\nmachine: {benchlib.cpu_model()}, {os.cpu_count()} CPUs, commit {benchlib.commit()}, "
        f"load average {load[0]:.2f} -> {benchlib.loadavg()[0]:.2f}\n"
    )
    print(table(results))


if __name__ == "__main__":
    sys.exit(main())
