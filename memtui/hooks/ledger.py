"""The step ledger: the training thread's tallies of the step under way and the records it closed.

The hot path's state lives here and only here. Per micro-batch, the open step (``OpenStep``)
gets the wait, the samples and (for a re-queue after an out-of-memory rollback) what was
delivered: in place from the DataLoader wrapper's loop, else through ``on_batch``; per optimizer
step, ``close_step`` appends one raw tuple to a bounded outbox. The agent thread takes the
records with ``drain_steps`` (the training thread only appends, the agent only pops: a deque
does both without a lock) and turns them into wire records with ``records``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from memtui.wire import STEP_AFTER_CHECKPOINT, CheckpointRecord, StepRecord

_perf_counter = time.perf_counter
"""The step clock, bound once: ``close_step`` is on the hot path."""

OUTBOX_RECORDS = 16384
"""Step records held for the agent; if it stalls, the oldest are dropped (and counted)."""
CHECKPOINT_RECORDS = 256
"""Checkpoint boundaries held for the agent."""
MAX_STEP_BATCHES = 4096
"""Micro-batches of the current step kept for a re-queue (the latest): a loop that never closes
a step does not grow them without bound (a re-queue counts the samples of older ones skipped)."""

RawStep = tuple[int, float, float, float, int, int, int]
"""One step as the training thread records it: a ``StepRecord``'s fields in order, so it is
encoded exactly as one (the agent sends the tuples as they are: no object built per step)."""


class Requeue(Protocol):
    """A loader that can take delivered samples back (an out-of-memory rollback)."""

    def requeue(self, indices: list[int]) -> bool:
        """Deliver ``indices`` again first; False when this loader cannot."""
        ...


class OpenStep:
    """The open step's tallies: the wait, the samples, the micro-batches and what was delivered.

    The ledger owns it and resets it when a step closes (never replaces it: the loader's loop
    holds it for the whole epoch). The DataLoader wrapper's loop adds each micro-batch to it in
    place (three additions and one append: a method call per batch was a third of the wrapper's
    cost); everyone else goes through ``StepLedger.on_batch``.
    """

    __slots__ = ("batches", "micro", "samples", "wait")

    def __init__(self) -> None:
        self.wait = 0.0
        """Seconds spent waiting for the step's micro-batches."""
        self.samples = 0
        """Samples delivered in the step."""
        self.micro = 0
        """Micro-batches delivered in the step."""
        self.batches: deque[tuple[Requeue, list[int] | int]] = deque(maxlen=MAX_STEP_BATCHES)
        """The micro-batches delivered (their source and indices, or their sample count), for a
        rollback to re-queue: the latest ``MAX_STEP_BATCHES`` (cleared, never replaced)."""

    def clear(self) -> None:
        """Start the tallies over."""
        self.wait = 0.0
        self.samples = 0
        self.micro = 0
        self.batches.clear()


