"""The control server: answers hello, set and cancel on a rank's ROUTER sockets, within bounds.

What peers can make it do is bounded (``memtui.hooks.limits``): requests, refusals and
authentications are paid from one CPU budget of a few percent of a core, and once it is spent
the control sockets rest until it is refilled; each connection gets a few requests a second,
then a cheap "rate limited". Refusals and rate-limited requests are counted.

A peer can open a connection per request, so the per-connection rate does not bound what a
request writes to the audit log: turning the autopilot on or off is also rated across every
connection (``TOGGLES_PER_S``), since each toggle is one audit line and a flood of them would
rotate the log's history away. Changes (set, cancel) are audited exactly, each one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import zmq

from memtui.hooks.control import Control, Pilot
from memtui.hooks.errors import Report
from memtui.hooks.limits import Budget, PeerRates
from memtui.storage import registry
from memtui.transport.security import READONLY_REASON, public_info
from memtui.wire import (
    AutotuneReply,
    AutotuneRequest,
    CancelRequest,
    Decoder,
    ErrorReply,
    Hello,
    Message,
    RankInfo,
    SetRequest,
    Snapshot,
    encode,
)

RATE_LIMITED = "rate limited: this connection sent too many requests; try again in a second"
_RATE_LIMITED_FRAME = encode(ErrorReply(reason=RATE_LIMITED))
REQUESTS_PER_WAKE = 64
"""Requests answered per wake-up before the others wait for the next."""
TOGGLES_PER_S = 0.1
"""Autopilot toggles (``memtui autotune``) taken a second, sustained, from all peers together:
each is an audit line, so this bounds what toggling adds to the log (~1.5 KB a minute)."""
TOGGLES_BURST = 10.0
"""Autopilot toggles taken at once after a quiet spell."""
TOGGLES_RATE_LIMITED = (
    "rate limited: the autopilot was turned on or off too often "
    f"(at most {TOGGLES_BURST:g} at once, then one every {1 / TOGGLES_PER_S:g} s); try again later"
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
        """The CPU the control plane may take from the training (requests, authentications)."""
        self._peers = PeerRates()
        """Each control connection's request rate."""
        self._toggles = PeerRates(TOGGLES_PER_S, TOGGLES_BURST, 1)
        """The autopilot toggles' rate, every connection's together (one bucket)."""
        self.toggles_refused = 0
        """Autopilot toggles refused over their rate since the last one taken (its audit line
        says how many, ``rate_limited_before``)."""
        self.decoder = Decoder()
        self.refused = 0
        """Requests refused before they were answered (undecodable, malformed envelopes)."""
        self.rate_limited = 0
        """Requests answered only with "rate limited"."""
        self.send_failures = 0
        """Replies ZeroMQ could not queue."""

    def serve(self, router: zmq.Socket, readonly: bool = False) -> None:
        """Answer the requests waiting, each paid from the CPU budget: once it is spent, the
        rest wait in ZeroMQ's queues, unread, until it is refilled."""
        budget = self.budget
        for _ in range(REQUESTS_PER_WAKE):
            if budget.resting():
                return
            start = time.thread_time()
            try:
                if not self._serve_one(router, readonly):
                    return
            finally:
                budget.spend(time.thread_time() - start)

    def _serve_one(self, router: zmq.Socket, readonly: bool) -> bool:
        """Read and answer one request (False when none waits); a connection over its rate gets
        "rate limited", its request not even decoded."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        if len(frames) < 2:
            self.decoder.bad_frames += 1
            self.refused += 1
            return True
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
        return True

    def answer(self, request: Message | None) -> Message:
        """The reply to one decoded request (None: it did not decode)."""
        control, rank = self._control, self._rank()
        try:
            if isinstance(request, Hello):
                return self._snapshot(request.history, request.summary)
            if isinstance(request, (SetRequest, CancelRequest, AutotuneRequest)) and rank != 0:
                return ErrorReply(reason=f"rank {rank} takes no changes: rank 0 does")
            if isinstance(request, SetRequest):
                return control.queue(request)
            if isinstance(request, CancelRequest):
                return control.cancel(request)
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
