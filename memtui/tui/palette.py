"""Colours and small text helpers shared by the widgets (Rich styles; no Textual)."""

from __future__ import annotations

import math

from rich.style import Style
from rich.text import Text

from memtui.advice.verdict import State
from memtui.tui.state import Status

STATUS_STYLES: dict[Status, str] = {
    Status.CONNECTING: "bold yellow",
    Status.LIVE: "bold green",
    Status.QUIET: "bold yellow",
    Status.ENDED: "bold magenta",
    Status.DISCONNECTED: "bold red",
}
"""How each connection status is shown."""

STATE_STYLES: dict[State, str] = {
    State.NO_DATA: "bold white on grey30",
    State.STARVED: "bold black on dark_orange",
    State.BALANCED: "bold black on green",
    State.UNDERUSED: "bold black on deep_sky_blue1",
    State.OOM_RISK: "bold white on red3",
    State.HOST_PRESSURE: "bold white on magenta",
}
"""The verdict's word, as a badge."""

SEVERITY_STYLES = ("", "bold yellow", "bold red")
"""A reason's number by severity: fine, at the edge, over."""

DATA_WAIT = Style(color="dark_orange")
COMPUTE = Style(color="green")
ALLOCATED = Style(color="dodger_blue1")
RESERVED = Style(color="steel_blue")
PEAK = Style(color="grey50")
BEYOND_TORCH = Style(color="medium_purple")
RAM = Style(color="cyan")
SWAP = Style(color="magenta")
EDGE_BAND = Style(bgcolor="#3a3300")
DANGER_BAND = Style(bgcolor="#3d0a0a")


def chips(parts: list[tuple[str, str]], separator: str = "  ", width: int = 0) -> Text:
    """A line of (text, style) chips, broken between chips (never inside one) to fit ``width``."""
    text = Text()
    column = 0
    for part, style in parts:
        if not part:
            continue
        if column and width and column + len(separator) + len(part) > width:
            text.append("\n")
            column = 0
        elif column:
            text.append(separator)
            column += len(separator)
        text.append(part, style)
        column += len(part)
    return text


def counted(count: int, noun: str) -> str:
    """``1 bad value``, ``3 bad values``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def rate(value: float) -> str:
    """A rate with sensible precision: ``0.42``, ``9.4``, ``1,024`` (``-`` for infinity or NaN)."""
    if not math.isfinite(value):
        return "-"
    if value < 1:
        return f"{value:.2f}"
    if value < 100:
        return f"{value:.1f}"
    return f"{value:,.0f}"
