"""Out of memory in the loop: a post-mortem always, and a rollback when a recent change caused it.

Guard the part of the step that allocates (forward and backward) with ``tuner.guard()``::

    guard = tuner.guard()
    for batch in loader:
        with guard:
            loss = model(batch) / config.grad_accum
            loss.backward()
        if guard.rolled_back:      # the OOM was handled: this step starts over
            micro = 0
            continue
        ...

When a CUDA out-of-memory error (or a CPU ``MemoryError``) leaves the guarded block, memtui
parses it (what was asked for, capacity, free, in use by the process, allocated by PyTorch,
reserved but unallocated) and publishes it before the exception goes further. If a change
applied within ``rollback_steps`` steps made the run bigger (micro-batch, workers, pinning), and
the run is a single process, it is reverted at once: the old values go back into the config,
the step's gradients are zeroed, the allocator's cache is emptied, the loader is rebuilt, and
the step's micro-batches are re-queued in the loader (exact-position loaders: they are trained
on again, nothing is lost; other loaders: they are skipped, and the report says how many
samples). The exception is then swallowed and training goes on; the change log and the audit
log say exactly what happened.

Otherwise (no recent change, several ranks, or an unguarded OOM, caught by memtui's
``sys.excepthook``), the exception goes on and the run dies as it would have, but first the
post-mortem and a safe config for the restart are written into the tuned YAML, so a run
resumed with ``resume=True`` starts from it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from memtui.advice.oom import is_oom, parse_oom
from memtui.advice.predict import max_batch
from memtui.core.knobs import accumulation_for, as_dict, format_diffs, grew, knobs_with
from memtui.hooks.boundary import Boundary
from memtui.hooks.caches import release_caches
from memtui.hooks.control import Control
from memtui.hooks.errors import Report
from memtui.hooks.knobstore import KnobStore
from memtui.hooks.ledger import StepLedger
from memtui.hooks.persist import TunedConfig
from memtui.hooks.placement import Placement
from memtui.hooks.tracker import TrackerEvent
from memtui.wire import AppliedChange, KnobDiff, Knobs, OomEvent, all_fields

log = logging.getLogger("memtui")


@dataclass(frozen=True)
class OomRun:
    """What the handler reads to judge an out-of-memory error: the step and its micro-batches,
    the knobs, the changes applied (the control, which also records the error) and the ranks."""

    ledger: StepLedger
    store: KnobStore
    control: Control
    placement: Placement


@dataclass(frozen=True)
class OomActions:
    """What a post-mortem and a rollback act on."""

    boundary: Boundary
    """Reverts the change that grew the run."""
    tuned: TunedConfig
    """Keeps the safe config and the post-mortem for a restart."""
    zero_grad: Callable[[], None]
    """Drops the failed step's gradients."""
    reset_peaks: Callable[[], None] = lambda: None
    """Resets the allocator's peak counters once a rollback's caches are given back."""
    notify: Callable[[TrackerEvent, int], None] = lambda event, step: None
    """Hands each post-mortem and rollback to the user's tracker (``tuner.on_event``)."""


