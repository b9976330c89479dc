"""The one worker that owns the sockets: it reads a Source, decodes, and reports in batches.

The receiver runs on a thread of its own (a Textual thread worker). It connects the source (and
reconnects it when the run goes quiet or comes back: the same run only; once the run is gone it
may offer another, followed only when the user says so), decodes every frame with a
``FrameDecoder`` (bad frames are counted, never raised; step records beyond a budget are
sampled), makes the operator's set/cancel requests
on the same thread, and hands the app one :class:`~memtui.runs.events.ReceivedBatch` at a time
through an :class:`Inbox`, calling ``notify`` once per batch (at most every ``post_interval_s``,
sooner for a change of connection or a request's outcome). Widgets never see a socket.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from memtui.advice.autopilot import describe_state
from memtui.core.knobs import format_changes
from memtui.runs.events import (
    MANY_RANKS,
    VIEWER,
    ConnectionEvent,
    Event,
    Notice,
    ReceivedBatch,
    RunOffer,
    Status,
)
from memtui.runs.frames import FrameDecoder
from memtui.runs.plausible import MAX_RANKS, rank_limit
from memtui.transport.client import client_name
from memtui.transport.sources import Source, SourceUnavailable
from memtui.wire import (
    AutotuneReply,
    AutotuneRequest,
    CancelReply,
    CancelRequest,
    Hello,
    SetReply,
    SetRequest,
    Snapshot,
    Telemetry,
)

Request = SetRequest | CancelRequest | AutotuneRequest
"""What the operator can ask of the run."""

HISTORY = 2048
"""Step records asked for in a hello (the hook keeps 2048)."""
MAX_CONTROL_JUMP = 64
"""The most changes of the control state believed between two batches of the control rank (the
hook counts each queued, applied, cancelled or rejected change: a few per checkpoint). A batch
whose ``control_seq`` jumps further, or goes back (after the snapshot: the batches already on
their way when it was taken may go back), is not believed: its control state is dropped and
counted as a bad value, and the run is asked for a snapshot, whose count is the run's own."""
RESUBSCRIBE_MAX_S = 30.0
"""The longest wait between two subscriptions made anew to a rank that stays silent while it
answers (the first comes after ``quiet_after_s``, each next one waits twice as long)."""
ALL_RANKS = -1
"""The key of the whole run in the receiver's resubscription times."""
GONE = frozenset({Status.ENDED, Status.EXITED, Status.DISCONNECTED})
"""The run is lost: another live run may be offered (never followed without a key press)."""


@dataclass(frozen=True)
class ReceiverTimings:
    """How long the receiver waits, polls and gathers, in seconds."""

    quiet_after_s: float = 3.0
    """Silence after which the run is called quiet (the hook sends a heartbeat every 1 s)."""
    disconnect_after_s: float = 6.0
    """Silence after which a source that cannot be asked (a replay) is called disconnected."""
    retry_s: float = 1.0
    """The wait between two looks for a run not found."""
    poll_s: float = 0.1
    """The longest wait for frames in one poll."""
    post_interval_s: float = 0.1
    """The least time between two batches posted to the app (a change of connection or a
    request's outcome goes sooner)."""
    heartbeat_s: float = 1.0
    """How often the clock is posted when nothing else happens (ages keep counting)."""
    gather_s: float = 0.1
    """After a poll that brought frames, wait this long before the next one, so that the frames
    of many ranks are taken in one wake-up each (64 ranks send 640 a second)."""
    many_ranks_gather_s: float = 0.25
    """The same (and the least time between two batches posted) above ``MANY_RANKS`` ranks."""
    refresh_s: float = 1.0
    """The least time between two snapshots asked for because of what the stream said (a missed
    change, another run, an implausible count): a peer cannot make it ask more."""


DEFAULT_TIMINGS = ReceiverTimings()
"""The viewer's and the exporter's timings."""


@dataclass
class ReceiverCounts:
    """What the receiver counted since it started."""

    errors: int = 0
    """Exceptions the receiver caught (and survived)."""
    batches_posted: int = 0
    """Batches handed to the app."""
    attempts: int = 0
    """Times the receiver looked for its run (found or not)."""
    bad_values: int = 0
    """Messages (or their control states) dropped for values the run cannot have sent: a rank
    past its world size, a control seq that jumps or goes back."""
    snapshots_asked: int = 0
    """Snapshots asked for because of what the stream said (not counting the connection's)."""
    reconnects: int = 0
    """Times telemetry was subscribed to anew: the run (or a rank) answered a hello but sent
    nothing for ``quiet_after_s`` (libzmq drops a connection for good on an oversized frame)."""


