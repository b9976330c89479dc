"""The verdict: one gauge from STARVED through UNDERUSED and BALANCED to OOM RISK (HOST PRESSURE
marks the risk side in magenta), the state in words, and the numbers behind it."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.verdict import THRESHOLDS, UNDERUSED_END, State, Thresholds, Verdict
from memtui.runs.state import RunState, ViewOptions
from memtui.tui.palette import SEVERITY_STYLES, STATE_STYLES, Chip, chips, flow
from memtui.tui.widgets.base import StateView

ZONE_COLORS = {
    State.STARVED: "dark_orange",
    State.UNDERUSED: "deep_sky_blue1",
    State.BALANCED: "green",
    State.HOST_PRESSURE: "magenta",
}
"""Each state's colour on the gauge (OOM RISK is yellow in the edge band, red over it)."""


def zones(thresholds: Thresholds) -> tuple[tuple[float, str], ...]:
    """Gauge positions where each zone ends, and its colour: STARVED, UNDERUSED, BALANCED, the
    edge band and danger."""
    t = thresholds
    edge_end = 0.5 + 0.5 * (t.memory_danger_fraction - t.memory_edge_fraction) / max(
        1e-9, 1 - t.memory_edge_fraction
    )
    return (
        (-0.5, ZONE_COLORS[State.STARVED]),
        (UNDERUSED_END, ZONE_COLORS[State.UNDERUSED]),
        (0.5, ZONE_COLORS[State.BALANCED]),
        (edge_end, "yellow"),
        (1.01, "red"),
    )


def _zone(position: float, table: tuple[tuple[float, str], ...]) -> str:
    for end, color in table:
        if position < end:
            return color
    return table[-1][1]


def _column(position: float, width: int) -> int:
    return round((position + 1) / 2 * (width - 1))


def gauge(verdict: Verdict, width: int, thresholds: Thresholds = THRESHOLDS) -> Text:
    """The gauge's bar with its marker, and the zone labels under it (each under its zone)."""
    width = max(20, width)
    table = zones(thresholds)
    marker = _column(verdict.position, width)
    marker_color = (
        ZONE_COLORS[State.HOST_PRESSURE]
        if verdict.state is State.HOST_PRESSURE
        else _zone(verdict.position, table)
    )
    bar = Text(no_wrap=True, overflow="crop")
    for x in range(width):
        position = 2 * x / (width - 1) - 1
        if x == marker and verdict.reasons:  # no marker until there is something to weigh
            bar.append("◆", f"bold bright_white on {marker_color}")
        else:
            bar.append("━", _zone(position, table))
    right = "OOM RISK ▸"
    if verdict.state is State.HOST_PRESSURE:
        right = "HOST PRESSURE ▸" if width >= 80 else "HOST ▸"
    labels = [
        ("◂ STARVED", 0, ZONE_COLORS[State.STARVED]),
        ("UNDERUSED", _middle(-0.5, UNDERUSED_END, width, 9), ZONE_COLORS[State.UNDERUSED]),
        ("BALANCED", _middle(UNDERUSED_END, 0.5, width, 8), ZONE_COLORS[State.BALANCED]),
        (right, width - len(right), "magenta" if right.startswith("HOST") else "red"),
    ]
    line = Text(no_wrap=True, overflow="crop")
    column = 0
    for label, at, color in labels:
        at = max(at, column + (1 if column else 0))
        if at + len(label) > width:
            continue
        line.append(" " * (at - column))
        line.append(label, color)
        column = at + len(label)
    return Text("\n").join([bar, line])


def _middle(start: float, end: float, width: int, length: int) -> int:
    """The column where a label of ``length`` is centred under the zone from start to end."""
    return (_column(start, width) + _column(end, width)) // 2 - length // 2


class VerdictGauge(StateView):
    """Starvation against OOM risk at a glance, with the numbers that say why."""

    DEFAULT_CSS = "VerdictGauge { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the verdict (its numbers included) changes."""
        return state.summary().verdict

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """Gauge, state and headline, and the reasons (naming the rank on a multi-rank run)."""
        verdict = state.summary().verdict
        text = gauge(verdict, width, state.thresholds.thresholds)
        badge = Text().append(f" {verdict.state.value} ", STATE_STYLES[verdict.state])
        badge.append(" ")
        style = "bold" if verdict.severity else ""
        # broken between words, a parenthesis (``(no memory limit known)``) kept whole
        first, *asides = verdict.headline.split(" (")
        parts = [Chip(Text(word, style), " ") for word in first.split(" ")]
        parts += [Chip(Text(f"({aside}", style), " ") for aside in asides]
        for line in flow(badge, parts, width):
            text.append("\n")
            text.append_text(line)
        if verdict.reasons:
            text.append("\n")
            text.append_text(
                chips(
                    [
                        (f"{r.label} {r.value}", SEVERITY_STYLES[r.severity])
                        for r in verdict.reasons
                    ],
                    separator=" · ",
                    width=width,
                )
            )
        return text
