"""The time series: step time split into compute and data wait, device memory, host RAM and swap.

All three charts are text in one widget (see ``memtui.tui.charts``): one repaint per update, and
the app updates it at a lower rate than the numbers. Narrow (a side pane), the charts take the
lines the panels above leave, the host chart only under host pressure or in a tall pane.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from rich.console import RenderableType
from rich.style import Style
from rich.text import Text

from memtui.advice.verdict import THRESHOLDS, State, Thresholds
from memtui.core.stats import format_bytes, format_duration
from memtui.runs.state import (
    HostBucket,
    MemoryBucket,
    RankSeries,
    RunState,
    StepBucket,
    ViewOptions,
)
from memtui.tui import palette
from memtui.tui.charts import Layer, legend, nice_ceiling, sparkline, stacked_rows, to_columns
from memtui.tui.widgets.base import StateView

AXIS = 10
"""Columns of the value axis at the left of each chart."""
MIB = 1 << 20
HOST_NEAR = 0.10
"""Narrow: the host chart is shown from this far under the host RAM threshold (90% - 10 points)."""
NARROW_MAX_ROWS = (6, 8)
"""Narrow: the most rows of the step time and memory charts (a tall side pane)."""
NARROW_LINES = 7
"""Narrow: the charts' lines until the layout has given them theirs."""
STEP_MIN_ROWS = 2
"""Narrow: the fewest rows of the step time chart beside the memory chart (16 levels)."""
MEMORY_MIN_ROWS = 2
"""Narrow: the fewest rows of the memory chart beside the step time chart."""


def _merge_steps(group: list[StepBucket]) -> tuple[float, float]:
    steps = sum(b.steps for b in group)
    if not steps:
        return 0.0, 0.0
    return sum(b.step_time_s for b in group) / steps, sum(b.data_wait_s for b in group) / steps


def _merge_memory(group: list[MemoryBucket]) -> MemoryBucket:
    last = group[-1]
    return MemoryBucket(
        start=group[0].start,
        capacity_bytes=last.capacity_bytes,
        allocated_bytes=last.allocated_bytes,
        reserved_bytes=last.reserved_bytes,
        peak_reserved_bytes=max(b.peak_reserved_bytes for b in group),
        peak_allocated_bytes=max(b.peak_allocated_bytes for b in group),
        beyond_torch_bytes=max(b.beyond_torch_bytes for b in group),
    )


def _last(group: list[HostBucket]) -> HostBucket:
    return group[-1]


def _axis(rows: list[Text], top_label: str, bottom_label: str = "0") -> list[Text]:
    """Prefix each row with the value axis: the top value on the first row, 0 on the last."""
    out = []
    for index, row in enumerate(rows):
        label = top_label if index == 0 else bottom_label if index == len(rows) - 1 else ""
        line = Text(f"{label:>{AXIS - 2}} ┤" if label else f"{'':>{AXIS - 2}} │", style="dim")
        line.append_text(row)
        out.append(line)
    return out


def band_label(fraction: float) -> str:
    """A band's share as the chart's title names it: ``85%``, ``87.5%``."""
    return f"{round(fraction * 100, 1):g}%"


def _band_tint(capacity: float, thresholds: Thresholds) -> Callable[[float, float], Style]:
    """Tints the blank cells of the rows in the edge band and over the danger band (85-90% and
    over 90% unless the config file says otherwise)."""
    edge = thresholds.memory_edge_fraction * capacity
    danger = thresholds.memory_danger_fraction * capacity

    def tint(low: float, high: float) -> Style:
        if (low + high) / 2 >= danger:
            return palette.DANGER_BAND
        if high > edge:
            return palette.EDGE_BAND
        return Style()

    return tint


def _memory_layers(
    bucket: MemoryBucket, cpu: bool, capacity: float, thresholds: Thresholds = THRESHOLDS
) -> list[Layer]:
    """allocated < reserved < peak reserved < + beyond torch; the peak coloured by its band."""
    peak = float(max(bucket.peak_reserved_bytes, bucket.reserved_bytes))
    used = peak + bucket.beyond_torch_bytes
    band = palette.PEAK
    if capacity and used >= thresholds.memory_danger_fraction * capacity:
        band = Style(color="red")
    elif capacity and used >= thresholds.memory_edge_fraction * capacity:
        band = Style(color="yellow")
    layers: list[Layer] = [(float(bucket.allocated_bytes), palette.ALLOCATED)]
    if not cpu:
        layers.append((float(bucket.reserved_bytes), palette.RESERVED))
    layers.append((peak, band))
    if bucket.beyond_torch_bytes:
        layers.append((used, palette.BEYOND_TORCH))
    return layers


