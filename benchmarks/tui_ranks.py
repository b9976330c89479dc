"""How much CPU the viewer takes watching 64 ranks: recorded streams replayed at full rate, one
socket each.

The streams are real hook output. By default the benchmark first records the hook itself
(``benchmarks/tui_cpu.py --loop``: ``memtui.hooks`` in a loop at ``--rate`` steps/s, 1,000 by
default, for ``--record-seconds``) with ``MEMTUI_RECORD``, which writes exactly the frames the
hook publishes: a snapshot, then one telemetry batch every 100 ms (the hook's flush period) with
that period's step records, device and host samples, checkpoints and control state.
``--recording FILE`` (repeatable) replays recordings you give instead (``tests/data/*.mtrec``;
every rank of a multi-rank recording is a stream of its own).

A publisher process then stands for a ``--ranks``-rank job (64 by default, with no need of
64 GPUs or 64 cores to run 64 hooks). ONE PUB SOCKET PER SIMULATED RANK replays one
stream (the streams are dealt out to the ranks in turn) at its recorded pace (``--speed 1``,
full rate: every frame when the hook published it), in a loop, each rank starting at another
point of its stream, so that their memory and timings differ (their step numbers are kept in
step, as the ranks of a data-parallel job are). A frame goes out as recorded except
for what makes it this rank's, now: the run id and rank number, its seq, and every time and step
number moved on by the loop (and a recorded end of the run is not passed on). Each rank's
control socket answers hello with a snapshot built from the recording's and the steps it has
replayed (rank 0's lists all the ranks' endpoints, as a real run's does). The run is registered
in the runtime directory as a hook registers it, so the real ``memtui attach RUN`` finds it by
run id and discovers the endpoints itself.

The viewer runs in a detached tmux pane (or headless without tmux); after a warm-up its CPU time
is measured over ``--seconds`` with psutil. One JSON line per pane size::

    {"tui_cpu_pct_of_core": 7.9, "ranks": 64, "steps_per_s_per_rank": 998.1, "size": "60x50", ...}

Target: under 10% of one core. Run: ``.venv/bin/python benchmarks/tui_ranks.py [--ranks 64]
[--rate 1000] [--seconds 20] [--size 120x40 --size 60x50] [--recording FILE ...]``.

``--exporter`` measures ``memtui export`` instead of the viewer, on the same replayed job: it
finds the run in the registry as it finds any, and the benchmark scrapes ``/metrics`` every
``--scrape-every`` seconds (15 by default, Prometheus's usual interval) over the window, for
``--rounds`` rounds; one JSON line per round, then the median with its min and max::

    {"exporter_cpu_pct_of_core_median": 3.72, "min": 3.68, "max": 3.85, "rounds": 5, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    from memtui.wire import (
        ControlState,
        DeviceSample,
        HostSample,
        RankInfo,
        RunInfo,
        Snapshot,
        StepRecord,
        Telemetry,
    )

ROOT = Path(__file__).resolve().parent.parent
FLUSH_S = 0.1
"""The hook's flush period: the gap assumed after a stream's last frame, before it loops."""
DEFAULT_PUBLISH_RECORDING = ROOT / "tests" / "data" / "demo_starving.mtrec"
"""What ``--publish`` alone replays (a recorded ``memtui demo``; the viewer tests use it)."""


@dataclass
class Stream:
    """One recorded rank's telemetry, ready to loop."""

    name: str
    frames: list[tuple[float, Telemetry]]
    """(seconds since the stream's first frame, the frame)."""
    snapshot: Snapshot | None
    period: float
    """One loop: the last frame's offset plus one flush period."""
    step_span: int
    """Steps one loop covers (the step numbers of loop k are moved on by k times this)."""
    control_span: int

    @property
    def steps_per_s(self) -> float:
        """The recorded step rate."""
        return self.step_span / self.period


def load_streams(paths: list[Path]) -> list[Stream]:
    """Every rank's telemetry in each recording, as a stream."""
    from memtui.transport.recording import read_recording
    from memtui.wire import Decoder, Snapshot, Telemetry

    streams = []
    for path in paths:
        recording = read_recording(path)
        decoder = Decoder()
        snapshots: dict[int, Snapshot] = {}
        frames: dict[int, list[tuple[float, Telemetry]]] = {}
        for recorded in recording.frames:
            message = decoder.decode(recorded.frame)
            if isinstance(message, Snapshot):
                snapshots.setdefault(message.info.rank, message)
            elif isinstance(message, Telemetry):
                frames.setdefault(message.rank, []).append((recorded.offset_s, message))
        for rank, telemetry in sorted(frames.items()):
            if len(telemetry) < 2:
                continue
            first = telemetry[0][0]
            base = telemetry[0][1].step - len(telemetry[0][1].steps)
            streams.append(
                Stream(
                    name=f"{path.name}#{rank}",
                    frames=[(offset - first, message) for offset, message in telemetry],
                    snapshot=snapshots.get(rank) or next(iter(snapshots.values()), None),
                    period=telemetry[-1][0] - first + FLUSH_S,
                    step_span=max(1, telemetry[-1][1].step - base),
                    control_span=max(m.control_seq for _o, m in telemetry) + 1,
                )
            )
    if not streams:
        raise SystemExit(f"no telemetry to replay in {', '.join(map(str, paths))}")
    return streams


