"""The main screen: header, verdict, the ranks, charts, memory, config, recommendations and
change log (arranged for a wide terminal or a side pane)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widget import MountError
from textual.widgets import Footer

from memtui.runs.state import RunState, ViewOptions
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
NARROW_LEFT_OUT = frozenset({"A", "o", "g"})
"""Keys the footer leaves out in a side pane: 60 columns hold the others only (the ``?`` help
lists every key, and the recommendations panel says ``o: queue it``)."""
ROOMY_FOOTER = 110
"""The fewest columns whose footer holds ``A`` (the autopilot) beside the other keys and the
palette's; narrower, the ``?`` help lists it."""
ROOMY_ONLY = frozenset({"A"})
"""Keys the footer shows only from ``ROOMY_FOOTER`` columns."""
ONE_RANK_PANELS = ("memory", "charts")
"""The panels that show one rank: with several ranks, their titles say which."""


class KeysFooter(Footer):
    """The footer, without the keys it has no room for: in a side pane (``NARROW_LEFT_OUT``),
    and under ``ROOMY_FOOTER`` columns (``ROOMY_ONLY``)."""

    def compose(self) -> ComposeResult:
        """Textual's footer keys, those it has no room for at this width dropped."""
        narrow = self.screen.has_class("narrow")
        roomy = self.screen.size.width >= ROOMY_FOOTER
        for widget in super().compose():
            key = getattr(widget, "key", None)
            if not ((narrow and key in NARROW_LEFT_OUT) or (not roomy and key in ROOMY_ONLY)):
                yield widget


class MainScreen(Screen[None]):
    """Everything at once; the ``narrow`` class (under 80 columns) stacks the panels, and the
    ``multirank`` class (a run of several ranks) shows the per-rank table.

    Wide: the config and memory panels beside the charts and recommendations, the change log
    under them all. Narrow (a side pane): the change log right under the config panel (it is
    the feedback for a config change: the step it landed at, old → new, the measured effect),
    then the memory panel, the recommendations, and the charts in the lines left above the
    footer (the stylesheet gives them the rest of the height)."""

    HORIZONTAL_BREAKPOINTS = [(0, "narrow"), (80, "wide")]  # noqa: RUF012 (Textual's attribute)

    def __init__(self) -> None:
        super().__init__()
        self._views: list[StateView] | None = None
        self._focus_title = ""
        self._roomy: bool | None = None
        """Whether the footer was last composed with ``ROOMY_ONLY``'s keys (None: not yet)."""

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
        yield KeysFooter()

    def on_mount(self) -> None:
        """Titles on the panels' borders (with the rank, if a view came first: under load the
        first data can be drawn before the screen's mount handler runs)."""
        for widget_id, title in TITLES.items():
            focus = self._focus_title if widget_id in ONE_RANK_PANELS else ""
            self.query_one(f"#{widget_id}").border_title = title + focus
        self._views = list(self.query(StateView))

    async def on_resize(self) -> None:
        """Arrange the panels for the width; narrow, no palette key in the footer (ctrl+p still
        works; the help lists it), nor o and g."""
        if not self.is_attached:  # the app is closing: a late resize finds the screen gone
            return
        narrow = self.has_class("narrow")
        roomy = self.size.width >= ROOMY_FOOTER
        footer = self.query_one(KeysFooter)
        if footer.show_command_palette == narrow or roomy != self._roomy:  # a breakpoint crossed
            footer.show_command_palette = not narrow
            self._roomy = roomy
            footer.refresh(recompose=True)  # (composed in its own context: Textual binds data)
        await self._arrange(narrow)

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
        try:
            if narrow:
                await side.mount(changes, after=self.query_one(ConfigPanel))
            else:
                await self.mount(changes, before=self.query_one(Footer))
        except (MountError, NoMatches):  # the screen was taken down meanwhile (the app quits)
            return
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
