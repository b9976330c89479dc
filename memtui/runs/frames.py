"""Frames into messages for the viewer: as ``wire.Decoder`` does, with step records on a budget.

A 64-rank run at 1,000 steps/s sends 64,000 step records a second; decoding and folding every one
would cost the viewer more CPU than all the rest of it. So a telemetry frame is decoded with its
step records left as raw msgpack (a quarter of the cost), and those are decoded only for the
favoured rank (the one the charts show: all of its records) and, for the others, while the rank
is within its share of ``STEP_BUDGET`` records a second, counted on the rank's own clock (a
replay decodes the same frames the live view did). Up to 4,000 steps/s over the other ranks,
every record is decoded; above that each rank's batches are sampled evenly: its numbers are
means over its newest decoded steps, and its newest step comes from every batch. The rest of
every frame (memory, host, control) is always decoded.
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from typing import Any

import msgspec

from memtui.runs.plausible import MAX_RANKS
from memtui.wire import WIRE_VERSION, Message, StepRecord, Telemetry

STEP_BUDGET = 4_000.0
"""Step records decoded per second over the ranks but the favoured one (an equal share each)."""

_ERRORS = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


def _empty() -> msgspec.Raw:
    return msgspec.Raw(b"\x90")


class TelemetryHead(Telemetry):
    """A Telemetry decoded with its step records left as the raw msgpack array; the decoder sets
    ``steps`` to the records (or none) before handing it on, so it reads as any Telemetry."""

    steps: msgspec.Raw = msgspec.field(default_factory=_empty)  # type: ignore[assignment]


def array_length(raw: msgspec.Raw) -> int:
    """The number of items in an encoded msgpack array (-1: not an array)."""
    view = memoryview(raw)
    if not len(view):
        return -1
    head = view[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(view) >= 3:
        return int.from_bytes(view[1:3], "big")
    if head == 0xDD and len(view) >= 5:
        return int.from_bytes(view[1:5], "big")
    return -1


class FrameDecoder:
    """Decodes frames into messages, counting (never raising on) anything malformed; telemetry's
    step records within each rank's share of the budget."""

    def __init__(self, budget: float = STEP_BUDGET) -> None:
        others = tuple(m for m in Message.__args__ if m is not Telemetry)
        self._decoder: Any = msgspec.msgpack.Decoder(reduce(or_, (TelemetryHead, *others)))
        self._steps = msgspec.msgpack.Decoder(list[StepRecord])
        self.budget = budget
        """Step records decoded per second over the ranks but the favoured one."""
        self.bad_frames = 0
        """Frames dropped: undecodable, wrong schema or an unknown major version."""
        self.last_error = ""
        self.sampled_out = 0
        """Step records left undecoded (the run sends more than the budget)."""
        self.favoured: int | None = None
        """The rank whose records are all decoded (set by the app: the rank the charts show)."""
        self.rank_limit = MAX_RANKS
        """Ranks numbered under this are the run's (set by the receiver from its world size):
        another rank's records are not decoded, and it gets no share of the budget."""
        self._tokens: dict[int, tuple[float, float]] = {}

    def _bad(self, error: str) -> None:
        self.bad_frames += 1
        self.last_error = error[:200]

    def decode(self, frame: bytes | memoryview) -> Message | None:
        """Return the message in ``frame``, or None (counted) if it is not a valid one."""
        try:
            message = self._decoder.decode(frame)
        except _ERRORS as exc:
            self._bad(str(exc))
            return None
        if message.v != WIRE_VERSION:
            self._bad(f"wire version {message.v}, expected {WIRE_VERSION}")
            return None
        if not isinstance(message, TelemetryHead):
            return message
        raw = message.steps
        count = array_length(raw)
        steps: list[StepRecord] = []
        rank = message.rank
        if not 0 <= rank < self.rank_limit:
            count = 0  # not a rank of the run: the receiver drops the batch
        if count and (rank == self.favoured or self._within_budget(rank, message.time, count)):
            try:
                steps = self._steps.decode(raw)
            except _ERRORS as exc:
                self._bad(str(exc))
                return None
        elif count > 0:
            self.sampled_out += count
        message.steps = steps  # type: ignore[assignment]
        return message

    def limit_ranks(self, limit: int) -> None:
        """Decode the records of ranks under ``limit`` only (the run's world size), and forget
        the budget of the others."""
        self.rank_limit = limit
        for rank in [r for r in self._tokens if r >= limit]:
            del self._tokens[rank]

    def _within_budget(self, rank: int, time: float, count: int) -> bool:
        """Take ``count`` records from the rank's share (a token bucket a second deep)."""
        if count < 0:
            return True  # not an array: decoding says what is wrong
        share = self.budget / max(1, len(self._tokens) + (rank not in self._tokens))
        tokens, at = self._tokens.get(rank, (share, time))
        tokens = min(share, tokens + share * max(0.0, time - at))
        allowed = tokens > 0
        self._tokens[rank] = (tokens - count if allowed else tokens, time)
        return allowed
