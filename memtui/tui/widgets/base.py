"""The base of every panel: render from the state, and only when what it shows has changed."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from memtui.runs.state import RunState, ViewOptions
from memtui.tui.compat import cached_content_height
from memtui.tui.safe import sanitize


class StateView(Widget):
    """A widget drawn from a RunState; ``show`` repaints it only when its ``key`` changed."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.state: RunState | None = None
        """The state last shown."""
        self.view = ViewOptions()
        """The viewer's options last shown (paused, read-only, keep-effective-batch)."""
        self._key: Hashable = None
        self._cache: tuple[Hashable, tuple[int, ...], RenderableType] | None = None
        self._measuring: int | None = None
        self._relaid: Hashable = None
        """The content key a layout was last asked again for (``_check_measured``)."""

    @property
    def narrow(self) -> bool:
        """True in the narrow layout (the screen's ``narrow`` class, under 80 columns)."""
        try:
            return self.screen.has_class("narrow")
        except Exception:  # not mounted on a screen yet
            return False

    @property
    def multirank(self) -> bool:
        """True when the run has several ranks (the screen's ``multirank`` class): the per-rank
        table is shown, and the other panels make room for it."""
        try:
            return self.screen.has_class("multirank")
        except Exception:  # not mounted on a screen yet
            return False

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """What the widget's content depends on; a new key means a repaint."""
        raise NotImplementedError

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """The content for ``width`` columns."""
        raise NotImplementedError

    def show(self, state: RunState, view: ViewOptions) -> bool:
        """Repaint if the content changed; True if it did."""
        key = self.key(state, view)
        if key == self._key and self.state is state:
            return False
        self._key = key
        self.state = state
        self.view = view
        # an auto-height panel is laid out again with its new content (its line count, measured
        # against a size laid out before, missed growth under load: a header and a verdict
        # drawn two lines short, the charts taking the lines), the others only repainted
        auto = self.styles.height is not None and self.styles.height.is_auto
        self.refresh(layout=bool(auto))
        return True

    def shape(self) -> tuple[int, ...]:
        """What the content's layout depends on besides the key: the width, narrow, several
        ranks (a widget that fills the height it is given adds it)."""
        return self.width_now(), self.narrow, self.multirank

    def width_now(self) -> int:
        """The columns the content is built for: the layout's while it measures the height,
        else the content size's (which catches up with the layout only once it is done)."""
        return self._measuring if self._measuring is not None else self.content_size.width

    def _check_measured(self) -> None:
        """An auto-height panel painted with content it was never measured for (Textual keeps
        its last height then, and under load a layout asked for while panels were being moved
        for the narrow layout was skipped: a verdict two lines short) asks for a layout again,
        once per content."""
        if self._measuring is not None or self._relaid == self._key:
            return
        height = self.styles.height
        if height is not None and height.is_auto and self.get_cached_height() is None:
            self._relaid = self._key
            self.call_after_refresh(self.refresh, layout=True)

    def get_cached_height(self) -> int | None:
        """The content height Textual measured since the content last changed (None: none)."""
        return cached_content_height(self)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """The height of the content built for ``width`` columns: a panel that wraps its lines
        itself, measured at the width it had before (a scrollbar shown while a replay came in),
        kept a line too few at 60 columns once the width changed."""
        self._measuring = width
        try:
            return super().get_content_height(container, viewport, width)
        finally:
            self._measuring = None

    def render(self) -> RenderableType:
        """The content, built once per key and shape."""
        if self.state is None:
            return Text("")
        self._check_measured()
        shape = self.shape()
        if self._cache is not None and self._cache[0] == self._key and self._cache[1] == shape:
            return self._cache[2]
        try:
            content = self.build(self.state, self.view, shape[0])
        except Exception as error:  # the last line of defence: count it, show it, go on
            self.state.note_viewer_error(f"drawing the {self.id or 'panel'}", error)
            content = Text(f"cannot draw this: {type(error).__name__}", "bold red")
        if isinstance(content, Text):  # what the run sent: no control character to the terminal
            sanitize(content)
        self._cache = (self._key, shape, content)
        return content