class StepLedger:
    """The open step's wait, samples and micro-batches, and the closed steps for the agent."""

    __slots__ = (
        "_checkpoints",
        "_flags",
        "_outbox",
        "_post",
        "_report",
        "_step",
        "_t_last",
        "open",
        "training_thread",
        "wall_offset",
    )
    """The fields in the object itself: each step touches fewer cache lines."""

    def __init__(self, report: Callable[[BaseException, str], None] | None = None) -> None:
        self._report = report
        self._step = 0
        self._t_last: float | None = None
        self.open = OpenStep()
        """The open step's tallies (the loader's hot loop adds to them in place)."""
        self._flags = 0
        self._outbox: deque[RawStep] = deque(maxlen=OUTBOX_RECORDS)
        self._post = self._outbox.append
        """The outbox's ``append``, bound once: ``close_step`` is on the hot path."""
        self._checkpoints: deque[CheckpointRecord] = deque(maxlen=CHECKPOINT_RECORDS)
        self.wall_offset = time.time() - time.perf_counter()
        """Wall-clock time minus the step clock: a record's end time is wall-clock time."""
        self.training_thread = threading.get_ident()
        """The thread that trains: the one that made the ledger, then the one that closed the
        first step (the agent thread looks where it is for the other ranks)."""

    # ------------------------------------------------------------ the training thread

    @property
    def step(self) -> int:
        """Optimizer steps closed so far."""
        return self._step

    def steps_closed(self) -> int:
        """Optimizer steps closed so far, as a call (for the parts that read the step clock)."""
        return self._step

    def start_clock(self) -> None:
        """Start the open step's clock if nothing started it yet (the first batch)."""
        if self._t_last is None:
            self._t_last = _perf_counter()

    def restart_clock(self) -> None:
        """Start the open step's clock now (after a checkpoint, a resume, a failed step)."""
        self._t_last = _perf_counter()

    def resume_at(self, step: int) -> None:
        """Continue counting from ``step`` (a restored checkpoint), the clock restarted."""
        self._step = step
        self._t_last = _perf_counter()

    def on_batch(
        self,
        wait_s: float,
        samples: int,
        source: Requeue | None = None,
        delivered: list[int] | None = None,
        micro: int = 1,
    ) -> None:
        """Add ``micro`` micro-batches of ``samples`` that took ``wait_s`` to arrive; ``source``
        and ``delivered`` (the indices) let a rollback hand them back."""
        tally = self.open
        tally.wait += wait_s
        tally.samples += samples
        tally.micro += micro
        if source is not None:
            tally.batches.append((source, samples if delivered is None else delivered))

    def mark(self, flag: int) -> None:
        """Set a ``STEP_*`` flag on the open step's record."""
        self._flags |= flag

    def close_step(self, samples: int | None = None) -> None:
        """Close the open step (``samples`` overrides the loader's count); never raises (a
        failure is reported)."""
        now = _perf_counter()
        try:
            step = self._step + 1
            self._step = step
            tally = self.open
            # the bound ``append`` read as a slot, then called: ``self._post(...)`` compiles to a
            # method load, which cannot specialise on a slot and takes the generic lookup each call
            post = self._post
            post(
                (
                    step,
                    now + self.wall_offset,
                    now - (self._t_last or now),  # None before the first batch: 0 s
                    tally.wait,
                    tally.samples if samples is None else samples,
                    tally.micro,
                    self._flags,
                )
            )
            self._t_last = now
            self._flags = 0
            # ``tally.clear()`` inlined: this runs once per optimizer step
            tally.wait = 0.0
            tally.samples = 0
            tally.micro = 0
            tally.batches.clear()
        except Exception as exc:
            if self._report is not None:
                self._report(exc, "step")

    def open_step(self) -> tuple[int, int]:
        """The open step's (samples, micro-batches) so far."""
        return self.open.samples, self.open.micro

    def since_last(self) -> float:
        """Seconds since the open step's clock started (0 before the first batch)."""
        return 0.0 if self._t_last is None else _perf_counter() - self._t_last

    def close_checkpoint(self, taken_time: float, save_s: float) -> None:
        """Record a checkpoint boundary at this step; the next step's clock starts now."""
        self._checkpoints.append(CheckpointRecord(self._step, taken_time, save_s))
        self._t_last = _perf_counter()
        self._flags |= STEP_AFTER_CHECKPOINT

    def requeue(self) -> tuple[int, int]:
        """Hand the open step's micro-batches back to their loaders: (re-queued, skipped)."""
        requeued = skipped = 0
        tally = self.open
        for source, batch in tally.batches:
            if isinstance(batch, list) and source.requeue(batch):
                requeued += len(batch)
            else:
                skipped += len(batch) if isinstance(batch, list) else batch
        # beyond MAX_STEP_BATCHES micro-batches the oldest were not kept: their samples are
        # counted as skipped, never lost silently
        skipped += max(0, tally.samples - requeued - skipped)
        tally.batches.clear()
        return requeued, skipped

    def reset_open_step(self) -> None:
        """Forget the failed open step's tallies; it starts over now."""
        self.open.clear()
        self._t_last = _perf_counter()

    # ------------------------------------------------------------ the agent thread

    def drain_steps(self) -> list[RawStep]:
        """Take the closed steps not taken yet, oldest first."""
        outbox = self._outbox
        popleft = outbox.popleft
        return [popleft() for _ in range(len(outbox))]  # the training thread only appends

    def drain_checkpoints(self) -> list[CheckpointRecord]:
        """Take the checkpoint boundaries not taken yet, oldest first."""
        boxed = self._checkpoints
        return [boxed.popleft() for _ in range(len(boxed))]

    @staticmethod
    def records(raw: Iterable[RawStep]) -> list[StepRecord]:
        """Wire records of raw steps (for a snapshot and the effect measurement: telemetry sends
        the tuples themselves, which encode the same)."""
        return [StepRecord(*step) for step in raw]
