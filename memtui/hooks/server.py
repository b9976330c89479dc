"""The control server: answers hello, set and cancel on a rank's ROUTER sockets, within bounds.

What peers can make it do is bounded (``memtui.hooks.limits``): requests, refusals and
authentications are paid from a CPU budget of a few percent of a core, one for the private ipc
socket (the run's user) and one for the TCP socket (other users or nodes), and once one is spent
its socket rests until it is refilled; each connection gets a few requests a second, then a
cheap "rate limited". Refusals and rate-limited requests are counted.

ZeroMQ keeps every connection whose request waits unread (its pipes, ~50 KiB allocated and
~18 KiB resident, until the request is read), so requests that arrive faster than the budget
serves them must not wait there: while a budget rests, the agent moves its socket's requests
every ``SHED_PERIOD_S`` into a queue of its own (``hold_waiting``: each read, not decoded), which
keeps the newest ``HELD_REQUESTS`` of them (4 KiB each at most) and drops the older ones
unanswered (``shed``). A client that asks during a short rest is answered when it ends, as
before; in a flood, the memory it holds is what arrives in one period. What is dropped is not
answered: a reply would double its cost and let a flooder that waits for answers come back
sooner.

A peer can open a connection per request, so the per-connection rate does not bound what a
request writes to the audit log: turning the autopilot on or off (``TOGGLES_PER_S``) and queueing
or cancelling a change (``CHANGES_PER_S``) are also rated across every connection, since each is
one audit line and a flood of them would rotate the log's history away. What is taken is
audited exactly, each one; what is refused is counted, and the next line taken says how many.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from memtui.hooks.control import Control, Pilot, clip
from memtui.hooks.errors import Report
from memtui.hooks.limits import Budget, PeerRates
from memtui.storage import registry
from memtui.transport.security import READONLY_REASON, public_info
from memtui.wire import (
    AutotuneReply,
    AutotuneRequest,
    CancelReply,
    CancelRequest,
    Decoder,
    ErrorReply,
    Hello,
    Message,
    RankInfo,
    SetReply,
    SetRequest,
    Snapshot,
    encode,
)

RATE_LIMITED = "rate limited: this connection sent too many requests; try again in a second"
_RATE_LIMITED_FRAME = encode(ErrorReply(reason=RATE_LIMITED))
REQUESTS_PER_WAKE = 64
"""Requests answered per wake-up before the others wait for the next."""
SHED_PERIOD_S = 0.05
"""While a budget rests, its socket's requests are moved into the held queue this often (each
connection whose request waits unread holds ~50 KiB in ZeroMQ)."""
HELD_REQUESTS = 256
"""Requests held while a budget rests (the newest; 1 MiB at most): answered when it ends."""
SHED_PER_WAKE = 4096
"""Requests read at most per period: more than one ZeroMQ I/O thread accepts connections in
``SHED_PERIOD_S``, so a flood is read as fast as it can arrive, and one reading stays short."""
SHED_SLACK = 16
"""Requests read beyond twice the connections they came on (see ``hold_waiting``)."""
TOGGLES_PER_S = 0.1
"""Autopilot toggles (``memtui autotune``) taken a second, sustained, from all peers together:
each is an audit line, so this bounds what toggling adds to the log (~1.5 KB a minute)."""
TOGGLES_BURST = 10.0
"""Autopilot toggles taken at once after a quiet spell."""
TOGGLES_RATE_LIMITED = (
    "rate limited: the autopilot was turned on or off too often "
    f"(at most {TOGGLES_BURST:g} at once, then one every {1 / TOGGLES_PER_S:g} s); try again later"
)
CHANGES_PER_S = 0.2
"""Changes queued or cancelled a second (``memtui set``, ``memtui cancel``; dry runs and
rejected requests spend nothing), sustained, from all peers together: each is an audit line
(~0.5 KB), so a flood of them adds ~6 KB a minute to the log, and its 16 MiB take two days to
rotate, not minutes."""
CHANGES_BURST = 30.0
"""Changes queued or cancelled at once after a quiet spell."""


def changes_rate_limited() -> str:
    """The refusal of a set or cancel over the changes' rate."""
    return (
        "rate limited: changes were queued or cancelled too often "
        f"(at most {CHANGES_BURST:g} at once, then one every {1 / CHANGES_PER_S:g} s); "
        "try again later"
    )


