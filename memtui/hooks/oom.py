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

import gc
import logging
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from memtui.advice.oom import is_oom, parse_oom
from memtui.advice.predict import max_batch
from memtui.knobs import accumulation_for
from memtui.wire import AppliedChange, KnobDiff, Knobs, OomEvent

if TYPE_CHECKING:
    from memtui.hooks.tuner import Tuner

log = logging.getLogger("memtui")

GROWING_KNOBS = ("batch_size", "num_workers", "pin_memory")
"""Knobs whose increase can cause an out-of-memory error."""


class Guard:
    """A reusable context manager around the allocating part of a step."""

    def __init__(self, tuner: Tuner) -> None:
        self.tuner = tuner
        self.rolled_back = False
        """True after a block whose out-of-memory error was handled by a rollback."""

    def __enter__(self) -> Guard:
        self.rolled_back = False
        if self.tuner._empty_cache_pending:
            self.tuner._empty_cache_pending = False
            _empty_cache()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None or not is_oom(exc):
            return False
        try:
            self.rolled_back = handle(self.tuner, exc, guarded=True)
        except Exception as failure:  # never make it worse: the original error goes on
            self.tuner._report(failure, "oom handling")
            return False
        return self.rolled_back


def _empty_cache() -> None:
    """Give cached memory back: torch's CUDA cache, and on CPU glibc's free heap (malloc_trim)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim_heap()


def trim_heap() -> None:
    """Return free heap memory to the OS (glibc only; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rollback_target(tuner: Tuner, step: int) -> AppliedChange | None:
    """The recent change that grew the run, if a rollback may revert it."""
    if tuner.options.rollback_steps <= 0 or tuner.coordinator is not None or tuner.world_size > 1:
        return None
    for applied in reversed(list(tuner.control.applied)):
        if applied.rollback:
            return None
        if step - applied.step > tuner.options.rollback_steps:
            return None
        if any(_grew(k, d) for k, d in applied.changes.items()):
            return applied
        return None
    return None


def _grew(knob: str, diff: KnobDiff) -> bool:
    if knob not in GROWING_KNOBS:
        return False
    if isinstance(diff.new, bool) or isinstance(diff.old, bool):
        return bool(diff.new) and not diff.old
    return diff.old is None or int(diff.new) > int(diff.old)


def safe_config(tuner: Tuner) -> tuple[dict[str, Any], str]:
    """The config to restart with after an OOM, and why it is safe."""
    values = {k: v for k, v in tuner.values.items() if v is not None}
    recent = _rollback_target(tuner, tuner.step_count) if tuner.world_size == 1 else None
    last = next((a for a in reversed(list(tuner.control.applied)) if not a.rollback), None)
    if recent is None and last is not None and any(_grew(k, d) for k, d in last.changes.items()):
        recent = last
    if recent is not None:
        for knob, diff in recent.changes.items():
            if diff.old is not None:
                values[knob] = diff.old
        return (
            values,
            f"the config before change #{','.join(map(str, recent.ids)) or '?'} (applied at step {recent.step})",
        )
    batch = values.get("batch_size")
    if isinstance(batch, int) and batch > 1:
        model = tuner.control.model
        edge = tuner.control.thresholds.memory_edge_fraction
        safer = max_batch(model, edge) if model is not None else None
        new_batch = safer if safer and safer < batch else max(1, batch // 2)
        accum = values.get("grad_accum")
        if isinstance(accum, int):
            values["grad_accum"], _ = accumulation_for(batch * accum, new_batch)
        values["batch_size"] = new_batch
        why = (
            f"the memory model's largest micro-batch under {edge:.0%}"
            if safer and safer < batch
            else "the micro-batch halved"
        )
        return values, why + (
            ", accumulation raised to keep the effective batch" if isinstance(accum, int) else ""
        )
    return values, "unchanged: nothing memtui can make smaller"


def handle(tuner: Tuner, exc: BaseException, *, guarded: bool) -> bool:
    """Report an out-of-memory error; roll back a recent change if allowed. True: training goes on."""
    if getattr(exc, "__memtui_handled__", False):
        return False
    try:
        exc.__memtui_handled__ = True  # type: ignore[attr-defined]
    except Exception:
        pass
    report = parse_oom(exc)
    step = tuner.step_count
    config = tuner.knobs()
    target = _rollback_target(tuner, step) if guarded else None
    samples = tuner._samples_acc
    micro = tuner._micro_acc
    event_fields: dict[str, Any] = dict(
        time=time.time(),
        step=step,
        kind=report.kind,
        message=report.message,
        config=config,
        tried_bytes=report.tried_bytes,
        capacity_bytes=report.capacity_bytes,
        free_bytes=report.free_bytes,
        process_in_use_bytes=report.process_in_use_bytes,
        allocated_bytes=report.allocated_bytes,
        reserved_unallocated_bytes=report.reserved_unallocated_bytes,
    )
    if target is None:
        values, why = safe_config(tuner)
        where = "inside tuner.guard()" if guarded else "outside any tuner.guard()"
        batch = f"lost with the run: step {step + 1} had {micro} micro-batch(es), {samples} samples, when it failed"
        event = OomEvent(
            **event_fields,
            rolled_back=False,
            batch=batch,
            safe_config=Knobs(**_knob_fields(values)),
        )
        tuner._record_oom(event, values, why)
        log.error(
            "memtui: out of memory at step %d (%s); no rollback (%s). Wrote a safe config for the "
            "restart (%s): %s",
            step,
            where,
            _no_rollback_reason(tuner, guarded),
            why,
            values,
        )
        return False
    requeued, skipped = tuner._requeue_step_batches()
    if requeued:
        batch = f"re-queued: the step's {micro} micro-batch(es), {requeued} samples, are trained on again after the rollback"
    else:
        batch = f"skipped: the step's {micro} micro-batch(es), {skipped or samples} samples, were dropped (this loader cannot re-queue them)"
    reverted = tuner._revert(target, report_text=f"rollback after out of memory at step {step}")
    tuner._zero_grad()
    tuner._reset_partial_step()
    tuner._empty_cache_pending = True
    values = {k: v for k, v in tuner.values.items() if v is not None}
    event = OomEvent(
        **event_fields, rolled_back=True, batch=batch, safe_config=Knobs(**_knob_fields(values))
    )
    tuner._record_oom(event, values, f"rolled back change #{','.join(map(str, target.ids))}")
    log.error(
        "memtui: out of memory at step %d, %d step(s) after change #%s; rolled it back (%s); %s",
        step,
        step - target.step,
        ",".join(map(str, target.ids)),
        reverted,
        batch,
    )
    return True


def _no_rollback_reason(tuner: Tuner, guarded: bool) -> str:
    if not guarded:
        return "the step is not inside tuner.guard()"
    if tuner.world_size > 1:
        return "several ranks: a rollback on one rank alone would desynchronise them"
    if tuner.options.rollback_steps <= 0:
        return "rollback is off"
    return (
        f"no change that grew the run was applied in the last {tuner.options.rollback_steps} steps"
    )


def _knob_fields(values: dict[str, Any]) -> dict[str, Any]:
    return {k: values.get(k) for k in ("batch_size", "grad_accum", "num_workers", "pin_memory")}


def install_excepthook(tuner: Tuner) -> None:
    """Write the post-mortem of an out-of-memory error that ends the program unguarded."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            if is_oom(exc) and not tuner._closed:
                handle(tuner, exc, guarded=False)
        except Exception as failure:
            tuner._report(failure, "oom post-mortem")
        previous(kind, exc, tb)

    sys.excepthook = hook
