"""Rank 0's change queue: validates and queues requests, and hands them to the checkpoint boundary.

Thread-safe: the agent thread queues and cancels, the training thread takes the pending set at a
boundary and records the result. Every change of state bumps ``seq`` so viewers notice it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import msgspec

from memtui.advice.effect import describe
from memtui.advice.measure import Measured
from memtui.advice.prediction import Prediction
from memtui.advice.speed import SpeedEstimate, speed_error
from memtui.advice.verdict import Thresholds
from memtui.core.knobs import (
    KNOBS,
    KnobError,
    format_changes,
    format_diffs,
    knobs_with,
    merge,
    parse_changes,
    resolve,
)
from memtui.core.stats import printable
from memtui.hooks.limits import PeerRates
from memtui.hooks.lr import LearningRate
from memtui.hooks.persist import AuditLog
from memtui.storage.userconfig import load_thresholds
from memtui.wire import (
    AppliedChange,
    AutopilotState,
    AutotuneReply,
    AutotuneRequest,
    CancelledChange,
    CancelReply,
    CancelRequest,
    Ceiling,
    ControlState,
    KnobDiff,
    Knobs,
    KnobValue,
    MemoryModel,
    OomEvent,
    PendingChange,
    RejectedChange,
    SetReply,
    SetRequest,
    StaticMemory,
    to_builtins,
)

log = logging.getLogger("memtui")

HISTORY = 50
"""Applied and rejected changes kept in memory (the audit log keeps all)."""
MAX_PENDING = 64
MAX_CHANGES = 8
"""Knobs one request may name (there are five, by any of their names)."""
MAX_TEXT = 64
"""Characters of a knob's name, of a value given as text, and of a client's name."""
MAX_REASON = 400
"""Characters of a rejection's reason as stored and echoed."""
AUDIT_REJECTIONS_PER_S = 2.0
"""Rejections written to the audit log a second, sustained (the rest are counted in the next)."""
AUDIT_REJECTIONS_BURST = 50.0
NO_PINNING = (
    "pin_memory=true has no effect on this run: torch sees no accelerator (pinned memory only "
    "speeds copies to a GPU), and it will warn at every loader rebuild"
)
"""The note on a change that turns pinning on in a run without an accelerator."""
NO_UNPINNING = (
    "pin_memory=false has no effect on this run: torch sees no accelerator, so nothing was pinned"
)
"""The note on a change that turns pinning off in a run without an accelerator."""
PINNING_IDLE = "pin_memory does nothing without an accelerator"
"""What pinning cannot do on a run without an accelerator: its change's effect is not measured."""


class Pilot(Protocol):
    """The autopilot as the queue sees it: its state to publish, and a pause at an operator's
    change (``hooks.autopilot.Autopilot``)."""

    def state(self) -> AutopilotState: ...

    def operator_acted(self, what: str) -> None: ...

    def turn(self, request: AutotuneRequest, rate_limited_before: int = 0) -> AutotuneReply: ...


class PilotSeat:
    """The autopilot's place at the queue, made before both and given to each at construction:
    the queue publishes the seated autopilot's state and tells it of an operator's change, and
    the control server turns it on or off through it; empty, the run has no autopilot."""

    def __init__(self) -> None:
        self.pilot: Pilot | None = None
        """The autopilot seated here (``Autopilot`` takes the seat it is given)."""

    def take(self, pilot: Pilot) -> None:
        """Seat ``pilot``: the queue publishes its state and pauses it at an operator's change."""
        self.pilot = pilot


class RequestRefused(KnobError):
    """A request out of bounds: refused before it is parsed, and neither stored nor logged."""