def _memory_title(
    cpu: bool,
    beyond: bool,
    capacity: float | None,
    short: bool = False,
    thresholds: Thresholds = THRESHOLDS,
) -> Text:
    """The memory chart's title: its legend, then the bands in force (or, zoomed in, the
    capacity)."""
    items: list[tuple[str, Style | str]] = [("now" if cpu else "alloc", palette.ALLOCATED)]
    if not cpu:
        items.append(("reserved", palette.RESERVED))
    items.append(("peak", palette.PEAK))
    if beyond:
        items.append(("beyond" if short else "beyond torch", palette.BEYOND_TORCH))
    title = Text("memory ", style="bold")
    title.append_text(legend(*items))
    if capacity is None:
        title.append("  ")
        title.append(band_label(thresholds.memory_edge_fraction), style=palette.EDGE_BAND)
        title.append(" ")
        title.append(band_label(thresholds.memory_danger_fraction), style=palette.DANGER_BAND)
    else:
        title.append(f"  {'limit' if cpu else 'capacity'} {format_bytes(capacity)}", "dim")
    return title


def host_pressed(state: RunState) -> bool:
    """The verdict says HOST PRESSURE, or host RAM is near its threshold."""
    if state.summary().verdict.state is State.HOST_PRESSURE:
        return True
    buckets = state.host_buckets.buckets
    if not buckets or not buckets[-1].ram_total_bytes:
        return False
    share = buckets[-1].ram_used_bytes / buckets[-1].ram_total_bytes
    return share >= state.thresholds.thresholds.host_ram_fraction - HOST_NEAR


