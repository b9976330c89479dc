"""A hooked training that records its steps, and a flooder of its sockets, each a process.

``python -m tests.support.flood train OUT SECONDS`` is the training: a small CPU MLP whose steps
take about ``--step-ms`` on a CPU (calibrated on the thread's CPU clock), hooked by memtui (over
plain loopback TCP too with ``--tcp``, read-only to other users, as ``--tcp 127.0.0.1
--insecure`` starts a run); it prints one JSON line with its run id and endpoints once it
trains, and appends its steps (``Step``) to OUT as it goes (written out twice a second, so that
they can be read while it trains, and never held in its memory), until SECONDS have passed or a
``SIGTERM``. ``python -m tests.support.flood flood MODE ENDPOINT SECONDS`` floods one socket of it (run
as another user too: it needs only ZeroMQ and memtui's wire schema) and prints one JSON line of
what came back. ``Training`` starts the training and reads its resident memory from ``/proc``.

The flood's modes, each on fresh connections (``--inflight`` at once, each closed when answered
or after ``--patience`` seconds) unless said otherwise:

- ``hello``: a hello asking for 2,048 steps of history (the largest snapshot);
- ``set``: a set request the run refuses (an unknown knob; read-only over plain TCP);
- ``junk``: a frame that is no request;
- ``connect``: nothing sent, each connection closed after ``--patience``;
- ``sub``: a viewer's subscription on the telemetry socket, closed after ``--patience``;
- ``hello-pipelined``, ``set-pipelined``: the same requests, pipelined on one connection;
- ``hold``: ``--inflight`` connections opened with a hello each and held to the end.

``python -m tests.support.flood slowloris HOST PORT SECONDS`` holds ``--connections`` HTTP
connections to an exporter, each dripping a request's headers a byte at a time and opened again
as soon as the server closes it (a slowloris), and prints what the server answered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODES = (
    "hello",
    "set",
    "junk",
    "connect",
    "sub",
    "hello-pipelined",
    "set-pipelined",
    "hold",
)
HELLO_HISTORY = 2048
PAGE = os.sysconf("SC_PAGE_SIZE")
STEP_RECORD = struct.Struct("=4d")
"""One step in the training's file: when it ended, its wall, CPU and queued seconds."""
STEPS_WRITTEN_S = 0.5
"""How often the training writes out the steps it buffered."""


# --------------------------------------------------------------------------- the training


def train(out: Path, seconds: float, step_ms: float, tcp: str) -> None:
    """The hooked training: print its endpoints, train ``seconds``, write its steps to ``out``."""
    import torch

    from memtui.hooks import Options, Tuner

    torch.set_num_threads(1)
    width = 128
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, width), torch.randn(8, 1)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(200):  # warm up, then calibrate: repeats of the small step in step_ms
        step()
    # on the thread's CPU clock: the same steps whatever else the host runs while it calibrates
    start = time.thread_time()
    for _ in range(200):
        step()
    repeats = max(1, round(step_ms / 1e3 / ((time.thread_time() - start) / 200)))
    config = {"batch_size": 8, "grad_accum": 1}
    options = Options(tcp=tcp, insecure=True) if tcp else Options()
    tuner = Tuner(config, state_dir=out.parent / "state", name="flood", options=options).start()
    rank = tuner.ranks[0]
    endpoints = {"control": rank.control, "pub": rank.pub}
    endpoints.update(control_tcp=rank.control_tcp, pub_tcp=rank.pub_tcp)
    print(json.dumps({"run": tuner.run_id, "pid": os.getpid(), **endpoints}), flush=True)
    schedstat = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_args: stop.set())
    deadline = time.time() + seconds
    with open(out, "wb", buffering=1 << 16) as log:
        written = time.time()
        while time.time() < deadline and not stop.is_set():
            began, cpu, queued = time.perf_counter(), _user_cpu(), _queued(schedstat)
            for _ in range(repeats):
                step()
            tuner.step()
            wall = time.perf_counter() - began
            now = time.time()
            log.write(STEP_RECORD.pack(now, wall, _user_cpu() - cpu, _queued(schedstat) - queued))
            if now - written >= STEPS_WRITTEN_S:
                log.flush()
                written = now
    tuner.close()


