"""What peers may make the hook do: the agent's CPU on their behalf, and each peer's rate.

The training run comes first. Every request on the control socket, every authentication and
every refusal takes the agent thread's CPU (and the GIL) from the training, so all of it is
paid from one :class:`Budget` of CPU seconds, refilled at a few percent of a core: once it is
spent, the agent stops reading the control and authentication sockets until it is refilled,
and ZeroMQ holds what arrives meanwhile (bounded by the sockets' queue limits), or pushes back
on the senders. Within it, :class:`PeerRates` lets each connection send a few requests a second:
the viewer and the CLI open a connection per request, so they never meet that limit, while
one connection that floods gets a cheap "rate limited" answer instead of being served, which
keeps the budget for everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Callable

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

    def __len__(self) -> int:
        return len(self._buckets)
