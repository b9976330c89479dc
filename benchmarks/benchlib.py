"""Shared by the hook benchmarks: per-thread CPU from /proc, a viewer in its own process, statistics.

Only the hook's public API is used (``hooks.install``, ``tuner.run_id``); the hook's threads are
found as the threads of this process that appeared when the hook was installed, so the figures
do not depend on how the hook names or stores them.

Run as a script (``python benchmarks/benchlib.py subscribe``) it is the viewer-like subscriber
that ``Watcher`` starts (through ``launch``, which starts it and exits, so that it is not the
benchmark's child): it says its pid, reads commands on stdin (``watch RUN_ID`` / ``stop``),
answers one line each, and while watching does what ``memtui attach`` does to a run: a hello on the control
socket (with history), then a SUB on every rank's telemetry socket, decoding every frame.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtui.core.stats import t975

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---------------------------------------------------------------------------- threads


@dataclass(frozen=True)
class Task:
    """One thread of this process as the kernel counts it."""

    tid: int
    name: str
    """The Python thread's name, else the kernel's (``comm``: libzmq names its I/O threads)."""
    cpu_s: float
    """On-CPU time (``schedstat``, nanoseconds; clock ticks of ``stat`` where it is missing)."""
    runnable_s: float
    """Time spent runnable but waiting for a CPU (``schedstat``; 0 where it is missing). The
    rest of the time off the CPU the thread was asleep: a blocking call, or a wait for the GIL."""
    slices: int
    """Times it was put on a CPU (``schedstat``): its wake-ups, and each GIL wait a wake-up."""
    voluntary: int
    """Context switches it asked for: a blocking call, or a wait for the GIL."""
    involuntary: int
    """Times it was preempted (another thread or process took its CPU)."""


def task_ids() -> set[int]:
    """The native ids of this process's threads now."""
    return {int(name) for name in os.listdir("/proc/self/task") if name.isdigit()}


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _task(tid: int, python_names: dict[int, str]) -> Task | None:
    base = f"/proc/self/task/{tid}"
    try:
        stat = _read(f"{base}/stat")
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        try:
            fields = _read(f"{base}/schedstat").split()
            cpu_s, runnable_s, slices = int(fields[0]) / 1e9, int(fields[1]) / 1e9, int(fields[2])
        except (OSError, IndexError, ValueError):
            after = stat[stat.rindex(")") + 2 :].split()
            cpu_s, runnable_s, slices = (int(after[11]) + int(after[12])) / _TICKS, 0.0, 0
        status = _read(f"{base}/status")
    except (OSError, ValueError):
        return None  # the thread ended meanwhile
    switches = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in switches:
            switches[key] = int(value)
    return Task(
        tid=tid,
        name=python_names.get(tid, comm),
        cpu_s=cpu_s,
        runnable_s=runnable_s,
        slices=slices,
        voluntary=switches["voluntary_ctxt_switches"],
        involuntary=switches["nonvoluntary_ctxt_switches"],
    )


def snapshot() -> dict[int, Task]:
    """Every thread of this process, by native id."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tasks = (_task(tid, names) for tid in sorted(task_ids()))
    return {task.tid: task for task in tasks if task is not None}


@dataclass
class ThreadDelta:
    """What one thread did between two snapshots."""

    name: str
    cpu_s: float
    runnable_s: float
    slices: int
    voluntary: int
    involuntary: int


def deltas(before: dict[int, Task], after: dict[int, Task]) -> dict[int, ThreadDelta]:
    """Per-thread differences, for the threads alive at both snapshots."""
    out: dict[int, ThreadDelta] = {}
    for tid, end in after.items():
        start = before.get(tid)
        if start is None:
            continue
        out[tid] = ThreadDelta(
            name=end.name,
            cpu_s=end.cpu_s - start.cpu_s,
            runnable_s=end.runnable_s - start.runnable_s,
            slices=end.slices - start.slices,
            voluntary=end.voluntary - start.voluntary,
            involuntary=end.involuntary - start.involuntary,
        )
    return out


def wait_run_id(log: Path, proc: subprocess.Popen[Any], timeout: float, what: str) -> str:
    """The run id a training prints first (``run ID ...``) in ``log``; raises if ``proc`` exits
    or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("run "):
                return line.split()[1]
        if proc.poll() is not None:
            tail = "\n".join(log.read_text().splitlines()[-8:])
            raise RuntimeError(f"{what} exited: {tail}")
        time.sleep(0.3)
    raise RuntimeError(f"{what} printed no run id in {timeout:g} s")


def stop_process(proc: subprocess.Popen[Any], wait_s: float = 20.0) -> None:
    """End ``proc``: SIGTERM, then SIGKILL after ``wait_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def cpu_hogs(count: int) -> Any:
    """``count`` processes of ``yes > /dev/null`` (each keeps a core busy) for the length of the
    block: the load a shared training machine puts beside a run."""
    hogs = [
        subprocess.Popen(["yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor elsewhere): the same script
    ran the bare loop at 7.4 µs a step on one VM and 11.5-21 µs on another, so a wall-clock figure
    says which machine it came from."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    """The checkout's commit (with ``+`` when files differ from it), or "" outside a checkout."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return ""
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


# ---------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: list[float], digits: int = 3) -> dict[str, Any]:
    """Median, min, max and interquartile range of several runs or rounds."""
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return {"median": None, "min": None, "max": None, "iqr": None, "n": 0}
    return {
        "median": round(statistics.median(clean), digits),
        "min": round(min(clean), digits),
        "max": round(max(clean), digits),
        "iqr": [round(percentile(clean, 25), digits), round(percentile(clean, 75), digits)],
        "n": len(clean),
    }


