"""The memory panel: where the device's memory goes (or, on CPU runs, RSS against the limit)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.breakdown import Breakdown, breakdown
from memtui.advice.verdict import Thresholds
from memtui.stats import MemoryStats, format_bytes, ram_fraction
from memtui.tui.palette import SEVERITY_STYLES, chips
from memtui.tui.state import RunState, ViewOptions
from memtui.tui.widgets.base import StateView


class Row(NamedTuple):
    """One line of the panel."""

    label: str
    value: str
    share: str = ""
    """The value as a share of capacity (or a change)."""
    note: str = ""
    """What the value means: the secondary column, dropped when narrow."""
    style: str = ""
    secondary: bool = False
    """A whole line dropped when narrow."""
    detail: bool = False
    """A whole line dropped on a multi-rank run (to make room for the per-rank table)."""
    compact: bool = False
    """A whole line dropped on a multi-rank run in the narrow layout."""
    in_bar: bool = False
    """A whole line dropped when the breakdown bar (which shows the same) is drawn."""
    in_bar_compact: bool = False
    """The same on a multi-rank run (room for the per-rank table)."""
    in_bar_tight: bool = False
    """The same on a multi-rank run in the narrow layout (the verdict says it too)."""


def _share(value: int, capacity: int) -> str:
    return f"{value / capacity:.0%}" if capacity else ""


def _band_style(fraction: float, thresholds: Thresholds) -> str:
    if fraction >= thresholds.memory_danger_fraction:
        return SEVERITY_STYLES[2]
    if fraction >= thresholds.memory_edge_fraction:
        return SEVERITY_STYLES[1]
    return ""


PART_STYLES: dict[str, str] = {
    "parameters": "dodger_blue1",
    "gradients": "slate_blue1",
    "optimizer": "orchid",
    "other steady": "grey62",
    "activations": "green3",
    "runtime and workers": "grey50",
    "fragmentation": "yellow",
    "beyond torch": "medium_purple",
    "free": "grey30",
}
"""Each part of the breakdown bar, by colour."""
PART_LABELS = {"runtime and workers": "runtime+workers"}
"""Shorter names in the legend."""
SHORT_LABELS = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "other steady": "steady",
    "activations": "activ.",
    "runtime and workers": "runtime",
    "fragmentation": "frag.",
    "beyond torch": "beyond",
}
"""Shortest names, in a side pane or beside the per-rank table."""


def bar_cells(breakdown: Breakdown, width: int) -> list[tuple[str, int]]:
    """Each part's cells in a bar of ``width`` (largest remainders; a part with bytes gets at
    least one cell when there is room)."""
    total = max(1, breakdown.capacity_bytes, sum(p.bytes for p in breakdown.parts))
    exact = [(p.name, p.bytes * width / total) for p in breakdown.parts]
    cells = {name: int(share) for name, share in exact}
    for name, share in exact:
        if share > 0 and cells[name] == 0 and name != "free":
            cells[name] = 1
    spare = width - sum(cells.values())
    by_remainder = sorted(exact, key=lambda item: item[1] - int(item[1]), reverse=True)
    for name, _share in by_remainder:
        if spare <= 0:
            break
        cells[name] += 1
        spare -= 1
    while spare < 0:  # the minimum cells overshot: take from the widest part
        widest = max(cells, key=lambda n: cells[n])
        cells[widest] -= 1
        spare += 1
    return [(p.name, cells[p.name]) for p in breakdown.parts]


def breakdown_lines(
    breakdown: Breakdown,
    width: int,
    title: str = "",
    compact: bool = False,
    steady_known: bool = True,
) -> list[Text]:
    """The stacked bar (free memory dotted) and its legend with the numbers, wrapped to fit
    (``compact``: short names, no shares). Without the exact parts and a model
    (``steady_known`` False) the "activations" part is all that was allocated, and says so."""
    width = max(10, width)
    bar = Text(no_wrap=True, overflow="crop")
    for name, cells in bar_cells(breakdown, width):
        bar.append(("░" if name == "free" else "█") * cells, PART_STYLES.get(name, "white"))
    parts = []
    if title:
        parts.append((title, "dim"))
    for part in breakdown.parts:
        if part.bytes <= 0 and part.name != "free":
            continue
        style = PART_STYLES.get(part.name, "")
        if part.name == "activations" and not steady_known:
            parts.append(
                (f"■ {'alloc.' if compact else 'allocated'} {format_bytes(part.bytes)}", style)
            )
            continue
        if compact:
            label = SHORT_LABELS.get(part.name, part.name)
            parts.append((f"■ {label} {format_bytes(part.bytes)}", style))
            continue
        label = PART_LABELS.get(part.name, part.name)
        share = part.bytes / breakdown.capacity_bytes if breakdown.capacity_bytes else 0.0
        parts.append((f"■ {label} {format_bytes(part.bytes)} {share:.0%}", style))
    legend = chips(parts, separator="  ", width=width)
    return [bar, *legend.split("\n")]


def cuda_rows(state: RunState, memory: MemoryStats) -> list[Row]:
    """The device's memory, from capacity down to what torch does not see."""
    capacity = memory.capacity_bytes
    unallocated = max(0, memory.reserved_bytes - memory.current_bytes)
    beyond = memory.beyond_torch_bytes
    series = state.series.get(state.summary().focus_rank)
    newest = series.device[-1] if series and series.device else None
    device = state.info.device if state.info else ""
    if newest is not None and newest.name and len(state.series) > 1:  # the rank shown's device
        device = f"{newest.kind}:{newest.index} {newest.name}"
    rows = [
        Row(
            "capacity",
            format_bytes(capacity),
            "",
            device,
            compact=True,  # the verdict's reason says "of <capacity>"
            in_bar_compact=True,
        ),
        Row(
            "peak in use",
            format_bytes(memory.peak_used_bytes),
            _share(memory.peak_used_bytes, capacity),
            "peak reserved + beyond torch",
            _band_style(memory.peak_used_fraction, state.thresholds.thresholds),
            in_bar_tight=True,
        ),
        Row(
            "peak reserved",
            format_bytes(memory.peak_bytes),
            _share(memory.peak_bytes, capacity),
            detail=True,
            in_bar=True,
        ),
        Row(
            "peak allocated",
            format_bytes(memory.peak_allocated_bytes),
            _share(memory.peak_allocated_bytes, capacity),
            detail=True,
            in_bar=True,
        ),
        Row(
            "reserved unalloc.",
            format_bytes(unallocated),
            _share(unallocated, capacity),
            f"fragmentation (split blocks {format_bytes(memory.fragmentation_bytes)})",
            "yellow" if capacity and unallocated > 0.1 * capacity else "",
            in_bar_compact=True,
        ),
        Row(
            "beyond torch",
            format_bytes(beyond) if beyond is not None else "no NVML",
            _share(beyond, capacity) if beyond is not None else "",
            "CUDA context, NCCL, other processes",
            in_bar_compact=True,
        ),
    ]
    others = newest.other_processes if newest is not None else []
    if others:
        names = ", ".join(f"{p.name}[{p.pid}] {format_bytes(p.used_bytes)}" for p in others[:3])
        total = sum(p.used_bytes for p in others)
        rows.append(Row("other processes", format_bytes(total), str(len(others)), names, "", True))
    if memory.alloc_retries or memory.ooms:
        rows.append(
            Row(
                "retries / OOMs",
                f"{memory.alloc_retries} / {memory.ooms}",
                "",
                "the allocator freed its cache to retry",
                "bold red" if memory.ooms else "yellow",
            )
        )
    return rows + host_rows(state, secondary=True)


