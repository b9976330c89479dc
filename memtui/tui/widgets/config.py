"""The config panel: each knob's current value, its pending value, and the effective batch."""

from __future__ import annotations

from collections.abc import Hashable

from rich.cells import cell_len
from rich.console import RenderableType
from rich.text import Text

from memtui.advice.predict import GUESS_MULTIPLE, safe_batch
from memtui.core.knobs import KNOBS, format_value, unused_knobs
from memtui.runs.report import untunable_lines
from memtui.runs.state import RunState, ViewOptions
from memtui.tui.widgets.base import StateView
from memtui.wire import Ceiling, MemoryModel

KNOB_KEYS: dict[str, str] = {
    "batch_size": "b",
    "grad_accum": "a",
    "num_workers": "w",
    "pin_memory": "p",
    "prefetch_factor": "P",
}
"""The key that edits each knob (the app's bindings use the same)."""
LABEL = "max safe batch  "
"""Aligned with ``effective batch ``."""
Segments = list[tuple[str, str]]


def _confidences(model: MemoryModel) -> list[str]:
    """How sure the memory model is, in words from the longest to the shortest."""
    points = len(model.points)
    if points < 2 or model.fit_error is None:
        return [
            "low confidence: one micro-batch seen",
            "low: one micro-batch seen",
            "low confidence",
        ]
    if points == 2:  # a line through two points fits them exactly: its error says nothing
        return [f"{points} micro-batches seen", f"{points} sizes seen"]
    fit = f"fit error {model.fit_error:.1%}"
    return [f"{points} micro-batches seen, {fit}", f"{points} sizes seen, {fit}", fit]


def _safe_batch_layouts(
    model: MemoryModel, edge: float, ceiling: Ceiling | None = None
) -> list[list[Segments]]:
    """The max safe batch line(s), from the most to the least spelt out: the figure (past
    ``GUESS_MULTIPLE`` x the largest micro-batch seen, that floor: the rest is a guess; under a
    micro-batch that ran out of memory, that), the band and the confidence (the confidence's
    words before the band's: the last layout is the shortest)."""
    safe = safe_batch(model, edge, ceiling)
    band = f"< {edge:.0%}"
    layouts: list[list[Segments]] = []
    if safe is not None and safe.capped_by_oom:
        figure: Segments = [(LABEL, "dim"), (str(safe.size), "bold cyan")]
        out = f" ({safe.size + 1} ran out of memory)"
        layouts.append([[*figure, (out, "dim")]])
        layouts.append([[*figure, (" (OOM above)", "dim")]])
        return layouts
    if safe is not None and safe.guess:  # the figure is the floor, as in `memtui status`
        largest = safe.largest_measured
        floor: Segments = [(LABEL, "dim"), (safe.figure, "bold cyan")]
        head = [*floor, (f", {GUESS_MULTIPLE}x the largest seen ({largest})", "dim")]
        short = [*floor, (f", {GUESS_MULTIPLE}x the {largest} seen", "dim")]
        for conf in _confidences(model):
            layouts.append([[*head, (f"; predicted {band}, {conf}", "dim")]])
            layouts.append([head, [(f"  predicted {band}; {conf}", "dim")]])
            layouts.append([[*short, (f" ({conf})", "dim")]])
        return layouts
    figure = [(LABEL, "dim"), ("unknown" if safe is None else str(safe.size), "bold cyan")]
    for conf in _confidences(model):
        layouts.append([[*figure, (f" (predicted {band}) {conf}", "dim")]])
        layouts.append([[*figure, (f" (predicted {band})", "dim")], [(f"  {conf}", "dim")]])
        layouts.append([[*figure, (f" ({band}; {conf})", "dim")]])
    return layouts


def safe_batch_lines(
    model: MemoryModel, edge: float, width: int, max_lines: int, ceiling: Ceiling | None = None
) -> list[Text]:
    """The largest micro-batch predicted under ``edge`` x capacity with how sure that is, in the
    most words that fit ``width`` columns in at most ``max_lines`` lines (else the fewest, cut)."""
    layouts = _safe_batch_layouts(model, edge, ceiling)
    fitting = [
        layout
        for layout in layouts
        if len(layout) <= max_lines
        and all(sum(cell_len(t) for t, _ in line) <= width for line in layout)
    ]
    chosen = fitting[0] if fitting else layouts[-1]
    return [Text.assemble(*line, no_wrap=True, overflow="ellipsis") for line in chosen]


