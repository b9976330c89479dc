"""Colours and small text helpers shared by the widgets (Rich styles; no Textual)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.style import Style
from rich.text import Text

from memtui.advice.verdict import State
from memtui.core.stats import format_rate
from memtui.runs.events import Status

STATUS_STYLES: dict[Status, str] = {
    Status.CONNECTING: "bold yellow",
    Status.LIVE: "bold green",
    Status.QUIET: "bold yellow",
    Status.ENDED: "bold magenta",
    Status.EXITED: "bold red",
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


@dataclass(frozen=True)
class Chip:
    """One part of an entry: kept whole on a line (broken between words only when it is too long
    for a line of its own)."""

    text: Text
    before: str = "  "
    """What separates it from the chip before it on the same line (nothing at a line's start)."""
    optional: bool = False
    """Narrow: left out when it does not fit on the line where it would go (a parenthetical)."""


def _words(text: Text, first: int, rest: int) -> list[Text]:
    """``text`` broken between words: the first piece at most ``first`` cells (empty when not
    even a word fits), the others at most ``rest`` (a word longer than that broken after it)."""
    plain = text.plain
    offsets: list[int] = []
    start, room = 0, first
    while len(plain) - start > room:
        cut = plain.rfind(" ", start, start + room + 1)
        if cut <= start:  # no word fits: an empty first piece, else a word broken
            cut = 0 if not offsets and first < rest else start + room
        offsets.append(cut)
        start = cut + (plain[cut : cut + 1] == " ")
        room = rest
    pieces = text.divide(offsets)
    return [piece[1:] if i and piece.plain.startswith(" ") else piece
            for i, piece in enumerate(pieces)]  # fmt: skip


def flow(head: Text, chips: Sequence[Chip], width: int = 0, indent: str = "") -> list[Text]:
    """An entry: ``head`` then its chips, on one line when ``width`` is 0, else on lines of at
    most ``width`` cells broken between chips (never inside one, except between the words of a
    chip too long for a line of its own), the lines after the first starting with ``indent``; an
    optional chip that does not fit where it would go is left out."""
    line = Text().append_text(head)  # its style on its own text only, not on the chips
    lines: list[Text] = []
    fresh = True  # nothing on the line yet but its head or indent
    room = max(1, width - len(indent))
    for chip in chips:
        gap = "" if fresh else chip.before
        left = width - line.cell_len - len(gap)
        if not width or chip.text.cell_len <= left:
            line.append(gap)
            line.append_text(chip.text)
            fresh = False
            continue
        if chip.optional:
            continue
        if chip.text.cell_len <= room:  # on a line of its own
            lines.append(line)
            line = Text(indent).append_text(chip.text)
            fresh = False
            continue
        pieces = _words(chip.text, max(0, left), room)  # too long for a line: by its words
        if pieces[0].plain:  # its first words where it would go
            line.append(gap)
            line.append_text(pieces[0])
        for piece in pieces[1:]:
            if line.plain.strip():
                lines.append(line)
            line = Text(indent).append_text(piece)
        fresh = False
    lines.append(line)
    return lines


def counted(count: int, noun: str) -> str:
    """``1 bad value``, ``3 bad values``."""
    return f"{count} {noun}" + ("" if count == 1 else "s")


def rate(value: float) -> str:
    """A rate with sensible precision: ``0.42``, ``9.4``, ``1,024`` (``-`` for infinity or NaN)."""
    return format_rate(value)
