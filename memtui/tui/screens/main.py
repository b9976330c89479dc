"""The main screen: header, verdict, the ranks, charts, memory, config, recommendations and
change log."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from memtui.tui.state import RunState, ViewOptions
from memtui.tui.widgets.advice import AdvicePanel
from memtui.tui.widgets.base import StateView
from memtui.tui.widgets.changelog import ChangeLog
from memtui.tui.widgets.config import ConfigPanel
from memtui.tui.widgets.header import RunHeader
from memtui.tui.widgets.memory import MemoryPanel
from memtui.tui.widgets.ranks import RanksPanel
from memtui.tui.widgets.series import SeriesChart
from memtui.tui.widgets.verdict import VerdictGauge


class MainScreen(Screen[None]):
    """Everything at once; the ``narrow`` class (under 80 columns) stacks the panels, and the
    ``multirank`` class (a run of several ranks) shows the per-rank table."""

    HORIZONTAL_BREAKPOINTS = [(0, "narrow"), (80, "wide")]  # noqa: RUF012 (Textual's attribute)

    def __init__(self) -> None:
        super().__init__()
        self._views: list[StateView] | None = None
        self._focus_title = ""

    def compose(self) -> ComposeResult:
        """Header, verdict, ranks, then the side panels and the charts, then the change log."""
        yield RunHeader(id="header")
        yield VerdictGauge(id="verdict", classes="panel")
        yield RanksPanel(id="ranks", classes="panel")
        with Horizontal(id="body"):
            with Vertical(id="side"):
                yield ConfigPanel(id="config", classes="panel")
                yield MemoryPanel(id="memory", classes="panel")
            with Vertical(id="main-col"):
                yield SeriesChart(id="charts", classes="panel")
                yield AdvicePanel(id="advice", classes="panel")
        yield ChangeLog(id="changes", classes="panel")
        yield Footer()

    def on_mount(self) -> None:
        """Titles on the panels' borders."""
        titles = {
            "verdict": "verdict",
            "ranks": "ranks, worst first",
            "config": "config",
            "memory": "memory",
            "charts": "history",
            "advice": "recommendations, best first",
            "changes": "changes",
        }
        for widget_id, title in titles.items():
            self.query_one(f"#{widget_id}").border_title = title
        self._views = list(self.query(StateView))

    def on_resize(self) -> None:
        """No palette key in the footer when narrow (ctrl+p still works; the help lists it)."""
        self.query_one(Footer).show_command_palette = not self.has_class("narrow")

    def update_view(self, state: RunState, view: ViewOptions, charts: bool = True) -> int:
        """Show the state; the charts only when ``charts``. Returns how many widgets repainted."""
        repainted = 0
        multirank = len(state.series) > 1 or state.world_size > 1
        self.set_class(multirank, "multirank")
        focus = f" · rank {state.summary().focus_rank}" if multirank else ""
        if focus != self._focus_title:  # the panels that show one rank say which
            self._focus_title = focus
            for widget_id, title in (("memory", "memory"), ("charts", "history")):
                self.query_one(f"#{widget_id}").border_title = title + focus
        for widget in self._views or ():
            if isinstance(widget, SeriesChart) and not charts:
                continue
            try:
                repainted += widget.show(state, view)
            except Exception as error:  # one panel that cannot be drawn leaves the others
                state.note_viewer_error(f"drawing the {widget.id}", error)
        return repainted