def step_axis_top(columns: list[float | None]) -> float:
    """The step time chart's scale for ``columns`` (oldest first; None: no steps): the newest
    third's slowest column, or the 90th percentile of all of them if higher, so that one slow
    column (a warm-up's first steps) does not set the scale for the rest."""
    values = [v for v in columns if v is not None]
    if not values:
        return 0.0
    recent = [v for v in columns[-max(1, len(columns) // 3) :] if v is not None]
    ranked = sorted(values)
    return max(max(recent, default=0.0), ranked[int(0.9 * (len(ranked) - 1))])


def narrow_rows(height: int, host: bool, memory_first: bool = False) -> tuple[int, int, bool]:
    """The rows of the step time and memory charts in ``height`` lines, and whether the host
    chart (3 lines) is shown (with ``host``, host pressure, and the least rows left to each
    chart, or when both have their most): with fewer lines than both charts need at their
    least, one chart alone takes them, the step time or (``memory_first``: the verdict is
    about memory) the memory chart, the other 0 rows."""
    least = 2 + STEP_MIN_ROWS + MEMORY_MIN_ROWS
    host = height >= 2 + sum(NARROW_MAX_ROWS) + 3 or (host and height >= least + 3)
    left = height - (3 if host else 0)
    if left < least:  # one chart alone, under its title
        if memory_first:
            return 0, min(NARROW_MAX_ROWS[1], max(1, left - 1)), host
        return min(NARROW_MAX_ROWS[0], max(1, left - 1)), 0, host
    rows = left - 2  # under the two titles
    steps = min(NARROW_MAX_ROWS[0], max(STEP_MIN_ROWS, (rows + 1) // 2))
    return steps, min(NARROW_MAX_ROWS[1], rows - steps), host


class SeriesChart(StateView):
    """Step time (compute and data wait), device memory with its bands, host RAM and swap."""

    DEFAULT_CSS = "SeriesChart { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when data arrives, and every second (the time axis moves)."""
        return state.data_version, int(state.clock), state.summary().focus_rank

    def shape(self) -> tuple[int, ...]:
        """Narrow, the charts fill the lines the layout leaves them: their height counts too."""
        return *super().shape(), self.content_size.height if self.narrow else 0

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """The three charts, stacked."""
        narrow, multirank = self.narrow, self.multirank
        rank = state.summary().focus_rank
        series = state.series.get(rank)
        chart_width = max(10, width - AXIS)
        end = state.clock or (state.info.started if state.info else 0.0)
        lines: list[Text] = []
        if narrow:  # the lines the layout left under the other panels (the host chart under
            # pressure), laid out with them in one pass: no frame shows them overflowing
            left = self.content_size.height or NARROW_LINES
            memory_first = state.summary().verdict.state is State.OOM_RISK
            step_rows, memory_rows, host = narrow_rows(left, host_pressed(state), memory_first)
        else:  # several ranks: shorter charts (room for the per-rank table)
            step_rows, memory_rows, host = (4, 5, True) if multirank else (5, 6, True)
        if series is not None:
            if step_rows:
                lines += self._steps(state, series, chart_width, end, step_rows)
            if memory_rows:
                lines += self._memory(state, series, chart_width, end, memory_rows)
        else:
            lines.append(Text("waiting for data", style="dim"))
        if host:
            lines += self._host(state, chart_width, end)
        return Text("\n", no_wrap=True, overflow="ellipsis").join(lines)

    def _steps(
        self, state: RunState, series: RankSeries, width: int, end: float, height: int
    ) -> list[Text]:
        columns = to_columns(
            list(series.step_buckets.buckets), lambda b: b.start, _merge_steps, width, end
        )
        top = nice_ceiling(step_axis_top([v[0] if v else None for v in columns.values]))
        bars: list[list[Layer] | None] = [
            [(v[1], palette.DATA_WAIT), (v[0], palette.COMPUTE)] if v else None
            for v in columns.values
        ]
        stats = state.summary().steps
        title = Text("step time ", style="bold")
        if stats is not None:
            # a wait not measured (no batch memtui timed) is said so, as `memtui status` does
            wait = (
                format_duration(stats.data_wait_s) if stats.data_wait_measured else "not measured"
            )
            title.append_text(
                legend(
                    (f"data wait {wait}", palette.DATA_WAIT),
                    (f"compute {format_duration(stats.compute_s)}", palette.COMPUTE),
                )
            )
        title.append(f"  {columns.seconds_per_column} s/col", style="dim")
        rows = stacked_rows(bars, height, top)
        return [title, *_axis(rows, format_duration(top).replace(".0 ", " "))]

    def _memory(
        self, state: RunState, series: RankSeries, width: int, end: float, height: int
    ) -> list[Text]:
        buckets = list(series.memory_buckets.buckets)
        columns = to_columns(buckets, lambda b: b.start, _merge_memory, width, end)
        capacity = float(buckets[-1].capacity_bytes) if buckets else 0.0
        cpu = bool(series.device) and series.device[-1].kind == "cpu"
        bands = state.thresholds.thresholds
        bars = [_memory_layers(b, cpu, capacity, bands) if b else None for b in columns.values]
        highest = max((layers[-1][0] for layers in bars if layers), default=0.0)
        top = capacity
        if not capacity or highest < 0.5 * capacity:  # far from the limit: zoom in
            top = nice_ceiling(max(highest, 1.0) * 1.25 / MIB) * MIB
        beyond = any(layers and len(layers) > 3 for layers in bars)
        shown = capacity if top != capacity else None
        title = _memory_title(cpu, beyond, shown, thresholds=bands)
        if title.cell_len > width + AXIS:  # a side pane: shorter names, the bands kept whole
            title = _memory_title(cpu, beyond, shown, short=True, thresholds=bands)
        tint = _band_tint(capacity, bands) if top == capacity else None
        rows = stacked_rows(bars, height, top, tint)
        return [title, *_axis(rows, format_bytes(top))]

    def _host(self, state: RunState, width: int, end: float) -> list[Text]:
        buckets = list(state.host_buckets.buckets)
        if not buckets:
            return []
        columns = to_columns(buckets, lambda b: b.start, _last, width, end)
        last = buckets[-1]
        ram = [b.ram_used_bytes / b.ram_total_bytes if b and b.ram_total_bytes else None
               for b in columns.values]  # fmt: skip
        swap_total = float(last.swap_total_bytes or 1)
        swap: list[float | None] = [b.swap_used_bytes if b else None for b in columns.values]
        title = Text("host ", style="bold")
        title.append_text(
            legend(
                (
                    f"RAM {format_bytes(last.ram_used_bytes)} of "
                    f"{format_bytes(last.ram_total_bytes)}",
                    palette.RAM,
                ),
                (
                    f"swap {format_bytes(last.swap_used_bytes)} of "
                    f"{format_bytes(last.swap_total_bytes)}"
                    if last.swap_total_bytes
                    else "no swap",
                    palette.SWAP,
                ),
            )
        )
        ram_line = Text(f"{'RAM':>{AXIS - 2}} │", style="dim")
        ram_line.append_text(sparkline(ram, 1.0, palette.RAM))
        swap_line = Text(f"{'swap':>{AXIS - 2}} │", style="dim")
        swap_line.append_text(sparkline(swap, swap_total, palette.SWAP))
        return [title, ram_line, swap_line]
