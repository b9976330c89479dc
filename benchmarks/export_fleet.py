"""``memtui export`` on a busy node: 10, 100 and 1,000 registered runs, most of them not answering.

The registry is a runtime directory of the benchmark's own, holding for each count N:

- ``--live`` real runs (``python -m memtui.demo``, the light model, started once and kept
  through every count);
- a tenth of N (at least one) *hung* runs: registered by a live process (this one) whose
  control and telemetry sockets exist and take connections (``listen``) but never answer, as a
  stopped or wedged training's do;
- a tenth of N *dead* runs: records of a process that has exited (the registry's first read
  removes them: they cost the exporter that read only);
- the rest *silent* runs: registered by a live process (this one) with no socket at all, the
  case of a private runtime directory full of runs that never answer.

For each count, ``memtui export`` is started on that registry and scraped every
``--scrape-every`` seconds for ``--minutes``; each scrape is timed (p50, p99, max), and the
exporter's RSS and threads are sampled every few seconds (first after ``--warmup``, then
through the window: memory flat means the end is the start). Then the viewer (``memtui attach``'s
app, headless under Textual's test driver, attached to a live run by id) runs on the same
registry for ``--viewer-minutes`` (0: not measured) and its RSS, threads and CPU are taken the
same way. One JSON line per count, with the machine's CPU model, the commit and the load
average, then a summary line::

    {"runs": 1000, "exporter": {"scrape_ms": {"p50": 11.2, "p99": 24.0, ...}, ...}, ...}

Run: ``.venv/bin/python benchmarks/export_fleet.py [--counts 10,100,1000] [--minutes 10]
[--viewer-minutes 10] [--live 2]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import benchlib
import psutil

ROOT = Path(__file__).resolve().parent.parent
LIGHT = ("--seq-len", "16", "--width", "32", "--layers", "1", "--vocab", "64",
         "--slow-data-ms", "1")  # fmt: skip
"""The demo's light model (a quarter of the default's CPU, about as many steps a second)."""
SAMPLE_S = 5.0
"""How often RSS and threads are sampled."""


def register(run: str, pid: int, created: float, host: str, sockets: bool) -> list[socket.socket]:
    """Write ``run``'s record as a hook does; with ``sockets``, bind its control and telemetry
    sockets as listening unix sockets that nobody serves (returned, to be kept open)."""
    from memtui.storage import registry
    from memtui.wire import RankInfo, RunRecord

    rundir = registry.run_dir(run)
    rundir.create()
    listed = RankInfo(rank=0, pub=rundir.pub_endpoint(0), control=rundir.control_endpoint(0),
                      host=host, pid=pid)  # fmt: skip
    held = []
    if sockets:
        for endpoint in (listed.control, listed.pub):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(endpoint[len("ipc://") :])
            sock.listen(64)
            held.append(sock)
    rundir.write(RunRecord(run=run, pid=pid, create_time=created, started=time.time(),
                           host=host, control=listed.control, ranks=[listed]))  # fmt: skip
    return held


def dead_process() -> tuple[int, float]:
    """The pid of a process that has exited, and a start time it had."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid, time.time() - 1.0


