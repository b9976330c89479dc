"""The user's tracker: every applied change, rollback and OOM post-mortem handed to the callbacks
registered with ``tuner.on_event(fn)``, with the step it landed at.

Callbacks run on the training thread, at the checkpoint boundary that applied a change, or in the
guarded block (or the exception hook) that handled an out-of-memory error: never on the per-step
path. A callback that raises is reported through the hook's error log and training goes on.
"""

from __future__ import annotations

from collections.abc import Callable

from memtui.core.knobs import as_dict, format_changes, format_diffs
from memtui.hooks.errors import Report
from memtui.wire import AppliedChange, LrWithdrawn, OomEvent

TrackerEvent = AppliedChange | OomEvent | LrWithdrawn
"""What a callback is given: an applied change or a rollback (``rollback=True``), an OOM, or the
LR factor withdrawn because the script sets its own LR."""

EventCallback = Callable[[TrackerEvent, int], None]
"""``fn(event, step)``: the event and the optimizer step it landed at."""

TAG = "memtui"
"""The name memtui's lines and values are logged under (``memtui/batch_size``)."""


def event_text(event: TrackerEvent) -> str:
    """The event in one line: ``batch_size 16 -> 32 at step 300`` (a rollback or an OOM says so)."""
    if isinstance(event, LrWithdrawn):
        return (
            f"the LR factor x{round(event.factor, 4)} no longer holds from step {event.step}: "
            f"{event.note}"
        )
    if isinstance(event, OomEvent):
        outcome = "rolled back" if event.rolled_back else "no rollback"
        text = f"out of memory at step {event.step} with {format_changes(as_dict(event.config))}"
        return f"{text}: {outcome}; {event.batch}" if event.batch else f"{text}: {outcome}"
    text = f"{format_diffs(event.changes) or 'no effective change'} at step {event.step}"
    text = f"rollback: {text}" if event.rollback else text
    notes = "; ".join(n for n in (event.note, event.lr_note) if n)
    return f"{text} ({notes})" if notes else text


def event_values(event: TrackerEvent) -> dict[str, float]:
    """Each knob's new value as a number (pinning as 0 or 1), keyed ``memtui/<knob>``; an OOM has
    none (its rollback, a change of its own, carries them)."""
    if isinstance(event, LrWithdrawn):
        return {f"{TAG}/lr_factor": 1.0}
    if isinstance(event, OomEvent):
        return {}
    return {f"{TAG}/{knob}": float(diff.new) for knob, diff in event.changes.items()}


class Tracker:
    """Owns the callbacks registered with ``tuner.on_event`` and calls each with every event."""

    def __init__(self, report: Report) -> None:
        self._report = report
        self._callbacks: list[EventCallback] = []

    def add(self, callback: EventCallback) -> EventCallback:
        """Call ``callback(event, step)`` for every event from now on; returns it."""
        self._callbacks.append(callback)
        return callback

    def emit(self, event: TrackerEvent, step: int) -> None:
        """Hand ``event`` to every callback; one that raises is reported and the others still run."""
        for callback in list(self._callbacks):
            try:
                callback(event, step)
            except Exception as exc:
                name = getattr(callback, "__qualname__", type(callback).__name__)
                self._report(exc, f"on_event callback {name}")
