"""Where a viewer's frames come from: a live run's sockets, or a recorded stream replayed.

A *source* hands raw wire frames to the viewer's receiver, which decodes them itself (so a
replay goes through the same decoder, bad-frame counting included). Two sources exist:
:class:`LiveSource` (ZeroMQ: SUB to every rank's telemetry, one socket per security domain,
requests to rank 0's control socket, and one hello to every other rank's control socket for its
history and config) and :class:`ReplaySource` (a recording file, at real or accelerated speed).
:func:`record` writes what a live source receives to a recording (:mod:`memtui.transport.recording`, the
file format, which the training process uses too and which imports no ZeroMQ).

Nothing here imports torch or Textual; the training process does not import this module.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

import zmq

from memtui import wire
from memtui.storage import registry
from memtui.transport.client import ClientError, ControlClient, client_name, send_request
from memtui.transport.recording import (
    CONTROL_RANK,
    Recording,
    RecordingHeader,
    RecordingWriter,
    read_recording,
)
from memtui.transport.security import SecurityError, client_domain, make_client
from memtui.wire import Decoder, Hello, Message, RankInfo, Snapshot, Telemetry, encode

TELEMETRY = -2
"""The rank a live source gives a telemetry frame: its publisher's rank is inside the frame
(one socket takes the telemetry of every rank of a security domain)."""
MAX_BURST = 10_000
"""Frames taken from each telemetry socket per poll, at most."""
MAX_FRAME = 16 << 20
"""Telemetry frames over this size are refused by ZeroMQ (a bad publisher cannot bloat us)."""
RANK_HISTORY = 512
"""Step records asked of each rank other than the control rank (its own hello, once)."""
RANKS_REFRESH_S = 5.0
"""How often a live source reads the run's registry record again for ranks that appeared."""

T = TypeVar("T")

RawFrame = tuple[int, bytes]
"""A frame as a source yields it: (publishing rank, -1 for the control socket, or -2 for
telemetry whose rank is in the frame; raw bytes)."""


class SourceUnavailable(RuntimeError):
    """The source cannot deliver now (no such run, no answer, end of a recording)."""


class Source(Protocol):
    """What the viewer's receiver reads from; every method is called from the receiver's thread."""

    serves_requests: bool
    """Whether hello/set/cancel requests can be made (a recording takes none)."""

    @property
    def label(self) -> str:
        """What the source is attached to, for the user: a run id, an endpoint or a file."""
        ...

    @property
    def finished(self) -> bool:
        """True when no frame will ever come again (the end of a recording)."""
        ...

    def connect(self) -> None:
        """Find the run and subscribe (or start the replay); raise SourceUnavailable."""
        ...

    def poll(self, timeout_s: float) -> list[RawFrame]:
        """Frames received within ``timeout_s`` (empty when none came)."""
        ...

    def request(self, message: Message, expect: type[T]) -> T:
        """Send a control request and return its reply; raise SourceUnavailable."""
        ...

    def disconnect(self) -> None:
        """Drop the subscriptions (``connect`` may be called again)."""
        ...

    def resubscribe(self, ranks: list[int] | None = None) -> int:
        """Connect anew to the telemetry of ``ranks`` (None: every rank); returns how many
        endpoints were (a source without subscriptions: 0)."""
        ...

    def probe(self, rank: int) -> None:
        """Ask ``rank`` (not the control rank) for a snapshot again: it comes back through
        ``poll`` if the rank is alive."""
        ...

    def close(self) -> None:
        """Release everything."""
        ...

    def now(self) -> float:
        """The source's wall clock: real time live, the recording's time in a replay."""
        ...

    def exited(self) -> str:
        """Words for the run's process known gone ("" while it may live, or nobody can tell)."""
        ...

    def picked(self) -> str:
        """Why this run was taken among several live ones ("" when it was named, or alone)."""
        ...

    def offer(self) -> tuple[wire.RunRecord, str] | None:
        """Another live run to offer the user once the run is gone, and why that one (None:
        none, or the user named the run)."""
        ...

    def follow(self, run: str) -> None:
        """Attach to ``run`` from the next ``connect`` on (the user chose it)."""
        ...