class Registry:
    """The benchmark's stand-in runs (hung, dead, silent), rewritten for each count."""

    def __init__(self) -> None:
        from memtui.storage import registry

        self.pid = os.getpid()
        self.created = registry.process_create_time(self.pid)
        self.host = socket.gethostname()
        self.runs: list[str] = []
        self.held: list[socket.socket] = []

    def fill(self, count: int, live: int) -> dict[str, int]:
        """Register stand-ins so that ``count`` runs are registered with the ``live`` ones;
        returns the mix."""
        self.clear()
        hung = max(1, count // 10)
        dead = count // 10
        silent = max(0, count - live - hung - dead)
        for index in range(hung):
            self.held += register(f"hung-{index:04d}", self.pid, self.created, self.host, True)
            self.runs.append(f"hung-{index:04d}")
        gone, gone_created = dead_process()
        for index in range(dead):
            register(f"dead-{index:04d}", gone, gone_created, self.host, False)
            self.runs.append(f"dead-{index:04d}")
        for index in range(silent):
            register(f"silent-{index:04d}", self.pid, self.created, self.host, False)
            self.runs.append(f"silent-{index:04d}")
        return {"live": live, "hung": hung, "dead": dead, "silent": silent}

    def clear(self) -> None:
        """Remove every stand-in (its record, its sockets)."""
        from memtui.storage import registry

        for sock in self.held:
            sock.close()
        self.held = []
        for run in self.runs:
            registry.run_dir(run).remove()
        self.runs = []


def start_demos(count: int, base: Path, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """``count`` demo trainings (the light model), running until stopped; waits until each has
    registered its run."""
    from memtui.storage import registry

    demos = []
    for index in range(count):
        out = base / f"demo{index}"
        log = open(base / f"demo{index}.log", "wb")  # noqa: SIM115 (kept open while it runs)
        command = [sys.executable, "-m", "memtui.demo", "--steps", "100000000", *LIGHT,
                   "--out", str(out), "--progress-every", "3600"]  # fmt: skip
        demos.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        )
    deadline = time.monotonic() + 180
    while len([r for r in registry.list_runs() if r.run.startswith("demo")]) < count:
        if time.monotonic() > deadline or any(d.poll() is not None for d in demos):
            raise SystemExit(f"the demo trainings did not start (see their logs in {base})")
        time.sleep(0.5)
    return demos


class Sampler:
    """A process's RSS and threads every ``SAMPLE_S`` on a thread, and its CPU over a window."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.rss_mb: list[float] = []
        self.threads: list[int] = []
        self.taken: list[float] = []
        """When each sample was taken (seconds into the window)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.cpu0 = self.wall0 = 0.0

    def start(self) -> None:
        """Start sampling (the CPU window starts now)."""
        self.cpu0, self.wall0 = sum(self.process.cpu_times()[:2]), time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while True:
            with contextlib.suppress(psutil.Error):
                self.rss_mb.append(self.process.memory_info().rss / 2**20)
                self.threads.append(self.process.num_threads())
                self.taken.append(time.monotonic() - self.wall0)
            if self._stop.wait(SAMPLE_S):
                return

    def stop(self) -> dict[str, Any]:
        """Stop; the samples and the CPU share over the window."""
        cpu1, wall1 = sum(self.process.cpu_times()[:2]), time.monotonic()
        self._stop.set()
        self._thread.join(SAMPLE_S + 1)
        return {
            "cpu_pct_of_core": round(100 * (cpu1 - self.cpu0) / (wall1 - self.wall0), 2),
            "rss_mb": {
                "first": round(self.rss_mb[0], 1),
                "last": round(self.rss_mb[-1], 1),
                "max": round(max(self.rss_mb), 1),
                "samples": len(self.rss_mb),
                "by_minute": [
                    round(rss, 1)
                    for rss, at, before in zip(
                        self.rss_mb, self.taken, [-1.0, *self.taken], strict=False
                    )
                    if int(at // 60) != int(before // 60)
                ],
            },
            "threads": {
                "min": min(self.threads),
                "max": max(self.threads),
                "last": self.threads[-1],
            },
            "seconds": round(wall1 - self.wall0, 1),
        }


def scrape_value(text: str, name: str) -> float | None:
    """The value of the unlabelled sample ``name`` in a scrape's text."""
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def measure_exporter(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """``memtui export`` on the registry as it is: scrapes timed, RSS and threads sampled."""
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtui.cli", "export", "--listen", "127.0.0.1:0", "--no-token"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert exporter.stderr is not None
    lines: list[str] = []
    try:
        found = re.search(r"serving (http\S+)", exporter.stderr.readline())
        if not found:
            raise SystemExit("the exporter did not start")
        url = found.group(1)
        threading.Thread(target=lambda: lines.extend(exporter.stderr or ()), daemon=True).start()
        seconds: list[float] = []
        failures: list[str] = []
        text = ""

        def scrape() -> None:
            nonlocal text
            started = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=30) as reply:
                    text = reply.read().decode()
                seconds.append(time.monotonic() - started)
            except OSError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")

        time.sleep(args.warmup)
        sampler = Sampler(exporter.pid)
        load_before = benchlib.loadavg()
        sampler.start()
        window = 60 * args.minutes
        while time.monotonic() - sampler.wall0 < window:
            began = time.monotonic()
            scrape()
            time.sleep(max(0.0, began + args.scrape_every - time.monotonic()))
        result = sampler.stop()
        load_after = benchlib.loadavg()
    finally:
        benchlib.stop_process(exporter)
    ms = [1e3 * s for s in seconds]
    result.update({
        "scrapes": len(seconds),
        "scrape_failures": len(failures),
        "first_failure": failures[0] if failures else "",
        "scrape_ms": {"p50": round(benchlib.percentile(ms, 50), 1),
                      "p90": round(benchlib.percentile(ms, 90), 1),
                      "p99": round(benchlib.percentile(ms, 99), 1),
                      "max": round(max(ms), 1) if ms else None,
                      "min": round(min(ms), 1) if ms else None},
        "under_1s": sum(s < 1.0 for s in seconds),
        "ranks_up": len(re.findall(r"^memtui_up\{.*\} 1\.0$", text, re.M)),
        "ranks_not_up": len(re.findall(r"^memtui_up\{.*\} 0\.0$", text, re.M)),
        "registered": scrape_value(text, "memtui_exporter_runs_registered"),
        "unanswered": scrape_value(text, "memtui_exporter_runs_unanswered"),
        "watched": scrape_value(text, "memtui_runs"),
        "load_avg": {"before": load_before, "after": load_after},
    })  # fmt: skip
    return result


def measure_viewer(args: argparse.Namespace, env: dict[str, str], run: str) -> dict[str, Any]:
    """The viewer headless on ``run`` with the registry as it is: RSS, threads and CPU."""
    viewer = subprocess.Popen(
        [sys.executable, __file__, "--viewer", run, "--minutes", str(args.viewer_minutes)],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert viewer.stdout is not None
    try:
        if viewer.stdout.readline().strip() != "ready":
            raise SystemExit("the viewer did not start")
        time.sleep(args.warmup)
        sampler = Sampler(viewer.pid)
        load_before = benchlib.loadavg()
        sampler.start()
        time.sleep(60 * args.viewer_minutes)
        result = sampler.stop()
        result["load_avg"] = {"before": load_before, "after": benchlib.loadavg()}
    finally:
        benchlib.stop_process(viewer)
    return result


def headless_viewer(run: str, minutes: float) -> int:
    """The viewer's app attached to ``run``, headless, until stopped (or ``minutes`` and a
    margin have passed); says ``ready`` once it runs."""
    from memtui.transport.sources import LiveSource
    from memtui.tui.app import MemtuiApp

    async def main() -> None:
        app = MemtuiApp(LiveSource(run))
        async with app.run_test(size=(120, 40)):
            print("ready", flush=True)
            await asyncio.sleep(60 * minutes + 120)

    asyncio.run(main())
    return 0


def main() -> int:
    """Parse the command line; run every count, or the headless viewer."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="10,100,1000", help="registered runs, comma-separated")
    parser.add_argument("--minutes", type=float, default=10.0, help="the exporter's window")
    parser.add_argument(
        "--viewer-minutes", type=float, default=None, help="the viewer's (default: --minutes)"
    )
    parser.add_argument("--live", type=int, default=2, help="real demo trainings among the runs")
    parser.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--viewer", metavar="RUN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.viewer_minutes is None:
        args.viewer_minutes = args.minutes
    if args.viewer:
        return headless_viewer(args.viewer, args.viewer_minutes)
    base = Path(tempfile.mkdtemp(prefix="mtx", dir="/tmp"))
    os.environ["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    os.environ["XDG_STATE_HOME"] = str(base / "state")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    env = dict(os.environ)
    about = {"cpu_model": benchlib.cpu_model(), "cpus": os.cpu_count(),
             "commit": benchlib.commit()}  # fmt: skip
    demos: list[subprocess.Popen[bytes]] = []
    stand_ins = Registry()
    results = []
    try:
        demos = start_demos(args.live, base, env)
        from memtui.storage import registry

        live_runs = sorted(r.run for r in registry.list_runs())
        for count in (int(c) for c in args.counts.split(",")):
            mix = stand_ins.fill(count, args.live)
            entry: dict[str, Any] = {"runs": count, "mix": mix, **about,
                                     "minutes": args.minutes,
                                     "scrape_every_s": args.scrape_every}  # fmt: skip
            entry["exporter"] = measure_exporter(args, env)
            if args.viewer_minutes > 0 and live_runs:
                entry["viewer"] = measure_viewer(args, env, live_runs[0])
            print(json.dumps(entry), flush=True)
            results.append(entry)
    finally:
        stand_ins.clear()
        for demo in demos:
            benchlib.stop_process(demo)
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(summary(results, about)), flush=True)
    return 0


def summary(results: list[dict[str, Any]], about: dict[str, Any]) -> dict[str, Any]:
    """One line: per count, the scrape's p50/p99/max, RSS first and last, threads at most, and
    the viewer's RSS and threads."""
    rows = {}
    for entry in results:
        exporter = entry["exporter"]
        row = {
            "scrape_ms_p50": exporter["scrape_ms"]["p50"],
            "scrape_ms_p99": exporter["scrape_ms"]["p99"],
            "scrape_ms_max": exporter["scrape_ms"]["max"],
            "all_under_1s": exporter["under_1s"] == exporter["scrapes"]
            and not exporter["scrape_failures"],
            "rss_mb": [exporter["rss_mb"]["first"], exporter["rss_mb"]["last"]],
            "threads_max": exporter["threads"]["max"],
            "cpu_pct_of_core": exporter["cpu_pct_of_core"],
        }
        if "viewer" in entry:
            viewer = entry["viewer"]
            row["viewer_rss_mb"] = [viewer["rss_mb"]["first"], viewer["rss_mb"]["last"]]
            row["viewer_threads_max"] = viewer["threads"]["max"]
            row["viewer_cpu_pct_of_core"] = viewer["cpu_pct_of_core"]
        rows[str(entry["runs"])] = row
    return {"summary": rows, **about}


if __name__ == "__main__":
    sys.exit(main())
