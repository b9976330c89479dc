"""The per-rank table: every rank's step, speed and memory, the worst first, the outliers named.

One line of medians over all ranks, then one row per rank sorted by pressure (silent ranks
first, then how close each is to a threshold), with a flag column that calls out the rank
nearest OOM, stragglers, silent ranks and ranks whose config differs. Rows fold: a side pane
shows the worst ``ROWS_PER_COLUMN`` and sums up the rest in one line ("+4 more: ..."); a full
width shows two columns of rows. Hidden on a single-rank run (the screen's ``multirank`` class).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.core.stats import format_bytes, format_duration
from memtui.runs.state import RankSummary, RunState, Summary, ViewOptions
from memtui.tui.palette import SEVERITY_STYLES, chips
from memtui.tui.widgets.base import StateView

ROWS_PER_COLUMN = 4
"""Rows of ranks per column before the rest is summed up in one line."""
COLUMN_GAP = 2
FLAG_WIDTH = 15
ROW_WIDTH = 4 + 1 + 7 + 1 + 9 + 1 + 4 + 1 + 4 + 1 + 8 + 1 + FLAG_WIDTH
"""rank, step, step time, wait, peak, host memory and the flag, space-separated."""
STRAGGLER_STYLE = "bold dark_orange"
SILENT_STYLE = "bold red"


def band_style(fraction: float, thresholds: Thresholds = THRESHOLDS) -> str:
    """A peak memory fraction's style: plain, edge band, danger (the bands in ``thresholds``)."""
    if fraction >= thresholds.memory_danger_fraction:
        return SEVERITY_STYLES[2]
    if fraction >= thresholds.memory_edge_fraction:
        return SEVERITY_STYLES[1]
    return ""


def rank_flag(rank: RankSummary, thresholds: Thresholds = THRESHOLDS) -> tuple[str, str]:
    """The most important thing to say about one rank, and its style ("" when nothing)."""
    if rank.silent:
        age = f"no data {format_duration(rank.age_s)}" if rank.reported else "no data yet"
        return age, SILENT_STYLE
    peak = rank.memory.peak_used_fraction if rank.memory is not None else 0.0
    if rank.nearest_oom and peak >= thresholds.memory_edge_fraction:
        return "nearest OOM", band_style(peak, thresholds)
    if rank.straggler:
        return rank.straggler, STRAGGLER_STYLE
    if rank.config_differs:
        return "config differs", "bold yellow"
    if rank.nearest_oom:
        return "nearest OOM", ""
    return "", ""


def heading() -> Text:
    """The column names, aligned with ``rank_row``."""
    return Text(
        f"{'rank':>4} {'step':>7} {'step time':>9} {'wait':>4} {'peak':>4} {'host mem':>8} "
        f"{'':<{FLAG_WIDTH}}",
        style="dim",
    )


def rank_row(rank: RankSummary, focus: int, thresholds: Thresholds = THRESHOLDS) -> Text:
    """One rank's row: the cells that make it an outlier are coloured (by ``thresholds``)."""
    row = Text(no_wrap=True, overflow="crop", style="dim" if rank.silent else "")
    row.append(f"{rank.rank:>4} ", "bold reverse" if rank.rank == focus else "bold")
    behind = rank.straggler.endswith("behind")
    step = f"{rank.last_step:>7}" if rank.reported else f"{'-':>7}"
    row.append(step, STRAGGLER_STYLE if behind else "")
    steps = rank.steps
    slow = rank.straggler.endswith("x")
    step_time = format_duration(steps.step_time_s) if steps else "-"
    row.append(f" {step_time:>9}", STRAGGLER_STYLE if slow else "")
    # a wait not measured (no batch memtui timed) is "-", as the headline says it, never 0%
    wait = steps.data_wait_fraction if steps and steps.data_wait_measured else None
    waits = rank.straggler.endswith("data") or (
        wait is not None and wait >= thresholds.starved_wait_fraction
    )
    row.append(
        f" {f'{wait:.0%}' if wait is not None else '-':>4}", STRAGGLER_STYLE if waits else ""
    )
    peak = rank.memory.peak_used_fraction if rank.memory is not None else None
    row.append(
        f" {f'{peak:.0%}' if peak is not None else '-':>4}", band_style(peak or 0.0, thresholds)
    )
    host = format_bytes(rank.tree.total_bytes) if rank.tree is not None else "-"
    row.append(f" {host:>8} ")
    flag, style = rank_flag(rank, thresholds)
    row.append(f"{flag:<{FLAG_WIDTH}}"[:FLAG_WIDTH], style)
    return row


