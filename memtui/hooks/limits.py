"""What peers may make the hook do: the agent's CPU on their behalf, each peer's rate, and the
connections they may hold.

The training run comes first. Every request on the control socket, every authentication and
every refusal takes the agent thread's CPU (and the GIL) from the training, so all of it is
paid from a :class:`Budget` of CPU seconds, refilled at a few percent of a core (one for the
private ipc socket, one for the TCP sockets): once one is spent, the agent stops serving its
sockets until it is refilled, and sheds what arrives meanwhile (``hooks.server``). Within it,
:class:`PeerRates` lets each connection send a few requests a second: the viewer and the CLI open
a connection per request, so they never meet that limit, while one connection that floods gets
a cheap "rate limited" answer instead of being served, which keeps the budget for everyone
else. And :class:`ConnectionCap` bounds the connections a TCP socket holds, whatever they send.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from memtui.transport.peers import connections

BUDGET_SHARE = 0.02
"""The share of one core the agent may spend on peers' requests, sustained."""
BUDGET_BURST_S = 0.1
"""CPU seconds the agent may spend at once after a quiet spell (a viewer's first snapshots)."""
BUDGET_RESUME_S = 0.01
"""Once the budget is spent, the sockets rest until it has this much again (~0.3 s)."""
PEER_RATE = 2.0
"""Requests a second one connection may make, sustained."""
PEER_BURST = 10.0
"""Requests one connection may make at once."""
PEERS = 1024
"""Connections whose rate is remembered (the least recently seen are forgotten)."""


class Budget:
    """CPU seconds the agent may spend on peers: refilled at ``share`` of a core up to
    ``burst``; spent past zero, it rests until it is back to ``resume``."""

    def __init__(
        self,
        share: float = BUDGET_SHARE,
        burst: float = BUDGET_BURST_S,
        resume: float = BUDGET_RESUME_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.share = share
        self.burst = burst
        self.resume = resume
        self._clock = clock
        self._level = burst
        self._stamp = clock()
        self.resting_until = 0.0
        """Until when (``clock``) the sockets it pays for are not read."""
        self.rests = 0
        """Times it was spent."""
        self.spent = 0.0
        """CPU seconds paid so far."""

    def level(self) -> float:
        """The CPU seconds left now."""
        now = self._clock()
        self._level = min(self.burst, self._level + (now - self._stamp) * self.share)
        self._stamp = now
        return self._level

    def spend(self, seconds: float) -> None:
        """Pay ``seconds`` of CPU; past zero, rest until it is refilled to ``resume``."""
        self.spent += seconds
        level = self.level() - seconds
        self._level = level
        if level <= 0 and not self.resting():
            self.resting_until = self._stamp + (self.resume - level) / self.share
            self.rests += 1

    def resting(self) -> bool:
        """Whether the sockets it pays for are resting now."""
        return self._clock() < self.resting_until


class PeerRates:
    """A token bucket per peer (a ROUTER routing id): ``rate`` requests a second, ``burst`` at
    once; the ``peers`` least recently seen are forgotten, so it never grows past them."""

    def __init__(
        self,
        rate: float = PEER_RATE,
        burst: float = PEER_BURST,
        peers: int = PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.peers = peers
        self._clock = clock
        self._buckets: dict[bytes, tuple[float, float]] = {}
        """Peer to (tokens, when counted), least recently seen first."""

    def allow(self, peer: bytes) -> bool:
        """Take one request's token from ``peer``'s bucket; False when it has none."""
        now = self._clock()
        tokens, stamp = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - stamp) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.peers:
            del self._buckets[next(iter(self._buckets))]
        return allowed

    def available(self, peer: bytes) -> bool:
        """Whether ``peer``'s bucket holds a token now (none taken: ``allow`` takes it)."""
        tokens, stamp = self._buckets.get(peer, (self.burst, self._clock()))
        return min(self.burst, tokens + (self._clock() - stamp) * self.rate) >= 1.0

    def __len__(self) -> int:
        return len(self._buckets)


MAX_TCP_CONNECTIONS = 512
"""Connections one TCP socket may hold (a viewer takes one on each rank's telemetry socket, a
request one on the control socket while it is answered). ZeroMQ keeps ~40 KiB for each, so a
peer holding thousands would grow the training by hundreds of MiB: past the bound the socket
is reset (closed, and bound again a second later, longer while it keeps happening), and its
connections with it."""
CONNECTION_CHECK_S = 1.0
"""How often the TCP sockets' connections are counted."""
DESCRIPTOR_STEP = 64
"""Descriptors the process may gain between two counts before they are counted at once."""


def open_descriptors() -> int:
    """The file descriptors this process holds now (a connection is one)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class ConnectionCap:
    """Which TCP ports hold more than ``limit`` connections. The kernel counts them
    (``transport.peers.connections``, a walk of its connection table: ~3 ms on a busy host) once
    every ``period``, and at once when the process gained ``step`` descriptors since the last
    count (cheap to read while they are few): a peer opening connections fast is caught within
    ``step`` of them, not a period later."""

    def __init__(
        self,
        limit: int = MAX_TCP_CONNECTIONS,
        period: float = CONNECTION_CHECK_S,
        step: int = DESCRIPTOR_STEP,
        clock: Callable[[], float] = time.monotonic,
        descriptors: Callable[[], int] = open_descriptors,
        count: Callable[[int, str], int | None] = connections,
    ) -> None:
        self.limit = limit
        self.period = period
        self.step = step
        self._clock = clock
        self._descriptors = descriptors
        self._count = count
        self._next = 0.0
        self._counted_at = 0
        """The descriptors held at the last count (lowered as they are closed)."""

    def over(self, ports: list[tuple[str, int]]) -> list[int]:
        """The ports of ``ports`` (host, port) holding more than the limit, when a count is due
        (else none)."""
        if not ports:
            return []
        now, held = self._clock(), self._descriptors()
        self._counted_at = min(self._counted_at, held)
        if now < self._next and held < self._counted_at + self.step:
            return []
        self._next, self._counted_at = now + self.period, held
        over = []
        for host, port in ports:
            count = self._count(port, host)
            if count is not None and count > self.limit:
                over.append(port)
        return over
