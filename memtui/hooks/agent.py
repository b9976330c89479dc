"""The agent thread: owns the ZeroMQ sockets, publishes telemetry in batches, serves the control socket.

Every ``flush_period_s`` (500 ms) while a viewer is subscribed or a recording is written, else
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
authentications are paid from a CPU budget of a few percent of a core, one for the private ipc
socket and one for the TCP sockets, and once one is spent its sockets rest until it is refilled;
each connection gets a few requests a second, then a cheap "rate limited"; while a budget rests,
the requests waiting on its socket are read every 50 ms into the server's bounded queue (the
newest answered when the rest ends, the older dropped: ZeroMQ keeps each unread request's
connection, so a flood of fresh connections left waiting would grow the training without bound);
a TCP socket holding more than ``MAX_TCP_CONNECTIONS`` connections is closed and bound again
after a rest; and a telemetry socket that receives anything but a viewer's subscription (or a
storm of them) is closed and reopened a second later, since ZeroMQ keeps every subscription it
is sent until the socket closes. Refusals, rate-limited
requests and failed authentications are counted in ``HookCounters`` (``memtui status``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from memtui.advice.measure import (
    LONG_STEPS,
    effects_due,
    measuring,
    model_moved,
    observe,
    speed_prediction_due,
)
from memtui.advice.predict import fit
from memtui.core.stats import one_line
from memtui.hooks.autopilot import Autopilot
from memtui.hooks.control import Control
from memtui.hooks.errors import ErrorLog
from memtui.hooks.knobstore import KnobStore
from memtui.hooks.ledger import StepLedger
from memtui.hooks.limits import Budget, ConnectionCap
from memtui.hooks.persist import TunedConfig
from memtui.hooks.placement import Placement
from memtui.hooks.progress import BackwardWatch, Progress, in_backward
from memtui.hooks.publisher import Publisher, Recorder
from memtui.hooks.server import SHED_PERIOD_S, ControlServer
from memtui.hooks.summary import RunSummaries
from memtui.hooks.threadname import name_native_thread
from memtui.storage import registry
from memtui.transport.recording import CONTROL_RANK, RecordingHeader
from memtui.transport.security import IPC, TcpPlan, ZapHandler, exposure, make_server
from memtui.wire import HookCounters, ModelPoint, RankInfo, RunInfo, RunRecord, Snapshot, encode

if TYPE_CHECKING:
    from memtui.hooks.sampler import Sampler

log = logging.getLogger("memtui")

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
"""How long a misused socket stays closed before it is bound again."""
CAPPED_REST_S = 60.0
"""The longest a TCP socket reset for too many connections stays closed: each reset within a
minute of the last doubles its rest from ``PUB_REST_S``, since ZeroMQ clients reconnect by
themselves, all at once, as soon as it is bound again."""
NEWS_GAP_S = 0.1
"""A change of the control state goes out at once, but at most this often."""
CAP_TICK_S = 0.1
"""How often a run with TCP sockets looks at the descriptors it holds (``ConnectionCap``): a peer
opening connections fast is caught within this much of its connections."""
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
"""The monitor events of a TCP peer that failed to authenticate before ZAP was asked (a wrong
server key, plain ZeroMQ on a CURVE socket, a connection dropped mid-handshake)."""


@dataclass
class HookParts:
    """The parts of the hook the agent thread reads (each through its public methods)."""

    ledger: StepLedger
    store: KnobStore
    control: Control
    placement: Placement
    errors: ErrorLog
    tuned: TunedConfig
    info: Callable[[], RunInfo]
    """This run's description as a viewer's hello gets it."""
    sampler: Callable[[], Sampler | None]
    tcp_plan: TcpPlan | None = None
    record_path: str | None = None
    """Also write the published stream here (``MEMTUI_RECORD``)."""
    autopilot: Autopilot | None = None
    """The autopilot (it acts on rank 0 only)."""
    summaries: RunSummaries | None = None
    """The run's summary, written beside its tuned config (rank 0) or posted (the others)."""