def check_request(changes: Mapping[str, object], client: str) -> None:
    """Refuse a request that names too many knobs, or a name, text value or client name that is
    too long: nothing a peer sends is stored or echoed before this check."""
    if len(changes) > MAX_CHANGES:
        raise RequestRefused(f"{len(changes)} knobs in one request: at most {MAX_CHANGES}")
    if len(client) > MAX_TEXT:
        raise RequestRefused(f"a client name of {len(client)} characters: at most {MAX_TEXT}")
    for name, value in changes.items():
        if len(name) > MAX_TEXT:
            raise RequestRefused(f"a knob name of {len(name)} characters: at most {MAX_TEXT}")
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise RequestRefused(f"a value of {len(value)} characters: at most {MAX_TEXT}")


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to ``limit`` characters, with anything unprintable made ``?``."""
    cut = "".join(c if c.isprintable() else "?" for c in text[:limit])
    return cut + "..." if len(text) > limit else cut


def _clipped(changes: Mapping[str, object]) -> dict[str, Any]:
    """A safe copy of a request's changes to store: names and text values clipped."""
    return {
        clip(str(name)): clip(value) if isinstance(value, str) else value
        for name, value in list(changes.items())[:MAX_CHANGES]
    }


class Control:
    """The pending queue and the record of what was applied or refused."""

    def __init__(
        self,
        knobs: Callable[[], Knobs],
        *,
        world_size: int = 1,
        audit: AuditLog | None = None,
        step: Callable[[], int] = lambda: 0,
        report: Callable[[BaseException, str], None] | None = None,
        thresholds: Thresholds | None = None,
        pinning: Callable[[], bool] = lambda: True,
        lr: LearningRate | None = None,
        why_not: Callable[[], Mapping[str, str]] = dict,
        seat: PilotSeat | None = None,
        read_values: Callable[[], Mapping[str, KnobValue]] = dict,
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        self._lock = threading.Lock()
        self._seat = seat or PilotSeat()
        """Where rank 0's autopilot sits: published here, paused by an operator."""
        self._why_not = why_not
        """Why each knob the run has no value of is not tunable (the knob store's)."""
        self._read_values = read_values
        """The values read of the knobs the run cannot change (the knob store's)."""
        self._version = version
        """Counts the knob store's changes (its values, the tunable set, why not): part of
        ``seq``, so that a knob found after a viewer attached reaches it in the next batch."""
        self._boundary = ""
        self._lr = lr or LearningRate()
        """The LR's owner: the run's rule for a change of the effective batch, and whether an
        optimizer is known for it to follow."""
        self._pinning = pinning
        """Whether pinned memory has an effect here (torch sees an accelerator)."""
        self.thresholds = thresholds or _thresholds_in_force()
        """The memory bands the gate uses: the verdict's, from the YAML config file if any."""
        self._knobs = knobs
        """The knob store's current values (the one copy; read, never kept)."""
        self.world_size = world_size
        self.audit = audit
        self._step = step
        self._report = report
        self.pending: list[PendingChange] = []
        self.applied: deque[AppliedChange] = deque(maxlen=HISTORY)
        self.rejected: deque[RejectedChange] = deque(maxlen=HISTORY)
        self.cancelled: deque[CancelledChange] = deque(maxlen=HISTORY)
        self._next_id = 1
        self.model: MemoryModel | None = None
        """The memory model (set by the agent thread as the run shows more)."""
        self.static: StaticMemory | None = None
        self.ooms: deque[OomEvent] = deque(maxlen=10)
        self.ceiling: Ceiling | None = None
        """What ran out of memory (this run or, restored, before its restart): the gate, the max
        safe batch and the advice stay under it."""
        self.disabled = ""
        """Why changes are off for this run (set when ranks fall out of step); empty when on."""
        self.taken_time = 0.0
        """When the last boundary took the pending set: changes queued later wait for the next."""
        self._changes = 1
        """Counts the changes of the queue's own state (the knob store counts its own)."""
        self.unapplied: list[PendingChange] = []
        """Changes still pending when the run ended (``close``): never applied."""
        self.ended = False
        """The run has ended (``close``): no boundary is left, a change is refused."""
        self.refused = 0
        """Requests refused out of bounds (``check_request``): counted, not stored."""
        self._audit_rejections = PeerRates(AUDIT_REJECTIONS_PER_S, AUDIT_REJECTIONS_BURST, 1)
        self._unaudited = 0
        """Rejections left out of the audit log since the last one written."""

    # ------------------------------------------------------------- views

    @property
    def pilot(self) -> Pilot | None:
        """Rank 0's autopilot, if one sits at this queue."""
        return self._seat.pilot

    @pilot.setter
    def pilot(self, pilot: Pilot) -> None:
        self._seat.take(pilot)

    @property
    def seq(self) -> int:
        """Moves at every change of the control state (the queue's, or the knobs' in the store):
        a viewer holds a stale state until it has the one of this count."""
        return self._changes + self._version()

    @property
    def boundary(self) -> str:
        """Where queued changes apply, in words ("" the run's next checkpoint)."""
        return self._boundary

    @boundary.setter
    def boundary(self, words: str) -> None:
        with self._lock:
            if words != self._boundary:
                self._boundary = words
                self._changes += 1

    @property
    def current(self) -> Knobs:
        """The knob values now (the knob store's)."""
        return self._knobs()

    @property
    def tunable(self) -> list[str]:
        """The knobs this run can change."""
        current = self._knobs()
        return [k for k in KNOBS if getattr(current, k) is not None]

    @property
    def untunable(self) -> dict[str, str]:
        """Why each knob this run cannot change is not tunable, where the hook knows."""
        tunable = self.tunable
        return {k: why for k, why in dict(self._why_not()).items() if k not in tunable}

    def state(self) -> ControlState:
        """A consistent copy of the control state."""
        with self._lock:
            return ControlState(
                config=self.current,
                tunable=self.tunable,
                world_size=self.world_size,
                pending=list(self.pending),
                applied=list(self.applied),
                rejected=list(self.rejected),
                cancelled=list(self.cancelled),
                disabled=self.disabled,
                model=self.model,
                static=self.static,
                ooms=list(self.ooms),
                ceiling=self.ceiling,
                autopilot=self.pilot.state() if self.pilot is not None else None,
                lr=self._lr.state(),
                untunable=self.untunable,
                boundary=self._boundary,
                untunable_values=dict(self._read_values()),
                unapplied=list(self.unapplied),
            )

    def touch(self) -> None:
        """Tell viewers the control state changed (the autopilot's, which it owns)."""
        with self._lock:
            self._changes += 1

    def projected(self) -> Knobs:
        """The config as it will be after the pending changes land."""
        with self._lock:
            return self._projected()

    def _projected(self) -> Knobs:
        return knobs_with(self.current, merge(c.changes for c in self.pending))

    # ------------------------------------------------------------- requests (agent thread)

    def queue(self, request: SetRequest, origin: str = "") -> SetReply:
        """Validate and queue a change (or only resolve it, for a dry run); ``origin``: who asks
        in this process ("" an operator over the wire, which pauses the autopilot)."""
        try:
            check_request(request.changes, request.client)
        except RequestRefused as exc:
            self.refused += 1
            return SetReply(ok=False, reason=str(exc))
        step = self._step()
        client = clip(request.client)
        try:
            parsed = parse_changes(request.changes)
            if self.disabled:
                raise KnobError(f"changes are off for this run: {self.disabled}")
            pin = parsed.get("pin_memory")
            no_effect = ""
            if pin is not None and not self._pinning():
                no_effect = NO_PINNING if pin is True else NO_UNPINNING
            rule = self._lr.resolve(request.lr_scale)
            with self._lock:
                if self.ended:  # under the lock: ``close`` takes what is pending under it
                    raise KnobError("the run has ended: no boundary is left to apply a change")
                if len(self.pending) >= MAX_PENDING and not request.dry_run:
                    raise KnobError(f"{MAX_PENDING} changes already pending: cancel some first")
                resolved = resolve(
                    parsed,
                    self._projected(),
                    self.tunable,
                    keep_effective_batch=request.keep_effective_batch,
                    world_size=self.world_size,
                    why_not=self.untunable,
                    held=self._read_values(),
                )
                projected = knobs_with(self._projected(), resolved.changes)
                prediction = self._predict(projected)
                lr_note = self._lr.words(self._projected(), projected, rule, self.world_size)
                if request.lr_scale and rule != "none" and self._lr.owner and lr_note:
                    raise KnobError(
                        f"--lr-scale {rule} cannot hold: {self._lr.owner}; queue it with "
                        "--lr-scale none, or install with lr_fields= naming what the schedule reads"
                    )
                if request.dry_run:
                    return _reply(
                        prediction,
                        ok=True,
                        changes=resolved.changes,
                        note=_join(resolved.note, lr_note, no_effect, prediction.warning),
                        needs_force=prediction.over_danger,
                        boundary=self.boundary,
                    )
                if prediction.over_danger and not request.force:
                    raise OverDanger(prediction.warning)
                change = PendingChange(
                    id=self._next_id,
                    changes=resolved.changes,
                    requested=parsed,
                    queued_time=time.time(),
                    queued_step=step,
                    keep_effective_batch=request.keep_effective_batch,
                    client=client,
                    note=_join(
                        resolved.note,
                        lr_note,
                        no_effect,
                        prediction.risk if request.force else "",
                    ),
                    predicted_peak_bytes=prediction.peak_bytes,
                    forced=bool(request.force and prediction.over_danger),
                    origin=origin,
                    lr_scale=rule,
                )
                self._next_id += 1
                self.pending.append(change)
                self._changes += 1
        except KnobError as exc:
            prediction = self._predict(self.projected())
            reason = clip(str(exc), MAX_REASON)
            rejected = RejectedChange(
                id=0,
                requested=_clipped(request.changes),
                reason=reason,
                time=time.time(),
                step=step,
                client=client,
            )
            with self._lock:
                self.rejected.append(rejected)
                self._changes += 1
            self._audit_rejected(rejected)
            return _reply(
                prediction, ok=False, reason=reason, needs_force=isinstance(exc, OverDanger)
            )
        self.audit_event("queued", change)
        if not origin and self.pilot is not None:
            self.pilot.operator_acted(f"{client or 'an operator'} queued {describe_change(change)}")
        return _reply(
            prediction,
            ok=True,
            id=change.id,
            changes=change.changes,
            note=change.note,
            boundary=self.boundary,
        )

    def _predict(self, projected: Knobs) -> Prediction:
        """The memory model's prediction for a config (empty without a model or a batch size),
        checked against what ran out of memory."""
        return Prediction.of_config(self.model, projected, self.thresholds, self.ceiling)

    def cancel(self, request: CancelRequest) -> CancelReply:
        """Remove one pending change (or all of them with id 0)."""
        try:
            check_request({}, request.client)
        except RequestRefused as exc:
            self.refused += 1
            return CancelReply(ok=False, reason=str(exc))
        client = clip(request.client)
        gone = self._remove(lambda c: request.id in (0, c.id), client)
        if not gone:
            known = (
                "no change is pending" if request.id == 0 else f"no pending change #{request.id}"
            )
            return CancelReply(ok=False, reason=known)
        if self.pilot is not None:
            self.pilot.operator_acted(f"{client or 'an operator'} cancelled #{gone[0]}")
        return CancelReply(ok=True, cancelled=gone)

    def withdraw(self, origin: str) -> list[int]:
        """Cancel the pending changes queued by ``origin`` (the autopilot's, when an operator
        takes over); the ids cancelled."""
        return self._remove(lambda c: c.origin == origin, origin)

    def _remove(self, chosen: Callable[[PendingChange], bool], client: str) -> list[int]:
        """Cancel the pending changes ``chosen`` picks, recorded and audited as ``client``'s;
        the ids cancelled."""
        step, now = self._step(), time.time()
        with self._lock:
            removed = [c for c in self.pending if chosen(c)]
            kept = [c for c in self.pending if c not in removed]
            if removed:
                self.pending = self._predicted_again(kept, min(c.id for c in removed))
            for change in removed:
                self.cancelled.append(CancelledChange(change.id, change.changes, now, step, client))
            if removed:
                self._changes += 1
        gone = [c.id for c in removed]
        if gone:
            self.audit_event("cancelled", {"ids": gone, "client": client, "step": step})
        return gone

    def _predicted_again(self, kept: list[PendingChange], after: int = 0) -> list[PendingChange]:
        """The pending changes ``kept``, those queued after change ``after`` predicted again: each
        one's peak is the config's once it and the changes before it land (a change before it
        was cancelled, or the config it was queued on was rolled back)."""
        out: list[PendingChange] = []
        merged: dict[str, KnobValue] = {}
        for change in kept:
            merged.update(change.changes)
            if change.id > after:
                peak = self._predict(knobs_with(self.current, merged)).peak_bytes
                change = msgspec.structs.replace(change, predicted_peak_bytes=peak)
            out.append(change)
        return out

    def close(self) -> list[PendingChange]:
        """The run ends: the changes still pending will never be applied. They are kept as its
        last word (``unapplied``, published in the last batch) and audited as ``unapplied``;
        returned, to be said."""
        step = self._step()
        with self._lock:
            self.ended = True
            left, self.pending = self.pending, []
            if left:
                self.unapplied = left
                self._changes += 1
        if left:
            self.audit_event(
                "unapplied",
                {
                    "ids": [c.id for c in left],
                    "changes": merge(c.changes for c in left),
                    "step": step,
                    "reason": "pending at exit",
                },
            )
        return left

    # ------------------------------------------------------------- boundary (training thread)

    def take_pending(self) -> list[PendingChange]:
        """Remove and return every pending change, oldest first."""
        with self._lock:
            self.taken_time = time.time()
            taken, self.pending = self.pending, []
            if taken:
                self._changes += 1
            return taken

    def record_applied(self, applied: AppliedChange) -> None:
        """Record changes applied at a boundary (or a rollback)."""
        with self._lock:
            self.applied.append(applied)
            if applied.rollback and self.pending:  # queued on the config rolled back
                self.pending = self._predicted_again(self.pending)
            self._changes += 1
        self.audit_event("applied", applied)

    def applied_changes(self) -> list[AppliedChange]:
        """The applied changes kept, oldest first (a copy)."""
        with self._lock:
            return list(self.applied)

    def disable(self, reason: str) -> None:
        """Take no more changes for this run, saying why."""
        with self._lock:
            if self.disabled != reason:
                self.disabled = reason
                self._changes += 1

    # ------------------------------------------------------------- what the hook learns

    def set_static(self, static: StaticMemory) -> None:
        """Publish the exact parameter, gradient and optimizer memory (when it changed)."""
        with self._lock:
            if self.static != static:
                self.static = static
                self._changes += 1

    def offer_model(self, model: MemoryModel, moved: Callable[[MemoryModel | None], bool]) -> None:
        """Publish a refit memory model if ``moved(published)`` says it differs enough."""
        with self._lock:
            if moved(self.model):
                self.model = model
                self._changes += 1

    def cannot_act(self) -> dict[str, str]:
        """The knobs whose change cannot act on this run, and why (their effect is not measured,
        and never credited): pinning without an accelerator."""
        return {} if self._pinning() else {"pin_memory": PINNING_IDLE}

    def record_effect(self, measured: Measured) -> None:
        """Publish and audit an applied change's measured effect (or why it has none: a change
        that cannot act on this run)."""
        applied, peak = measured.applied, measured.peak_after
        with self._lock:
            applied.effect = measured.effect
            if measured.effect is not None:
                applied.observed_peak_bytes = peak
            applied.effect_note = measured.note
            self._changes += 1
        record: dict[str, object] = {
            "ids": applied.ids,
            "step": applied.step,
            "predicted_peak_bytes": applied.predicted_peak_bytes,
            "observed_peak_bytes": applied.observed_peak_bytes,
        }
        if measured.effect is not None:
            record["effect"] = to_builtins(measured.effect)
            record["summary"] = describe(measured.effect)
        if measured.note:
            record["effect_note"] = measured.note
        if applied.predicted_peak_bytes and peak:
            record["prediction_error"] = applied.predicted_peak_bytes / peak - 1
        if applied.speed_note and measured.effect is not None:
            record["predicted_speed_delta"] = applied.predicted_speed_delta
            record["speed_note"] = applied.speed_note
            record["speed_error"] = speed_error(applied)
        self.audit_event("measured", record)

    def record_speed_prediction(self, applied: AppliedChange, estimate: SpeedEstimate) -> None:
        """Publish the speed predicted for an applied change from the steps before it (the audit
        log keeps it in the change's ``measured`` line, beside the effect it is checked against)."""
        with self._lock:
            applied.predicted_speed_delta = estimate.delta
            applied.speed_note = estimate.note or "speed unknown"
            self._changes += 1

    def record_oom(self, event: OomEvent, grown: Mapping[str, KnobDiff] | None = None) -> None:
        """Publish and audit an out-of-memory error, and lower the ceiling to the values it ran
        out of memory at (the micro-batch always; workers and pinning when ``grown``, the change
        that caused it, raised them)."""
        with self._lock:
            self.ooms.append(event)
            self.ceiling = lowered(self.ceiling, event, grown or {})
            self._changes += 1
        self.audit_event("oom", event)

    def restore_ceiling(self, ceiling: Ceiling) -> None:
        """Keep a ceiling saved before a restart (the tuned config's)."""
        with self._lock:
            self.ceiling = ceiling
            self._changes += 1

    def persisted(self) -> dict[str, Any]:
        """What the tuned config keeps besides the knobs: the ceiling."""
        ceiling = self.ceiling
        return {"ceiling": to_builtins(ceiling)} if ceiling is not None else {}

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
                self._changes += 1
            self.audit_event("rejected", rejected)

    def _audit_rejected(self, rejected: RejectedChange) -> None:
        """Log a request's rejection, a few a second at most (those left out are counted in the
        next line written, ``unaudited_before``)."""
        if not self._audit_rejections.allow(b""):
            self._unaudited += 1
            return
        payload: object = rejected
        if self._unaudited:
            payload = {**to_builtins(rejected), "unaudited_before": self._unaudited}
            self._unaudited = 0
        self.audit_event("rejected", payload)

    def audit_event(self, event: str, payload: object, *, durable: bool = False) -> None:
        """Append an event to the audit log (rank 0; ``durable``: on the disk before this
        returns); a failure is reported, never raised."""
        if self.audit is not None:
            try:
                self.audit.append(event, payload, durable=durable)
            except OSError as exc:  # the in-memory record still holds; say the log is short
                if self._report is not None:
                    self._report(exc, "audit log")


class OverDanger(KnobError):
    """A change predicted over the danger band, refused unless forced."""


def _reply(prediction: Prediction, **fields: Any) -> SetReply:
    """A SetReply carrying ``prediction``."""
    return SetReply(
        predicted_peak_bytes=prediction.peak_bytes,
        capacity_bytes=prediction.capacity_bytes,
        max_safe_batch_size=prediction.max_safe_batch_size,
        confidence=prediction.confidence,
        predicted_high_bytes=prediction.peak_high_bytes,
        max_safe=prediction.safe_words,
        **fields,
    )


def lowered(ceiling: Ceiling | None, event: OomEvent, grown: Mapping[str, KnobDiff]) -> Ceiling:
    """``ceiling`` lowered to what ran out of memory in ``event``."""
    old = ceiling or Ceiling()
    config = event.config
    batch = old.batch_size
    if isinstance(config.batch_size, int) and not isinstance(config.batch_size, bool):
        batch = min(batch, config.batch_size) if batch is not None else config.batch_size
    workers = old.num_workers
    if "num_workers" in grown and isinstance(config.num_workers, int):
        workers = min(workers, config.num_workers) if workers is not None else config.num_workers
    pin = old.pin_memory or ("pin_memory" in grown and bool(config.pin_memory))
    note = f"out of memory at step {event.step}" + (
        f" after {format_diffs(grown)}" if grown else ""
    )
    return Ceiling(batch, workers, pin, event.step, note)


def _thresholds_in_force() -> Thresholds:
    """The verdict's thresholds from the YAML config file, as the viewer and ``memtui status``
    read them (``$MEMTUI_CONFIG``, else ``~/.config/memtui/config.yaml``); what the file got wrong
    is logged, and the defaults stand in for it."""
    config = load_thresholds()
    for problem in config.problems:  # a file's text: its control characters made visible
        log.warning("memtui: %s", printable(problem))
    return config.thresholds


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def describe_change(change: PendingChange) -> str:
    """A one-line description of a pending change."""
    return f"#{change.id} {format_changes(change.changes)}"
