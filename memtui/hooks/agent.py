"""The agent thread: owns the ZeroMQ sockets, publishes telemetry in batches, serves the control socket.

Every ``flush_period_s`` (250 ms) while a viewer is subscribed or a recording is written, else
every ``idle_flush_s`` (1 s), it drains the training thread's outbox of step records, adds the
sampler's latest samples and any change of the control state, and sends one Telemetry frame with
``NOBLOCK`` on the PUB socket (a full queue drops the frame and counts it; the history ring keeps
the records for the next viewer's snapshot). The PUB socket is an XPUB that reports every
subscribe and unsubscribe, so the agent knows whether anyone listens: each wake-up takes the GIL
from the training thread, so an unwatched run gets one a second, and its step records stay as
the training thread wrote them (bounded) until a viewer asks. Between flushes it answers
hello/set/cancel on the ROUTER control socket (rank 0); a change queued or cancelled goes out
at once, not at the next flush. Every two seconds it checks the run's
registry file and recreates the runtime directory and sockets if someone removed them.

The training run comes first, so what peers can make the agent do is bounded
(``memtui.hooks.limits``): every frame a socket takes is small (``MAX_CONTROL_FRAME``,
``MAX_SUBSCRIPTION_FRAME``: ZeroMQ drops a peer that sends a bigger one); requests, refusals and
authentications are paid from one CPU budget of a few percent of a core, and once it is spent
the control and authentication sockets rest until it is refilled; each connection gets a few
requests a second, then a cheap "rate limited"; and a telemetry socket that receives anything
but a viewer's subscription (or a storm of them) is closed and reopened a second later, since
ZeroMQ keeps every subscription it is sent until the socket closes. Refusals, rate-limited
requests and failed authentications are counted in ``HookCounters`` (``memtui status``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import zmq

from memtui import registry
from memtui.advice.effect import SETTLE_STEPS, describe, measure
from memtui.advice.predict import Observation, fit, predict_peak
from memtui.hooks.limits import Budget, PeerRates
from memtui.recording import CONTROL_RANK, RecordingHeader, RecordingWriter
from memtui.security import IPC, READONLY_REASON, ZapHandler, exposure, make_server, public_info
from memtui.wire import (
    CancelRequest,
    CheckpointRecord,
    Decoder,
    DeviceSample,
    ErrorReply,
    Hello,
    HookCounters,
    HostSample,
    MemoryModel,
    Message,
    ModelPoint,
    RankInfo,
    RunRecord,
    SetRequest,
    Snapshot,
    StepRecord,
    Telemetry,
    encode,
    to_builtins,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from memtui.hooks.tuner import RawStep, Tuner

log = logging.getLogger("memtui")

HISTORY_STEPS = 2048
UNSENT_RECORDS = 16384
"""Drained records waiting for the next flush (as many as the training thread's outbox)."""
MAX_CONTROL_FRAME = 4096
"""Bigger frames on the control socket are refused by ZeroMQ (a bad peer cannot bloat us): the
largest request in bounds is ~1 KiB, and a CURVE handshake needs ~600 bytes."""
MAX_SUBSCRIPTION_FRAME = 1024
"""Bigger frames on a telemetry socket are refused by ZeroMQ: a viewer's subscription is one
byte, and a CURVE handshake needs ~600 bytes."""
SUBSCRIPTION_QUEUE = 32
"""Subscription frames queued per peer before ZeroMQ stops reading it."""
SUBSCRIPTION_REPORTS_PER_S = 100
"""More subscribe and unsubscribe reports than this in a second is a storm: the socket is reset."""
PUB_REST_S = 1.0
"""How long a misused telemetry socket stays closed before it is bound again."""
NEWS_GAP_S = 0.1
"""A change of the control state goes out at once, but at most this often."""
RATE_LIMITED = "rate limited: this connection sent too many requests; try again in a second"
_RATE_LIMITED_FRAME = encode(ErrorReply(reason=RATE_LIMITED))
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
"""The monitor events of a TCP peer that failed to authenticate before ZAP was asked (a wrong
server key, plain ZeroMQ on a CURVE socket, a connection dropped mid-handshake)."""


class Agent(threading.Thread):
    """Publishes one rank's telemetry and (on rank 0) serves the control socket."""

    def __init__(
        self,
        tuner: Tuner,
        run_dir: registry.RunDir,
        *,
        flush_period_s: float = 0.25,
        heartbeat_s: float = 1.0,
        idle_flush_s: float = 1.0,
    ) -> None:
        super().__init__(name="memtui-agent", daemon=True)
        self.tuner = tuner
        self.run_dir = run_dir
        self.flush_period_s = flush_period_s
        self.heartbeat_s = heartbeat_s
        self.idle_flush_s = max(idle_flush_s, flush_period_s)
        """The flush period while nobody is subscribed and nothing is recorded."""
        self._subscribers: dict[int, int] = {}
        """Live subscriptions on each PUB socket (by the socket's id), from the XPUB's reports."""
        self._unsent: deque[RawStep] = deque(maxlen=UNSENT_RECORDS)
        """Records drained (by a flush or a snapshot) and not yet published: nobody watching,
        they wait (bounded) for a viewer and are never converted to wire records."""
        self._unsent_device: list[DeviceSample] = []
        """Device samples drained from the sampler and not yet published (its deque's bound)."""
        self._unsent_host: HostSample | None = None
        """The newest host sample drained and not yet published."""
        self._unsent_checkpoints: list[CheckpointRecord] = []
        """Checkpoint boundaries drained and not yet published."""
        self.steps: deque[RawStep] = deque(maxlen=HISTORY_STEPS)
        """The last steps as the training thread recorded them (``records`` converts them)."""
        self.device: deque[DeviceSample] = deque(maxlen=600)
        self.host: deque[HostSample] = deque(maxlen=120)
        self.checkpoints: deque[CheckpointRecord] = deque(maxlen=128)
        self.seq = 0
        self.counters = HookCounters()
        self.decoder = Decoder()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._stop_event = threading.Event()
        self._context: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._pub_tcp: zmq.Socket | None = None
        self._router_tcp: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self.tcp_pub = ""
        """This rank's TCP telemetry endpoint as other nodes reach it ("" without TCP)."""
        self.tcp_control = ""
        self.tcp_readonly = False
        """The TCP control socket answers hello only (plain TCP without the control opt-in)."""
        self.registered = False
        self._warned_pub = False
        self._recording: RecordingWriter | None = None
        self._recorded_bytes = 0
        self._started_recording = 0.0
        self._points: dict[int, ModelPoint] = {}
        """The latest observed (micro-batch, peak) point of each micro-batch size."""
        self._sent_control_seq = 0
        self._sent_counters: HookCounters | None = None
        self._last_send = 0.0
        self._last_step = 0
        self._polled: tuple[zmq.Socket, ...] = ()
        self._poll = zmq.Poller()
        self._budget = Budget()
        """The CPU the control plane may take from the training (requests, authentications)."""
        self._peers = PeerRates()
        """Each control connection's request rate."""
        self._monitors: dict[zmq.Socket, zmq.Socket] = {}
        """Monitor sockets of the TCP sockets (monitor -> socket watched), read at every wake-up."""
        self._handshake_failures = 0
        self._reports: dict[int, tuple[float, int]] = {}
        """Subscription reports of each PUB socket (by id) in the current second: (since, count)."""
        self._closed_pubs: list[tuple[bool, str, float]] = []
        """Telemetry sockets closed for misuse: (TCP or not, endpoint, when to bind it again)."""

    # ------------------------------------------------------------------ lifecycle

    def stop(self, timeout: float = 2.0) -> None:
        """Send the last batch (``ended``), close the sockets and remove the registry entry."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        """Bind, then flush and serve until stopped; failures are reported, never raised."""
        try:
            self._context = zmq.Context()
            self._bind()
            self._bind_tcp()
            self._watch_handshakes(self._pub_tcp, self._router_tcp)
        except BaseException as exc:
            self.failed = exc
            self.tuner._report(exc, "agent start")
            self.ready.set()
            self._close()
            return
        self.ready.set()
        self._open_recording()
        next_flush = time.monotonic() + self.flush_period()
        next_check = time.monotonic() + 2.0
        next_model = time.monotonic() + 1.0
        while not self._stop_event.is_set():
            try:
                # rounded up: a timeout truncated to 0 ms would spin until the flush is due
                timeout_ms = max(0, math.ceil((self._wake(next_flush) - time.monotonic()) * 1000))
                cpu, spent, served = time.thread_time(), self._budget.spent, False
                for sock, _event in self._poller().poll(timeout_ms):
                    if sock in self._monitors:
                        self._read_monitor(sock)
                    elif self._zap is not None and sock is self._zap.socket:
                        self._authenticate()
                        served = True
                    elif isinstance(sock, zmq.Socket) and sock in (self._pub, self._pub_tcp):
                        if self._read_subscriptions(sock):
                            next_flush = time.monotonic()  # a viewer arrived: send at once
                            sampler = self.tuner._sampler
                            if sampler is not None:
                                sampler.wake.set()  # and sample at the viewer's rate now
                    else:
                        self._serve(sock)
                        served = True
                        if self._control_changed():  # a queued change is news: send it now
                            soon = max(time.monotonic(), self._last_send + NEWS_GAP_S)
                            next_flush = min(next_flush, soon)
                if served:  # the wake-up is the peers' too: the poll and what _serve did not pay
                    overhead = time.thread_time() - cpu - (self._budget.spent - spent)
                    self._budget.spend(max(0.0, overhead))
                if self._closed_pubs:
                    self._reopen_pubs()
                now = time.monotonic()
                if now >= next_flush:
                    next_flush = max(next_flush + self.flush_period(), now)
                    self.flush()
                if now >= next_check:
                    next_check = now + 2.0
                    self._check_registry()
                if now >= next_model:
                    next_model = now + 1.0
                    self._update_model()
                    self._measure_applied()
            except BaseException as exc:  # never let the thread die silently
                self.tuner._report(exc, "agent")
                self._stop_event.wait(0.5)
                with contextlib.suppress(BaseException):
                    self._rebind()
        with contextlib.suppress(BaseException):
            self._measure_applied(final=True)
            self.flush(ended=True)
            time.sleep(0.05)  # let the final frame leave before the socket closes
        self._close()
        if self._recording is not None:
            with contextlib.suppress(OSError):
                self._recording.close()
        if self.tuner.rank == 0:
            self.run_dir.remove()

    def _control_changed(self) -> bool:
        """Whether the control state moved since it was last sent (a change queued or cancelled)."""
        control = self.tuner.control
        return control is not None and control.seq != self._sent_control_seq

    def _wake(self, next_flush: float) -> float:
        """When the next poll must end: the flush, the end of a rest, or a socket to reopen."""
        wake = next_flush
        if self._budget.resting():
            wake = min(wake, self._budget.resting_until)
        for _tcp, _endpoint, at in self._closed_pubs:
            wake = min(wake, at)
        return wake

    def _poller(self) -> zmq.Poller:
        """The poller over the sockets served now, rebuilt only when they change (a rebind, or
        the control plane resting: then the control and authentication sockets are not read)."""
        resting = self._budget.resting()
        sockets = tuple(
            sock
            for sock in (
                None if resting else self._router,
                None if resting else self._router_tcp,
                self._zap.socket if self._zap and not resting else None,
                self._pub,
                self._pub_tcp,
                *self._monitors,
            )
            if sock is not None
        )
        if self._polled != sockets:
            self._polled = sockets
            self._poll = zmq.Poller()
            for sock in sockets:
                self._poll.register(sock, zmq.POLLIN)
        return self._poll

    @property
    def subscribers(self) -> int:
        """Subscriptions live on this rank's PUB sockets (viewers attached, roughly)."""
        return sum(self._subscribers.values())

    @property
    def watched(self) -> bool:
        """Whether a viewer is subscribed or the stream is recorded (the threads run fast)."""
        return self.subscribers > 0 or self._recording is not None

    def flush_period(self) -> float:
        """Seconds to the next flush: short while watched or recorded, long while not."""
        return self.flush_period_s if self.watched else self.idle_flush_s

    def _read_subscriptions(self, sock: zmq.Socket) -> bool:
        """Count the XPUB's subscribe/unsubscribe reports (True when the first viewer arrived);
        a topic other than the viewers' (everything) or a storm of reports resets the socket."""
        before = self.subscribers
        count = self._subscribers.get(id(sock), 0)
        now = time.monotonic()
        since, seen = self._reports.get(id(sock), (now, 0))
        if now - since >= 1.0:
            since, seen = now, 0
        while True:
            try:
                report = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            seen += 1
            if report not in (b"\x01", b"\x00") or seen > SUBSCRIPTION_REPORTS_PER_S:
                self._reset_pub(sock)
                return False
            count = count + 1 if report == b"\x01" else max(0, count - 1)
        self._subscribers[id(sock)] = count
        self._reports[id(sock)] = (since, seen)
        return before == 0 and count > 0

    def _reset_pub(self, sock: zmq.Socket) -> None:
        """Close a telemetry socket a peer misused, freeing the topics ZeroMQ kept (byte by byte,
        until closed), to bind it again ``PUB_REST_S`` later (viewers reconnect by themselves)."""
        tcp = sock is self._pub_tcp
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
        endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._unwatch(sock)
        self._subscribers.pop(id(sock), None)
        self._reports.pop(id(sock), None)
        with contextlib.suppress(zmq.ZMQError):
            sock.close(0)
        if tcp:
            self._pub_tcp = None
        else:
            self._pub = None
        self._closed_pubs.append((tcp, endpoint, time.monotonic() + PUB_REST_S))
        self.counters.requests_refused += 1
        if not self._warned_pub:  # once: a peer that keeps at it must not flood the log
            self._warned_pub = True
            log.warning(
                "memtui: a peer sent the telemetry socket %s what no viewer sends; "
                "reset it (counted in requests_refused)",
                endpoint,
            )

    def _reopen_pubs(self) -> None:
        """Bind again the telemetry sockets whose rest is over (retried later if that fails)."""
        assert self._context is not None
        now = time.monotonic()
        for entry in list(self._closed_pubs):
            tcp, endpoint, at = entry
            if now < at:
                continue
            self._closed_pubs.remove(entry)
            if (self._pub_tcp if tcp else self._pub) is not None:
                continue  # bound again meanwhile (a rebind)
            sock = _pub_socket(self._context)
            try:
                if tcp:
                    plan = self.tuner.tcp_plan
                    make_server(sock, plan.keys if plan is not None else None)
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                sock.close(0)
                self.tuner._report(exc, "telemetry socket")
                self._closed_pubs.append((tcp, endpoint, now + PUB_REST_S))
                continue
            if tcp:
                self._pub_tcp = sock
                self._watch_handshakes(sock)
            else:
                self._pub = sock
                _private(endpoint)

    def _watch_handshakes(self, *socks: zmq.Socket | None) -> None:
        """Count the failed handshakes of TCP sockets through a monitor each, read at every
        wake-up, never resting (~2000 unread events block ZeroMQ's I/O thread, every socket)."""
        for sock in socks:
            if sock is not None:
                self._monitors[sock.get_monitor_socket(HANDSHAKE_FAILURES)] = sock

    def _unwatch(self, sock: zmq.Socket) -> None:
        """Stop monitoring ``sock`` and close its monitor socket."""
        for monitor, watched in list(self._monitors.items()):
            if watched is sock:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
                monitor.close(0)
                del self._monitors[monitor]

    def _read_monitor(self, monitor: zmq.Socket) -> None:
        """Count the failed handshakes a monitor reports."""
        for _ in range(1024):
            try:
                event = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if event and int.from_bytes(event[0][:2], sys.byteorder) & HANDSHAKE_FAILURES:
                self._handshake_failures += 1

    def _authenticate(self) -> None:
        """Answer the waiting authentication requests, paid from the control plane's budget."""
        assert self._zap is not None
        start = time.thread_time()
        self._zap.handle(limit=64)
        self._budget.spend(time.thread_time() - start)

    def _bind(self) -> None:
        """Bind this rank's ipc PUB and ROUTER sockets in the private runtime directory."""
        assert self._context is not None
        self.run_dir.create()
        pub_endpoint = self.run_dir.pub_endpoint(self.tuner.rank)
        self._pub = _pub_socket(self._context)
        self._pub.bind(pub_endpoint)
        _private(pub_endpoint)
        control_endpoint = self.run_dir.control_endpoint(self.tuner.rank)
        self._router = _router_socket(self._context)
        self._router.bind(control_endpoint)
        _private(control_endpoint)

    def _bind_tcp(self) -> None:
        """Bind TCP twins of both sockets when asked (CURVE unless insecure on loopback; plain
        TCP without the control opt-in answers hello only, reduced), note the security mode and
        warn loudly about plain TCP."""
        plan = self.tuner.tcp_plan
        if plan is None:
            self.tuner.info.security = IPC
            return
        assert self._context is not None
        if plan.keys is not None:
            self._zap = ZapHandler(self._context, plan.keys)
        pub = _pub_socket(self._context)
        router = _router_socket(self._context)
        for sock in (pub, router):
            make_server(sock, plan.keys)
            sock.bind(f"tcp://{plan.address}:*")
        self._pub_tcp, self._router_tcp = pub, router
        self.tcp_pub = plan.advertised(_port(pub))
        self.tcp_control = plan.advertised(_port(router))
        self.tcp_readonly = not plan.control
        self.tuner.info.security = plan.mode
        warning = exposure(plan.mode, [self.tcp_pub, self.tcp_control])
        if warning:
            log.warning("memtui: %s", warning)

    def _answer_readonly(self, request: Message | None) -> Message:
        """The answer on a plain TCP socket without the control opt-in: hello gets a snapshot
        without the command line, cwd and paths; anything else is refused."""
        if not isinstance(request, Hello):
            return ErrorReply(reason=READONLY_REASON)
        reply = self._answer(request)
        if isinstance(reply, Snapshot):
            reply.info = public_info(reply.info)
        return reply

    def register(self) -> None:
        """Write the run's registry record (rank 0), once every rank's endpoints are known."""
        if self.tuner.rank == 0 and self._router is not None:
            self.run_dir.write(self.record())
            self.registered = True

    def _close(self) -> None:
        for watched in list(self._monitors.values()):
            self._unwatch(watched)
        for sock in (self._pub, self._router, self._pub_tcp, self._router_tcp):
            if sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sock.close()
        self._pub = self._router = self._pub_tcp = self._router_tcp = None
        self._subscribers.clear()
        if self._zap is not None:
            self._zap.close()
            self._zap = None
        if self._context is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._context.term()
            self._context = None

    def _rebind(self) -> None:
        """Close and bind the ipc sockets again (the TCP ones do not depend on the directory)."""
        for sock in (self._pub, self._router):
            if sock is not None:
                self._subscribers.pop(id(sock), None)
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(0)
        self._pub = self._router = None
        self._closed_pubs = [entry for entry in self._closed_pubs if entry[0]]  # TCP ones only
        self._bind()
        if self.registered:
            self.register()

    def _check_registry(self) -> None:
        """Recreate the runtime directory, sockets and record if they were removed."""
        if self.tuner.rank != 0 or not self.registered or self.run_dir.record_path.exists():
            return
        self._rebind()
        self.counters.recoveries += 1
        log.warning("memtui: the runtime directory %s vanished; recreated it", self.run_dir.path)

    def record(self) -> RunRecord:
        """This run's registry record."""
        info = self.tuner.info
        return RunRecord(
            run=info.run,
            pid=info.pid,
            create_time=registry.process_create_time(info.pid),
            started=info.started,
            host=info.host,
            control=self.run_dir.control_endpoint(),
            ranks=self.ranks(),
            command=info.command,
            cwd=info.cwd,
            world_size=info.world_size,
            state_dir=info.state_dir,
            security=info.security,
        )

    def ranks(self) -> list[RankInfo]:
        """Where each rank publishes and answers (exchanged at install)."""
        return list(self.tuner.ranks)

    # ------------------------------------------------------------------ telemetry

    def _drain(self) -> None:
        """Move new steps, samples and checkpoints into the history and what the next flush sends.

        A snapshot drains too (a viewer asking between flushes sees the newest state), so what
        it took waits in the unsent buffers for the next flush.
        """
        sampler = self.tuner._sampler
        if sampler is not None:
            device = sampler.device_samples
            while device:
                sample = device.popleft()
                self.device.append(sample)
                self._unsent_device.append(sample)
            del self._unsent_device[: -(device.maxlen or 512)]
            host = sampler.host_samples
            while host:
                self._unsent_host = host.popleft()
                self.host.append(self._unsent_host)
        boxed = self.tuner._checkpoint_box
        while boxed:
            checkpoint = boxed.popleft()
            self.checkpoints.append(checkpoint)
            self._unsent_checkpoints.append(checkpoint)
        del self._unsent_checkpoints[: -(boxed.maxlen or 256)]
        outbox = self.tuner._outbox
        popleft = outbox.popleft
        taken = [popleft() for _ in range(len(outbox))]  # the training thread only appends
        if not taken:
            return
        # a full outbox drops its oldest records, so a gap can only open before the first
        last = self._last_step
        if last and taken[0][0] > last + 1:
            self.counters.records_dropped += taken[0][0] - last - 1
        self._last_step = taken[-1][0]
        self.steps.extend(taken)
        self._unsent.extend(taken)

    def records(self, raw: Iterable[RawStep]) -> list[StepRecord]:
        """Wire records of the training thread's raw ones (their clock made wall-clock time).

        Done only for what is sent or asked for: building a record costs ~0.3 µs, and an
        unwatched run at thousands of steps a second would pay it for nobody.
        """
        offset = self.tuner._wall_offset
        return [
            StepRecord(step, end + offset, dt, wait, samples, micro, flags)
            for step, end, dt, wait, samples, micro, flags in raw
        ]

    def flush(self, ended: bool = False) -> None:
        """Send one batch with everything new since the previous one (or a heartbeat)."""
        tuner = self.tuner
        self._drain()
        records: list[StepRecord] = []
        if self.watched or ended:  # a snapshot in between drained some: they go out too
            records = self.records(self._unsent)
            self._unsent.clear()
        elif len(self._unsent) > HISTORY_STEPS:
            # nobody listens: keep what the history keeps (the same tuples), in case a viewer's
            # subscription is reported after its snapshot was taken
            self._unsent = deque(list(self._unsent)[-HISTORY_STEPS:], maxlen=UNSENT_RECORDS)
        device, self._unsent_device = self._unsent_device, []
        host, self._unsent_host = self._unsent_host, None
        checkpoints, self._unsent_checkpoints = self._unsent_checkpoints, []
        control = None
        control_seq = tuner.control.seq if tuner.control is not None else 0
        if tuner.control is not None and control_seq != self._sent_control_seq:
            control = tuner.control.state()
        counters = self.current_counters()
        send_counters = counters if counters != self._sent_counters else None
        now = time.monotonic()
        quiet = not (records or device or host or checkpoints or control or send_counters)
        if quiet and not ended and now - self._last_send < self.heartbeat_s:
            return
        self.seq += 1
        message = Telemetry(
            run=tuner.info.run,
            rank=tuner.rank,
            seq=self.seq,
            time=time.time(),
            step=tuner._step,
            steps=records,
            device=device,
            host=host,
            checkpoints=checkpoints,
            control_seq=control_seq,
            control=control,
            counters=send_counters,
            ended=ended,
        )
        frame = encode(message)
        if self._send(frame):
            self._sent_control_seq = control_seq
            self._sent_counters = counters
        self._record(self.tuner.rank, frame)
        self._last_send = now

    def _send(self, frame: bytes) -> bool:
        sent = False
        for sock in (self._pub, self._pub_tcp):
            if sock is None:
                continue
            try:
                sock.send(frame, zmq.NOBLOCK)
                sent = True
            except zmq.Again:
                self.counters.messages_dropped += 1
        return sent

    def current_counters(self) -> HookCounters:
        """The hook's counters now."""
        control = self.tuner.control
        return HookCounters(
            records_dropped=self.counters.records_dropped,
            messages_dropped=self.counters.messages_dropped,
            bad_frames=self.decoder.bad_frames,
            errors=self.tuner._errors,
            last_error=self.tuner._last_error,
            recoveries=self.counters.recoveries,
            requests_refused=self.counters.requests_refused + (control.refused if control else 0),
            requests_rate_limited=self.counters.requests_rate_limited,
            auth_failures=self._handshake_failures + (self._zap.denied if self._zap else 0),
            control_rests=self._budget.rests,
            tuned_unsaved_step=self.tuner.tuned_unsaved_step,
        )

    # ------------------------------------------------------------------ control

    def _serve(self, router: zmq.Socket) -> None:
        """Answer the requests waiting, each paid from the CPU budget: once it is spent, the
        rest wait in ZeroMQ's queues, unread, until it is refilled."""
        budget = self._budget
        for _ in range(64):
            if budget.resting():
                return
            start = time.thread_time()
            try:
                if not self._serve_one(router):
                    return
            finally:
                budget.spend(time.thread_time() - start)

    def _serve_one(self, router: zmq.Socket) -> bool:
        """Read and answer one request (False when none waits); a connection over its rate gets
        "rate limited", its request not even decoded."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        if len(frames) < 2:
            self.decoder.bad_frames += 1
            self.counters.requests_refused += 1
            return True
        envelope, payload = frames[:-1], frames[-1]
        if self._peers.allow(frames[0]):
            request = self.decoder.decode(payload)
            if request is None:
                self.counters.requests_refused += 1
            readonly = self.tcp_readonly and router is self._router_tcp
            reply = encode(self._answer_readonly(request) if readonly else self._answer(request))
        else:
            self.counters.requests_rate_limited += 1
            reply = _RATE_LIMITED_FRAME
        try:
            router.send_multipart([*envelope, reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters.messages_dropped += 1
        return True

    def _answer(self, request: Message | None) -> Message:
        control = self.tuner.control
        try:
            if isinstance(request, Hello):
                return self.snapshot(request.history)
            if isinstance(request, (SetRequest, CancelRequest)) and self.tuner.rank != 0:
                return ErrorReply(reason=f"rank {self.tuner.rank} takes no changes: rank 0 does")
            if isinstance(request, SetRequest):
                return control.queue(request)
            if isinstance(request, CancelRequest):
                return control.cancel(request)
        except Exception as exc:
            self.tuner._report(exc, "control")
            return ErrorReply(reason=f"internal error: {exc}")
        if request is None:
            return ErrorReply(reason=f"undecodable request ({self.decoder.last_error})")
        return ErrorReply(reason=f"unexpected {type(request).__name__} on the control socket")

    def snapshot(self, history: int = 512) -> Snapshot:
        """Everything a new viewer needs, with the last ``history`` step records."""
        self._drain()
        tuner = self.tuner
        control = tuner.control
        history = max(0, min(history, HISTORY_STEPS))
        steps = self.records(list(self.steps)[-history:]) if history else []
        return Snapshot(
            info=tuner.current_info(),
            control=control.state(),
            ranks=self.ranks(),
            step=tuner._step,
            seq=self.seq,
            control_seq=control.seq,
            steps=steps,
            device=list(self.device)[-300:],
            host=list(self.host),
            checkpoints=list(self.checkpoints),
            counters=self.current_counters(),
        )

    # ------------------------------------------------------------------ memory model and effects

    def _update_model(self) -> None:
        """Refit the memory model from the samples taken at the current micro-batch."""
        tuner, control = self.tuner, self.tuner.control
        batch = tuner.values.get("batch_size")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            return
        settle = tuner._segment_start + SETTLE_STEPS
        window = [s for s in self.device if s.step > settle]
        if len(window) < 3:
            return
        last = window[-1]
        peak_allocated = max(max(s.peak_allocated_bytes, s.allocated_bytes) for s in window)
        peak_reserved = max(max(s.peak_reserved_bytes, s.reserved_bytes) for s in window)
        floor = min(s.allocated_bytes for s in window)
        static = control.static
        beyond = 0
        if last.kind == "cuda":
            exact = 0
            if static is not None:
                exact = static.parameters_bytes + static.buffers_bytes
                exact += static.gradients_bytes + static.optimizer_bytes
            steady = max(exact, floor)
            if last.nvml_used_bytes is not None:
                beyond = max(0, last.nvml_used_bytes - last.reserved_bytes)
        else:
            # CPU: the lowest memory in use (RSS minus malloc's free cache) over the window: the
            # samples fall all over the step cycle, and the lowest ones between steps
            steady = floor
        observation = Observation(
            kind=last.kind,
            batch_size=batch,
            capacity_bytes=last.capacity_bytes,
            steady_bytes=steady,
            peak_allocated_bytes=peak_allocated,
            peak_reserved_bytes=peak_reserved,
            beyond_bytes=beyond,
            samples=len(window),
        )
        self._points[batch] = ModelPoint(batch, peak_allocated, len(window))
        model = fit(observation, [p for b, p in self._points.items() if b != batch])
        with control._lock:
            old = control.model
            if old is None or _moved(old, model, batch):
                control.model = model
                control.seq += 1

    def _measure_applied(self, final: bool = False) -> None:
        """Measure the effect and the peak of applied changes once enough steps ran after them."""
        control = self.tuner.control
        with control._lock:
            waiting = [a for a in control.applied if a.effect is None and not a.rollback]
            later = {id(a): b.step for a, b in itertools.pairwise(control.applied)}
        if not waiting:
            return
        steps = list(self.steps)
        for applied in waiting:
            start = applied.step + SETTLE_STEPS
            end = min(start + EFFECT_STEPS, later.get(id(applied), start + EFFECT_STEPS))
            after = self.records(r for r in steps if start < r[0] <= end)
            if len(after) < min(EFFECT_STEPS, end - start) and not final:
                continue
            if len(after) < 3:
                continue
            before = self.records(
                r for r in steps if applied.step - EFFECT_STEPS < r[0] <= applied.step
            )
            # a sample carries the step count when it was taken: samples counted ``step`` ran
            # during the step after it, so the last one before the change is ``step - 1``
            peak_before = self._peak_between(applied.step - EFFECT_STEPS - 1, applied.step - 1)
            peak_after = self._peak_between(start, after[-1].step)
            effect = measure(before, after, peak_before, peak_after)
            if effect is None:
                continue
            with control._lock:
                applied.effect = effect
                applied.observed_peak_bytes = peak_after
                control.seq += 1
            record: dict[str, object] = {
                "ids": applied.ids,
                "step": applied.step,
                "predicted_peak_bytes": applied.predicted_peak_bytes,
                "observed_peak_bytes": peak_after,
                "effect": to_builtins(effect),
                "summary": describe(effect),
            }
            if applied.predicted_peak_bytes and peak_after:
                record["prediction_error"] = applied.predicted_peak_bytes / peak_after - 1
            control._audit("measured", record)

    def _peak_between(self, first_step: int, last_step: int) -> int | None:
        """The device total at peak over samples taken in steps (first, last]."""
        samples = [s for s in self.device if first_step < s.step <= last_step]
        if not samples:
            return None
        if samples[-1].kind == "cuda":
            return max(
                max(s.peak_reserved_bytes, s.reserved_bytes)
                + max(0, (s.nvml_used_bytes or 0) - s.reserved_bytes)
                for s in samples
            )
        return max(max(s.peak_allocated_bytes, s.allocated_bytes) for s in samples)

    # ------------------------------------------------------------------ recording

    def _open_recording(self) -> None:
        """Start writing the published stream to ``options.record`` (with a first snapshot)."""
        path = self.tuner.options.record
        if not path:
            return
        if self.tuner.world_size > 1:
            path = f"{path}.rank{self.tuner.rank}"
        try:
            header = RecordingHeader(
                started=time.time(),
                run=self.tuner.run_id,
                source="hook",
                note=f"rank {self.tuner.rank}",
            )
            self._recording = RecordingWriter(path, header)
            self._started_recording = time.monotonic()
            if self.tuner.rank == 0:
                self._record(CONTROL_RANK, encode(self.snapshot()))
        except Exception as exc:
            self.tuner._report(exc, "recording")
            self._recording = None

    def _record(self, rank: int, frame: bytes) -> None:
        if self._recording is None:
            return
        try:
            self._recording.write(time.monotonic() - self._started_recording, rank, frame)
            self._recorded_bytes += len(frame)
            if self._recorded_bytes > RECORD_LIMIT:
                self._recording.close()
                self._recording = None
                log.warning("memtui: the recording reached %d MiB; stopped it", RECORD_LIMIT >> 20)
        except OSError as exc:
            self.tuner._report(exc, "recording")
            self._recording = None


def _moved(old: MemoryModel, new: MemoryModel, batch: int) -> bool:
    """True when a refit model differs enough from the published one to publish it again."""
    if len(old.points) != len(new.points) or old.batch_size != new.batch_size:
        return True
    drift = abs(predict_peak(old, batch) - predict_peak(new, batch))
    return drift > 0.01 * max(new.capacity_bytes, 1)


RECORD_LIMIT = 512 << 20
"""A recording stops (and says so) at this size: the hook never grows without bound."""
EFFECT_STEPS = 20
"""Steps compared before and after an applied change for its measured effect."""


def _pub_socket(context: zmq.Context) -> zmq.Socket:
    """An XPUB: a PUB that also reports each subscribe and unsubscribe (all of them, verbose)."""
    sock = context.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_VERBOSER, 1)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.LINGER, 100)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_FRAME)
    sock.setsockopt(zmq.RCVHWM, SUBSCRIPTION_QUEUE)
    return sock


def _router_socket(context: zmq.Context) -> zmq.Socket:
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME)
    sock.setsockopt(zmq.SNDHWM, 100)
    sock.setsockopt(zmq.RCVHWM, 100)
    return sock


def _port(sock: zmq.Socket) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])


def _private(endpoint: str) -> None:
    """Make an ipc socket file readable and writable by its owner only."""
    path = registry.endpoint_path(endpoint)
    if path is not None:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