class ControlServer:
    """Reads and answers control requests; rank 0 takes changes, every rank answers hello."""

    def __init__(
        self,
        control: Control,
        rank: Callable[[], int],
        snapshot: Callable[[int, bool], Snapshot],
        report: Report,
    ) -> None:
        self._control = control
        self._rank = rank
        self._snapshot = snapshot
        self._report = report
        self.budget = Budget()
        """The CPU the private ipc socket's requests may take from the training (the run's user's
        own)."""
        self.tcp_budget = Budget()
        """The CPU the TCP socket's requests and authentications may take (other users on a
        plain loopback socket, other nodes over CURVE): a budget of its own, so that a flood
        there never leaves the run's user without an answer over ipc."""
        self._peers = PeerRates()
        """Each control connection's request rate."""
        self._toggles = PeerRates(TOGGLES_PER_S, TOGGLES_BURST, 1)
        """The autopilot toggles' rate, every connection's together (one bucket)."""
        self.toggles_refused = 0
        """Autopilot toggles refused over their rate since the last one taken (its audit line
        says how many, ``rate_limited_before``)."""
        self._changes = PeerRates(CHANGES_PER_S, CHANGES_BURST, 1)
        """The rate of changes queued or cancelled, every connection's together (one bucket)."""
        self.changes_refused = 0
        """Sets and cancels refused over their rate since the last one taken."""
        self.decoder = Decoder()
        self.refused = 0
        """Requests refused before they were answered (undecodable, malformed envelopes)."""
        self.rate_limited = 0
        """Requests answered only with "rate limited", or shed unanswered."""
        self._held: dict[bool, deque[list[bytes]]] = {
            tcp: deque(maxlen=HELD_REQUESTS) for tcp in (False, True)
        }
        """Requests read while a socket's budget rested (by TCP or not), to answer once it ends."""
        self.shed = 0
        """Requests shed: read while their socket's budget rested, and dropped undecoded."""
        self.shed_cpu_s = 0.0
        """The agent's CPU seconds spent moving requests into the held queue (not paid from the
        budget: it bounds memory)."""
        self.send_failures = 0
        """Replies ZeroMQ could not queue."""

    def budget_of(self, tcp: bool) -> Budget:
        """The budget that pays for the TCP socket's requests, or for the ipc socket's."""
        return self.tcp_budget if tcp else self.budget

    def spent(self) -> float:
        """CPU seconds paid from both budgets so far."""
        return self.budget.spent + self.tcp_budget.spent

    def holding(self, tcp: bool) -> bool:
        """Whether requests read during a rest of the socket's budget wait to be answered."""
        return bool(self._held[tcp])

    def serve(self, router: zmq.Socket, readonly: bool = False, tcp: bool = False) -> None:
        """Answer the requests held, then those waiting, each paid from the socket's CPU
        budget: once it is spent, the rest wait until the next period (``hold_waiting``)."""
        budget = self.budget_of(tcp)
        held = self._held[tcp]
        for _ in range(REQUESTS_PER_WAKE):
            if budget.resting():
                return
            start = time.thread_time()
            try:
                if held:
                    frames = held.popleft()
                else:
                    try:
                        frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        return
                self._serve_one(router, frames, readonly)
            finally:
                budget.spend(time.thread_time() - start)

    def hold_waiting(self, router: zmq.Socket, tcp: bool = False) -> int:
        """Read the requests waiting (up to ``SHED_PER_WAKE``), undecoded, into the held queue,
        whose bound drops the oldest (counted as shed); the number read. Called while the
        socket's budget rests: a request left unread keeps its connection's pipes in ZeroMQ, so
        a flood of fresh connections would grow the training without bound (~18 KiB resident
        each) if they waited there for the budget."""
        start = time.thread_time()
        held = self._held[tcp]
        read = 0
        connections: set[bytes] = set()
        for _ in range(SHED_PER_WAKE):
            # ZeroMQ reads the connections with requests waiting in turn: once twice as many
            # were read as there are connections, the rest are pipelined on connections read
            # already, which their queue's bound (``RCVHWM``) holds: they wait, and cost nothing
            if read > 2 * len(connections) + SHED_SLACK:
                break
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            read += 1
            connections.add(frames[0])
            if len(held) == held.maxlen:
                self.shed += 1
                self.rate_limited += 1
            held.append(frames)
        self.shed_cpu_s += time.thread_time() - start
        return read

    def _serve_one(self, router: zmq.Socket, frames: list[bytes], readonly: bool) -> None:
        """Answer one request; a connection over its rate gets "rate limited", its request not
        even decoded."""
        if len(frames) < 2:
            self.decoder.bad_frames += 1
            self.refused += 1
            return
        envelope, payload = frames[:-1], frames[-1]
        if self._peers.allow(frames[0]):
            request = self.decoder.decode(payload)
            if request is None:
                self.refused += 1
            reply = encode(self.answer_readonly(request) if readonly else self.answer(request))
        else:
            self.rate_limited += 1
            reply = _RATE_LIMITED_FRAME
        try:
            router.send_multipart([*envelope, reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.send_failures += 1

    def answer(self, request: Message | None) -> Message:
        """The reply to one decoded request (None: it did not decode)."""
        control, rank = self._control, self._rank()
        try:
            if isinstance(request, Hello):
                return self._snapshot(request.history, request.summary)
            if isinstance(request, (SetRequest, CancelRequest, AutotuneRequest)) and rank != 0:
                return ErrorReply(reason=f"rank {rank} takes no changes: rank 0 does")
            if isinstance(request, SetRequest):
                if request.dry_run:
                    return control.queue(request)
                if not self._changes_open(request.client):
                    return SetReply(ok=False, reason=changes_rate_limited())
                queued = control.queue(request)
                if queued.ok:
                    self._changes.allow(b"")
                return queued
            if isinstance(request, CancelRequest):
                if not self._changes_open(request.client):
                    return CancelReply(ok=False, reason=changes_rate_limited())
                cancelled = control.cancel(request)
                if cancelled.ok:
                    self._changes.allow(b"")
                return cancelled
            if isinstance(request, AutotuneRequest):
                if control.pilot is None:
                    return ErrorReply(reason="this run has no autopilot")
                return self._turn(control.pilot, request)
        except Exception as exc:
            self._report(exc, "control")
            return ErrorReply(reason=f"internal error: {exc}")
        if request is None:
            return ErrorReply(reason=f"undecodable request ({self.decoder.last_error})")
        return ErrorReply(reason=f"unexpected {type(request).__name__} on the control socket")

    def _changes_open(self, client: str) -> bool:
        """Whether a set or cancel may be looked at: the changes' rate over every connection has
        a token left, which the request spends if it queues or cancels a change (a rejected
        one is audited at a rate of its own). Refused: counted; the first looked at after some
        were refused is preceded by an audit line that says how many (``rate_limited``), so the
        log shows the flood without a line each."""
        if not self._changes.available(b""):
            self.rate_limited += 1
            self.changes_refused += 1
            return False
        if self.changes_refused:
            refused, self.changes_refused = self.changes_refused, 0
            self._control.audit_event(
                "rate_limited",
                {"requests": "set/cancel", "refused": refused, "next_client": clip(client)},
            )
        return True

    def _turn(self, pilot: Pilot, request: AutotuneRequest) -> Message:
        """Turn the autopilot on or off, within the toggles' rate over every connection (over
        it: refused as "rate limited" with the state as it stays, counted, and said in the next
        toggle's audit line)."""
        if not self._toggles.allow(b""):
            self.rate_limited += 1
            self.toggles_refused += 1
            return AutotuneReply(ok=False, state=pilot.state(), reason=TOGGLES_RATE_LIMITED)
        refused, self.toggles_refused = self.toggles_refused, 0
        return pilot.turn(request, rate_limited_before=refused)

    def answer_readonly(self, request: Message | None) -> Message:
        """The answer on a plain TCP socket without the control opt-in: hello gets a snapshot
        without the command line, cwd and paths (the ranks' ipc sockets included); anything
        else is refused."""
        if not isinstance(request, Hello):
            return ErrorReply(reason=READONLY_REASON)
        reply = self.answer(request)
        if isinstance(reply, Snapshot):
            reply.info = public_info(reply.info)
            reply.ranks = public_ranks(reply.ranks)
            reply.summary = None  # it holds the command line, cwd and paths too
        return reply


def public_ranks(ranks: list[RankInfo]) -> list[RankInfo]:
    """The ranks as a read-only plain TCP socket gives them: their TCP endpoints alone (an ipc
    endpoint is a path in the run's private runtime directory, which no other user can open)."""
    return [
        msgspec.structs.replace(
            rank,
            pub="" if registry.endpoint_path(rank.pub) else rank.pub,
            control="" if registry.endpoint_path(rank.control) else rank.control,
        )
        for rank in ranks
    ]