class ConfigPanel(StateView):
    """Knob, now, pending, and the key that edits it; effective batch now and after; the
    largest micro-batch the memory model predicts under the edge band in force (85% of capacity
    unless the config file says otherwise), and how sure it is."""

    DEFAULT_CSS = "ConfigPanel { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the control state, the knobs' values (those the steps measure move with
        the data) or the viewer's switches change."""
        known = state.known_config()
        values = (tuple(known.values.items()), known.measured) if known is not None else None
        return state.control_version, values, view

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """The knob table and the effective batch line."""
        control = state.control
        known = state.known_config()
        if control is None or known is None:
            return Text("waiting for the run's config", style="dim")
        pending = state.pending_values()
        show_keys = not view.readonly
        heading = f"{'knob':<15} {'now':>6}  {'pending':<9}" + (" key" if show_keys else "")
        lines = [Text(heading, "dim")]
        # every knob's value as `memtui status` gives it: those memtui cannot change too (dim,
        # without a key), "?" where it does not know one
        knobs_now = dict(known.values)
        knobs_after = {**knobs_now, **pending}
        # a value the loader does not use (prefetch_factor without workers) is said "unused",
        # as in `memtui status`; a pending change of workers that starts or stops using it too
        unused_now, unused_after = unused_knobs(knobs_now), unused_knobs(knobs_after)
        for knob in KNOBS:
            tunable = knob in control.tunable
            line = Text(f"{knob:<15} ", "" if tunable else "dim")
            value = knobs_now[knob]
            if value is None:
                line.append(f"{'?':>6}  ", "dim")
            else:
                line.append(f"{format_value(value):>6}  ", "dim" if knob in unused_now else "")
            later = ""
            if knob in pending:
                later = f"→ {format_value(knobs_after[knob])}"
            elif (knob in unused_now) != (knob in unused_after):
                later = "→ unused" if knob in unused_after else "→ used"
            if later:
                line.append(f"{later:<9}", "bold yellow")
            else:  # measured by the steps (the run holds it where memtui cannot read it)
                note = "unused" if knob in unused_now else ""
                line.append(f"{'measured' if knob in known.measured else note:<9}", "dim")
            if show_keys and tunable:
                line.append(f" {KNOB_KEYS[knob]}", "bold cyan")
            lines.append(line)
        if control.boundary:
            lines.append(Text(f"changes apply at {control.boundary}", "dim"))
        lines += [Text(line, "dim") for line in untunable_lines(control.untunable)]
        current = state.effective_batch()
        if current is not None:
            line = Text("effective batch ", "dim")
            line.append(f"{current}", "bold")
            batch, accum = state.knob_value("batch_size"), state.knob_value("grad_accum")
            line.append(f" = {batch} x {accum} x {state.world_size} ranks", "dim")
            after = state.effective_batch(pending=True)
            if after != current:
                line.append(f" → {after}", "bold yellow")
            lines.append(line)
        lr = control.lr
        if lr is not None and lr.script_schedule:  # `memtui status` says why
            lines.append(Text("lr the script's own schedule: memtui does not scale it", "yellow"))
        elif lr is not None and lr.factor != 1.0:
            line = Text("lr ", "dim")
            line.append(f"x{round(lr.factor, 4)}", "bold")
            line.append(" the script's own" + (f" ({lr.rule})" if lr.rule else ""), "dim")
            lines.append(line)
        keep = Text("keep effective batch ", "dim")
        keep.append("on" if view.keep_effective_batch else "off", "bold")
        if show_keys:
            keep.append(" (k)", "dim")
            keep.append("  lr rule ", "dim")
            keep.append(view.lr_scale or "run's", "bold")
            keep.append(" (l)", "dim")
        model = control.model
        if model is not None and "batch_size" in control.tunable:
            edge = state.thresholds.thresholds.memory_edge_fraction
            # a side pane is taller than wide: one line there, two in the wide layout's column
            lines += safe_batch_lines(model, edge, width, 1 if self.narrow else 2, control.ceiling)
        lines.append(keep)
        return Text("\n").join(lines)
