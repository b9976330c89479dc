"""The memory panel: where the device's memory goes (or, on CPU runs, RSS against the limit)."""

from __future__ import annotations

from collections.abc import Collection, Hashable
from typing import NamedTuple

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.assess import loader_memory
from memtui.advice.breakdown import NOT_KNOWN, Breakdown, breakdown
from memtui.advice.verdict import Thresholds
from memtui.core.stats import MemoryStats, format_bytes, ram_fraction
from memtui.runs.state import RunState, ViewOptions
from memtui.tui.palette import SEVERITY_STYLES, chips
from memtui.tui.widgets.base import StateView
from memtui.wire import HostSample


class Row(NamedTuple):
    """One number of the panel."""

    label: str
    value: str
    share: str = ""
    """The value as a share of capacity (or a change)."""
    note: str = ""
    """What the value means: the secondary column, dropped when narrow."""
    style: str = ""
    secondary: bool = False
    """A whole line dropped when narrow."""
    short: str = ""
    """The label in a narrow grid cell (at most ``SHORT_LABEL`` columns; "" when it fits)."""
    tight: bool = False
    """Kept in the narrowest view (a side pane beside the per-rank table), where the bar's
    legend and the verdict give the rest."""
    in_verdict: bool = False
    """The verdict's reasons show it too: dropped when the numbers are a grid."""
    in_bar: bool = False
    """The breakdown bar's legend shows it too: dropped from a grid under the bar."""


SHORT_LABEL = 10
"""The narrowest label of a grid cell."""
VALUE_WIDTH = 8
"""``20.0 GiB``, ``1023 MiB``."""
SHARE_WIDTH = 5
"""`` 100%``."""
CELL_GAP = 2


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
    "in-step": "green3",
    "runtime and workers": "grey50",
    "malloc free": "yellow",
    "not known yet": "grey70",
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
    "in-step": "in-step",
    "runtime and workers": "runtime",
    "malloc free": "malloc",
    "not known yet": "not known",
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
    named_only: Collection[str] = (),
    spare: Collection[str] = (),
) -> list[Text]:
    """The stacked bar (free memory dotted) and its legend with the numbers, wrapped to fit
    (``compact``: short names, no shares). Until the run's optimizer and its memory between
    steps are known, the peak the exact parts do not explain is one "not known yet" part. The
    parts in ``named_only`` are named without their numbers (shown beside the bar), and so are
    those in ``spare`` when that saves a line."""
    width = max(10, width)
    bar = Text(no_wrap=True, overflow="crop")
    for name, cells in bar_cells(breakdown, width):
        bar.append(("░" if name == "free" else "█") * cells, PART_STYLES.get(name, "white"))
    legend = _legend(breakdown, width, title, compact, named_only)
    if spare:
        shorter = _legend(breakdown, width, title, compact, {*named_only, *spare})
        legend = shorter if len(shorter) < len(legend) else legend
    return [bar, *legend]


def _legend(
    breakdown: Breakdown,
    width: int,
    title: str,
    compact: bool,
    named_only: Collection[str],
) -> list[Text]:
    """The bar's legend, wrapped to ``width`` (see ``breakdown_lines``)."""
    parts = []
    if title:
        parts.append((title, "dim"))
    for part in breakdown.parts:
        if part.bytes <= 0 and part.name != "free":
            continue
        style = PART_STYLES.get(part.name, "")
        if part.name in named_only:
            parts.append((f"■ {SHORT_LABELS.get(part.name, part.name)}", style))
        elif compact:
            label = SHORT_LABELS.get(part.name, part.name)
            parts.append((f"■ {label} {format_bytes(part.bytes)}", style))
        else:
            label = PART_LABELS.get(part.name, part.name)
            share = part.bytes / breakdown.capacity_bytes if breakdown.capacity_bytes else 0.0
            parts.append((f"■ {label} {format_bytes(part.bytes)} {share:.0%}", style))
    return list(chips(parts, separator="  ", width=width).split("\n"))


class Rows(NamedTuple):
    """The panel's numbers: the key ones (a grid when room is short) and the other lines."""

    numbers: list[Row]
    lines: list[Row]