def record_hook(rate: float, seconds: float, directory: Path) -> Path:
    """Record the real hook stepping at ``rate`` steps/s for ``seconds``; return the file."""
    path = directory / f"hook-{rate:g}.mtrec"
    env = dict(os.environ, MEMTUI_RECORD=str(path), MEMTUI_RUNTIME_DIR=str(directory / "rec"),
               XDG_STATE_HOME=str(directory / "rec-state"))  # fmt: skip
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tui_cpu.py"), "--loop", "--rate", str(rate),
         "--seconds", str(seconds)],
        env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=seconds + 60,
    )  # fmt: skip
    return path


class Replayer:
    """One simulated rank replaying a stream: moves each frame on to its loop and to now."""

    def __init__(self, rank: int, stream: Stream, run: str, start_index: int) -> None:
        self.rank = rank
        self.stream = stream
        self.run = run
        self.index = start_index
        self.loop = 0
        self.origin = stream.frames[start_index][0]
        """The stream offset this rank started at (its time zero)."""
        self.step_origin = stream.frames[start_index][1].step - stream.frames[0][1].step
        """Steps taken off, so that every rank counts from the stream's start (in step, as the
        ranks of a data-parallel job are)."""
        self.seq = 0
        self.step = 0
        self.control_seq = 0
        self.control: ControlState | None = None
        if stream.snapshot is not None:
            self.control = stream.snapshot.control
        self.history: deque[StepRecord] = deque(maxlen=2048)
        self.device: deque[DeviceSample] = deque(maxlen=64)
        self.host: deque[HostSample] = deque(maxlen=64)
        self.steps_sent = 0

    def due(self) -> float:
        """Seconds after this rank's start that its next frame is due (at speed 1)."""
        return self.loop * self.stream.period + self.stream.frames[self.index][0] - self.origin

    def next_frame(self, world_size: int) -> Telemetry:
        """The next frame as this rank publishes it now; advances the replay."""
        import msgspec

        from memtui.wire import CheckpointRecord, StepRecord

        replace = msgspec.structs.replace
        recorded = self.stream.frames[self.index][1]
        now = time.time()
        dt = now - recorded.time
        ds = self.loop * self.stream.step_span - self.step_origin
        steps = [StepRecord(r.step + ds, r.end_time + dt, r.step_time_s, r.data_wait_s,
                            r.samples, r.micro_batches, r.flags)
                 for r in recorded.steps]  # fmt: skip
        device = [replace(d, time=d.time + dt, step=d.step + ds) for d in recorded.device]
        host = replace(recorded.host, time=recorded.host.time + dt) if recorded.host else None
        control = recorded.control
        if control is not None:
            control = self.control = replace(control, world_size=world_size)
        self.seq += 1
        self.step = recorded.step + ds
        self.control_seq = recorded.control_seq + self.loop * self.stream.control_span
        message = replace(
            recorded, run=self.run, rank=self.rank, seq=self.seq, time=now, step=self.step,
            steps=steps, device=device, host=host, control=control,
            control_seq=self.control_seq, ended=False,
            checkpoints=[CheckpointRecord(c.step + ds, c.time + dt, c.save_s)
                         for c in recorded.checkpoints],
        )  # fmt: skip
        self.history.extend(steps)
        self.device.extend(device)
        if host is not None:
            self.host.append(host)
        self.steps_sent += len(steps)
        self.index += 1
        if self.index == len(self.stream.frames):
            self.index = 0
            self.loop += 1
        return message

    def snapshot(self, info: RunInfo, ranks: list[RankInfo], want: int) -> Snapshot:
        """This rank's answer to a hello: its replayed history and the latest control state."""
        from memtui.wire import ControlState, Knobs, Snapshot

        control = self.control or ControlState(config=Knobs(), tunable=[])
        recent = list(self.history)[-min(want, 2048) :] if want else []
        return Snapshot(info=info, control=control, ranks=ranks, step=self.step, seq=self.seq,
                        control_seq=self.control_seq, steps=recent, device=list(self.device),
                        host=list(self.host))  # fmt: skip


