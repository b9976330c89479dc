"""The config panel: each knob's current value, its pending value, and the effective batch."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.predict import EDGE, confidence, max_batch
from memtui.knobs import KNOBS, format_value
from memtui.tui.state import RunState, ViewOptions
from memtui.tui.widgets.base import StateView

KNOB_KEYS: dict[str, str] = {
    "batch_size": "b",
    "grad_accum": "a",
    "num_workers": "w",
    "pin_memory": "p",
}
"""The key that edits each knob (the app's bindings use the same)."""


class ConfigPanel(StateView):
    """Knob, now, pending, and the key that edits it; effective batch now and after; the
    largest micro-batch the memory model predicts under 85% of capacity."""

    DEFAULT_CSS = "ConfigPanel { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the control state or the viewer's switches change."""
        return state.control_version, view

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """The knob table and the effective batch line."""
        control = state.control
        if control is None:
            return Text("waiting for the run's config", style="dim")
        pending = state.pending_values()
        show_keys = not view.readonly
        heading = f"{'knob':<12} {'now':>6}  {'pending':<9}" + (" key" if show_keys else "")
        lines = [Text(heading, "dim")]
        for knob in KNOBS:
            tunable = knob in control.tunable
            line = Text(f"{knob:<12} ", "" if tunable else "dim")
            line.append(f"{format_value(state.knob_value(knob)) if tunable else 'n/a':>6}  ")
            later = f"→ {format_value(pending[knob])}" if knob in pending else ""
            line.append(f"{later:<9}", "bold yellow")
            if show_keys and tunable:
                line.append(f" {KNOB_KEYS[knob]}", "bold cyan")
            lines.append(line)
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
        keep = Text("keep effective batch ", "dim")
        keep.append("on" if view.keep_effective_batch else "off", "bold")
        if show_keys:
            keep.append(" (k)", "dim")
        model = control.model
        if model is not None and "batch_size" in control.tunable:
            safe = max_batch(model, EDGE)
            line = Text("max safe batch  ", "dim") if not self.narrow else keep
            if self.narrow:  # one line less in a side pane
                line.append(" · max safe batch ", "dim")
            line.append("unbounded" if safe is None else str(safe), "bold cyan")
            line.append(f" (< {EDGE:.0%})" if self.narrow else f" (predicted < {EDGE:.0%})", "dim")
            if not self.narrow:
                line.append(f" {confidence(model)}", "dim")
                lines.append(line)
        lines.append(keep)
        return Text("\n").join(lines)