class Agent(threading.Thread):
    """Publishes one rank's telemetry and (on rank 0) serves the control socket."""

    def __init__(
        self,
        parts: HookParts,
        run_dir: registry.RunDir,
        *,
        flush_period_s: float = 0.5,
        heartbeat_s: float = 1.0,
        idle_flush_s: float = 1.0,
    ) -> None:
        super().__init__(name="memtui-agent", daemon=True)
        self.parts = parts
        self._report = parts.errors.report
        self.run_dir = run_dir
        self.flush_period_s = flush_period_s
        self.idle_flush_s = max(idle_flush_s, flush_period_s)
        """The flush period while nobody is subscribed and nothing is recorded."""
        self.publisher = Publisher(
            parts.ledger,
            parts.control,
            parts.sampler,
            heartbeat_s,
            summary=parts.summaries.builder if parts.summaries is not None else None,
            report=self._report,
        )
        self.server = ControlServer(
            parts.control, lambda: parts.placement.rank, self.snapshot, self._report
        )
        self._subscribers: dict[int, int] = {}
        """Live subscriptions on each PUB socket (by the socket's id), from the XPUB's reports."""
        self.recoveries = 0
        """Times the runtime directory vanished and was recreated."""
        self.messages_dropped = 0
        """Telemetry frames a full socket queue dropped."""
        self.socket_resets = 0
        """Sockets reset for misuse: telemetry sockets sent what no viewer sends, TCP sockets
        holding too many connections (counted as refused requests)."""
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self._stop_event = threading.Event()
        self._waker: tuple[int, int] | None = None
        """A pipe (read, write) whose read end the poll watches: ``stop`` writes to it, so the
        thread ends at once instead of at its next wake-up (a second apart unwatched)."""
        self._waker_lock = threading.Lock()
        """Held to write to the pipe and to close it (a closed descriptor may be reused)."""
        self._context: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._pub_tcp: zmq.Socket | None = None
        self._router_tcp: zmq.Socket | None = None
        self._zap: ZapHandler | None = None
        self.security = IPC
        """How this rank's sockets are exposed (``ipc`` unless TCP was asked for)."""
        self.tcp_pub = ""
        """This rank's TCP telemetry endpoint as other nodes reach it ("" without TCP)."""
        self.tcp_control = ""
        self.tcp_readonly = False
        """The TCP control socket answers hello only (plain TCP without the control opt-in)."""
        self.registered = False
        self._displaced = ""
        """Why the run's directory cannot be recreated ("" while it is in place)."""
        self._warned_pub = False
        self._warned_connections = False
        self._cap = ConnectionCap()
        """Counts the TCP sockets' connections (``MAX_TCP_CONNECTIONS`` each at most)."""
        self._capped_at = -math.inf
        self._capped_rest = PUB_REST_S
        """When a TCP socket was last reset for its connections, and how long it rested."""
        self._recorder: Recorder | None = None
        self._points: dict[int, ModelPoint] = {}
        """The latest observed (micro-batch, peak) point of each micro-batch size."""
        self._observed: tuple[object, ...] = ()
        """What the last memory observation was made of (the newest samples, the config)."""
        self._polled: tuple[zmq.Socket | int, ...] = ()
        self._poll = zmq.Poller()
        self._monitors: dict[zmq.Socket, zmq.Socket] = {}
        """Monitor sockets of the TCP sockets (monitor -> socket watched), read at every wake-up."""
        self._handshake_failures = 0
        self._reports: dict[int, tuple[float, int]] = {}
        """Subscription reports of each PUB socket (by id) in the current second: (since, count)."""
        self._closed: list[tuple[str, str, float]] = []
        """Sockets closed for misuse: (which: ``pub``, ``pub_tcp`` or ``control_tcp``, endpoint,
        when to bind it again)."""
        self._backward = BackwardWatch()
        self._posted: Progress | None = None
        """This rank's progress as last posted for the other ranks."""

    # ------------------------------------------------------------------ lifecycle

    def stop(self, timeout: float = 2.0) -> None:
        """Send the last batch (``ended``), close the sockets and remove the registry entry."""
        self._stop_event.set()
        with self._waker_lock:
            if self._waker is not None:
                with contextlib.suppress(OSError):  # full: a wake-up is pending already
                    os.write(self._waker[1], b"x")
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        """Bind, then flush and serve until stopped; failures are reported, never raised."""
        name_native_thread(self.name)
        try:
            self._waker = os.pipe()
            os.set_blocking(self._waker[1], False)
            self._context = zmq.Context()
            self._bind()
            self._bind_tcp()
            self._watch_handshakes(self._pub_tcp, self._router_tcp)
        except BaseException as exc:
            self.failed = exc
            self._report(exc, "agent start")
            self.ready.set()
            self._close()
            return
        self.ready.set()
        self._open_recording()
        next_flush = time.monotonic() + self.flush_period()
        next_check = time.monotonic() + 2.0
        next_model = time.monotonic() + 1.0
        next_shed = next_cap = 0.0
        server = self.server
        while not self._stop_event.is_set():
            try:
                # rounded up: a timeout truncated to 0 ms would spin until the flush is due
                wake = self._wake(next_flush, next_shed, next_cap)
                timeout_ms = max(0, math.ceil((wake - time.monotonic()) * 1000))
                cpu, spent = time.thread_time(), server.spent()
                served: Budget | None = None
                for sock, _event in self._poller().poll(timeout_ms):
                    if self._waker is not None and sock == self._waker[0]:
                        continue  # stop() woke the poll: the loop's test ends it
                    if isinstance(sock, zmq.Socket) and sock.closed:
                        continue  # reset earlier in this round (a TCP socket's monitor with it)
                    if sock in self._monitors:
                        self._read_monitor(sock)
                    elif self._zap is not None and sock is self._zap.socket:
                        self._authenticate()
                        served = server.tcp_budget
                    elif isinstance(sock, zmq.Socket) and sock in (self._pub, self._pub_tcp):
                        if self._read_subscriptions(sock):
                            next_flush = time.monotonic()  # a viewer arrived: send at once
                            sampler = self.parts.sampler()
                            if sampler is not None:
                                sampler.wake.set()  # and sample at the viewer's rate now
                    elif isinstance(sock, zmq.Socket) and sock in (self._router, self._router_tcp):
                        tcp = sock is self._router_tcp
                        server.serve(sock, readonly=self.tcp_readonly and tcp, tcp=tcp)
                        served = server.budget_of(tcp)
                        if self.publisher.control_changed():  # a queued change is news: now
                            soon = max(time.monotonic(), self.publisher.last_send + NEWS_GAP_S)
                            next_flush = min(next_flush, soon)
                if served:  # the wake-up is the peers' too: the poll and what serve did not pay
                    overhead = time.thread_time() - cpu - (server.spent() - spent)
                    served.spend(max(0.0, overhead))
                if self._closed:
                    self._reopen()
                now = time.monotonic()
                if now >= next_cap and self._tcp_sockets():
                    next_cap = now + CAP_TICK_S
                    self._cap_connections()
                for router, tcp in ((self._router, False), (self._router_tcp, True)):
                    if router is None:
                        continue
                    if server.budget_of(tcp).resting():
                        if now >= next_shed:
                            server.hold_waiting(router, tcp)
                    elif server.holding(tcp):  # a rest ended: answer what it held, in turn
                        server.serve(router, readonly=self.tcp_readonly and tcp, tcp=tcp)
                if now >= next_shed:
                    next_shed = now + SHED_PERIOD_S
                if now >= next_flush:
                    next_flush = max(next_flush + self.flush_period(), now)
                    self.flush()
                if now >= next_check:
                    next_check = now + 2.0
                    self._check_registry()
                if now >= next_model:
                    next_model = now + 1.0
                    self.post_progress()
                    self.learn()
                    self.summarize()
            except BaseException as exc:  # never let the thread die silently
                self._report(exc, "agent")
                self._stop_event.wait(0.5)
                with contextlib.suppress(BaseException):
                    self._rebind()
        with contextlib.suppress(BaseException):
            self.learn(final=True)
            self.flush(ended=True)
            self.summarize(final=True)
            time.sleep(0.05)  # let the final frame leave before the socket closes
        self._close()
        if self._recorder is not None:
            self._recorder.close()
        if self.parts.placement.rank == 0:
            self.run_dir.remove()

    def _wake(self, next_flush: float, next_shed: float, next_cap: float) -> float:
        """When the next poll must end: the flush, the end of a rest or the next shedding
        during one, a socket to reopen, or the TCP sockets' next look at their connections."""
        wake = min(next_flush, next_cap) if self._tcp_sockets() else next_flush
        for tcp in (False, True):
            budget = self.server.budget_of(tcp)
            if budget.resting():
                wake = min(wake, budget.resting_until, next_shed)
            elif self.server.holding(tcp):
                wake = min(wake, next_shed)
        for _which, _endpoint, at in self._closed:
            wake = min(wake, at)
        return wake

    def _poller(self) -> zmq.Poller:
        """The poller over the sockets served now, rebuilt only when they change (a rebind, or
        the control plane resting: then the control and authentication sockets are not read)."""
        resting = self.server.budget.resting()
        tcp_resting = self.server.tcp_budget.resting()
        sockets = tuple(
            sock
            for sock in (
                None if resting else self._router,
                None if tcp_resting else self._router_tcp,
                self._zap.socket if self._zap and not tcp_resting else None,
                self._pub,
                self._pub_tcp,
                *self._monitors,
                self._waker[0] if self._waker is not None else None,
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
        return self.subscribers > 0 or (self._recorder is not None and self._recorder.active)

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
                endpoint = self._reset(sock)
                if not self._warned_pub:  # once: a peer that keeps at it must not flood the log
                    self._warned_pub = True
                    log.warning(
                        "memtui: a peer sent the telemetry socket %s what no viewer sends; "
                        "reset it (counted in requests_refused)",
                        endpoint,
                    )
                return False
            count = count + 1 if report == b"\x01" else max(0, count - 1)
        self._subscribers[id(sock)] = count
        self._reports[id(sock)] = (since, seen)
        return before == 0 and count > 0

    def _tcp_sockets(self) -> list[zmq.Socket]:
        """The TCP sockets bound now."""
        return [sock for sock in (self._router_tcp, self._pub_tcp) if sock is not None]

    def _cap_connections(self) -> None:
        """Reset a TCP socket that holds more connections than ``MAX_TCP_CONNECTIONS`` (when
        they are counted: ``ConnectionCap``)."""
        plan = self.parts.tcp_plan
        host = plan.address if plan is not None else "127.0.0.1"
        ports = {_port(sock): sock for sock in self._tcp_sockets()}
        for port in self._cap.over([(host, port) for port in ports]):
            now = time.monotonic()
            recent = now - self._capped_at < CAPPED_REST_S
            self._capped_rest = min(CAPPED_REST_S, 2 * self._capped_rest if recent else PUB_REST_S)
            self._capped_at = now
            endpoint = self._reset(ports[port], self._capped_rest)
            if not self._warned_connections:  # once, as above
                self._warned_connections = True
                log.warning(
                    "memtui: the TCP socket %s held more than %d connections; reset it, "
                    "dropping them all (counted in requests_refused)",
                    endpoint,
                    self._cap.limit,
                )

    def _reset(self, sock: zmq.Socket, rest: float = PUB_REST_S) -> str:
        """Close a socket peers misused (a telemetry socket sent what no viewer sends, whose
        topics ZeroMQ keeps byte by byte until it is closed; a TCP socket holding too many
        connections), freeing what ZeroMQ kept for them, to bind it again ``rest`` seconds later
        (viewers reconnect by themselves); its endpoint."""
        which = (
            "pub_tcp"
            if sock is self._pub_tcp
            else "control_tcp"
            if sock is self._router_tcp
            else "pub"
        )
        raw = sock.getsockopt(zmq.LAST_ENDPOINT)
        endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._unwatch(sock)
        self._subscribers.pop(id(sock), None)
        self._reports.pop(id(sock), None)
        with contextlib.suppress(zmq.ZMQError):
            sock.close(0)
        if which == "pub_tcp":
            self._pub_tcp = None
        elif which == "control_tcp":
            self._router_tcp = None
        else:
            self._pub = None
        self._closed.append((which, endpoint, time.monotonic() + rest))
        self.socket_resets += 1
        return endpoint

    def _reopen(self) -> None:
        """Bind again the sockets whose rest is over (retried later if that fails)."""
        assert self._context is not None
        now = time.monotonic()
        plan = self.parts.tcp_plan
        for entry in list(self._closed):
            which, endpoint, at = entry
            if now < at:
                continue
            self._closed.remove(entry)
            bound = {"pub": self._pub, "pub_tcp": self._pub_tcp, "control_tcp": self._router_tcp}
            if bound[which] is not None:
                continue  # bound again meanwhile (a rebind)
            control = which == "control_tcp"
            sock = _router_socket(self._context) if control else _pub_socket(self._context)
            try:
                if which != "pub":
                    make_server(sock, plan.keys if plan is not None else None)
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                sock.close(0)
                self._report(exc, "control socket" if control else "telemetry socket")
                self._closed.append((which, endpoint, now + PUB_REST_S))
                continue
            if which == "pub":
                self._pub = sock
                _private(endpoint)
            else:
                if control:
                    self._router_tcp = sock
                else:
                    self._pub_tcp = sock
                self._watch_handshakes(sock)

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
        """Answer the waiting authentication requests, paid from the TCP sockets' budget."""
        assert self._zap is not None
        start = time.thread_time()
        self._zap.handle(limit=64)
        self.server.tcp_budget.spend(time.thread_time() - start)

    def _bind(self) -> None:
        """Bind this rank's ipc PUB and ROUTER sockets in the private runtime directory."""
        assert self._context is not None
        self.run_dir.create()
        pub_endpoint = self.run_dir.pub_endpoint(self.parts.placement.rank)
        self._pub = _pub_socket(self._context)
        self._pub.bind(pub_endpoint)
        _private(pub_endpoint)
        control_endpoint = self.run_dir.control_endpoint(self.parts.placement.rank)
        self._router = _router_socket(self._context)
        self._router.bind(control_endpoint)
        _private(control_endpoint)

    def _bind_tcp(self) -> None:
        """Bind TCP twins of both sockets when asked (CURVE unless insecure on loopback; plain
        TCP without the control opt-in answers hello only, reduced), note the security mode and
        warn loudly about plain TCP."""
        plan = self.parts.tcp_plan
        if plan is None:
            self.security = IPC
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
        self.security = plan.mode
        warning = exposure(plan.mode, [self.tcp_pub, self.tcp_control])
        if warning:
            log.warning("memtui: %s", warning)

    def register(self) -> None:
        """Write the run's registry record (rank 0), once every rank's endpoints are known."""
        if self.parts.placement.rank == 0 and self._router is not None:
            self.run_dir.write(self.record())
            self.registered = True

    def _close(self) -> None:
        with self._waker_lock:
            waker, self._waker = self._waker, None
        for fd in waker or ():
            with contextlib.suppress(OSError):
                os.close(fd)
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
        """Close and bind the ipc sockets again (the TCP ones do not depend on the directory),
        once the run's directory is there again: while it cannot be (the runtime directory moved
        away, another account's in its place) the sockets are kept as they are."""
        self.run_dir.create()  # raises before anything is closed
        for sock in (self._pub, self._router):
            if sock is not None:
                self._subscribers.pop(id(sock), None)
                with contextlib.suppress(zmq.ZMQError):
                    sock.close(0)
        self._pub = self._router = None
        self._closed = [entry for entry in self._closed if entry[0] != "pub"]  # TCP ones only
        self._bind()
        if self.registered:
            self.register()

    def _check_registry(self) -> None:
        """Recreate the runtime directory, sockets and record if they were removed; while the
        runtime directory cannot be used (moved away and another account's in its place), keep
        the sockets, say so once, and try again at the next check."""
        if self.parts.placement.rank != 0 or not self.registered:
            return
        try:
            if self._router is not None and self.run_dir.record_path.exists():
                self._displaced = ""
                return
            self._rebind()
        except (registry.RegistryError, OSError) as exc:
            if not self._displaced:
                log.warning(
                    "memtui: the runtime directory %s was moved or replaced (%s): the run keeps "
                    "training and serving its sockets where they are; it registers again once "
                    "the directory can be its own (tried every 2 s)",
                    self.run_dir.path.parent,
                    one_line(exc),
                )
            self._displaced = one_line(exc)
            return
        self.recoveries += 1
        self._displaced = ""
        log.warning("memtui: the runtime directory %s vanished; recreated it", self.run_dir.path)

    def record(self) -> RunRecord:
        """This run's registry record."""
        info = self.parts.info()
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
        return list(self.parts.placement.ranks)

    # ------------------------------------------------------------------ telemetry

    def flush(self, ended: bool = False) -> None:
        """Send one batch with everything new since the previous one (or a heartbeat)."""
        placement = self.parts.placement
        counters = self.current_counters()
        message = self.publisher.telemetry(
            run=placement.run_id,
            rank=placement.rank,
            counters=counters,
            watched=self.watched,
            ended=ended,
        )
        if message is None:
            return
        frame = encode(message)
        if self._send(frame):
            self.publisher.sent(message, counters)
        if self._recorder is not None:
            self._recorder.write(placement.rank, frame)

    def _send(self, frame: bytes) -> bool:
        sent = False
        for sock in (self._pub, self._pub_tcp):
            if sock is None:
                continue
            try:
                sock.send(frame, zmq.NOBLOCK)
                sent = True
            except zmq.Again:
                self.messages_dropped += 1
        return sent

    def current_counters(self) -> HookCounters:
        """The hook's counters now."""
        parts, server = self.parts, self.server
        return HookCounters(
            records_dropped=self.publisher.records_dropped,
            messages_dropped=self.messages_dropped + server.send_failures,
            bad_frames=server.decoder.bad_frames,
            errors=parts.errors.count,
            last_error=parts.errors.last,
            recoveries=self.recoveries,
            requests_refused=server.refused + self.socket_resets + parts.control.refused,
            requests_rate_limited=server.rate_limited,
            auth_failures=self._handshake_failures + (self._zap.denied if self._zap else 0),
            control_rests=server.budget.rests + server.tcp_budget.rests,
            tuned_unsaved_step=parts.tuned.unsaved_step,
        )

    def snapshot(self, history: int = 512, summary: bool = False) -> Snapshot:
        """Everything a new viewer needs, with the last ``history`` step records (and the run's
        summary where ``summary``: ``memtui report``)."""
        snapshot = self.publisher.snapshot(
            self.parts.info(), self.ranks(), self.current_counters(), history
        )
        summaries = self.parts.summaries
        if summary and summaries is not None:
            summaries.look(lambda: snapshot)
            snapshot.summary = summaries.summary(
                snapshot.info, snapshot.counters, self.publisher.records_dropped
            )
        return snapshot

    def summarize(self, final: bool = False) -> None:
        """Take the verdict for the run's summary when a look is due (rank 0), and write the
        summary (or post this rank's figures) when due or ``final``."""
        summaries = self.parts.summaries
        if summaries is None:
            return
        try:
            summaries.look(lambda: self.snapshot(64), force=final)
        except Exception as exc:
            self._report(exc, "the run's summary")
        summaries.save(
            self.parts.info, self.current_counters, self.publisher.records_dropped, final=final
        )

    # ------------------------------------------------------------------ the other ranks

    def post_progress(self) -> None:
        """Post how far this rank got, for a rank waiting at a checkpoint boundary: the steps
        closed, the open step's micro-batches, whether the training thread is in a backward
        pass (a job of several only; nothing posted while it stays where it was); switch
        changes off here once an abort is posted at a boundary this rank went past."""
        parts = self.parts
        if not parts.placement.coordinated:
            return
        ledger = parts.ledger
        # a step closing between these reads is seen whole at the next look (a second later),
        # and only a position seen twice in a backward pass names a rank
        step, micro = ledger.step, ledger.open.micro
        busy = in_backward(ledger.training_thread)
        progress = self._backward.look(step, micro, busy, time.monotonic())
        fresh = progress if progress != self._posted else None
        self._posted = progress
        aborted = parts.placement.post_progress(fresh)
        if aborted:
            parts.control.disable(aborted)

    # ------------------------------------------------------------------ what the run teaches

    def learn(self, final: bool = False) -> None:
        """Refit the memory model and measure the applied changes whose steps after have run;
        what has nothing new to work on is skipped (no new sample, no change to measure)."""
        parts, publisher = self.parts, self.publisher
        control = parts.control
        self._observe()
        applied = control.applied_changes()
        if final or measuring(applied):
            steps = list(publisher.steps)
            due = speed_prediction_due(
                applied,
                steps,
                parts.ledger.records,
                parts.store.knobs,
                control.thresholds.starved_wait_fraction,
                control.cannot_act(),
            )
            if due is not None:
                control.record_speed_prediction(*due)
            for measured in effects_due(
                control.applied_changes(),
                steps,
                list(publisher.device),
                parts.ledger.records,
                final=final,
                now=parts.store.knobs,
                cannot_act=control.cannot_act(),
            ):
                control.record_effect(measured)
        autopilot = parts.autopilot
        if autopilot is not None and not final and autopilot.acting():
            autopilot.tick(
                parts.ledger.records(list(publisher.steps)[-3 * LONG_STEPS :]),
                publisher.host[-1] if publisher.host else None,
                parts.info(),
            )

    def _observe(self) -> None:
        """Offer the memory model a refit from the samples at the current micro-batch, unless
        none of what the observation is made of changed since the last one."""
        parts, publisher = self.parts, self.publisher
        batch = parts.store.value("batch_size")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            return
        workers = parts.store.value("num_workers")
        sampler = parts.sampler()
        host = publisher.host[-1] if publisher.host else None
        since, static = parts.store.memory_since_step, parts.control.static
        returns_freed = sampler is not None and sampler.returns_freed()
        newest = publisher.device[-1] if publisher.device else None
        inputs = (newest, host, batch, since, static, workers, returns_freed)
        if inputs == self._observed:
            return
        self._observed = inputs
        observation = observe(
            publisher.device,
            batch,
            since,
            static,
            workers=workers if isinstance(workers, int) else None,
            host=host,
            returns_freed=returns_freed,
        )
        if observation is not None:
            model = fit(observation, list(self._points.values()))
            # the points the fit used are the history: one it left out (a CPU peak after a
            # decrease) does not replace the one measured at that batch before
            self._points = {p.batch_size: p for p in model.points}
            parts.control.offer_model(model, lambda old: model_moved(old, model, batch))

    # ------------------------------------------------------------------ recording

    def _open_recording(self) -> None:
        """Start writing the published stream to the record path (with a first snapshot)."""
        path = self.parts.record_path
        if not path:
            return
        placement = self.parts.placement
        if placement.world_size > 1:
            path = f"{path}.rank{placement.rank}"
        try:
            header = RecordingHeader(
                started=time.time(),
                run=placement.run_id,
                source="hook",
                note=f"rank {placement.rank}",
            )
            self._recorder = Recorder(path, header, self._report)
            if placement.rank == 0:
                self._recorder.write(CONTROL_RANK, encode(self.snapshot()))
        except Exception as exc:
            self._report(exc, "recording")
            self._recorder = None


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