class OomHandler:
    """Reports out-of-memory errors and rolls back the recent change that caused one."""

    def __init__(
        self, run: OomRun, actions: OomActions, *, rollback_steps: int, report: Report
    ) -> None:
        self._ledger = run.ledger
        self._store = run.store
        self._control = run.control
        self._placement = run.placement
        self._actions = actions
        self.rollback_steps = rollback_steps
        """A change applied within this many steps before a guarded OOM is reverted (0: never)."""
        self.report = report
        self.empty_cache_pending = False
        """A rollback happened: the next guarded block starts by emptying the caches."""

    def guard(self) -> Guard:
        """A context manager for the allocating part of a step."""
        return Guard(self)

    def empty_cache_if_pending(self) -> None:
        """Give the caches back if a rollback asked for it (at the start of a guarded block), and
        start the peak counters afresh: the peak before was the reverted config's."""
        if self.empty_cache_pending:
            self.empty_cache_pending = False
            release_caches()
            self._actions.reset_peaks()

    def _rollback_target(self, step: int) -> AppliedChange | None:
        """The recent change that grew the run, if a rollback may revert it."""
        placement = self._placement
        if self.rollback_steps <= 0 or placement.coordinated or placement.world_size > 1:
            return None
        for applied in reversed(self._control.applied_changes()):
            if applied.rollback or step - applied.step > self.rollback_steps:
                return None
            return applied if any(grew(k, d) for k, d in applied.changes.items()) else None
        return None

    def safe_config(self) -> tuple[Knobs, str]:
        """The config to restart with after an OOM, and why it is safe."""
        current = self._store.knobs
        step = self._ledger.step
        recent = self._rollback_target(step) if self._placement.world_size == 1 else None
        applied = self._control.applied_changes()
        last = next((a for a in reversed(applied) if not a.rollback), None)
        if recent is None and last is not None and any(grew(k, d) for k, d in last.changes.items()):
            recent = last
        if recent is not None:
            old = {k: d.old for k, d in recent.changes.items() if d.old is not None}
            ids = ",".join(map(str, recent.ids)) or "?"
            return (
                knobs_with(current, old),
                f"the config before change #{ids} (applied at step {recent.step})",
            )
        batch = current.batch_size
        if isinstance(batch, int) and batch > 1:
            model = self._control.model
            edge = self._control.thresholds.memory_edge_fraction
            safer = max_batch(model, edge, self._control.ceiling) if model is not None else None
            new_batch = safer if safer and safer < batch else max(1, batch // 2)
            changes: dict[str, int] = {"batch_size": new_batch}
            accum = current.grad_accum
            if isinstance(accum, int):
                changes["grad_accum"], _ = accumulation_for(batch * accum, new_batch)
            why = (
                f"the memory model's largest micro-batch under {edge:.0%}"
                if safer and safer < batch
                else "the micro-batch halved"
            )
            return knobs_with(current, changes), why + (
                ", accumulation raised to keep the effective batch"
                if isinstance(accum, int)
                else ""
            )
        return current, "unchanged: nothing memtui can make smaller"

    def handle(self, exc: BaseException, *, guarded: bool) -> bool:
        """Report an out-of-memory error; roll back a recent change if allowed. True: training
        goes on."""
        if getattr(exc, "__memtui_handled__", False):
            return False
        try:
            exc.__memtui_handled__ = True  # type: ignore[attr-defined]
        except Exception:
            pass
        report = parse_oom(exc)
        ledger = self._ledger
        step = ledger.step
        samples, micro = ledger.open_step()
        grown = self._grown()
        target = self._rollback_target(step) if guarded else None
        event = OomEvent(
            time=time.time(),
            step=step,
            kind=report.kind,
            message=report.message,
            config=self._store.knobs,
            tried_bytes=report.tried_bytes,
            capacity_bytes=report.capacity_bytes,
            free_bytes=report.free_bytes,
            process_in_use_bytes=report.process_in_use_bytes,
            allocated_bytes=report.allocated_bytes,
            reserved_unallocated_bytes=report.reserved_unallocated_bytes,
        )
        if target is None:
            safe, why = self.safe_config()
            where = "inside tuner.guard()" if guarded else "outside any tuner.guard()"
            event.batch = (
                f"lost with the run: step {step + 1} had {micro} micro-batch(es), {samples} "
                "samples, when it failed"
            )
            event.safe_config = safe
            self._record(event, why, grown)
            self._actions.notify(event, step)
            log.error(
                "memtui: out of memory at step %d (%s); no rollback (%s). Wrote a safe config for "
                "the restart (%s): %s",
                step,
                where,
                self._no_rollback_reason(guarded),
                why,
                as_dict(safe),
            )
            return False
        requeued, skipped = ledger.requeue()
        if requeued:
            event.batch = (
                f"re-queued: the step's {micro} micro-batch(es), {requeued} samples, are trained "
                "on again after the rollback"
            )
        else:
            event.batch = (
                f"skipped: the step's {micro} micro-batch(es), {skipped or samples} samples, were "
                "dropped (this loader cannot re-queue them)"
            )
        rollback = self._actions.boundary.revert(
            target, step, f"rollback after out of memory at step {step}"
        )
        reverted = rollback if isinstance(rollback, str) else format_diffs(rollback.changes)
        self._actions.zero_grad()
        ledger.reset_open_step()
        self.empty_cache_pending = True
        event.rolled_back = True
        event.safe_config = self._store.knobs
        self._record(event, f"rolled back change #{','.join(map(str, target.ids))}", grown)
        self._actions.notify(event, step)
        if not isinstance(rollback, str):
            self._actions.notify(rollback, step)
        log.error(
            "memtui: out of memory at step %d, %d step(s) after change #%s: rolled it back (%s), "
            "training goes on; %s",
            step,
            step - target.step,
            ",".join(map(str, target.ids)),
            reverted,
            event.batch,
        )
        return True

    def _grown(self) -> dict[str, KnobDiff]:
        """The knobs the latest applied change raised, if the run still has them (the likely
        cause of an out-of-memory error)."""
        for applied in reversed(self._control.applied_changes()):
            if applied.rollback:
                return {}
            return {k: d for k, d in applied.changes.items() if grew(k, d)}
        return {}

    def _record(self, event: OomEvent, why: str, grown: dict[str, KnobDiff]) -> None:
        """Publish and audit an OOM (lowering the ceiling), and write its safe config and
        post-mortem as the tuned config."""
        self._control.record_oom(event, grown)
        safe = event.safe_config or self._store.knobs
        self._actions.tuned.write(
            safe, event.step, {"safe_config_reason": why, "oom": all_fields(event)}
        )

    def _no_rollback_reason(self, guarded: bool) -> str:
        if not guarded:
            return "the step is not inside tuner.guard()"
        if self._placement.world_size > 1:
            return "several ranks: a rollback on one rank alone would desynchronise them"
        if self.rollback_steps <= 0:
            return "rollback is off"
        return f"no change that grew the run was applied in the last {self.rollback_steps} steps"

    def install_excepthook(self, closed: Callable[[], bool]) -> None:
        """Write the post-mortem of an out-of-memory error that ends the program unguarded."""
        previous = sys.excepthook

        def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
            try:
                if is_oom(exc) and not closed():
                    self.handle(exc, guarded=False)
            except Exception as failure:
                self.report(failure, "oom post-mortem")
            previous(kind, exc, tb)

        sys.excepthook = hook


class Guard:
    """A reusable context manager around the allocating part of a step."""

    def __init__(self, handler: OomHandler) -> None:
        self._handler = handler
        self.rolled_back = False
        """True after a block whose out-of-memory error was handled by a rollback."""

    def __enter__(self) -> Guard:
        self.rolled_back = False
        self._handler.empty_cache_if_pending()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None or not is_oom(exc):
            return False
        try:
            self.rolled_back = self._handler.handle(exc, guarded=True)
        except Exception as failure:  # never make it worse: the original error goes on
            self._handler.report(failure, "oom handling")
            return False
        return self.rolled_back