def aggregate_line(summary: Summary, width: int, thresholds: Thresholds = THRESHOLDS) -> Text:
    """All ranks in one line: how many, the medians, the range of peaks."""
    ranks = summary.ranks
    parts: list[tuple[str, str]] = [(f"{len(ranks)} ranks", "bold")]
    if summary.median_step_s is not None:
        parts.append((f"median {format_duration(summary.median_step_s)}/step", ""))
    if summary.median_wait_fraction is not None:
        parts.append((f"wait {summary.median_wait_fraction:.0%}", ""))
    peaks = [r.memory.peak_used_fraction for r in ranks if r.memory and r.memory.capacity_bytes]
    if peaks:
        low, high = min(peaks), max(peaks)
        low_pct, high_pct = f"{100 * low:.0f}", f"{100 * high:.0f}"
        text = f"peak {high_pct}%" if low_pct == high_pct else f"peak {low_pct}-{high_pct}%"
        parts.append((text, band_style(high, thresholds)))
    by_rss = [r.rank for r in ranks if r.tree is not None and r.tree.measure == "RSS"]
    if by_rss:  # their USS not read yet: the pages they share with the main process count again
        names = ", ".join(map(str, by_rss[:3])) + ("…" if len(by_rss) > 3 else "")
        plural = "s" if len(by_rss) > 1 else ""
        parts.append((f"workers by RSS on rank{plural} {names}", "dim"))
    return chips(parts, separator=" · ", width=width)  # silent ranks: the header counts them


def rest_line(
    hidden: Sequence[RankSummary], median_step_s: float | None, thresholds: Thresholds = THRESHOLDS
) -> Text:
    """The ranks that did not fit, summed up: how far their numbers spread."""
    flagged = sum(1 for r in hidden if rank_flag(r, thresholds)[0])
    text = Text(f"+{len(hidden)} more", style="bold")
    if flagged:
        text.append(f" ({flagged} flagged)", "bold yellow")
    timed = [r.steps for r in hidden if r.steps is not None]
    parts = []
    if timed and median_step_s:
        spread = max(abs(s.step_time_s / median_step_s - 1) for s in timed)
        parts.append(f"step time ±{spread:.0%} of median")
        waits = [s.data_wait_fraction for s in timed if s.data_wait_measured]
        if waits:
            parts.append(f"wait ≤ {max(waits):.0%}")
    peaks = [r.memory.peak_used_fraction for r in hidden if r.memory and r.memory.capacity_bytes]
    if peaks:
        parts.append(f"peak ≤ {max(peaks):.0%}")
    if parts:
        text.append(": " + ", ".join(parts), "dim")
    elif not timed:
        text.append(": no data yet", "dim")
    return text


def rank_table(summary: Summary, width: int, thresholds: Thresholds = THRESHOLDS) -> Text:
    """The aggregate line, then the rows (in columns when ``width`` allows), then the rest; the
    memory bands and the starved share coloured by ``thresholds`` (the config file's)."""
    ranks = summary.worst_first
    columns = max(1, min(2, (width + COLUMN_GAP) // (ROW_WIDTH + COLUMN_GAP)))
    capacity = columns * ROWS_PER_COLUMN
    shown = ranks if len(ranks) <= capacity else ranks[:capacity]
    rows = -(-len(shown) // columns)
    columns = -(-len(shown) // rows) if rows else 1
    lines = [aggregate_line(summary, width, thresholds)]
    gap = " " * COLUMN_GAP
    header = Text(gap).join([heading()] * columns)
    header.rstrip()
    lines.append(header)
    for index in range(rows):
        cells = [shown[c * rows + index] for c in range(columns) if c * rows + index < len(shown)]
        line = Text(gap, no_wrap=True, overflow="crop").join(
            rank_row(r, summary.focus_rank, thresholds) for r in cells
        )
        line.rstrip()
        lines.append(line)
    if len(ranks) > len(shown):
        lines.append(rest_line(ranks[len(shown) :], summary.median_step_s, thresholds))
    return Text("\n").join(lines)


class RanksPanel(StateView):
    """Every rank: step, step time, data wait, peak memory and host memory (the main process's
    RSS and its loader workers' own memory), the worst first."""

    DEFAULT_CSS = "RanksPanel { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the summaries are made again (new data, or another second passed)."""
        return state.summary().serial

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """The table for ``width`` columns."""
        return rank_table(state.summary(), width, state.thresholds.thresholds)
