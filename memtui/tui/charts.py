"""Charts drawn as text: time columns over one-second buckets, stacked bars and sparklines.

Everything here is pure (Rich ``Text`` in, out; no Textual): a whole chart is one text block in
one widget, which costs a fraction of a stock ``Sparkline`` per series. Bars have a resolution of
an eighth of a row: a cell where one layer ends and the next begins draws the lower block in the
lower layer's colour on the upper layer's colour.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rich.style import Style
from rich.text import Text

BLOCKS = " ▁▂▃▄▅▆▇█"
"""Eighths of a cell, from empty to full."""
SCALES_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600)
"""Seconds per column the charts may use, the smallest that shows all the history."""

B = TypeVar("B")
C = TypeVar("C")


@dataclass(frozen=True)
class Columns(Generic[C]):
    """Buckets merged into chart columns: one value (or None: no data) per column."""

    values: list[C | None]
    seconds_per_column: int
    span_s: float
    """The time the columns cover."""


def pick_scale(history_s: float, width: int) -> int:
    """The smallest seconds-per-column that fits ``history_s`` into ``width`` columns."""
    for scale in SCALES_S:
        if scale * width >= history_s:
            return scale
    return SCALES_S[-1]


def to_columns(
    buckets: Sequence[B],
    start_of: Callable[[B], float],
    merge: Callable[[list[B]], C],
    width: int,
    end: float,
) -> Columns[C]:
    """Merge time buckets into ``width`` columns ending at ``end`` (the newest at the right)."""
    width = max(1, width)
    if not buckets:
        return Columns([None] * width, SCALES_S[0], float(width))
    end = max(end, start_of(buckets[-1]))  # the newest bucket is in the last column
    scale = pick_scale(end - start_of(buckets[0]), width)
    span = float(scale * width)
    first = math.floor(end / scale) * scale + scale - span
    groups: list[list[B]] = [[] for _ in range(width)]
    for bucket in buckets:
        index = int((start_of(bucket) - first) // scale)
        if 0 <= index < width:
            groups[index].append(bucket)
    return Columns([merge(g) if g else None for g in groups], scale, span)


def nice_ceiling(value: float) -> float:
    """The next 1, 2 or 5 times a power of ten at or above ``value``."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for factor in (1, 2, 5, 10):
        if factor * power >= value * 0.999:
            return float(factor * power)
    return float(10 * power)


Layer = tuple[float, Style]
"""One layer of a stacked bar: its top (cumulative, in the chart's units) and its colour."""


def _cell(layers: Sequence[Layer], low: float, high: float, empty: Style) -> tuple[str, Style]:
    """The character and style of one cell covering values ``low``..``high``."""

    def layer_at(value: float) -> Style | None:
        for top, style in layers:
            if top > value:
                return style
        return None

    bottom = layer_at(low + 1e-12)
    for top, _style in layers:
        if low < top < high:
            eighths = round(8 * (top - low) / (high - low))
            if eighths <= 0:  # the boundary is at the floor: the layer above starts the cell
                bottom = layer_at(top + 1e-12)  # (and may end in it: 30 ms over 3 ms of wait)
                continue
            lower = bottom or empty
            if eighths >= 8:
                return "█", lower
            upper = layer_at(top + 1e-12)
            background = upper.color if upper is not None else empty.bgcolor
            return BLOCKS[eighths], Style(color=lower.color, bgcolor=background)
    layer = layer_at((low + high) / 2)
    return ("█", layer) if layer is not None else (" ", empty)


def _least_cell(layers: Sequence[Layer], empty: Style) -> tuple[str, Style]:
    """The lowest block, in the colour of the layer that covers the most of the bar."""
    widest, below, colour = -1.0, 0.0, empty
    for top, style in layers:
        if top - below > widest:
            widest, colour = top - below, style
        below = top
    return BLOCKS[1], Style(color=colour.color, bgcolor=empty.bgcolor)


def stacked_rows(
    columns: Sequence[Sequence[Layer] | None],
    height: int,
    top: float,
    empty: Callable[[float, float], Style] | None = None,
) -> list[Text]:
    """Rows (top first) of stacked bars, one column per entry (None: no data).

    ``empty(low, high)`` styles the blank cells of the row covering ``low``..``high`` (a band's
    tint, say). A bar above zero is never blank: under an eighth of a row, it draws the lowest
    block (30 ms steps on a 500 ms axis of one row would round to nothing).
    """
    rows: list[Text] = []
    top = top if top > 0 else 1.0
    for row in range(height - 1, -1, -1):
        low, high = top * row / height, top * (row + 1) / height
        background = empty(low, high) if empty is not None else Style()
        text = Text(no_wrap=True, overflow="crop")
        run_chars: list[str] = []
        run_style: Style | None = None
        for layers in columns:
            char, style = _cell(layers, low, high, background) if layers else (" ", background)
            if not row and char == " " and layers and max(t for t, _ in layers) > 0:
                char, style = _least_cell(layers, background)
            if style != run_style and run_chars:
                text.append("".join(run_chars), run_style)
                run_chars = []
            run_style = style
            run_chars.append(char)
        if run_chars:
            text.append("".join(run_chars), run_style)
        rows.append(text)
    return rows


def sparkline(values: Iterable[float | None], top: float, style: Style | str) -> Text:
    """One row of eighth blocks (None: blank)."""
    top = top if top > 0 else 1.0
    chars = []
    for value in values:
        if value is None:
            chars.append(" ")
        else:
            level = max(0, min(8, round(8 * value / top)))
            chars.append(BLOCKS[level] if level else "▁")
    return Text("".join(chars), style=style, no_wrap=True, overflow="crop")


def legend(*items: tuple[str, Style | str]) -> Text:
    """``■ name`` chips in their colours."""
    text = Text(no_wrap=True, overflow="ellipsis")
    for index, (name, style) in enumerate(items):
        if index:
            text.append("  ")
        text.append("■ ", style)
        text.append(name)
    return text
