"""The modal that picks a recommendation to queue (only those memtui can apply are offered)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList, Static
from textual.widgets.option_list import Option

from memtui.advice.recommend import Recommendation
from memtui.tui.safe import as_text
from memtui.tui.widgets.advice import expected

ADVICE_ONLY = "\n   (advice only: a restart or a code change)"
"""Under an option memtui cannot apply."""


class AdviceScreen(ModalScreen[Recommendation | None]):
    """Pick one of the ranked options; dismissed with it, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "dismiss_none", "Back")]

    def __init__(self, options: list[Recommendation]) -> None:
        super().__init__()
        self.options = list(options)

    def compose(self) -> ComposeResult:
        """Every option, best first; those memtui cannot apply are listed but disabled."""
        items = [
            Option(
                as_text(
                    f"{rank}. {option.title}\n   "
                    + " · ".join(text for text, _style in expected(option))
                    + (f"\n   {option.why}" if option.why else "")
                    + ("" if option.applicable else ADVICE_ONLY)
                ),
                id=str(rank - 1),
                disabled=not option.applicable,
            )
            for rank, option in enumerate(self.options, start=1)
        ]
        with Vertical(id="dialog"):
            yield Label("Queue a recommendation", id="dialog-title")
            yield OptionList(*items, id="pending")
            yield Static("enter: queue it for the next checkpoint · esc: back", id="dialog-help")

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.options[int(event.option.id or 0)])

    def action_dismiss_none(self) -> None:
        """Close without queueing anything."""
        self.dismiss(None)
