"""The modal that edits one knob: the value is validated, and its predicted peak shown, before
anything is sent; a change predicted over the danger band (90% unless the config file says
otherwise) needs a second Enter (it is then sent with ``force``)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.validation import ValidationResult, Validator
from textual.widgets import Input, Label, Static

from memtui.advice.prediction import Prediction
from memtui.core.knobs import (
    GROWING_KNOBS,
    KnobError,
    Resolved,
    format_changes,
    format_value,
    knobs_with,
    parse_value,
    resolve,
)
from memtui.runs.state import RunState
from memtui.tui.safe import as_text
from memtui.wire import KnobValue

INPUT_WAIT_S = 5.0
"""The longest Enter waits for the input to take in the keys typed before it."""


@dataclass(frozen=True)
class EditResult:
    """What the modal sends: the value, and whether the operator confirmed a risky change."""

    value: KnobValue
    force: bool = False


def predict_change(resolved: Resolved, state: RunState) -> Prediction | None:
    """The predicted peak once ``resolved`` lands, against what ran out of memory (None: no
    model, or no knob that takes memory changes)."""
    control = state.control
    if control is None or not set(resolved.changes) & set(GROWING_KNOBS):
        return None
    model = control.model
    if model is None or not model.capacity_bytes:
        return None
    projected = knobs_with(knobs_with(control.config, state.pending_values()), resolved.changes)
    return Prediction.of_config(model, projected, state.thresholds.thresholds, control.ceiling)


def text_key(text: str) -> str:
    """The typed value as compared between two Enters (spaces around it do not count)."""
    return text.strip()


def check_change(
    knob: str, text: str, state: RunState, keep_effective_batch: bool
) -> tuple[KnobValue, Resolved]:
    """Parse and resolve a new value for ``knob`` against the run as it will be; raise KnobError."""
    control = state.control
    if control is None:
        raise KnobError("the run's config is not known yet")
    value = parse_value(knob, text)
    pending = state.pending_values()
    projected = knobs_with(control.config, pending)
    resolved = resolve(
        {knob: value},
        projected,
        control.tunable,
        keep_effective_batch=keep_effective_batch and knob == "batch_size",
        world_size=control.world_size,
        why_not=control.untunable,
        held=control.untunable_values,
    )
    return value, resolved


class KnobValidator(Validator):
    """Accepts what the hook would accept: the knob's type and range, and keep-effective-batch."""

    def __init__(self, knob: str, state: RunState, keep_effective_batch: bool) -> None:
        super().__init__()
        self.knob = knob
        self.state = state
        self.keep_effective_batch = keep_effective_batch

    def validate(self, value: str) -> ValidationResult:
        """Success, or the reason the hook would give."""
        try:
            check_change(self.knob, value, self.state, self.keep_effective_batch)
        except KnobError as exc:
            return self.failure(str(exc))
        return self.success()


class EditKnobScreen(ModalScreen[EditResult | None]):
    """Type a new value for one knob; Enter queues it for the next checkpoint (a change predicted
    over the danger band takes a second Enter, and is sent forced), Escape cancels."""

    # priority: taken when the app reads them, in the order typed, so a key typed after Enter
    # or Escape goes to the main screen (as a plain binding, it went into this input first)
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss_none", "Cancel", priority=True),
        Binding("enter", "submit", "Queue", priority=True),
    ]

    def __init__(self, knob: str, state: RunState, keep_effective_batch: bool) -> None:
        super().__init__()
        self.knob = knob
        self.state = state
        self.keep_effective_batch = keep_effective_batch
        self.confirming: str | None = None
        """The text whose risky prediction was shown: Enter on it again sends it forced."""

    def compose(self) -> ComposeResult:
        """Title, what the knob is now, the input and a preview of what will be sent."""
        current = self.state.knob_value(self.knob)
        pending = self.state.pending_values().get(self.knob)
        if self.knob == "pin_memory":
            start = format_value(not (pending if pending is not None else current))
        else:
            start = ""
        about = f"now {format_value(current)}"
        if pending is not None:
            about += f", pending {format_value(pending)}"
        if self.knob == "batch_size" and self.keep_effective_batch:
            about += "; keep-effective-batch is on: grad_accum follows"
        with Vertical(id="dialog"):
            yield Label(f"Set {self.knob}", id="dialog-title", markup=False)
            yield Static(as_text(about), id="dialog-about")
            yield Input(
                value=start,
                placeholder=format_value(current),
                validators=[KnobValidator(self.knob, self.state, self.keep_effective_batch)],
                validate_on=["changed", "submitted"],
                id="value",
            )
            yield Static("", id="preview")
            control = self.state.control
            when = (control.boundary if control is not None else "") or "the next checkpoint"
            # the run's words: shown as text, never as markup
            yield Static(as_text(f"enter: queue for {when} · esc: cancel"), id="dialog-help")

    def on_mount(self) -> None:
        """Show the preview of a prefilled value."""
        self._preview(self.query_one(Input).value)

    def _preview(self, text: str) -> bool:
        preview = self.query_one("#preview", Static)
        if not text.strip():
            preview.update("")
            return False
        try:
            _value, resolved = check_change(self.knob, text, self.state, self.keep_effective_batch)
        except KnobError as exc:  # it quotes what was typed: text, not markup
            preview.update(as_text(exc, "red"))
            return False
        shown = Text.assemble("will queue ", as_text(format_changes(resolved.changes), "bold"))
        if resolved.note:
            shown.append("\n").append_text(as_text(resolved.note))
        prediction = predict_change(resolved, self.state)
        if prediction is not None:
            style = "bold red" if prediction.over_danger else "green"
            if not prediction.over_danger and prediction.fraction >= prediction.edge:
                style = "bold yellow"
            shown.append("\n").append_text(as_text(prediction.describe(), style))
            if prediction.over_danger:
                safe = prediction.safe_words
                if prediction.ran_out:
                    shown.append("\n").append_text(as_text(prediction.ran_out, "bold red"))
                if prediction.high_fraction > prediction.danger:
                    where = f"\nhigh end over the {prediction.danger:.0%} danger band"
                    shown.append(where, "bold red")
                if safe:
                    shown.append(f" (largest under {prediction.edge:.0%}: {safe})")
                if self.confirming == text_key(text):
                    shown.append("\n")
                    shown.append(" enter again: queue it anyway (forced) ", "bold reverse red")
                else:
                    shown.append("\nenter asks for a confirmation")
        preview.update(shown)
        return True

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        if self.confirming != text_key(event.value):
            self.confirming = None  # a new value: a new confirmation
        self._preview(event.value)

    async def action_submit(self) -> None:
        """Enter: once the input has taken in the keys typed before it, send its value (or ask
        for the confirmation)."""
        field = self.query_one(Input)
        typed = asyncio.Event()
        if field.call_later(typed.set):  # runs after the keys already sent to the input
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(typed.wait(), INPUT_WAIT_S)
        self._submit(field.value)

    def _submit(self, text: str) -> None:
        """Send ``text`` as the new value, or ask for the confirmation a risky one takes."""
        if not self._preview(text):
            return
        value, resolved = check_change(self.knob, text, self.state, self.keep_effective_batch)
        prediction = predict_change(resolved, self.state)
        if prediction is not None and prediction.over_danger:
            if self.confirming != text_key(text):
                self.confirming = text_key(text)  # the confirm step
                self._preview(text)
                return
            self.dismiss(EditResult(value, force=True))
            return
        self.dismiss(EditResult(value))

    def action_dismiss_none(self) -> None:
        """Close without sending."""
        self.dismiss(None)
