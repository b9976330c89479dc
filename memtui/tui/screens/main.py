"""The main screen: header, verdict, the ranks, charts, memory, config, recommendations and
change log (arranged for a wide terminal or a side pane)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widget import Widget
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

TITLES = {
    "verdict": "verdict",
    "ranks": "ranks, worst first",
    "config": "config",
    "memory": "memory",
    "charts": "history",
    "advice": "recommendations, best first",
    "changes": "changes",
}
"""The panels' titles, on their borders."""
ONE_RANK_PANELS = ("memory", "charts")
"""The panels that show one rank: with several ranks, their titles say which."""


class MainScreen(Screen[None]):
    """Everything at once; the ``narrow`` class (under 80 columns) stacks the panels, and the
    ``multirank`` class (a run of several ranks) shows the per-rank table.

    Wide: the config and memory panels beside the charts and recommendations, the change log
    under them all. Narrow (a side pane): the change log right under the config panel (it is
    the feedback for a config change: the step it landed at, old → new, the measured effect),
    then the memory panel, the recommendations, and the charts in the lines left above the
    footer (``fit_charts``)."""

    HORIZONTAL_BREAKPOINTS = [(0, "narrow"), (80, "wide")]  # noqa: RUF012 (Textual's attribute)

    def __init__(self) -> None:
        super().__init__()
        self._views: list[StateView] | None = None
        self._focus_title = ""

    def compose(self) -> ComposeResult:
        """Header, verdict, ranks, then the side panels and the charts, then the change log (as
        wide: ``on_resize`` arranges them for a side pane)."""
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
        """Titles on the panels' borders (with the rank, if a view came first: under load the
        first data can be drawn before the screen's mount handler runs)."""
        for widget_id, title in TITLES.items():
            focus = self._focus_title if widget_id in ONE_RANK_PANELS else ""
            self.query_one(f"#{widget_id}").border_title = title + focus
        self._views = list(self.query(StateView))

    async def on_resize(self) -> None:
        """Arrange the panels for the width; no palette key in the footer when narrow (ctrl+p
        still works; the help lists it)."""
        narrow = self.has_class("narrow")
        self.query_one(Footer).show_command_palette = not narrow
        await self._arrange(narrow)
        if narrow:
            self.call_after_refresh(self.fit_charts)

    async def _arrange(self, narrow: bool) -> None:
        """Narrow: the change log under the config panel, the recommendations over the charts;
        wide: the change log under everything, the charts over the recommendations."""
        column = self.query_one("#main-col")
        charts, advice = self.query_one(SeriesChart), self.query_one(AdvicePanel)
        if narrow and column.children[0] is charts:
            column.move_child(advice, before=charts)
        elif not narrow and column.children[0] is advice:
            column.move_child(charts, before=advice)
        old = self.query_one(ChangeLog)
        side = self.query_one("#side")
        if (old.parent is side) == narrow:
            return
        # a widget cannot change parents: a new change log, showing what the old one showed
        await old.remove()
        changes = ChangeLog(id="changes", classes="panel")
        changes.border_title = TITLES["changes"]
        if narrow:
            await side.mount(changes, after=self.query_one(ConfigPanel))
        else:
            await self.mount(changes, before=self.query_one(Footer))
        self._views = list(self.query(StateView))
        if old.state is not None:
            changes.show(old.state, old.view)

    def update_view(self, state: RunState, view: ViewOptions, charts: bool = True) -> int:
        """Show the state; the charts only when ``charts``. Returns how many widgets repainted."""
        repainted = 0
        multirank = len(state.series) > 1 or state.world_size > 1
        self.set_class(multirank, "multirank")
        focus = f" · rank {state.summary().focus_rank}" if multirank else ""
        if focus != self._focus_title:  # the panels that show one rank say which
            self._focus_title = focus
            for widget_id in ONE_RANK_PANELS:
                self.query_one(f"#{widget_id}").border_title = TITLES[widget_id] + focus
        for widget in self._views or ():
            if isinstance(widget, SeriesChart) and not charts:
                continue
            try:
                repainted += widget.show(state, view)
            except Exception as error:  # one panel that cannot be drawn leaves the others
                state.note_viewer_error(f"drawing the {widget.id}", error)
        return repainted

    def on_state_view_resized(self) -> None:
        """A panel has a new size: narrow, the lines left to the charts may have changed."""
        if self.has_class("narrow"):
            self.call_after_refresh(self.fit_charts)

    def fit_charts(self) -> bool:
        """Narrow: give the charts the lines left between the panels above them (as laid out)
        and the footer (after a layout: a panel resized, the screen too); True if that changed
        them."""
        if not self.has_class("narrow") or not self.is_mounted:
            return False
        charts = self.query_one(SeriesChart)
        above: list[Widget] = [self.query_one("#side")]
        above += [self.query_one(w) for w in (RunHeader, VerdictGauge, RanksPanel, AdvicePanel)]
        used = sum(w.outer_size.height for w in above if w.display)
        left = self.size.height - self.query_one(Footer).outer_size.height - used - 2  # border
        if left == charts.rows_left:
            return False
        charts.rows_left = left
        if charts.state is not None:
            try:
                charts.show(charts.state, charts.view)
            except Exception as error:  # as in update_view
                charts.state.note_viewer_error("drawing the charts", error)
        return True
