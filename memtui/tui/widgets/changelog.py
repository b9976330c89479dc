"""The change log: pending changes (with cancel), applied ones with their step (and on how many
ranks), rejected ones."""

from __future__ import annotations

from collections.abc import Hashable

from rich.console import RenderableType
from rich.text import Text

from memtui.knobs import format_changes, format_value
from memtui.tui.state import RunState, ViewOptions
from memtui.tui.widgets.base import StateView


def change_lines(state: RunState, view: ViewOptions, limit: int) -> list[Text]:
    """Pending first (oldest first), then applied and rejected changes, newest first."""
    control = state.control
    lines: list[Text] = []
    if control is not None:
        for change in control.pending:
            line = Text()
            line.append("pending  ", "bold yellow")
            line.append(f"#{change.id} {format_changes(change.changes)}")
            line.append(f"  queued at step {change.queued_step}", "dim")
            if change.note:
                line.append(f"  ({change.note})", "dim")
            if not view.readonly:
                line.append("  c: cancel", "dim")
            lines.append(line)
        history: list[tuple[float, Text]] = []
        for applied in control.applied:
            line = Text()
            line.append("applied  ", "bold green")
            line.append(f"step {applied.step}  ", "bold")
            landed, known = state.applied_on(applied)
            if known > 1:  # every rank applies the same change set at the same step
                line.append(
                    f"on {landed}/{known} ranks  ", "" if landed == known else "bold yellow"
                )
            diffs = ", ".join(
                f"{k} {format_value(d.old)} → {format_value(d.new)}"
                for k, d in applied.changes.items()
            )
            line.append(diffs or "no effective change")
            line.append("  " + " ".join(f"#{i}" for i in applied.ids), "dim")
            if applied.note:
                line.append(f"  ({applied.note})", "dim")
            history.append((applied.time, line))
        for rejected in control.rejected:
            line = Text()
            line.append("rejected ", "bold red")
            line.append(f"step {rejected.step}  ", "bold")
            line.append(f"{format_changes(rejected.requested)}: ")
            line.append(rejected.reason, "red")
            history.append((rejected.time, line))
        history.sort(key=lambda item: item[0], reverse=True)
        lines += [line for _time, line in history]
    if state.notices:
        last = state.notices[-1]
        line = Text()
        line.append("you      ", "bold cyan")
        line.append(last.text, "" if last.ok else "red")
        lines.insert(len(control.pending) if control else 0, line)
    if not lines:
        hint = "no changes yet" if view.readonly else "no changes yet: b, a, w or p to queue one"
        lines.append(Text(hint, "dim"))
    return lines[:limit]


class ChangeLog(StateView):
    """Pending, applied (step, old → new) and rejected (reason) changes."""

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the change log or the viewer's switches change."""
        return state.control_version, view.readonly, self.content_size.height

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """As many lines as fit."""
        limit = max(1, self.content_size.height)
        separator = Text("\n", no_wrap=True, overflow="ellipsis")
        return separator.join(change_lines(state, view, limit))