def publish(
    ranks: int,
    paths: list[Path],
    seconds: float,
    stats_path: str,
    late: int = 0,
    speed: float = 1.0,
) -> int:
    """Stand for a ``ranks``-rank job: replay the streams, one PUB socket per rank; answer hellos.

    With ``late``, the last ``late`` ranks are listed (in the registry and the snapshots) only
    after two seconds, as ranks that join late: the viewer's tests use it.
    """
    import msgspec
    import zmq

    from memtui.storage import registry
    from memtui.wire import Decoder, Hello, RankInfo, RunInfo, RunRecord, encode

    streams = load_streams(paths)
    run = registry.new_run_id("bench64")
    rundir = registry.run_dir(run)
    rundir.create()
    context = zmq.Context()
    pid = os.getpid()
    pubs, routers, infos, replayers = [], [], [], []
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
                              host="bench-node", pid=pid))  # fmt: skip
        stream = streams[rank % len(streams)]
        start = (rank // len(streams)) * len(stream.frames) * len(streams) // ranks
        replayers.append(Replayer(rank, stream, run, start % len(stream.frames)))
    started = time.time()
    listed = infos[: ranks - late]

    def register() -> None:
        rundir.write(RunRecord(run=run, pid=pid, create_time=registry.process_create_time(pid),
                               started=started, host="bench-node",
                               control=rundir.control_endpoint(0), ranks=listed,
                               command=sys.argv, world_size=ranks))  # fmt: skip

    register()

    def run_info(rank: int) -> RunInfo:
        stream = replayers[rank].stream
        base = stream.snapshot.info if stream.snapshot is not None else RunInfo("", 0, "", 0.0)
        return msgspec.structs.replace(base, run=run, pid=pid, host="bench-node", started=started,
                                       rank=rank, local_rank=rank % 8, world_size=ranks)  # fmt: skip

    stop = False

    def on_term(*_args: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print(f"run {run}", flush=True)
    poller = zmq.Poller()
    for router in routers:
        poller.register(router, zmq.POLLIN)
    decoder = Decoder()
    begin = time.monotonic()
    # each rank's clock starts a fraction of a flush period after the previous one's
    starts = [begin + FLUSH_S * rank / ranks for rank in range(ranks)]
    heap = [(starts[r] + replayers[r].due() / speed, r) for r in range(ranks)]
    heapq.heapify(heap)
    try:
        while not stop and time.monotonic() - begin < seconds:
            if len(listed) < ranks and time.monotonic() - begin > 2.0:
                listed = infos
                register()
            wait_ms = max(0, min(50, int((heap[0][0] - time.monotonic()) * 1000)))
            for sock, _event in poller.poll(wait_ms):
                rank = routers.index(sock)
                frames = sock.recv_multipart()
                request = decoder.decode(frames[-1])
                if isinstance(request, Hello):
                    answer = replayers[rank].snapshot(run_info(rank), listed, request.history)
                    sock.send_multipart([*frames[:-1], encode(answer)])
            now = time.monotonic()
            while heap[0][0] <= now:
                _due, rank = heapq.heappop(heap)
                replayer = replayers[rank]
                frame = encode(replayer.next_frame(ranks))
                try:
                    pubs[rank].send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                heapq.heappush(heap, (starts[rank] + replayer.due() / speed, rank))
    finally:
        elapsed = time.monotonic() - begin
        Path(stats_path).write_text(json.dumps({
            "steps_per_s_per_rank": sum(r.steps_sent for r in replayers) / ranks / elapsed,
            "frames_per_s": sum(r.seq for r in replayers) / elapsed,
            "streams": sorted({s.name for s in streams}),
            "recorded_steps_per_s": [round(s.steps_per_s, 1) for s in streams],
        }))  # fmt: skip
        for sock in pubs + routers:
            sock.close(0)
        context.term()
        rundir.remove()
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
            cpu0, wall0 = sum(me.cpu_times()[:2]), time.monotonic()
            await asyncio.sleep(seconds)
            cpu1, wall1 = sum(me.cpu_times()[:2]), time.monotonic()
            return {"cpu_s": cpu1 - cpu0, "wall_s": wall1 - wall0,
                    "ranks_seen": len(app.state.series)}  # fmt: skip

    print(json.dumps(asyncio.run(main())), flush=True)
    return 0


def start_publisher(
    args: argparse.Namespace, recordings: list[Path], total: float
) -> tuple[subprocess.Popen[str], Path, dict[str, str], str]:
    """The publisher replaying ``recordings`` for ``total`` seconds in a runtime directory of its
    own: the process, that directory, the environment that points at it, and the run id."""
    env = dict(os.environ)
    base = Path(tempfile.mkdtemp(prefix="mtr", dir="/tmp"))
    env["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    env["XDG_STATE_HOME"] = str(base / "state")
    publisher = subprocess.Popen(
        [sys.executable, __file__, "--publish", "--ranks", str(args.ranks), "--speed",
         str(args.speed), "--for", str(total), "--stats", str(base / "publisher.json"),
         *(a for path in recordings for a in ("--recording", str(path)))],
        stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    assert publisher.stdout is not None
    line = publisher.stdout.readline()
    if not line.startswith("run "):
        publisher.terminate()
        raise SystemExit(f"the publisher did not start: {line!r}")
    return publisher, base, env, line.split()[1]


def published_stats(base: Path) -> dict[str, Any]:
    """What the publisher says it sent (its JSON), {} if it wrote nothing."""
    stats = base / "publisher.json"
    return dict(json.loads(stats.read_text())) if stats.exists() else {}


def measure(args: argparse.Namespace, size: str, recordings: list[Path]) -> dict[str, object]:
    """Start the publisher (replaying ``recordings``) and the viewer at ``size``, measure."""
    total = args.warmup + args.seconds + 20
    publisher, base, env, run = start_publisher(args, recordings, total)
    width, height = (int(v) for v in size.split("x"))
    mode = args.mode
    if mode == "auto":
        mode = "tmux" if shutil.which("tmux") else "headless"
    server = f"memtui-ranks-{os.getpid()}"
    pane = ""
    publisher_pct = None
    try:
        if mode == "headless":
            out = subprocess.run(
                [sys.executable, __file__, "--viewer", run, "--seconds", str(args.seconds),
                 "--warmup", str(args.warmup), "--size", size],
                capture_output=True, text=True, env=env, cwd=ROOT, timeout=total + 30,
            )  # fmt: skip
            viewed = json.loads(out.stdout.strip().splitlines()[-1])
            cpu_s, wall_s = viewed["cpu_s"], viewed["wall_s"]
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
            viewer, replay = psutil.Process(pane_pid), psutil.Process(publisher.pid)
            time.sleep(args.warmup)
            pub0 = sum(replay.cpu_times()[:2])
            cpu0, wall0 = sum(viewer.cpu_times()[:2]), time.monotonic()
            time.sleep(args.seconds)
            cpu1, wall1 = sum(viewer.cpu_times()[:2]), time.monotonic()
            cpu_s, wall_s = cpu1 - cpu0, wall1 - wall0
            publisher_pct = round(100 * (sum(replay.cpu_times()[:2]) - pub0) / wall_s, 1)
            pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", "bench"],
                                  capture_output=True, text=True).stdout  # fmt: skip
    finally:
        if mode == "tmux":
            subprocess.run(["tmux", "-L", server, "kill-server"], capture_output=True)
        publisher.terminate()
        publisher.wait(20)
    published = published_stats(base)
    shutil.rmtree(base, ignore_errors=True)
    result: dict[str, object] = {
        "tui_cpu_pct_of_core": round(100 * cpu_s / wall_s, 2),
        "ranks": args.ranks,
        "steps_per_s_per_rank": round(published.get("steps_per_s_per_rank", 0.0), 1),
        "frames_per_s": round(published.get("frames_per_s", 0.0), 1),
        "streams": published.get("streams", []),
        "recorded_steps_per_s": published.get("recorded_steps_per_s", []),
        "publisher_cpu_pct_of_core": publisher_pct,
        "load_avg_1m": round(os.getloadavg()[0], 2),
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


def measure_exporter(args: argparse.Namespace, recordings: list[Path]) -> dict[str, object]:
    """Start the publisher and ``memtui export``; scrape ``/metrics`` every ``--scrape-every``
    seconds, as Prometheus would, and measure the exporter's CPU over ``--seconds``."""
    import re
    import urllib.request

    total = args.warmup + args.seconds + 20
    publisher, base, env, run = start_publisher(args, recordings, total)
    exporter = subprocess.Popen(
        [sys.executable, "-m", "memtui.cli", "export", "--listen", "127.0.0.1:0", "--no-token"],
        stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    scrapes: list[float] = []
    ranks_served = 0
    try:
        assert exporter.stderr is not None
        found = re.search(r"serving (http\S+)", exporter.stderr.readline())
        if not found:
            raise SystemExit("the exporter did not start")
        url = found.group(1)

        def scrape() -> str:
            started = time.monotonic()
            with urllib.request.urlopen(url, timeout=30) as reply:
                text = str(reply.read().decode())
            scrapes.append(time.monotonic() - started)
            return text

        time.sleep(args.warmup)
        me = psutil.Process(exporter.pid)
        cpu0, wall0 = sum(me.cpu_times()[:2]), time.monotonic()
        while time.monotonic() - wall0 < args.seconds:
            text = scrape()
            ranks_served = len(re.findall(rf'^memtui_up{{.*run="{run}".*}} 1\.0$', text, re.M))
            time.sleep(max(0.0, min(args.scrape_every, wall0 + args.seconds - time.monotonic())))
        cpu1, wall1 = sum(me.cpu_times()[:2]), time.monotonic()
    finally:
        exporter.terminate()
        exporter.wait(20)
        publisher.terminate()
        publisher.wait(20)
    published = published_stats(base)
    shutil.rmtree(base, ignore_errors=True)
    return {
        "exporter_cpu_pct_of_core": round(100 * (cpu1 - cpu0) / (wall1 - wall0), 2),
        "ranks": args.ranks,
        "ranks_served": ranks_served,
        "steps_per_s_per_rank": round(published.get("steps_per_s_per_rank", 0.0), 1),
        "frames_per_s": round(published.get("frames_per_s", 0.0), 1),
        "scrape_every_s": args.scrape_every,
        "scrapes": len(scrapes),
        "scrape_s_max": round(max(scrapes), 3) if scrapes else None,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "seconds": round(wall1 - wall0, 1),
        "target_pct": 10,
    }


def summarize_rounds(rounds: list[dict[str, object]], key: str) -> dict[str, object]:
    """The median of ``key`` over the rounds, with its min and max and the load averages."""
    values = sorted(float(str(r[key])) for r in rounds)
    loads = [float(str(r["load_avg_1m"])) for r in rounds]
    return {
        f"{key}_median": values[len(values) // 2],
        "min": values[0],
        "max": values[-1],
        "rounds": len(values),
        "load_avg_1m": [min(loads), max(loads)],
    }


def main() -> int:
    """Parse the command line; run the publisher, the viewer, or the whole measurement."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument(
        "--rate", type=float, default=1000.0, help="steps per second of the hook loop recorded"
    )
    parser.add_argument(
        "--record-seconds", type=float, default=10.0, help="how long the hook loop is recorded"
    )
    parser.add_argument(
        "--recording",
        type=Path,
        action="append",
        metavar="FILE",
        help="replay this recording (repeatable) instead of recording the hook loop",
    )
    parser.add_argument(
        "--speed", type=float, default=1.0, help="replay speed (1: as recorded, full rate)"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window")
    parser.add_argument("--warmup", type=float, default=6.0)
    parser.add_argument("--size", action="append", help="terminal WIDTHxHEIGHT (repeatable)")
    parser.add_argument("--mode", choices=("auto", "tmux", "headless"), default="auto")
    parser.add_argument("--show", action="store_true", help="print the pane at the end (stderr)")
    parser.add_argument(
        "--exporter",
        action="store_true",
        help="measure `memtui export` (scraped every --scrape-every s) instead of the viewer",
    )
    parser.add_argument("--scrape-every", type=float, default=15.0, help="seconds between scrapes")
    parser.add_argument("--rounds", type=int, default=1, help="--exporter: rounds to measure")
    parser.add_argument("--publish", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--for", dest="duration", type=float, default=60.0, help=argparse.SUPPRESS)
    parser.add_argument("--stats", default="/dev/null", help=argparse.SUPPRESS)
    parser.add_argument("--late", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--viewer", metavar="RUN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.size or ["120x40", "60x50"]
    if args.publish:
        paths = args.recording or [DEFAULT_PUBLISH_RECORDING]
        return publish(args.ranks, paths, args.duration, args.stats, args.late, args.speed)
    if args.viewer:
        width, height = (int(v) for v in sizes[0].split("x"))
        return headless_viewer(args.viewer, args.seconds, args.warmup, width, height)
    with tempfile.TemporaryDirectory(prefix="mtrec", dir="/tmp") as scratch:
        recordings = args.recording or [record_hook(args.rate, args.record_seconds, Path(scratch))]
        if args.exporter:
            rounds = [measure_exporter(args, recordings) for _round in range(args.rounds)]
            for result in rounds:
                print(json.dumps(result), flush=True)
            print(json.dumps(summarize_rounds(rounds, "exporter_cpu_pct_of_core")), flush=True)
            return 0
        for size in sizes:
            print(json.dumps(measure(args, size, recordings)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
