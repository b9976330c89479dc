"""The memory panel: where the device's memory goes (or, on CPU runs, RSS against the limit)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.verdict import THRESHOLDS
from memtui.stats import MemoryStats, format_bytes, ram_fraction
from memtui.tui.palette import SEVERITY_STYLES
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


def _share(value: int, capacity: int) -> str:
    return f"{value / capacity:.0%}" if capacity else ""


def _band_style(fraction: float) -> str:
    if fraction >= THRESHOLDS.memory_danger_fraction:
        return SEVERITY_STYLES[2]
    if fraction >= THRESHOLDS.memory_edge_fraction:
        return SEVERITY_STYLES[1]
    return ""


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
        ),
        Row(
            "peak in use",
            format_bytes(memory.peak_used_bytes),
            _share(memory.peak_used_bytes, capacity),
            "peak reserved + beyond torch",
            _band_style(memory.peak_used_fraction),
        ),
        Row(
            "peak reserved",
            format_bytes(memory.peak_bytes),
            _share(memory.peak_bytes, capacity),
            detail=True,
        ),
        Row(
            "peak allocated",
            format_bytes(memory.peak_allocated_bytes),
            _share(memory.peak_allocated_bytes, capacity),
            detail=True,
        ),
        Row(
            "reserved unalloc.",
            format_bytes(unallocated),
            _share(unallocated, capacity),
            f"fragmentation (split blocks {format_bytes(memory.fragmentation_bytes)})",
            "yellow" if capacity and unallocated > 0.1 * capacity else "",
        ),
        Row(
            "beyond torch",
            format_bytes(beyond) if beyond is not None else "no NVML",
            _share(beyond, capacity) if beyond is not None else "",
            "CUDA context, NCCL, other processes",
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
    """On CPU runs the host is the device: the process tree's RSS against the memory limit."""
    capacity = memory.capacity_bytes
    rows = [
        Row("limit", format_bytes(capacity), "", "cgroup limit, else total RAM"),
        Row(
            "peak RSS",
            format_bytes(memory.peak_bytes),
            _share(memory.peak_bytes, capacity),
            "main process + loader workers",
            _band_style(memory.peak_used_fraction),
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
    return rows + host_rows(state, secondary=False)


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
            "bold yellow" if fraction >= THRESHOLDS.host_ram_fraction else "",
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


class MemoryPanel(StateView):
    """Capacity, peaks, fragmentation and memory beyond torch; RSS against the limit on CPU.

    On a multi-rank run it shows the rank the verdict is about (named in the border title)."""

    DEFAULT_CSS = "MemoryPanel { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the focused rank's memory or the host changes."""
        summary = state.summary()
        series = state.series.get(summary.focus_rank)
        others = series.device[-1].other_processes if series and series.device else ()
        return summary.memory, summary.host, summary.focus_rank, tuple(others)

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """Aligned lines; the note column and secondary lines are dropped when narrow."""
        memory = state.summary().memory
        if memory is None:
            return Text("no memory samples yet", style="dim")
        wide = not self.narrow
        multirank = self.multirank
        rows = cpu_rows(state, memory) if memory.kind == "cpu" else cuda_rows(state, memory)
        lines = []
        for row in rows:
            if (row.secondary and not wide) or (row.detail and multirank):
                continue
            if row.compact and multirank and not wide:
                continue
            line = Text(f"{row.label:<17} ", style="dim")
            line.append(f"{row.value:>9} {row.share:>4}", style=row.style)
            if wide and row.note:
                line.append(f" {row.note}", style="dim")
            lines.append(line)
        return Text("\n").join(lines)