def cuda_rows(state: RunState, memory: MemoryStats) -> Rows:
    """The device's memory, from capacity down to what torch does not see."""
    capacity = memory.capacity_bytes
    unallocated = max(0, memory.peak_bytes - memory.peak_allocated_bytes)  # the bar's part
    beyond = memory.beyond_torch_bytes
    series = state.series.get(state.summary().focus_rank)
    newest = series.device[-1] if series and series.device else None
    device = f"{newest.kind}:{newest.index}" if newest is not None else ""
    numbers = [
        Row("capacity", format_bytes(capacity), "", device),
        Row(
            "peak in use",
            format_bytes(memory.peak_used_bytes),
            _share(memory.peak_used_bytes, capacity),
            "reserved+beyond",
            _band_style(memory.peak_used_fraction, state.thresholds.thresholds),
            short="peak used",
            in_verdict=True,
        ),
        Row(
            "peak reserved",
            format_bytes(memory.peak_bytes),
            _share(memory.peak_bytes, capacity),
            "torch's cache",
            short="peak res.",
            tight=True,
        ),
        Row(
            "peak allocated",
            format_bytes(memory.peak_allocated_bytes),
            _share(memory.peak_allocated_bytes, capacity),
            "tensors",
            short="pk alloc.",
            tight=True,
        ),
        Row(
            "unallocated",
            format_bytes(unallocated),
            _share(unallocated, capacity),
            "fragmentation",
            "yellow" if capacity and unallocated > 0.1 * capacity else "",
            short="unalloc.",
            in_bar=True,
        ),
        Row(
            "beyond torch",
            format_bytes(beyond) if beyond is not None else "no NVML",
            _share(beyond, capacity) if beyond is not None else "",
            "context, NCCL",
            short="beyond",
            in_bar=True,
        ),
    ]
    if memory.alloc_retries or memory.ooms:
        numbers.append(
            Row(
                "retries / OOMs",
                f"{memory.alloc_retries} / {memory.ooms}",
                "",
                "cache flushes",
                "bold red" if memory.ooms else "yellow",
                short="retry/OOM",
                tight=True,
            )
        )
    lines = []
    others = newest.other_processes if newest is not None else []
    if others:
        names = ", ".join(f"{p.name}[{p.pid}] {format_bytes(p.used_bytes)}" for p in others[:3])
        total = sum(p.used_bytes for p in others)
        lines.append(Row("other processes", format_bytes(total), str(len(others)), names, "", True))
    return Rows(numbers, lines + host_rows(state, secondary=True))


def workers_measure(memory: MemoryStats, host: HostSample) -> str:
    """``USS`` or ``RSS``: which of the loader workers' numbers the device's memory counts
    (the hook counts their USS once measured; an older hook, or one before the first
    measurement, their RSS), told from what the tree holds beyond the main process."""
    uss = host.workers_uss_bytes
    if uss is None:
        return "RSS"
    workers = memory.reserved_bytes - host.main_rss_bytes
    return "USS" if abs(workers - uss) <= abs(workers - host.workers_rss_bytes) else "RSS"


