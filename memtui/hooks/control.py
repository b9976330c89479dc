"""Rank 0's change queue: validates and queues requests, and hands them to the checkpoint boundary.

Thread-safe: the agent thread queues and cancels, the training thread takes the pending set at a
boundary and records the result. Every change of state bumps ``seq`` so viewers notice it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from memtui.hooks.persist import AuditLog
from memtui.knobs import KNOBS, KnobError, format_changes, parse_changes, resolve
from memtui.wire import (
    AppliedChange,
    CancelReply,
    CancelRequest,
    ControlState,
    Knobs,
    KnobValue,
    PendingChange,
    RejectedChange,
    SetReply,
    SetRequest,
)

HISTORY = 50
"""Applied and rejected changes kept in memory (the audit log keeps all)."""
MAX_PENDING = 64


def knobs_with(base: Knobs, changes: dict[str, KnobValue]) -> Knobs:
    """A copy of ``base`` with ``changes`` applied."""
    values = {k: getattr(base, k) for k in KNOBS}
    values.update(changes)
    return Knobs(**values)


class Control:
    """The pending queue and the record of what was applied or refused."""

    def __init__(
        self,
        current: Knobs,
        tunable: list[str],
        *,
        world_size: int = 1,
        audit: AuditLog | None = None,
        step: Callable[[], int] = lambda: 0,
        report: Callable[[BaseException, str], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self.current = current
        self.tunable = list(tunable)
        self.world_size = world_size
        self.audit = audit
        self._step = step
        self._report = report
        self.pending: list[PendingChange] = []
        self.applied: deque[AppliedChange] = deque(maxlen=HISTORY)
        self.rejected: deque[RejectedChange] = deque(maxlen=HISTORY)
        self._next_id = 1
        self.disabled = ""
        """Why changes are off for this run (set when ranks fall out of step); empty when on."""
        self.taken_time = 0.0
        """When the last boundary took the pending set: changes queued later wait for the next."""
        self.seq = 1
        """Bumped on every change of the control state."""

    # ------------------------------------------------------------- views

    def state(self) -> ControlState:
        """A consistent copy of the control state."""
        with self._lock:
            return ControlState(
                config=self.current,
                tunable=list(self.tunable),
                world_size=self.world_size,
                pending=list(self.pending),
                applied=list(self.applied),
                rejected=list(self.rejected),
                disabled=self.disabled,
            )

    def projected(self) -> Knobs:
        """The config as it will be after the pending changes land."""
        with self._lock:
            return self._projected()

    def _projected(self) -> Knobs:
        merged: dict[str, KnobValue] = {}
        for change in self.pending:
            merged.update(change.changes)
        return knobs_with(self.current, merged)

    # ------------------------------------------------------------- requests (agent thread)

    def queue(self, request: SetRequest) -> SetReply:
        """Validate and queue a change (or only resolve it, for a dry run)."""
        step = self._step()
        try:
            parsed = parse_changes(request.changes)
            if self.disabled:
                raise KnobError(f"changes are off for this run: {self.disabled}")
            with self._lock:
                if len(self.pending) >= MAX_PENDING and not request.dry_run:
                    raise KnobError(f"{MAX_PENDING} changes already pending: cancel some first")
                resolved = resolve(
                    parsed,
                    self._projected(),
                    self.tunable,
                    keep_effective_batch=request.keep_effective_batch,
                    world_size=self.world_size,
                )
                if request.dry_run:
                    return SetReply(ok=True, changes=resolved.changes, note=resolved.note)
                change = PendingChange(
                    id=self._next_id,
                    changes=resolved.changes,
                    requested=parsed,
                    queued_time=time.time(),
                    queued_step=step,
                    keep_effective_batch=request.keep_effective_batch,
                    client=request.client,
                    note=resolved.note,
                )
                self._next_id += 1
                self.pending.append(change)
                self.seq += 1
        except KnobError as exc:
            rejected = RejectedChange(
                id=0,
                requested=dict(request.changes),
                reason=str(exc),
                time=time.time(),
                step=step,
                client=request.client,
            )
            with self._lock:
                self.rejected.append(rejected)
                self.seq += 1
            self._audit("rejected", rejected)
            return SetReply(ok=False, reason=str(exc))
        self._audit("queued", change)
        return SetReply(ok=True, id=change.id, changes=change.changes, note=change.note)

    def cancel(self, request: CancelRequest) -> CancelReply:
        """Remove one pending change (or all of them with id 0)."""
        with self._lock:
            if request.id == 0:
                gone = [c.id for c in self.pending]
                self.pending.clear()
            else:
                gone = [c.id for c in self.pending if c.id == request.id]
                self.pending = [c for c in self.pending if c.id != request.id]
            if gone:
                self.seq += 1
        if not gone:
            known = (
                "no change is pending" if request.id == 0 else f"no pending change #{request.id}"
            )
            return CancelReply(ok=False, reason=known)
        self._audit("cancelled", {"ids": gone, "client": request.client, "step": self._step()})
        return CancelReply(ok=True, cancelled=gone)

    # ------------------------------------------------------------- boundary (training thread)

    def take_pending(self) -> list[PendingChange]:
        """Remove and return every pending change, oldest first."""
        with self._lock:
            self.taken_time = time.time()
            taken, self.pending = self.pending, []
            if taken:
                self.seq += 1
            return taken

    def record_applied(self, applied: AppliedChange, current: Knobs) -> None:
        """Record changes applied at a boundary and the config they produced."""
        with self._lock:
            self.current = current
            self.applied.append(applied)
            self.seq += 1
        self._audit("applied", applied)

    def record_rejected(self, changes: list[PendingChange], reason: str, step: int) -> None:
        """Record pending changes refused at a boundary."""
        for change in changes:
            rejected = RejectedChange(
                id=change.id,
                requested=dict(change.requested),
                reason=reason,
                time=time.time(),
                step=step,
                client=change.client,
            )
            with self._lock:
                self.rejected.append(rejected)
                self.seq += 1
            self._audit("rejected", rejected)

    def _audit(self, event: str, payload: object) -> None:
        if self.audit is not None:
            try:
                self.audit.append(event, payload)
            except OSError as exc:  # the in-memory record still holds; say the log is short
                if self._report is not None:
                    self._report(exc, "audit log")


def describe_change(change: PendingChange) -> str:
    """A one-line description of a pending change."""
    return f"#{change.id} {format_changes(change.changes)}"
