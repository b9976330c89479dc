"""The recommendations panel: memtui's ranked options on the run's live numbers (the same
function as ``memtui status --json``), each with its expected memory and speed change and the
resulting effective batch; ``o`` queues the top one that memtui can apply, ``O`` picks one."""

from __future__ import annotations

import re
from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.autopilot import describe_state
from memtui.advice.recommend import Recommendation
from memtui.advice.verdict import State
from memtui.core.stats import format_bytes
from memtui.runs.state import RunState, ViewOptions
from memtui.tui.palette import Chip, chips, flow
from memtui.tui.widgets.base import StateView

SHOWN = 2
"""Recommendations listed (the rest are counted; the narrow layout lists one)."""


def _signed_bytes(value: int) -> str:
    if value == 0:
        return "±0"
    return ("+" if value > 0 else "-") + format_bytes(abs(value))


def expected(option: Recommendation) -> list[tuple[str, str]]:
    """The option's expected effects as (text, style) chips."""
    parts: list[tuple[str, str]] = []
    if option.memory_delta_bytes is not None:
        memory = f"memory {_signed_bytes(option.memory_delta_bytes)}"
        if option.predicted_peak_bytes is not None:
            memory += f" (peak {format_bytes(option.predicted_peak_bytes)})"
        parts.append((memory, "yellow" if option.memory_delta_bytes > 0 else "green"))
    else:
        parts.append(("memory ?", "dim"))
    if option.host_delta_bytes:
        parts.append((f"host {_signed_bytes(option.host_delta_bytes)}", "dim"))
    if option.speed_delta is not None:
        if not round(option.speed_delta, 2):  # "+0%" reads as a gain
            parts.append(("speed unchanged", "dim"))
        else:
            style = "green" if option.speed_delta > 0 else "yellow"
            parts.append((f"speed {option.speed_delta:+.0%}", style))
    else:
        parts.append(("speed: measured once applied", "dim"))
    if option.effective_batch is not None:
        parts.append((f"eff. batch {option.effective_batch}", ""))
    return parts


def title_chips(title: str, width: int, style: str = "") -> list[Chip]:
    """The title in parts, to be broken only after a comma or a colon or before a parenthesis
    (``bigger micro-batch:`` ``batch_size 16 -> 32,`` ``grad_accum 2 -> 1``); longer than
    ``width``, a knob option goes without its name when that makes it fit (its changes say it:
    ``batch_size 16 -> 32, grad_accum 2 -> 1``)."""
    _name, colon, changes = title.partition(": ")
    if colon and len(title) > width >= len(changes) and "->" in changes:
        title = changes
    parts = re.split(r"(?<=[,:]) | (?=\()", title)
    return [Chip(Text(part, style), " ") for part in parts if part]


def top_applicable(options: list[Recommendation]) -> Recommendation | None:
    """The best option memtui can queue itself (None: none); no option repeats a pending change
    (``advice.recommend``)."""
    return next((o for o in options if o.applicable), None)


def advice_lines(
    state: RunState, view: ViewOptions, width: int, narrow: bool, multirank: bool = False
) -> list[Text]:
    """Each option: its rank and title (marked when it needs a restart or a code change), then
    its expected effects; the reason behind it in the wide layout."""
    advice = state.summary().advice
    if advice is None:
        return [Text("waiting for the run's config", "dim")]
    options = advice.recommendations
    if not options:
        if advice.held_for_pending:  # an option moving a pending knob waits for it to land
            return [Text("nothing more to recommend until the pending changes land", "dim")]
        if state.summary().verdict.state in (State.BALANCED, State.NO_DATA):
            return [Text("nothing to recommend now: no threshold is near", "dim")]
        return [Text("nothing to recommend now: no change is predicted to help measurably", "dim")]
    top = top_applicable(options)
    lines: list[Text] = []
    shown = 1 if narrow or multirank else SHOWN
    for rank, option in enumerate(options[:shown], start=1):
        tag: tuple[str, str] | None = None
        if option.needs_restart:
            tag = ("advice only: restart or code change", "dim")
        elif not option.applicable:
            tag = ("advice only", "dim")
        elif option is top and not view.readonly:
            tag = ("o: queue it", "bold cyan")
        if narrow and not multirank:  # a side pane: wrapped between parts, never cut
            room = width - 3 - (len(tag[0]) + 2 if tag else 0)
            parts = title_chips(option.title, room, "bold" if option.applicable else "")
            if tag is not None:
                parts.append(Chip(Text(*tag)))
            lines += flow(Text(f"{rank}. ", "bold"), parts, width, "   ")
        else:
            line = Text(f"{rank}. ", "bold")
            line.append(option.title, "bold" if option.applicable else "")
            if tag is not None:
                line.append(f"  {tag[0]}", tag[1])
            if multirank:  # one line beside the per-rank table (O lists them in full)
                for text, style in expected(option):
                    line.append(" · ", "dim")
                    line.append(text, style)
                lines.append(line)
                continue
            lines.append(line)
        effects = chips(expected(option), separator=" · ", width=max(10, width - 3))
        for part in effects.split("\n"):
            lines.append(Text("   ").append_text(part))
    if len(options) > shown and not multirank:  # beside the per-rank table: no room
        more = len(options) - shown
        hint = f"+{more} more" + ("" if view.readonly else " (O lists them)")
        lines.append(Text(hint, "dim"))
    return lines


class AdvicePanel(StateView):
    """Ranked recommendations with their expected effects."""

    DEFAULT_CSS = "AdvicePanel { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the recommendations (made at the summary's rate) change."""
        advice = state.summary().advice
        options = tuple(advice.recommendations) if advice else None
        return options, view.readonly, state.control_version

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """The autopilot's state while it is on or paused, then the options, best first."""
        lines = advice_lines(state, view, width, self.narrow, self.multirank)
        pilot = state.control.autopilot if state.control is not None else None
        if pilot is not None and pilot.mode != "off":
            style = "bold cyan" if pilot.mode == "on" else "bold yellow"
            lines.insert(0, Text(describe_state(pilot), style, overflow="fold"))
        return Text("\n").join(lines)
