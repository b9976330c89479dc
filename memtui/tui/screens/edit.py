"""The modal that edits one knob: the value is validated before anything is sent."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.validation import ValidationResult, Validator
from textual.widgets import Input, Label, Static

from memtui.knobs import (
    KNOBS,
    KnobError,
    Resolved,
    format_changes,
    format_value,
    parse_value,
    resolve,
)
from memtui.tui.state import RunState
from memtui.wire import Knobs, KnobValue


def check_change(
    knob: str, text: str, state: RunState, keep_effective_batch: bool
) -> tuple[KnobValue, Resolved]:
    """Parse and resolve a new value for ``knob`` against the run as it will be; raise KnobError."""
    control = state.control
    if control is None:
        raise KnobError("the run's config is not known yet")
    value = parse_value(knob, text)
    pending = state.pending_values()
    projected = Knobs(**{k: pending.get(k, getattr(control.config, k)) for k in KNOBS})
    if getattr(projected, knob) == value:
        raise KnobError(f"{knob} is already {format_value(value)} (pending changes included)")
    resolved = resolve(
        {knob: value},
        projected,
        control.tunable,
        keep_effective_batch=keep_effective_batch and knob == "batch_size",
        world_size=control.world_size,
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


class EditKnobScreen(ModalScreen[KnobValue | None]):
    """Type a new value for one knob; Enter queues it for the next checkpoint, Escape cancels."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss_none", "Cancel")]

    def __init__(self, knob: str, state: RunState, keep_effective_batch: bool) -> None:
        super().__init__()
        self.knob = knob
        self.state = state
        self.keep_effective_batch = keep_effective_batch

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
            yield Label(f"Set {self.knob}", id="dialog-title")
            yield Static(about, id="dialog-about")
            yield Input(
                value=start,
                placeholder=format_value(current),
                validators=[KnobValidator(self.knob, self.state, self.keep_effective_batch)],
                validate_on=["changed", "submitted"],
                id="value",
            )
            yield Static("", id="preview")
            yield Static("enter: queue for the next checkpoint · esc: cancel", id="dialog-help")

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
        except KnobError as exc:
            preview.update(f"[red]{exc}[/]")
            return False
        note = f"\n{resolved.note}" if resolved.note else ""
        preview.update(f"will queue [bold]{format_changes(resolved.changes)}[/]{note}")
        return True

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        self._preview(event.value)

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if not self._preview(event.value):
            return
        value, _resolved = check_change(
            self.knob, event.value, self.state, self.keep_effective_batch
        )
        self.dismiss(value)

    def action_dismiss_none(self) -> None:
        """Close without sending."""
        self.dismiss(None)