def cpu_rows(state: RunState, memory: MemoryStats) -> Rows:
    """On CPU runs the host is the device: the main process's RSS plus the loader workers' own
    memory (USS; their RSS until it is measured) against the limit."""
    capacity = memory.capacity_bytes
    series = state.series.get(state.summary().focus_rank)
    host = series.host if series is not None and series.host else state.summary().host
    workers = host.workers if host is not None else 0
    measure = workers_measure(memory, host) if host is not None and workers else "USS"
    with_workers = f"+workers {measure}" if workers else ""
    numbers = [
        Row("limit", format_bytes(capacity), "", "cgroup or RAM"),
        Row(
            "peak",
            format_bytes(memory.peak_bytes),
            _share(memory.peak_bytes, capacity),
            f"RSS{with_workers}" if workers else "main RSS",
            _band_style(memory.peak_used_fraction, state.thresholds.thresholds),
            tight=True,
        ),
        Row(
            "in use now",
            format_bytes(memory.current_bytes),
            _share(memory.current_bytes, capacity),
            "RSS-malloc free",
        ),
    ]
    if host is not None:
        numbers.append(
            Row(
                "main RSS",
                format_bytes(host.main_rss_bytes),
                _share(host.main_rss_bytes, capacity),
                "the trainer",
            )
        )
    if host is not None and workers:
        uss = host.workers_uss_bytes
        if measure == "USS":  # their RSS counts the pages they share with the main process
            own, note = uss or 0, f"{workers} workers' own"
        else:
            own = host.workers_rss_bytes
            note = (
                f"{workers}, USS {format_bytes(uss)}" if uss is not None else f"{workers}, no USS"
            )
        numbers.append(
            Row(
                f"workers {measure}",
                format_bytes(own),
                _share(own, capacity),
                note,
                short=f"wkrs {measure}",
                tight=True,
            )
        )
    return Rows(numbers, host_rows(state, secondary=True))


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
    --json``'s); another rank's is made the same way from its own memory and loader workers
    (the ranks hold the same model and optimizer, so the exact parts are the control rank's)."""
    summary = state.summary()
    control = state.control
    control_rank = state.info.rank if state.info is not None else 0
    if summary.focus_rank == control_rank or control is None or summary.memory is None:
        return summary.advice.breakdown if summary.advice is not None else None
    series = state.series.get(summary.focus_rank)
    workers = loader_memory(series.host if series is not None else None)
    return breakdown(summary.memory, control.static, control.model, workers)


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
        """The breakdown bar, then the numbers: one a line with what it means when wide and
        there is one rank, else two a line (in a side pane without what the verdict says, and
        beside the per-rank table only the peaks); host lines are dropped when narrow."""
        memory = state.summary().memory
        if memory is None:
            return Text("no memory samples yet", style="dim")
        wide = not self.narrow
        multirank = self.multirank
        rows = cpu_rows(state, memory) if memory.kind == "cpu" else cuda_rows(state, memory)
        split = focus_breakdown(state)
        bar = split is not None and split.capacity_bytes > 0
        in_grid = multirank or not wide
        numbers = rows.numbers
        if in_grid:  # short of room: what the verdict or the bar's legend says is left out
            numbers = [r for r in numbers if not (r.in_verdict or (r.in_bar and bar))]
            if multirank and not wide:
                numbers = [r for r in numbers if r.tight]
        lines: list[Text] = []
        if split is not None and bar:
            beside = {row.label for row in numbers} if in_grid else set()
            # all that was allocated, not split yet, is the peak beside; free is capacity less
            # the peak in use
            unsplit = split.as_dict().get(NOT_KNOWN) == memory.peak_allocated_bytes
            named_only = {NOT_KNOWN} if unsplit and "peak allocated" in beside else set()
            spare = {"free"} if beside & {"capacity", "limit"} else set()
            lines += breakdown_lines(
                split, width, compact=in_grid, named_only=named_only, spare=spare
            )
        lines += grid(numbers, width) if in_grid else [_line(row, True) for row in numbers]
        lines += [_line(row, notes=wide) for row in rows.lines if wide or not row.secondary]
        return Text("\n").join(lines)


def _line(row: Row, notes: bool) -> Text:
    """One number a line: label, value, share and (``notes``) what it means."""
    line = Text(f"{row.label:<17} ", style="dim")
    line.append(f"{row.value:>9} {row.share:>4}", style=row.style)
    if notes and row.note:
        line.append(f" {row.note}", style="dim")
    return line


def grid(rows: list[Row], width: int) -> list[Text]:
    """Two numbers a line, aligned: label, value and share in each cell (the short label when
    the long one does not fit)."""
    cell = max(SHORT_LABEL + VALUE_WIDTH + SHARE_WIDTH, (width - CELL_GAP) // 2)
    label_width = cell - VALUE_WIDTH - SHARE_WIDTH
    lines = []
    for first in range(0, len(rows), 2):
        line = Text()
        for index, row in enumerate(rows[first : first + 2]):
            if index:
                line.append(" " * CELL_GAP)
            label = row.label if len(row.label) < label_width or not row.short else row.short
            line.append(f"{label:<{label_width}}", style="dim")
            line.append(f"{row.value:>{VALUE_WIDTH}}{row.share:>{SHARE_WIDTH}}", style=row.style)
        lines.append(line)
    return lines
