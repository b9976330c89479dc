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

from memtui.core.knobs import format_changes
from memtui.tui.safe import as_text
from memtui.wire import ControlState, PendingChange


def fate(change: PendingChange, control: ControlState | None) -> str:
    """What became of a change no longer pending, in words (``was applied at step 300``)."""
    if control is not None:
        for applied in control.applied:
            if change.id in applied.ids:
                return f"was applied at step {applied.step:,}"
        for cancelled in control.cancelled:
            if cancelled.id == change.id:
                return (
                    f"was cancelled by {cancelled.client}" if cancelled.client else "was cancelled"
                )
        for rejected in control.rejected:
            if rejected.id == change.id:
                return f"was rejected ({rejected.reason})"
    return "is no longer pending"


class CancelScreen(ModalScreen[int | None]):
    """Pick the pending change to cancel; dismissed with its id, 0 for all, None for none."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss_none", "Back")]

    def __init__(self, pending: list[PendingChange]) -> None:
        super().__init__()
        self.pending = list(pending)
        """The changes listed, as the run last said they were pending."""

    def compose(self) -> ComposeResult:
        """The pending changes, newest first, and 'all'."""
        with Vertical(id="dialog"):
            yield Label("Cancel a pending change", id="dialog-title")
            yield OptionList(*self._options(), id="pending")
            news = Static("", id="dialog-news")  # what became of a change listed
            news.display = False
            yield news
            yield Static("enter: cancel it · esc: back", id="dialog-help")

    def _options(self) -> list[Option]:
        options = [
            Option(  # the run's knob names: text, never markup
                as_text(f"#{c.id} {format_changes(c.changes)} (queued at step {c.queued_step})"),
                id=str(c.id),
            )
            for c in reversed(self.pending)
        ]
        if len(self.pending) > 1:
            options.append(Option(as_text(f"all {len(self.pending)} pending changes"), id="0"))
        return options

    def follow(self, control: ControlState | None) -> str:
        """List the changes the run has pending now; those gone since (applied at a checkpoint
        meanwhile, cancelled from another shell, rejected) are said in the dialog, which closes
        when none is left. Returns what to tell once it closed ("" while it stays open)."""
        now = list(control.pending) if control is not None else []
        if [c.id for c in now] == [c.id for c in self.pending]:
            return ""
        ids = {c.id for c in now}
        gone = [f"#{c.id} {format_changes(c.changes)} {fate(c, control)}"
                for c in self.pending if c.id not in ids]  # fmt: skip
        self.pending = now
        news = f"{'; '.join(gone)} meanwhile" if gone else ""
        if not now:
            self.dismiss(None)
            return f"{news}: nothing left to cancel" if news else "nothing left to cancel"
        options = self.query_one("#pending", OptionList)
        kept = options.highlighted_option.id if options.highlighted_option is not None else None
        options.clear_options()
        options.add_options(self._options())
        if kept is not None and int(kept) in ids:
            options.highlighted = options.get_option_index(kept)
        if news:
            told = self.query_one("#dialog-news", Static)
            told.update(as_text(news, "yellow"))
            told.display = True
        return ""

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_dismiss_none(self) -> None:
        """Close without cancelling anything."""
        self.dismiss(None)
