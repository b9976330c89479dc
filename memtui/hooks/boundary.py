"""The checkpoint boundary: rank 0 decides, the ranks agree through the job's store, and every
rank validates and applies the same change at the same step.

The one place a knob changes during a run (``apply``) and is undone after an out-of-memory error
(``revert``); each writes the tuned config from the knob store's value it produced. An applied
change is recorded in two phases that a crash cannot split unseen: the audit log's ``applying``
line and the tuned config, each flushed to the disk before the next, then the ``applied`` line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from memtui.advice.prediction import Prediction
from memtui.core.knobs import (
    KnobError,
    format_diffs,
    format_lr,
    knobs_with,
    lr_words,
    merge,
    shrank,
)
from memtui.hooks.caches import release_caches
from memtui.hooks.control import Control
from memtui.hooks.errors import Report
from memtui.hooks.knobstore import LOADER_KNOBS, KnobStore
from memtui.hooks.lr import LearningRate
from memtui.hooks.persist import TunedConfig
from memtui.hooks.placement import Placement
from memtui.wire import AppliedChange, PendingChange

log = logging.getLogger("memtui")


class Applied(AppliedChange):
    """What a checkpoint boundary changed: the wire's record, printed as one line for the log."""

    def __str__(self) -> str:
        return describe_applied(self)


def describe_applied(applied: AppliedChange) -> str:
    """``memtui: applied at step 40: batch_size 8 -> 16 (note)``."""
    text = f"memtui: applied at step {applied.step}: {format_diffs(applied.changes) or 'no effective change'}"
    notes = "; ".join(n for n in (applied.note, applied.lr_note) if n)
    return f"{text} ({notes})" if notes else text


def lr_rule_of(pending: list[PendingChange]) -> str:
    """The LR rule of a boundary's changes: the latest one's that moves the micro-batch or the
    accumulation (``none`` if none names a rule)."""
    for change in reversed(pending):
        if {"batch_size", "grad_accum"} & set(change.changes):
            return change.lr_scale or "none"
    return "none"


def _predicted_peak(pending: list[PendingChange], control: Control, store: KnobStore) -> int | None:
    """The peak predicted for the config a boundary's changes make: the one the last of them
    was queued with (the gate's, for the whole config they make together, workers and pinning
    included: the figure shown while it was pending), else the memory model's now."""
    queued = pending[-1].predicted_peak_bytes if pending else None
    if queued is not None:
        return queued
    return Prediction.of_config(control.model, store.knobs).peak_bytes