def _user_cpu() -> float:
    """This thread's CPU seconds in user mode (the kernel's work on the host's packets, charged
    to whichever thread it interrupts, is left out)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_utime


def _queued(schedstat: int) -> float:
    """Seconds this thread has waited for a CPU on a run queue (the kernel's schedstat)."""
    return int(os.pread(schedstat, 64, 0).split()[1]) / 1e9


@dataclass
class Training:
    """The training in a subprocess: its endpoints, its resident memory, its steps."""

    proc: subprocess.Popen[str]
    out: Path
    endpoints: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        work: Path,
        seconds: float,
        *,
        step_ms: float = 20.0,
        tcp: str = "",
        env: dict[str, str],
    ) -> Training:
        """Start it in ``work`` and wait until it trains (its endpoints printed)."""
        out = work / "steps.bin"
        # this file run by its path, from ``work``: memtui is the one $PYTHONPATH names first
        command = [sys.executable, __file__, "train", str(out), str(seconds)]
        command += ["--step-ms", str(step_ms), "--tcp", tcp]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd=work)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the training exited with {proc.wait()} before it trained")
        return cls(proc, out, json.loads(line))

    def rss(self) -> int:
        """The training process's resident memory now (bytes, from ``/proc``)."""
        with open(f"/proc/{self.proc.pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE

    def steps(self, timeout: float = 120.0) -> list[Step]:
        """Each step: the training is told to end now (``SIGTERM``), and writes the last."""
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout)
        return self.steps_so_far()

    def steps_so_far(self) -> list[Step]:
        """The steps the training has written out (all but the last half second's while it
        trains)."""
        data = self.out.read_bytes() if self.out.exists() else b""
        whole = len(data) - len(data) % STEP_RECORD.size
        return [Step(*fields) for fields in STEP_RECORD.iter_unpack(data[:whole])]

    def stop(self) -> None:
        """End it now if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


@dataclass
class RssCurve:
    """The training's resident memory sampled over time: (seconds since the start, bytes)."""

    started: float
    samples: list[tuple[float, int]] = field(default_factory=list)

    def sample(self, training: Training) -> int:
        """Read and keep the resident memory now."""
        rss = training.rss()
        self.samples.append((time.monotonic() - self.started, rss))
        return rss

    def between(self, start: float, end: float) -> list[int]:
        """The samples taken between ``start`` and ``end`` seconds."""
        return [rss for t, rss in self.samples if start <= t <= end]


@dataclass(frozen=True)
class Step:
    """One training step as the training thread saw it."""

    end: float
    """When it ended (wall clock, epoch seconds)."""
    wall: float
    """Its duration (seconds)."""
    cpu: float
    """The training thread's CPU time in it, in user mode."""
    queued: float
    """The time the training thread waited for a CPU in it (another process or thread ran):
    the rest of ``wall`` beyond ``cpu`` and ``queued`` is the kernel's time on it and the time
    it was blocked (the GIL)."""

    @property
    def active(self) -> float:
        """The time it took while it had a CPU (its wall time less its wait for one)."""
        return max(0.0, self.wall - self.queued)

    @property
    def blocked(self) -> float:
        """The time the training thread neither ran in user mode nor waited for a CPU (the
        GIL, the kernel's work)."""
        return max(0.0, self.wall - self.cpu - self.queued)


def median_step_ms(steps: list[Step], start: float, end: float, part: str = "wall") -> float:
    """The median ``part`` (``wall``, ``cpu``, ``queued``, ``active``, ``blocked``; ms) of the
    steps that ended between ``start`` and ``end`` (epoch seconds)."""
    inside = [getattr(step, part) for step in steps if start <= step.end < end]
    return statistics.median(inside) * 1e3 if inside else float("nan")


# --------------------------------------------------------------------------- the flooder