def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (the rounds taken as independent)."""
    n = len(values)
    mean = statistics.fmean(values) if values else math.nan
    if n < 2:
        return mean, math.nan
    return mean, t975(n - 1) * statistics.stdev(values) / math.sqrt(n)


def bootstrap_median(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median (seeded: the same data, the same CI)."""
    if len(values) < 2:
        return math.nan, math.nan
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def paired(diffs: list[float], digits: int = 3) -> dict[str, Any]:
    """The hook-minus-bare differences of the rounds: mean with its 95% t-interval, median
    with a bootstrap interval, and the range."""
    mean, half = t_interval(diffs)
    low, high = bootstrap_median(diffs)

    def r(x: float) -> float | None:
        return None if math.isnan(x) else round(x, digits)

    return {
        "mean": r(mean),
        "ci95": r(half),
        "median": r(statistics.median(diffs)) if diffs else None,
        "median_ci95": [r(low), r(high)],
        "min": r(min(diffs)) if diffs else None,
        "max": r(max(diffs)) if diffs else None,
        "n": len(diffs),
    }


# ---------------------------------------------------------------------------- the viewer


class Watcher:
    """A viewer-like subscriber in its own process (``memtui attach`` minus the drawing).

    The subscriber is not a child of this process: a launcher starts it and exits at once, so it
    is reparented away and talks through the inherited pipes only. The benchmarks measure in
    the training process, and the hook counts the training's child processes as its loader
    workers (their RSS, USS and CPU, every sample): a viewer started as the training's child
    would be sampled as one, which a real ``memtui attach`` never is.
    """

    def __init__(self) -> None:
        launcher = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "launch"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        launcher.wait()
        assert launcher.stdin is not None and launcher.stdout is not None
        self.stdin, self.stdout = launcher.stdin, launcher.stdout
        self.pid = int(self._answer()["pid"])
        """The subscriber's process id (not a child of this process)."""

    def _answer(self) -> dict[str, Any]:
        answer = self.stdout.readline()
        if not answer:
            raise RuntimeError("the subscriber ended")
        reply: dict[str, Any] = json.loads(answer)
        if "error" in reply:
            raise RuntimeError(f"the subscriber: {reply['error']}")
        return reply

    def _ask(self, line: str) -> dict[str, Any]:
        self.stdin.write(line + "\n")
        self.stdin.flush()
        return self._answer()

    def watch(self, run_id: str) -> dict[str, Any]:
        """Attach to the run and return once its first telemetry frame arrived."""
        return self._ask(f"watch {run_id}")

    def unwatch(self) -> dict[str, Any]:
        """Detach; returns the frames and bytes received while watching."""
        return self._ask("stop")

    def close(self) -> None:
        """End the subscriber: its stdin closed, it exits (its stdout ends); killed after 5 s."""
        if self.stdin.closed:
            return
        with contextlib.suppress(OSError):
            self.stdin.close()
        ended, _, _ = select.select([self.stdout], [], [], 5.0)
        if not ended:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        self.stdout.close()

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _subscribe() -> None:
    """The subscriber process (see the module's docstring)."""
    import zmq

    from memtui.storage import registry
    from memtui.transport.client import ControlClient, client_name
    from memtui.wire import Decoder

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    decoder = Decoder()
    subs: list[zmq.Socket] = []
    frames = size = 0
    poller = zmq.Poller()
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)

    def say(reply: dict[str, Any]) -> None:
        print(json.dumps(reply), flush=True)

    say({"pid": os.getpid()})

    def receive(sock: zmq.Socket) -> None:
        nonlocal frames, size
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames += 1
            size += len(frame.buffer)
            decoder.decode(frame.buffer)

    while True:
        ready = dict(poller.poll(1000))
        for sock in subs:
            if sock in ready:
                receive(sock)
        if stdin not in ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        command, _, arg = line.strip().partition(" ")
        if command == "watch":
            try:
                deadline = time.monotonic() + 15
                while True:
                    try:
                        target = registry.find_run(arg)
                        if target.ranks:
                            break
                    except registry.RunNotFound:
                        pass
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"run {arg} not registered")
                    time.sleep(0.02)
                ControlClient(target.control, client=client_name("bench")).hello()
                for rank in target.ranks:
                    sock = context.socket(zmq.SUB)
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(registry.rank_pub(rank))
                    poller.register(sock, zmq.POLLIN)
                    subs.append(sock)
                frames = size = 0
                while frames == 0 and time.monotonic() < deadline:
                    for sock, _ in poller.poll(100):
                        if sock in subs:
                            receive(sock)
                if frames == 0:
                    raise TimeoutError("no telemetry frame within 15 s")
                say({"watching": arg, "ranks": len(subs)})
            except Exception as exc:
                say({"error": f"{type(exc).__name__}: {exc}"})
        elif command == "stop":
            for sock in subs:
                receive(sock)
                poller.unregister(sock)
                sock.close(0)
            subs.clear()
            say({"frames": frames, "bytes": size, "bad_frames": decoder.bad_frames})
        else:
            say({"error": f"unknown command {command!r}"})


if __name__ == "__main__" and sys.argv[1:] == ["launch"]:
    # the subscriber inherits this launcher's stdin and stdout (the Watcher's pipes); the
    # launcher exits at once, so the subscriber is nobody's child in the benchmark's tree
    subprocess.Popen([sys.executable, __file__, "subscribe"])
elif __name__ == "__main__" and sys.argv[1:] == ["subscribe"]:
    _subscribe()