def cpu_rows(state: RunState, memory: MemoryStats) -> list[Row]:
    """On CPU runs the host is the device: main RSS plus the workers' own memory against the limit."""
    capacity = memory.capacity_bytes
    rows = [
        Row("limit", format_bytes(capacity), "", "cgroup limit, else total RAM", in_bar=True),
        Row(
            "peak RSS",
            format_bytes(memory.peak_bytes),
            _share(memory.peak_bytes, capacity),
            "main process + loader workers",
            _band_style(memory.peak_used_fraction, state.thresholds.thresholds),
        ),
    ]
    series = state.series.get(state.summary().focus_rank)
    host = series.host if series is not None and series.host else state.summary().host
    note = f"main {format_bytes(host.main_rss_bytes)} + {host.workers} workers" if host else ""
    rows.append(
        Row(
            "RSS now",
            format_bytes(memory.current_bytes),
            _share(memory.current_bytes, capacity),
            note,
        )
    )
    return rows + host_rows(state, secondary=True)


def host_rows(state: RunState, secondary: bool) -> list[Row]:
    """Host RAM and swap (OOM risk on the host side)."""
    summary = state.summary()
    host = summary.host
    if host is None:
        return []
    fraction = ram_fraction(host)
    growth = summary.swap_growth_bytes
    return [
        Row(
            "host RAM",
            format_bytes(host.ram_used_bytes),
            f"{fraction:.0%}",
            f"of {format_bytes(host.ram_total_bytes)}",
            "bold yellow" if fraction >= state.thresholds.thresholds.host_ram_fraction else "",
            secondary,
        ),
        Row(
            "swap",
            format_bytes(host.swap_used_bytes) if host.swap_total_bytes else "none",
            f"+{format_bytes(growth)}" if growth > 0 else "",
            f"of {format_bytes(host.swap_total_bytes)}" if host.swap_total_bytes else "",
            "yellow" if growth > 0 else "",
            secondary,
        ),
    ]


