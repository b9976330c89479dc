"""The modal that picks a pending change to cancel (or all of them)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, Static
from textual.widgets.option_list import Option

from memtui.knobs import format_changes
from memtui.tui.safe import as_text
from memtui.wire import PendingChange


class CancelScreen(ModalScreen[int | None]):
    """Pick the pending change to cancel; dismissed with its id, 0 for all, None for none."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss_none", "Back")]

    def __init__(self, pending: list[PendingChange]) -> None:
        super().__init__()
        self.pending = list(pending)

    def compose(self) -> ComposeResult:
        """The pending changes, newest first, and 'all'."""
        options = [
            Option(  # the run's knob names: text, never markup
                as_text(f"#{c.id} {format_changes(c.changes)} (queued at step {c.queued_step})"),
                id=str(c.id),
            )
            for c in reversed(self.pending)
        ]
        if len(self.pending) > 1:
            options.append(Option(as_text(f"all {len(self.pending)} pending changes"), id="0"))
        with Vertical(id="dialog"):
            yield Label("Cancel a pending change", id="dialog-title")
            yield OptionList(*options, id="pending")
            yield Static("enter: cancel it · esc: back", id="dialog-help")

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_dismiss_none(self) -> None:
        """Close without cancelling anything."""
        self.dismiss(None)