class LiveSource:
    """A live run: SUB sockets on every rank's telemetry, a ControlClient for rank 0's control.

    ``selector`` is what the user gave ``memtui attach`` (run id or prefix, pid, endpoint, or
    None for the newest live run). Once a run has answered, the source is attached to that run
    alone (``run``): after it is lost, ``connect`` finds only the same run again (an endpoint
    that answers for another run is refused), never another one on its own; ``offer`` names a
    run the user may choose to ``follow`` (only without a selector: a named run is a promise).

    Every rank the registry or a snapshot lists is subscribed to (ranks that appear later too:
    the registry record is read again every ``ranks_refresh_s``): ranks on this host over ipc,
    the others, and ranks here whose ipc socket this user cannot open (``reachable``), over
    TCP. One SUB socket takes the telemetry of every rank reached the same way (fair-queued):
    one for the plain ipc ranks, one per CURVE server key, all polled here.
    They cannot share one socket: CURVE options set for a TCP rank apply to every later
    connect, and an ipc rank connected after that would never deliver a frame. Once
    the control rank has answered, every other rank gets one hello on its own control socket,
    without waiting for the answer: the snapshots come back through ``poll`` as control frames
    (rank -1), and a rank that does not answer within the request timeout is given up on.
    """

    serves_requests = True

    def __init__(
        self,
        selector: str | None,
        *,
        context: zmq.Context | None = None,
        client: str = "",
        request_timeout_s: float = 2.0,
        ranks_refresh_s: float = RANKS_REFRESH_S,
    ) -> None:
        self.selector = selector
        self.ranks_refresh_s = ranks_refresh_s
        """How often the run's registry record is read again for ranks that appeared."""
        self.context = context or zmq.Context()
        self._own_context = context is None
        self.client = client or client_name("tui")
        self.request_timeout_s = request_timeout_s
        self.run = ""
        """The run this source is attached to, as the registry knows it (set by the first
        connection, or by ``follow``): the only run it looks for."""
        self._picked = ""
        """Why the run was taken among several (the registry's note at the first connection)."""
        self._info: wire.RunInfo | None = None
        """The run's identity, from its latest snapshot (pid, host, state dir, cwd): a snapshot
        of another run is refused."""
        self._control = ""
        self._sockets: dict[bytes, zmq.Socket] = {}
        """SUB sockets by security domain (``security.client_domain``): b"" for the plain ipc
        (and insecure loopback) ranks, else the CURVE server key; each is connected to the
        telemetry endpoint of every rank of its domain (fair-queued)."""
        self._subs: dict[str, int] = {}
        """The endpoints subscribed to, and their ranks."""
        self.refused: dict[str, str] = {}
        """Endpoints a snapshot listed that could not be subscribed to, and why (until the next
        connection)."""
        self._poller = zmq.Poller()
        self._wanted: list[RankInfo] = []
        self._wanted_lock = threading.Lock()
        self._ranks: dict[int, RankInfo] = {}
        """Every rank subscribed to, by number (its latest endpoints)."""
        self._control_rank: int | None = None
        """The rank whose control socket answered the last hello (None: not yet)."""
        self._asked: set[int] = set()
        """Ranks sent their hello in this connection."""
        self._probed: set[int] = set()
        """Ranks to send one more hello at the next poll, the control rank too (``probe``)."""
        self._hellos: dict[zmq.Socket, tuple[int, float]] = {}
        """Hellos awaiting an answer: socket -> (rank, give up at)."""
        self._next_refresh = 0.0

    @property
    def label(self) -> str:
        """The run id once known, else what the user asked for."""
        return self.run or self.selector or "the newest live run"

    @property
    def finished(self) -> bool:
        """A live run may always come back."""
        return False

    @property
    def control_endpoint(self) -> str:
        """Rank 0's control endpoint while connected ("" otherwise)."""
        return self._control

    def _resolve(self) -> registry.Target:
        selector = self.selector
        if selector and "://" in selector:
            return registry.Target(control=selector, ranks=[], run="")
        try:
            if self.run:  # attached: this run only (a run id is never reused)
                return registry.find_run(self.run)
            return registry.find_run(selector)
        except registry.RunNotFound as exc:
            if self.run:
                raise SourceUnavailable(f"run {self.run} is not running")
            if selector:
                raise SourceUnavailable(f"waiting for a run matching {selector!r} ({exc})")
            where = registry.runtime_dir(create=False)
            raise SourceUnavailable(f"waiting for a run in {where} (ctrl+c to quit)")
        except registry.RegistryError as exc:
            raise SourceUnavailable(str(exc))

    def connect(self) -> None:
        """Resolve the run and subscribe to its ranks' telemetry (before any hello)."""
        self.disconnect()
        target = self._resolve()
        self._control = target.control
        if target.run:
            self._picked = self._picked or target.note
            self.run = target.run
        self.subscribe(*target.ranks)
        self._apply_wanted(strict=True)
        self._next_refresh = time.monotonic() + self.ranks_refresh_s

    def subscribe(self, *ranks: RankInfo) -> None:
        """Subscribe to more ranks' telemetry (thread-safe: applied in the receiver's thread)."""
        with self._wanted_lock:
            self._wanted.extend(ranks)

    def _apply_wanted(self, strict: bool = False) -> None:
        """Subscribe to the ranks wanted; an endpoint that cannot be subscribed to is skipped
        and not tried again in this connection (``strict``, when connecting: raise)."""
        with self._wanted_lock:
            wanted, self._wanted = self._wanted, []
        for rank in wanted:
            endpoint = reachable_pub(rank)  # ipc on this host as its user, else TCP
            if not endpoint or endpoint in self._subs or endpoint in self.refused:
                continue
            try:
                self._sub_socket(endpoint).connect(endpoint)
            except (zmq.ZMQError, SecurityError) as exc:
                if strict:
                    raise SourceUnavailable(f"cannot subscribe to {endpoint}: {exc}")
                # a snapshot's word (a peer's): one bad endpoint leaves the other ranks
                self.refused[endpoint] = str(exc)
                continue
            self._subs[endpoint] = rank.rank
            if self._ranks.get(rank.rank, rank) != rank:
                self._asked.discard(rank.rank)  # new endpoints: ask it again
            self._ranks[rank.rank] = rank

    def _sub_socket(self, endpoint: str) -> zmq.Socket:
        """The SUB socket for ``endpoint``'s security domain (made on first use)."""
        domain = client_domain(endpoint)
        sock = self._sockets.get(domain)
        if sock is None:
            sock = self.context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 10000)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                make_client(sock, endpoint)  # every endpoint of the domain takes the same keys
            except SecurityError:
                sock.close(0)
                raise
            self._sockets[domain] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _refresh_ranks(self) -> None:
        """Subscribe to ranks the run's registry record lists now (at most every few seconds)."""
        now = time.monotonic()
        if not self.run or now < self._next_refresh:
            return
        self._next_refresh = now + self.ranks_refresh_s
        try:
            target = registry.find_run(self.run)
        except (registry.RunNotFound, registry.RegistryError):
            return
        if target.run == self.run:
            self.subscribe(*(r for r in target.ranks if self._ranks.get(r.rank) != r))

    def _ask_ranks(self) -> None:
        """Send one hello to every known rank not asked yet (the control rank aside, unless
        probed)."""
        if self._control_rank is None:
            return
        frame = b""
        for number, info in self._ranks.items():
            probed = number in self._probed
            if (number == self._control_rank and not probed) or number in self._asked:
                continue
            self._asked.add(number)
            self._probed.discard(number)
            endpoint = reachable_control(info)
            if not endpoint:
                continue
            frame = frame or encode(Hello(client=self.client, history=RANK_HISTORY))
            sock = send_request(self.context, endpoint, frame, MAX_FRAME)
            if sock is None:
                continue
            self._hellos[sock] = (number, time.monotonic() + self.request_timeout_s)
            self._poller.register(sock, zmq.POLLIN)

    def _close_hello(self, sock: zmq.Socket) -> None:
        self._hellos.pop(sock, None)
        with contextlib.suppress(KeyError):
            self._poller.unregister(sock)
        sock.close(0)

    def resubscribe(self, ranks: list[int] | None = None) -> int:
        """Connect anew to the telemetry endpoints of ``ranks`` (None: every rank), leaving the
        other ranks sharing their sockets alone; returns how many endpoints were."""
        # libzmq drops a SUB connection for good on a frame over MAXMSGSIZE (no reconnect):
        # disconnecting that endpoint and connecting it again brings its frames back
        count = 0
        for endpoint, rank in list(self._subs.items()):
            if ranks is not None and rank not in ranks:
                continue
            try:
                sock = self._sockets[client_domain(endpoint)]
            except (KeyError, SecurityError):
                continue
            with contextlib.suppress(zmq.ZMQError):  # gone already: only connect
                sock.disconnect(endpoint)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                del self._subs[endpoint]
                self.refused[endpoint] = str(exc)
                continue
            count += 1
        return count

    def probe(self, rank: int) -> None:
        """Send ``rank`` one more hello at the next poll, without waiting for its answer (its
        snapshot comes through ``poll`` if it is alive)."""
        self._asked.discard(rank)
        self._probed.add(rank)

    def poll(self, timeout_s: float) -> list[RawFrame]:
        """Frames from every subscribed rank (and the other ranks' snapshots, as control frames),
        waiting up to ``timeout_s`` for the first."""
        self._apply_wanted()
        self._refresh_ranks()
        self._apply_wanted()
        self._ask_ranks()
        if not self._sockets and not self._hellos:
            time.sleep(timeout_s)
            return []
        frames: list[RawFrame] = []
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        for sock in self._sockets.values():
            if sock not in ready:
                continue
            for _ in range(MAX_BURST):
                try:
                    frames.append((TELEMETRY, sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        now = time.monotonic()
        for sock, (_rank, give_up) in list(self._hellos.items()):
            if sock in ready:
                with contextlib.suppress(zmq.Again):
                    frames.append((CONTROL_RANK, sock.recv(zmq.NOBLOCK)))
                    self._close_hello(sock)
            elif now >= give_up:
                self._close_hello(sock)
        return frames

    def request(self, message: Message, expect: type[T]) -> T:
        """One request on rank 0's control socket; a Snapshot also tells which ranks to follow."""
        if not self._control:
            raise SourceUnavailable("not connected")
        client = ControlClient(
            self._control,
            timeout_s=self.request_timeout_s,
            context=self.context,
            client=self.client,
        )
        try:
            reply = client.request(message, expect)
        except ClientError as exc:
            raise SourceUnavailable(str(exc))
        if isinstance(reply, Snapshot):
            known = self._info.run if self._info is not None else ""
            if known and reply.info.run != known:  # an endpoint that another run took
                raise SourceUnavailable(f"{reply.info.run} answers there now, not {known}")
            self.run = self.run or reply.info.run
            self._info = reply.info
            self._control_rank = reply.info.rank
            self.subscribe(*reply.ranks)
        return reply

    def disconnect(self) -> None:
        """Close the SUB sockets and the hellos still waiting."""
        for sock in self._sockets.values():
            with contextlib.suppress(KeyError):
                self._poller.unregister(sock)
            sock.close(0)
        self._sockets.clear()
        self._subs.clear()
        self.refused.clear()
        for sock in list(self._hellos):
            self._close_hello(sock)
        self._ranks.clear()
        self._asked.clear()
        self._probed.clear()
        self._control_rank = None
        self._control = ""

    def close(self) -> None:
        """Close the sockets and (if it is ours) the ZeroMQ context."""
        self.disconnect()
        if self._own_context:
            self.context.term()

    def now(self) -> float:
        """Real wall time."""
        return time.time()

    def picked(self) -> str:
        """The registry's words when it took the newest of several live runs (the viewer shows
        them: on stderr they were hidden behind it)."""
        return self._picked

    def exited(self) -> str:
        """Words for the run's process known gone: it ran on this host and no process with its
        pid started before the run did ("" otherwise: alive, or on another host)."""
        info = self._info
        if info is None or not registry.process_exited(info.pid, info.host, info.started):
            return ""
        return f"process {info.pid} exited without ending the run (killed or crashed)"

    def offer(self) -> tuple[wire.RunRecord, str] | None:
        """The live run most like the lost one (same state dir, then same working directory,
        then the newest), and why; None when the user named the run or none is live."""
        if self.selector or not self.run:
            return None
        try:
            others = [r for r in registry.list_runs() if r.run != self.run]
        except registry.RegistryError:
            return None
        if not others:
            return None
        info = self._info
        state_dir = info.state_dir if info is not None else ""
        cwd = info.cwd if info is not None else ""

        def likeness(record: wire.RunRecord) -> tuple[bool, bool, float]:
            same_dir = bool(state_dir) and record.state_dir == state_dir
            return same_dir, bool(cwd) and record.cwd == cwd, record.started

        best = max(others, key=likeness)
        same_dir, same_cwd, _started = likeness(best)
        why = "same state dir" if same_dir else "same working directory" if same_cwd else "newest"
        return best, why

    def follow(self, run: str) -> None:
        """Attach to ``run`` from the next ``connect`` on (the user chose it)."""
        self.run = run
        self._info = None


def reachable_pub(rank: RankInfo) -> str:
    """The endpoint this user subscribes to for a rank's telemetry (``reachable``)."""
    return reachable(registry.rank_pub, rank, rank.pub_tcp)


def reachable_control(rank: RankInfo) -> str:
    """The endpoint this user asks a rank for its snapshot on (``reachable``)."""
    return reachable(registry.rank_control, rank, rank.control_tcp)


def reachable(pick: Callable[[RankInfo], str], rank: RankInfo, tcp: str) -> str:
    """The registry's choice for ``rank`` (``pick``: its ipc socket when the rank runs on this
    host, else TCP), unless that is an ipc socket this user cannot open, then ``tcp``: a run
    of another user on this node is, for this user, a run on another node."""
    try:
        endpoint = pick(rank)
    except OSError:  # the socket's directory is another user's (0700): it cannot be looked in
        return tcp
    path = registry.endpoint_path(endpoint)
    if path is not None and tcp and not os.access(path, os.R_OK | os.W_OK):
        return tcp
    return endpoint


ReplayEnd = Literal["hold", "disconnect"]
"""What a replay does after its last frame: hold the view as it is (the clock stops), or go
silent so that the viewer sees the run disconnect."""


class ReplaySource:
    """A recording replayed: at ``speed`` times real time, or at once (``speed=None``).

    ``until_s`` stops the replay at that offset. The clock (``now``) is the recording's: the
    header's start plus the offset of the last frame delivered, so ages and elapsed times read
    the same on every replay. With ``at_end="disconnect"`` the clock then jumps ``silence_s``
    ahead and nothing more comes, exactly what a viewer sees when a run dies without a word.
    """

    serves_requests = False

    def __init__(
        self,
        recording: Recording | str | os.PathLike[str],
        *,
        speed: float | None = 1.0,
        until_s: float | None = None,
        at_end: ReplayEnd = "hold",
        silence_s: float = 10.0,
    ) -> None:
        self.recording = (
            recording if isinstance(recording, Recording) else read_recording(recording)
        )
        self._name = "" if isinstance(recording, Recording) else Path(recording).name
        self.speed = speed
        self.until_s = until_s
        self.at_end = at_end
        self.silence_s = silence_s
        self._frames = [
            f for f in self.recording.frames if until_s is None or f.offset_s <= until_s
        ]
        self._next = 0
        self._started: float | None = None
        self._offset = 0.0
        self._silent = False
        self._clock_lock = threading.Lock()
        self._base_position = 0.0
        """The recording offset (seconds) reached at ``_based_at``."""
        self._based_at = 0.0
        self.paused = False
        """The replay's clock is stopped (``pause``); nothing more is delivered until resumed."""

    @property
    def label(self) -> str:
        """The recording's file name (or run id)."""
        return f"replay {self._name or self.recording.header.run}"

    @property
    def delivered(self) -> bool:
        """True once every frame (up to ``until_s``) has been delivered."""
        return self._started is not None and self._next >= len(self._frames)

    @property
    def finished(self) -> bool:
        """Delivered, and (``at_end="disconnect"``) polled once more: the silence has begun."""
        return self.delivered and (self.at_end == "hold" or self._silent)

    def connect(self) -> None:
        """Start the replay (once: after its end there is nothing to connect to)."""
        if self.delivered:
            raise SourceUnavailable("end of the recording")
        if self._started is None:
            self._started = self._based_at = time.monotonic()

    def position(self) -> float:
        """How far into the recording the replay's clock is (seconds)."""
        with self._clock_lock:
            if self._started is None or self.paused or self.speed is None:
                return self._base_position
            return self._base_position + (time.monotonic() - self._based_at) * self.speed

    def _rebase(self) -> None:
        # called with the lock held: the clock's position so far becomes the new base
        now = time.monotonic()
        if self._started is not None and not self.paused and self.speed is not None:
            self._base_position += (now - self._based_at) * self.speed
        self._based_at = now

    def pause(self, paused: bool) -> None:
        """Stop (or restart) the replay's clock; safe from any thread."""
        with self._clock_lock:
            self._rebase()
            self.paused = paused

    def set_speed(self, speed: float) -> None:
        """Replay at ``speed`` times real time from here on; safe from any thread."""
        if speed <= 0:
            raise ValueError("the replay speed must be positive")
        with self._clock_lock:
            self._rebase()
            self.speed = speed

    def poll(self, timeout_s: float) -> list[RawFrame]:
        """The frames due by now; sleeps until the next one is due (at most ``timeout_s``)."""
        if self._started is None or self.delivered:
            self._silent = self.delivered and self.at_end == "disconnect"
            time.sleep(timeout_s)
            return []
        if self.speed is None:
            due = len(self._frames)
        else:
            position = self.position()
            due = self._next
            while due < len(self._frames) and self._frames[due].offset_s <= position:
                due += 1
            if due == self._next:
                speed = self.speed or 1.0
                wait = timeout_s if self.paused else (self._frames[due].offset_s - position) / speed
                time.sleep(max(0.0, min(timeout_s, wait)))
                return []
        frames = self._frames[self._next : due]
        self._next = due
        self._offset = frames[-1].offset_s
        return [(f.rank, f.frame) for f in frames]

    def request(self, message: Message, expect: type[T]) -> T:
        """A recording answers no request."""
        raise SourceUnavailable("a recording takes no requests")

    def resubscribe(self, ranks: list[int] | None = None) -> int:
        """A recording has no subscription to make anew."""
        return 0

    def probe(self, rank: int) -> None:
        """A recording takes no hello."""

    def disconnect(self) -> None:
        """Nothing to release."""

    def close(self) -> None:
        """Nothing to release."""

    def now(self) -> float:
        """The recording's time at the last frame delivered (plus the silence, at the end)."""
        now = self.recording.header.started + self._offset
        return now + self.silence_s if self._silent else now

    def exited(self) -> str:
        """A recording has no process."""
        return ""

    def picked(self) -> str:
        """A recording is the one named."""
        return ""

    def offer(self) -> tuple[wire.RunRecord, str] | None:
        """A recording offers no other run."""
        return None

    def follow(self, run: str) -> None:
        """A recording follows no other run."""


# --------------------------------------------------------------------------- recorder


@dataclass
class RecordingSummary:
    """What ``record`` wrote."""

    path: Path
    run: str
    frames: int
    bytes: int
    duration_s: float
    ended: bool
    bad_frames: int


def record(
    selector: str | None,
    path: str | os.PathLike[str],
    *,
    duration_s: float = 30.0,
    history: int = 512,
    note: str = "",
    stop: threading.Event | None = None,
) -> RecordingSummary:
    """Subscribe to a live run and write what it publishes to ``path``.

    Starts with a snapshot (``history`` recent steps) and stops after ``duration_s``, when the
    run sends its last batch, or when ``stop`` is set. Frames are written raw; frames that do
    not decode are written too (they are part of what a viewer saw) and counted.
    """
    source = LiveSource(selector, client=client_name("record"), request_timeout_s=5.0)
    decoder = Decoder()
    ended = False
    try:
        source.connect()
        start_wall = time.time()
        start = time.monotonic()
        snapshot = source.request(Hello(client=source.client, history=history), Snapshot)
        header = RecordingHeader(
            started=start_wall, run=snapshot.info.run, source=source.control_endpoint, note=note
        )
        with RecordingWriter(path, header) as writer:
            writer.write(time.monotonic() - start, CONTROL_RANK, encode(snapshot))
            while time.monotonic() - start < duration_s and not (stop and stop.is_set()):
                for rank, frame in source.poll(0.1):
                    message = decoder.decode(frame)
                    if isinstance(message, Telemetry):
                        rank = message.rank
                        ended = ended or (message.ended and message.rank == 0)
                    writer.write(time.monotonic() - start, rank, frame)
                if ended:
                    break
            frames = writer.frames
        return RecordingSummary(
            Path(path),
            snapshot.info.run,
            frames,
            Path(path).stat().st_size,
            time.monotonic() - start,
            ended,
            decoder.bad_frames,
        )
    finally:
        source.close()