def focus_breakdown(state: RunState) -> Breakdown | None:
    """The breakdown of the rank shown: the control rank's is the summary's (``memtui status
    --json``'s); another rank's is made the same way from its own memory (the ranks hold the
    same model and optimizer, so the exact parts are the control rank's)."""
    summary = state.summary()
    control = state.control
    control_rank = state.info.rank if state.info is not None else 0
    if summary.focus_rank == control_rank or control is None or summary.memory is None:
        return summary.advice.breakdown if summary.advice is not None else None
    return breakdown(summary.memory, control.static, control.model)


class MemoryPanel(StateView):
    """Capacity, peaks, fragmentation and memory beyond torch; RSS against the limit on CPU.

    On a multi-rank run it shows the rank the verdict is about (named in the border title)."""

    DEFAULT_CSS = "MemoryPanel { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the focused rank's memory or the host changes."""
        summary = state.summary()
        series = state.series.get(summary.focus_rank)
        others = series.device[-1].other_processes if series and series.device else ()
        control = state.control
        model = (control.static, control.model) if control is not None else None
        return summary.memory, summary.host, summary.focus_rank, tuple(others), model

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """Aligned lines; the note column and secondary lines are dropped when narrow."""
        memory = state.summary().memory
        if memory is None:
            return Text("no memory samples yet", style="dim")
        wide = not self.narrow
        multirank = self.multirank
        rows = cpu_rows(state, memory) if memory.kind == "cpu" else cuda_rows(state, memory)
        lines: list[Text] = []
        split = focus_breakdown(state)
        bar = split is not None and split.capacity_bytes > 0
        if split is not None and bar:
            control = state.control
            known = control is not None and (
                control.static is not None or control.model is not None
            )
            lines += breakdown_lines(
                split, width, compact=multirank or not wide, steady_known=known
            )
        for row in rows:
            if (row.secondary and not wide) or (row.detail and multirank):
                continue
            if bar and (
                row.in_bar
                or (row.in_bar_compact and multirank)
                or (row.in_bar_tight and multirank and not wide)
            ):
                continue
            if row.compact and multirank and not wide:
                continue
            line = Text(f"{row.label:<17} ", style="dim")
            line.append(f"{row.value:>9} {row.share:>4}", style=row.style)
            if wide and row.note:
                line.append(f" {row.note}", style="dim")
            lines.append(line)
        return Text("\n").join(lines)