def flood(
    mode: str, endpoint: str, seconds: float, inflight: int = 300, patience: float = 1.0
) -> dict[str, int]:
    """Flood ``endpoint`` in ``mode`` for ``seconds``; what was sent and what came back."""
    import zmq

    from memtui.wire import Decoder, ErrorReply, Hello, SetRequest, encode

    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 16384)  # closed sockets are reaped a little later
    decoder = Decoder()
    counts = {"sent": 0, "connections": 0, "replies": 0, "busy": 0, "refused": 0}
    hello = encode(Hello(client="flood", history=HELLO_HISTORY))
    frames = {
        "hello": hello,
        "set": encode(SetRequest(changes={"nope": 1}, client="flood")),
        "junk": b"\xc1 this is no request",
        "connect": b"",
        "hold": hello,
    }

    def tally(frame: bytes) -> None:
        counts["replies"] += 1
        reply = decoder.decode(frame)
        if isinstance(reply, ErrorReply):
            counts["busy" if reply.reason.startswith("busy") else "refused"] += 1

    deadline = time.monotonic() + seconds
    if mode.endswith("-pipelined"):
        frame = frames[mode.split("-")[0]]
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, 256 << 20)
        dealer.connect(endpoint)
        counts["connections"] = 1
        while time.monotonic() < deadline:
            try:
                dealer.send_multipart([b"", frame], zmq.NOBLOCK)
                counts["sent"] += 1
            except zmq.Again:
                dealer.poll(10, zmq.POLLIN)
            while dealer.poll(0):
                tally(dealer.recv_multipart()[-1])
        return counts

    def fresh() -> tuple[zmq.Socket, float]:
        if mode == "sub":
            sock = context.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        else:
            sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 256 << 20)
        sock.connect(endpoint)
        counts["connections"] += 1
        if mode not in ("sub", "connect"):
            sock.send(frames[mode])
            counts["sent"] += 1
        return sock, time.monotonic()

    if mode == "hold":
        held = [fresh()[0] for _ in range(inflight)]
        while time.monotonic() < deadline:
            for sock in held:
                if sock.poll(0):
                    tally(sock.recv())
            time.sleep(0.2)
        for sock in held:
            sock.close(0)
        return counts
    answers = mode not in ("sub", "connect")
    """Whether the connections wait for an answer (else each is closed after ``patience``)."""
    poller = zmq.Poller()
    live: dict[zmq.Socket, float] = {}
    while time.monotonic() < deadline:
        while len(live) < inflight:
            try:
                sock, opened = fresh()
            except zmq.ZMQError:  # out of descriptors until the closed sockets are reaped
                break
            live[sock] = opened
            if answers:
                poller.register(sock, zmq.POLLIN)
        answered = dict(poller.poll(20)) if answers else {}
        if not answers:
            time.sleep(0.02)
        now = time.monotonic()
        for sock, opened in list(live.items()):
            done = sock in answered
            if done:
                with contextlib.suppress(zmq.ZMQError):
                    tally(sock.recv(zmq.NOBLOCK))
            if done or now - opened > patience:
                if answers:
                    poller.unregister(sock)
                sock.close(0)
                del live[sock]
    for sock in live:
        sock.close(0)
    return counts


def slowloris(host: str, port: int, seconds: float, connections: int = 40) -> dict[str, int]:
    """Hold ``connections`` to ``host:port`` for ``seconds``, each dripping a request's headers a
    byte every 0.1 s and opened again once closed; what came back, by status line."""
    import selectors
    import socket

    drip = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 4000
    counts: dict[str, int] = {"connections": 0}
    selector = selectors.DefaultSelector()
    live: dict[socket.socket, int] = {}

    def opened() -> None:
        try:
            sock = socket.create_connection((host, port), timeout=2)
        except OSError:
            counts["failed"] = counts.get("failed", 0) + 1
            return
        sock.setblocking(False)
        counts["connections"] += 1
        live[sock] = 0
        selector.register(sock, selectors.EVENT_READ)

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        while len(live) < connections and time.monotonic() < deadline:
            opened()
        for key, _events in selector.select(0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                answer = sock.recv(4096)
            except OSError:
                answer = b""
            status = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
            counts[status] = counts.get(status, 0) + 1
            selector.unregister(sock)
            sock.close()
            del live[sock]
        for sock, sent in list(live.items()):
            with contextlib.suppress(OSError):
                sock.send(drip[sent % len(drip) : sent % len(drip) + 1])
                live[sock] = sent + 1
    for sock in live:
        sock.close()
    return counts


def main() -> int:
    """``train``, ``flood`` or ``slowloris``: see the module's docstring."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role", required=True)
    trainer = sub.add_parser("train")
    trainer.add_argument("out", type=Path)
    trainer.add_argument("seconds", type=float)
    trainer.add_argument("--step-ms", type=float, default=20.0)
    trainer.add_argument("--tcp", default="")
    flooder = sub.add_parser("flood")
    flooder.add_argument("mode", choices=MODES)
    flooder.add_argument("endpoint")
    flooder.add_argument("seconds", type=float)
    flooder.add_argument("--inflight", type=int, default=300)
    flooder.add_argument("--patience", type=float, default=1.0)
    loris = sub.add_parser("slowloris")
    loris.add_argument("host")
    loris.add_argument("port", type=int)
    loris.add_argument("seconds", type=float)
    loris.add_argument("--connections", type=int, default=40)
    args = parser.parse_args()
    if args.role == "train":
        train(args.out, args.seconds, args.step_ms, args.tcp)
    elif args.role == "slowloris":
        print(json.dumps(slowloris(args.host, args.port, args.seconds, args.connections)))
    else:
        counts = flood(args.mode, args.endpoint, args.seconds, args.inflight, args.patience)
        print(json.dumps(counts), flush=True)
        os._exit(0)  # nothing to tidy: ZeroMQ's context is the process's
    return 0


if __name__ == "__main__":
    sys.exit(main())
