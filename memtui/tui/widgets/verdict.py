"""The verdict: one gauge from STARVED through BALANCED to OOM RISK, the state, and its numbers."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.verdict import THRESHOLDS, Verdict
from memtui.tui.palette import SEVERITY_STYLES, STATE_STYLES, chips
from memtui.tui.state import RunState, ViewOptions
from memtui.tui.widgets.base import StateView

_ZONES = (
    (-0.5, "dark_orange"),  # starved
    (0.5, "green"),  # balanced
    (
        0.5
        + 0.5
        * (THRESHOLDS.memory_danger_fraction - THRESHOLDS.memory_edge_fraction)
        / (1 - THRESHOLDS.memory_edge_fraction),
        "yellow",
    ),  # the 85-90% edge band
    (1.01, "red"),  # over 90%
)
"""Gauge positions where each zone ends, and its colour."""


def _zone(position: float) -> str:
    for end, color in _ZONES:
        if position < end:
            return color
    return _ZONES[-1][1]


def gauge(verdict: Verdict, width: int) -> Text:
    """The gauge's bar with its marker, and the zone labels under it."""
    width = max(20, width)
    marker = round((verdict.position + 1) / 2 * (width - 1))
    bar = Text(no_wrap=True, overflow="crop")
    for x in range(width):
        position = 2 * x / (width - 1) - 1
        if x == marker and verdict.reasons:  # no marker until there is something to weigh
            bar.append("◆", f"bold bright_white on {_zone(position)}")
        else:
            bar.append("━", _zone(position))
    labels = Text(no_wrap=True, overflow="crop")
    left, middle, right = "◂ STARVED", "BALANCED", "OOM RISK ▸"
    gap = max(1, (width - len(middle)) // 2 - len(left))
    labels.append(left, "dark_orange")
    labels.append(" " * gap)
    labels.append(middle, "green")
    labels.append(" " * max(1, width - len(left) - gap - len(middle) - len(right)))
    labels.append(right, "red")
    return Text("\n").join([bar, labels])


class VerdictGauge(StateView):
    """Starvation against OOM risk at a glance, with the numbers that say why."""

    DEFAULT_CSS = "VerdictGauge { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the verdict (its numbers included) changes."""
        return state.summary().verdict

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """Gauge, state and headline, and the reasons (naming the rank on a multi-rank run)."""
        verdict = state.summary().verdict
        text = gauge(verdict, width)
        text.append("\n")
        text.append(f" {verdict.state.value} ", STATE_STYLES[verdict.state])
        text.append(" ")
        text.append(verdict.headline, "bold" if verdict.severity else "")
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