@dataclass(frozen=True)
class Posted:
    """What the last batch handed to the app carried (a batch with nothing new is not posted)."""

    at: float = 0.0
    """When it was posted (``time.monotonic``)."""
    clock: float = 0.0
    """The source's clock it carried."""
    bad_frames: int = 0
    bad_values: int = 0
    reconnects: int = 0


class Inbox:
    """Batches handed from the receiver's thread to the app's, in order (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: deque[ReceivedBatch] = deque()

    def put(self, batch: ReceivedBatch) -> None:
        """Add a batch (receiver thread)."""
        with self._lock:
            self._batches.append(batch)

    def drain(self) -> list[ReceivedBatch]:
        """Take every batch waiting, oldest first (app thread)."""
        with self._lock:
            batches = list(self._batches)
            self._batches.clear()
        return batches


def describe_reply(request: Request, reply: SetReply | CancelReply | AutotuneReply) -> Notice:
    """The outcome of a request, in words for the change log."""
    if isinstance(reply, AutotuneReply):
        if not reply.ok or reply.state is None:
            return Notice(False, f"autotune refused: {reply.reason}")
        return Notice(True, describe_state(reply.state))
    if isinstance(reply, SetReply):
        assert isinstance(request, SetRequest)
        if not reply.ok:
            return Notice(False, f"rejected {format_changes(request.changes)}: {reply.reason}")
        text = f"queued #{reply.id}: {format_changes(reply.changes)}"
        return Notice(True, f"{text} ({reply.note})" if reply.note else text, queued=reply.id)
    if not reply.ok:
        return Notice(False, f"cancel refused: {reply.reason}")
    return Notice(True, "cancelled " + " ".join(f"#{i}" for i in reply.cancelled))


class Receiver:
    """Reads one Source on its own thread and reports to the app through an Inbox."""

    def __init__(
        self,
        source: Source,
        inbox: Inbox,
        notify: Callable[[], None],
        *,
        readonly: bool = False,
        timings: ReceiverTimings = DEFAULT_TIMINGS,
    ) -> None:
        self.source = source
        self.inbox = inbox
        self.notify = notify
        self.readonly = readonly
        self.timings = timings
        self.counts = ReceiverCounts()
        """What the receiver counted (the app shows some; the tests read them)."""
        self._ranks_seen: set[int] = set()
        """Ranks heard from: at most the run's world size (``plausible.rank_limit``)."""
        self.decoder = FrameDecoder()
        self.client = client_name("tui")
        self._heard: dict[int, float] = {}
        """Each rank's last telemetry, on the source's clock (in this connection)."""
        self._retry: dict[int, tuple[float, float]] = {}
        """Silent ranks (``ALL_RANKS``: the run): when to ask (and resubscribe) again, and the
        wait after that (doubling to ``RESUBSCRIBE_MAX_S``)."""
        self.caught_up = threading.Event()
        """Set once a finished source (the end of a replay) has been fully reported."""
        self._stop = threading.Event()
        self._requests: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._reconnect = threading.Event()
        self._follow: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._offered = RunOffer()
        """The run offered last (``run`` "": none)."""
        self._said_picked = False
        """The note that the newest of several live runs was taken has been shown."""
        self._events: list[Event] = []
        self._urgent = False
        self._connected = False
        self._status: ConnectionEvent | None = None
        self._run = ""
        self._ended_runs: set[str] = set()
        self._control_seq = 0
        self._control_rank = 0
        self._snapshot_seq = 0
        """The control rank's telemetry seq when the snapshot was taken: batches up to it were
        on their way before it, and their control seq may be older."""
        self._world_size: int | None = None
        self._snapshot_wanted = False
        self._next_refresh = 0.0
        self._last_frame_clock = 0.0
        self._next_retry = 0.0
        self._next_probe = 0.0
        self._posted = Posted()
        """What the last batch posted carried, and when."""

    # ------------------------------------------------------------------ app side (any thread)

    def submit(self, request: Request) -> None:
        """Queue a set or cancel request for the run (thread-safe; the answer comes as a batch)."""
        self._requests.put(request)

    def reconnect(self) -> None:
        """Drop the connection and look for the run again (thread-safe)."""
        self._reconnect.set()

    def follow(self, run: str) -> None:
        """Attach to another run, the one the user chose (thread-safe)."""
        self._follow.put(run)
        self._reconnect.set()

    def stop(self) -> None:
        """Ask the thread to end (thread-safe); it closes the source on its way out."""
        self._stop.set()

    # ------------------------------------------------------------------ the thread

    def run(self, cancelled: threading.Event | None = None) -> None:
        """Receive until ``stop()`` is called or ``cancelled`` is set; failures are survived."""
        try:
            while not (self._stop.is_set() or (cancelled is not None and cancelled.is_set())):
                try:
                    self._cycle()
                except Exception as exc:  # never die: say what happened and start over
                    self.counts.errors += 1
                    self._emit(
                        Notice(False, f"receiver error: {type(exc).__name__}: {exc}", who=VIEWER)
                    )
                    self._drop(Status.DISCONNECTED, f"receiver error: {exc}")
                self._flush()
                if self.source.finished and not self._events:
                    self.caught_up.set()
        finally:
            with contextlib.suppress(Exception):
                self.source.close()

    def _cycle(self) -> None:
        if self._reconnect.is_set():
            self._reconnect.clear()
            self._take_follow()
            if self._connected:
                self._drop(Status.CONNECTING, "reconnecting")
            self._next_retry = 0.0
        if not self._connected:
            if time.monotonic() >= self._next_retry:
                self._try_connect()
                self._check_gone()
            if not self._connected:
                self._serve_requests()
                self._stop.wait(self.timings.poll_s)
                return
        started = time.monotonic()
        frames = self.source.poll(self.timings.poll_s)
        for _rank, frame in frames:
            self._handle(frame)
        if self._snapshot_wanted and self._connected and time.monotonic() >= self._next_refresh:
            self._refresh_snapshot()
        self._check_silence()
        self._serve_requests()
        if frames and not self.source.finished:
            self._stop.wait(max(0.0, started + self._gather() - time.monotonic()))

    def _gather(self) -> float:
        """How long frames are gathered between two polls (longer with many ranks)."""
        if len(self._ranks_seen) > MANY_RANKS:
            return max(self.timings.gather_s, self.timings.many_ranks_gather_s)
        return self.timings.gather_s

    def _emit(self, event: Event, urgent: bool = False) -> None:
        self._events.append(event)
        self._urgent = self._urgent or urgent

    def _set_status(self, status: Status, detail: str = "") -> None:
        event = ConnectionEvent(status, detail, self.source.label)
        if event != self._status:
            self._status = event
            self._emit(event, urgent=True)

    def _flush(self) -> None:
        """Post a batch if there is news (at most every ``post_interval_s`` unless urgent)."""
        now = time.monotonic()
        bad = self.decoder.bad_frames
        clock = self.source.now()
        posted = self._posted
        news = bool(self._events) or (bad, self.counts.bad_values, self.counts.reconnects) != (
            posted.bad_frames,
            posted.bad_values,
            posted.reconnects,
        )
        heartbeat = clock != posted.clock and now - posted.at >= self.timings.heartbeat_s
        if not (news or heartbeat):
            return
        if not self._urgent and now - posted.at < max(self.timings.post_interval_s, self._gather()):
            return
        batch = ReceivedBatch(
            self._events,
            clock,
            bad,
            self.decoder.last_error,
            self.counts.bad_values,
            self.counts.reconnects,
        )
        self._events = []
        self._urgent = False
        self._posted = Posted(now, clock, bad, self.counts.bad_values, self.counts.reconnects)
        self.inbox.put(batch)
        self.counts.batches_posted += 1
        self.notify()

    # ------------------------------------------------------------------ connection

    def _take_follow(self) -> None:
        """Attach the source to the run the user chose last, if any (the offer is withdrawn)."""
        run = ""
        with contextlib.suppress(queue.Empty):
            while True:
                run = self._follow.get_nowait()
        if run:
            self.source.follow(run)
            self._set_status(Status.CONNECTING, f"following {run}")
            self._set_offer(RunOffer())

    def _check_gone(self) -> None:
        """While the run is lost: say so if its process exited, and offer another live run."""
        if self._connected or self._status is None or self._status.status not in GONE:
            return
        if self._status.status is Status.DISCONNECTED:
            gone = self.source.exited()
            if gone:
                self._set_status(Status.EXITED, gone)
        found = self.source.offer()
        if found is None:
            self._set_offer(RunOffer())
            return
        record, why = found
        self._set_offer(RunOffer(record.run, record.pid, record.cwd, why))

    def _set_offer(self, offer: RunOffer) -> None:
        if offer != self._offered:
            self._offered = offer
            self._emit(offer, urgent=True)

    def _lost(self, detail: str) -> None:
        """The run does not answer: its process exited (on this host), or it is unreachable."""
        gone = self.source.exited()
        self._drop(Status.EXITED if gone else Status.DISCONNECTED, gone or detail)

    def _try_connect(self) -> None:
        self._next_retry = time.monotonic() + self.timings.retry_s
        self.counts.attempts += 1
        try:
            self.source.connect()
            if self.source.serves_requests:
                snapshot = self.source.request(Hello(client=self.client, history=HISTORY), Snapshot)
                if snapshot.info.run in self._ended_runs:
                    raise SourceUnavailable(f"run {snapshot.info.run} has ended")
                self._take_snapshot(snapshot)
        except SourceUnavailable as exc:
            with contextlib.suppress(Exception):
                self.source.disconnect()
            if self._status is None or self._status.status is Status.CONNECTING:
                self._set_status(Status.CONNECTING, str(exc))
            return
        self._connected = True
        self._last_frame_clock = self.source.now()
        self._heard.clear()
        self._retry.clear()
        self._set_status(Status.LIVE)
        self._set_offer(RunOffer())
        picked = self.source.picked()
        if picked and not self._said_picked:  # several runs live: say which, once
            self._said_picked = True
            self._emit(Notice(True, picked, who=VIEWER), urgent=True)

    def _drop(self, status: Status, detail: str) -> None:
        self._connected = False
        self._snapshot_wanted = False
        self._next_retry = time.monotonic() + self.timings.retry_s
        with contextlib.suppress(Exception):
            self.source.disconnect()
        self._set_status(status, detail)

    def _take_snapshot(self, snapshot: Snapshot) -> None:
        """The run's own word: its identity, world size and control seq (even a lower one)."""
        self._run = snapshot.info.run
        self._control_rank = snapshot.info.rank
        self._control_seq = snapshot.control_seq
        self._snapshot_seq = snapshot.seq
        self._set_world_size(max(snapshot.info.world_size, snapshot.control.world_size))
        self._snapshot_wanted = False
        self._emit(snapshot, urgent=True)

    def _set_world_size(self, world_size: int) -> None:
        """Follow ranks under ``world_size`` only (and tell the decoder: no budget for others)."""
        self._world_size = world_size
        self.decoder.limit_ranks(rank_limit(world_size))
        self._ranks_seen = {r for r in self._ranks_seen if r < self.decoder.rank_limit}

    def _want_snapshot(self) -> None:
        """Ask the run for a snapshot at the next cycle (not sooner than ``refresh_s`` after the
        previous one asked so): a source that cannot be asked (a replay) is not."""
        self._snapshot_wanted = self.source.serves_requests

    def _refresh_snapshot(self) -> None:
        self._snapshot_wanted = False
        self._next_refresh = time.monotonic() + self.timings.refresh_s
        self.counts.snapshots_asked += 1
        try:
            snapshot = self.source.request(Hello(client=self.client, history=HISTORY), Snapshot)
        except SourceUnavailable as exc:
            self._lost(f"no answer from the run ({exc})")
            return
        self._take_snapshot(snapshot)

    def _handle(self, frame: bytes) -> None:
        message = self.decoder.decode(frame)
        if isinstance(message, Snapshot):  # another rank's, or a recording's snapshot
            info = message.info
            if self._run and info.run == self._run and info.rank != self._control_rank:
                if not 0 <= info.rank < self.decoder.rank_limit:
                    self.counts.bad_values += 1  # a rank the run does not have
                    return
                self._emit(message)  # that rank's history and config only
            elif self._run and info.run != self._run and self.source.serves_requests:
                self._want_snapshot()  # another run's word: ask ours (never switch to it)
                return
            else:
                self._take_snapshot(message)
            if self._is_silent(info.rank):  # it answers (probed), but its telemetry stopped
                self._resubscribe([info.rank])
            return
        if not isinstance(message, Telemetry):
            return  # None (counted by the decoder) or a stray reply: nothing to show
        ours = not self._run or message.run == self._run
        if not 0 <= message.rank < (self.decoder.rank_limit if ours else MAX_RANKS):
            self.counts.bad_values += 1  # a rank the run does not have: no entry kept for it
            return
        self._last_frame_clock = self.source.now()
        if ours:
            self._heard[message.rank] = self._last_frame_clock
            if self._retry:  # heard again: a later silence starts the waits afresh
                self._retry.pop(message.rank, None)
                self._retry.pop(ALL_RANKS, None)
        self._ranks_seen.add(message.rank)
        if self._status is not None and self._status.status is Status.QUIET:
            self._set_status(Status.LIVE)
        if not ours:
            # another run publishes here now (restarted on the same endpoint): ask who it is
            self._want_snapshot()
        elif message.rank == self._control_rank:  # other ranks count their own control seq
            message = self._check_control_seq(message)
        self._emit(message)
        if message.ended and message.rank == 0 and message.run == self._run:
            self._ended_runs.add(message.run)
            self._drop(Status.ENDED, f"run ended at step {message.step}")

    def _check_control_seq(self, message: Telemetry) -> Telemetry:
        """Follow the control rank's count of changes: a change missed (the count went up, no
        control state came) asks for a snapshot; an implausible count (see ``MAX_CONTROL_JUMP``)
        is not believed: the batch goes on without its control state (counted as a bad value),
        and a snapshot is asked for. Returns the batch as the state should fold it."""
        seq, known = message.control_seq, self._control_seq
        if seq == known or (seq < known and message.seq <= self._snapshot_seq):
            return message  # on its way before the snapshot (the state keeps the newer control)
        if known < seq <= known + MAX_CONTROL_JUMP:
            if message.control is None:
                self._want_snapshot()  # we missed a change
                return message
            self._control_seq = seq
            if message.control.world_size > (self._world_size or 0):  # ranks joined
                self._set_world_size(message.control.world_size)
            return message
        self._want_snapshot()
        if message.control is None:
            return message
        self.counts.bad_values += 1
        return msgspec.structs.replace(message, control=None, control_seq=known)

    def _check_silence(self) -> None:
        if not self._connected:
            return
        silence = self.source.now() - self._last_frame_clock
        if silence < self.timings.quiet_after_s:
            self._check_ranks()
            return
        quiet = f"no data for {silence:.0f} s"
        gone = self.source.exited()
        if gone:  # no need to ask: its process is not there
            self._drop(Status.EXITED, gone)
            return
        if not self.source.serves_requests:
            if silence >= self.timings.disconnect_after_s:
                self._drop(Status.DISCONNECTED, quiet)
            else:
                self._set_status(Status.QUIET, quiet)
            return
        if time.monotonic() < self._next_probe:
            self._set_status(Status.QUIET, f"{quiet}; the run answers")
            return
        self._set_status(Status.QUIET, quiet)
        self._next_probe = time.monotonic() + self.timings.quiet_after_s
        try:
            snapshot = self.source.request(Hello(client=self.client, history=0), Snapshot)
        except SourceUnavailable as exc:
            self._lost(f"{quiet}, and no answer ({exc})")
            return
        self._take_snapshot(snapshot)
        self._set_status(Status.QUIET, f"{quiet}; the run answers")
        if self._due(ALL_RANKS):  # alive, yet nothing comes: the subscription may be lost
            self._resubscribe(None)

    def _is_silent(self, rank: int) -> bool:
        """``rank`` sent telemetry in this connection, but none for ``quiet_after_s``."""
        heard = self._heard.get(rank)
        return heard is not None and self.source.now() - heard >= self.timings.quiet_after_s

    def _due(self, key: int) -> bool:
        """Whether a silent rank (``ALL_RANKS``: the run) may be asked again now; if so, the
        next time is set (twice as far off as the last)."""
        now = time.monotonic()
        due, wait = self._retry.get(key, (0.0, self.timings.quiet_after_s))
        if now < due:
            return False
        self._retry[key] = (now + wait, min(2 * wait, RESUBSCRIBE_MAX_S))
        return True

    def _check_ranks(self) -> None:
        """The run reports, but a rank heard from before has gone silent: ask it whether it is
        alive (a hello, not waited for); its answer, through ``poll``, subscribes anew."""
        if not self.source.serves_requests:
            return
        for rank in [r for r in self._heard if self._is_silent(r)]:
            if self._due(rank):
                self.source.probe(rank)

    def _resubscribe(self, ranks: list[int] | None) -> None:
        """Subscribe anew to the telemetry of ``ranks`` (None: the whole run), which answered
        but sent nothing, and count it."""
        if self.source.resubscribe(ranks):
            self.counts.reconnects += 1

    # ------------------------------------------------------------------ requests

    def _serve_requests(self) -> None:
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return
            self._emit(self._answer(request), urgent=True)

    def _answer(self, request: Request) -> Notice:
        if self.readonly:
            return Notice(False, "read-only view: nothing was sent")
        if not self.source.serves_requests:
            return Notice(False, f"{self.source.label} takes no changes")
        if not self._connected:
            return Notice(False, "not connected to the run: nothing was sent")
        try:
            if isinstance(request, SetRequest):
                return describe_reply(request, self.source.request(request, SetReply))
            if isinstance(request, AutotuneRequest):
                return describe_reply(request, self.source.request(request, AutotuneReply))
            return describe_reply(request, self.source.request(request, CancelReply))
        except SourceUnavailable as exc:
            return Notice(False, f"no answer from the run: {exc}")