class Boundary:
    """Decides, agrees on, validates and applies the pending changes at a checkpoint."""

    def __init__(
        self,
        store: KnobStore,
        control: Control,
        placement: Placement,
        tuned: TunedConfig,
        report: Report,
        on_ranks_changed: Callable[[], None] = lambda: None,
        lr: LearningRate | None = None,
        has_loader: Callable[[], bool] = lambda: True,
    ) -> None:
        self._lr = lr or LearningRate()
        self._store = store
        self._control = control
        self._placement = placement
        self._tuned = tuned
        self._report = report
        self._on_ranks_changed = on_ranks_changed
        self._has_loader = has_loader
        """Whether a data loader follows the loader knobs (memtui's, or a framework's that the
        adapter rebuilds): what the note of an applied change says happens next."""
        self.loader_words = "the data loader is rebuilt at the next batch"
        """What the note of an applied change of loader knobs says the loader does next."""

    def run(self, step: int, micro: int = 0) -> Applied | None:
        """Take (rank 0), agree on and apply the pending changes at ``step`` (``micro``: the
        micro-batches of the next step drawn already); what was applied."""
        control, placement = self._control, self._placement
        rank = placement.rank
        taken: list[PendingChange] = self._decide_lr(control.take_pending()) if rank == 0 else []
        coordinator = placement.coordinator
        if coordinator is None and placement.world_size > 1:
            if taken:  # one rank of several with no agreement: applying alone would split the job
                control.record_rejected(
                    taken,
                    f"rank {rank} of {placement.world_size} is not coordinated with the others "
                    "(torch.distributed was not initialised at install; call tuner.coordinate() "
                    "on every rank once it is)",
                    step,
                )
            return None
        pending = taken
        if coordinator is not None:
            agreed, abort = coordinator.boundary(step, taken, micro)
            if abort:
                if taken:
                    control.record_rejected(taken, f"changes are off for this run: {abort}", step)
                control.disable(abort)
                return None
            pending = agreed or []
            if placement.refresh():
                self._on_ranks_changed()
        return self._apply(pending, step) if pending else None

    def _decide_lr(self, taken: list[PendingChange]) -> list[PendingChange]:
        """Rank 0: stamp the LR factor of the whole boundary on its changes, so every rank
        multiplies by the same one (None while no optimizer is known here or the rule is none)."""
        if not taken or not self._lr.known():
            return taken
        new = knobs_with(self._store.knobs, merge(c.changes for c in taken))
        factor = self._lr.decide(self._store.knobs, new, lr_rule_of(taken))
        return [msgspec.structs.replace(c, lr_factor=factor) for c in taken]

    def _apply(self, pending: list[PendingChange], step: int) -> Applied | None:
        """Validate and apply ``pending`` (all or none); record, persist and log what changed."""
        store, control = self._store, self._control
        merged = merge(c.changes for c in pending)
        before = store.knobs
        try:
            store.check(merged)
            diffs = store.apply(merged, step)
        except KnobError as exc:
            control.record_rejected(pending, str(exc), step)
            return None
        rule, factor = lr_rule_of(pending), pending[-1].lr_factor
        lr = self._lr
        if factor is not None:
            lr_note = lr.note(factor, rule, before, store.knobs)
        else:  # rank 0 decided none: the rule is none, it knows no optimizer, or the script's
            lr_note = lr_words(
                before,
                store.knobs,
                rule,
                optimizer_known=False,
                world_size=self._placement.world_size,
                why=lr.owner if rule != "none" else "",
            )
        lr.changed(factor, rule, before, store.knobs)
        note = self._loader_note(set(diffs))
        applied = Applied(
            ids=[c.id for c in pending],
            step=step,
            time=time.time(),
            changes=diffs,
            note=note,
            predicted_peak_bytes=_predicted_peak(pending, control, store),
            origin=origins.pop() if len(origins := {c.origin for c in pending}) == 1 else "",
            lr_factor=factor,
            lr_note=lr_note,
        )
        if self._placement.rank == 0:
            # two phases, each on the disk before the next: the audit log's ``applying`` line,
            # then the tuned config; the ``applied`` line after them. A restart after a crash
            # anywhere between finds which the tuned config holds and says so
            # (``restart.unfinished``): an ``applied`` line a power cut takes back only makes it
            # say that the tuned config, which holds the change, is trusted
            control.audit_event("applying", applied, durable=True)
            self._tuned.write(store.knobs, step)
        control.record_applied(applied)
        if any(shrank(k, d) for k, d in diffs.items()):
            try:  # else the allocators keep what the smaller config frees
                release_caches()
            except Exception as exc:
                self._report(exc, "releasing caches")
        log.info("%s", describe_applied(applied))
        return applied

    def _loader_note(self, changed: set[str]) -> str:
        """What a change of loader knobs does next: the loader is rebuilt, or, in a loop without
        one (a batch function over a tensor), the script reads the config memtui wrote into."""
        knobs = [k for k in LOADER_KNOBS if k in changed]
        if not knobs:
            return ""
        try:
            has_loader = self._has_loader()
        except Exception as exc:
            self._report(exc, "the applied change's note")
            has_loader = True
        if has_loader:
            return self.loader_words
        names = " and ".join(knobs)
        when = " at its next batch" if knobs == ["batch_size"] else ""
        return f"no data loader to rebuild: the script reads {names} from its config{when}"

    def revert(self, target: AppliedChange, step: int, note: str) -> AppliedChange | str:
        """Undo an applied change now (an out-of-memory rollback): the rollback record, or why
        it could not be undone."""
        old = {k: d.old for k, d in target.changes.items() if d.old is not None}
        try:
            diffs = self._store.apply(old, step)
        except KnobError as exc:
            return str(exc)
        undo = 1.0 / target.lr_factor if target.lr_factor else None
        self._lr.revert(target.lr_factor)
        rollback = AppliedChange(
            ids=[],
            step=step,
            time=time.time(),
            changes=diffs,
            note=note,
            rollback=True,
            lr_factor=undo,
            lr_note=format_lr(undo, "rollback") if undo is not None else "",
        )
        self._control.record_applied(rollback)
        return rollback
