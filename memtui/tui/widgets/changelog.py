"""The change log, newest first: pending changes with their predicted peak (and cancel), then
applied ones with their step, measured effect next to what was predicted (and on how many
ranks), rollbacks and out-of-memory errors with what happened to the failing batch, rejected and
cancelled ones and the last request's outcome, by time, each saying who acted (you, another
shell, the autopilot, the run); under them, how far the memory predictions were off."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from rich.console import RenderableType
from rich.text import Text

from memtui.advice.autopilot import AUTOPILOT
from memtui.advice.effect import measurable, speed_words, speedup
from memtui.advice.measure import accuracy, error_words, prediction_error
from memtui.advice.predict import confidence
from memtui.advice.speed import inside_noise
from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.core.knobs import format_changes, format_value
from memtui.core.stats import format_bytes
from memtui.runs.events import RUN, VIEWER, YOU
from memtui.runs.report import diff_words, signed
from memtui.runs.state import RunState, ViewOptions, who_is
from memtui.tui.palette import Chip, flow
from memtui.tui.widgets.base import StateView
from memtui.wire import (
    AppliedChange,
    CancelledChange,
    ControlState,
    Effect,
    OomEvent,
    PendingChange,
    RejectedChange,
)

INDENT = " " * 9
"""The second line of an entry starts under the first line's text."""
ACCURACY_TARGET = 0.10
"""The prediction error memtui aims to stay within: 10% of what was observed."""
NARROW_LINES = 6
"""Lines of the change log in the narrow layout (newest first): the latest change landing, its
step, old → new and measured effect, with the pending ones above it."""
NOTICE_HEADS = {
    YOU: Text("you      ", "bold cyan"),
    RUN: Text("run      ", "bold magenta"),
    VIEWER: Text("viewer   ", "dim"),
}
"""The head of a notice's line, by who acted: a request this viewer sent, the training run, or
the viewer itself."""


def by_whom(who: str) -> str:
    """``by you``, ``by the autopilot``, ``from another shell`` ('' for nobody known)."""
    if not who:
        return ""
    return f"from {who}" if who.startswith("another ") else f"by {who}"


def entry_lines(head: Text, chips: Sequence[Chip], width: int = 0) -> list[Text]:
    """An entry on lines of ``width`` (0: one line), the lines after the first under the first
    line's text."""
    return flow(head, chips, width, INDENT)


def _band_style(fraction: float, thresholds: Thresholds) -> str:
    """Red over the danger band (where the hook refuses a change unless forced), yellow in the
    edge band, green under it: the bands in force (the config file's, else 85% and 90%)."""
    if fraction > thresholds.memory_danger_fraction:
        return "bold red"
    if fraction >= thresholds.memory_edge_fraction:
        return "bold yellow"
    return "green"


def prediction_chips(
    change: PendingChange, control: ControlState, thresholds: Thresholds = THRESHOLDS
) -> list[Chip]:
    """``predicted peak 1.3 GiB = 72% of 1.8 GiB, headroom 500 MiB (low: one micro-batch seen)``,
    the share coloured by the memory bands in ``thresholds``."""
    peak = change.predicted_peak_bytes
    model = control.model
    if peak is None or model is None or not model.capacity_bytes:
        return [Chip(Text("no prediction yet (the memory model needs a few steps)", "dim"))]
    capacity = model.capacity_bytes
    fraction = peak / capacity
    share = Text("predicted peak ", "dim")
    share.append(f"{format_bytes(peak)} = {fraction:.0%}", _band_style(fraction, thresholds))
    share.append(f" of {format_bytes(capacity)},", "dim")
    headroom = capacity - peak
    if headroom >= 0:
        room = Text(f"headroom {format_bytes(headroom)}", "dim")
    else:
        room = Text(f"over by {format_bytes(-headroom)}", "bold red")
    chips = [Chip(share), Chip(room, " "), Chip(Text(f"({confidence(model)})", "dim"), " ")]
    if change.forced:
        chips.append(Chip(Text("forced", "bold red")))
    return chips


MEASURED_WITHIN = 40
"""Steps after a change within which its effect is expected (the hook compares 20 after 2)."""


def effect_chips(applied: AppliedChange, step: int) -> list[Chip] | None:
    """What a change did next to what was predicted: ``+41% samples/s (predicted +35%), peak
    9.6 GiB → 15.2 GiB (predicted 15.0 GiB, 1% low)``; before it is measured, ``measuring the
    effect… · predicted +35% samples/s, peak 15.0 GiB`` (None: nothing measured nor predicted,
    and no longer expected: a hook that does not measure)."""
    effect: Effect | None = applied.effect
    speed, peak = applied.predicted_speed_delta, applied.predicted_peak_bytes
    if effect is None and applied.effect_note:  # a change that cannot act here: never measured
        return [Chip(Text(applied.effect_note, "dim"))]
    if effect is None and speed is None and peak is None:
        if step - applied.step > MEASURED_WITHIN:
            return None
        return [Chip(Text("measuring the effect…", "dim"))]
    if effect is None:
        chips = [Chip(Text("measuring the effect…", "dim"))]
        foretold = [] if speed is None else [f"{speed:+.0%} samples/s"]
        if speed is not None and not round(speed, 2):
            foretold = ["samples/s unchanged"]
        foretold += [f"peak {format_bytes(peak)}"] if peak is not None else []
        chips.append(Chip(Text("predicted " + ", ".join(foretold), "dim"), " · "))
        return chips
    gain = speedup(effect)
    style = "bold green" if gain > 0.02 and measurable(effect) else "bold"
    measured = Text(speed_words(effect), style if measurable(effect) else "dim")
    if speed is not None:  # the hook's estimate from the steps before
        measured.append(" ")
        missed = "dim" if inside_noise(applied) else "yellow"
        measured.append(f"(predicted {signed(speed)})", missed)
    chips = [Chip(measured)]
    if applied.effect_note:
        chips.append(Chip(Text(applied.effect_note, "dim"), " · "))
    if effect.peak_bytes_before is not None and effect.peak_bytes_after is not None:
        moved = f"peak {format_bytes(effect.peak_bytes_before)} → "
        chips.append(Chip(Text(moved + format_bytes(effect.peak_bytes_after)), ", "))
    if peak is not None:
        predicted = Text(f"(predicted {format_bytes(peak)}", "dim")
        error = prediction_error(applied)
        if error is not None:
            style = "bold yellow" if abs(error) > ACCURACY_TARGET else "dim"
            predicted.append(", ", "dim")
            predicted.append(error_words(error), style)
        predicted.append(")", "dim")
        chips.append(Chip(predicted, " "))
    return chips


def accuracy_line(control: ControlState, narrow: bool) -> Text | None:
    """How far the memory predictions of the changes applied were off, on average (None: none
    measured nor run out of memory): ``memory predictions off by 1.4% on average over 1
    change (aim: under 10%)``."""
    found = accuracy(control.applied, control.ooms)
    mean, count = found.mean_abs_error, found.measured
    if mean is None and not found.out_of_memory:
        return None
    line = Text("memory predictions ", "dim")
    if mean is not None:
        style = "bold green" if mean <= ACCURACY_TARGET else "bold yellow"
        line.append(f"off by {mean:.1%}", style)
        plural = "s" if count > 1 else ""
        if narrow:
            line.append(f" ({count} change{plural})", "dim")
        else:
            aim = f" (aim: under {ACCURACY_TARGET:.0%})"
            line.append(f" on average over {count} change{plural}{aim}", "dim")
    if found.out_of_memory:  # a change that ran out of memory is a miss, not a number
        line.append("; " if mean is not None else "")
        what = "OOM" if narrow else "ran out of memory"
        line.append(f"{found.out_of_memory} {what} (a miss)", "bold red")
    return line


def oom_lines(oom: OomEvent, width: int = 0) -> list[Text]:
    """An out-of-memory error: where, how much, what was done, and the failing batch's fate
    (on lines of ``width``, 0: as long as they are)."""
    chips = [Chip(Text(f"step {oom.step}", "bold"))]
    what = Text()
    if oom.config.batch_size is not None:
        what.append(f"batch_size {format_value(oom.config.batch_size)}: ")
    if oom.tried_bytes:
        what.append(f"tried {format_bytes(oom.tried_bytes)}")
        if oom.free_bytes is not None:
            what.append(f" with {format_bytes(oom.free_bytes)} free")
        what.append("; ")
    what.append("rolled back" if oom.rolled_back else "not rolled back", "bold")
    chips.append(Chip(what))
    if oom.safe_config is not None and oom.safe_config.batch_size is not None:
        done = "now" if oom.rolled_back else "restart with"  # rolled back: said as done
        chips.append(Chip(Text(f"({done} batch_size {oom.safe_config.batch_size})", "dim"), " "))
    batch = Text(oom.batch or "the failing batch: not reported", "yellow")
    head = entry_lines(Text("OOM      ", "bold white on red3"), chips, width)
    return head + entry_lines(Text(INDENT), [Chip(batch)], width)


def change_lines(
    state: RunState, view: ViewOptions, limit: int, narrow: bool = False, width: int = 0
) -> list[Text]:
    """Pending first, then applied changes, rollbacks, OOMs, rejected and cancelled changes and
    the last notice (a request's outcome, the run's exit), all newest first, each saying who
    acted; then, always on the last line shown, how far the memory predictions were off. Each
    entry on lines of ``width`` (0: one line, as long as it is) with, when narrow, its notes left
    out where they do not fit."""
    control = state.control
    lines: list[Text] = []
    history: list[tuple[float, list[Text]]] = []
    if state.notices:
        last = state.notices[-1]
        said = Text(last.text, "" if last.ok else "red")
        head = NOTICE_HEADS.get(last.who, NOTICE_HEADS[YOU])
        history.append((last.time, entry_lines(head, [Chip(said)], width)))
    if control is not None:
        for change in reversed(control.unapplied):
            lines += _unapplied_entry(change, width)
        for change in reversed(control.pending):
            lines += _pending_entry(state, control, change, view, narrow, width)
        for applied in control.applied:
            history.append((applied.time, _applied_entry(state, control, applied, narrow, width)))
        for oom in control.ooms:
            history.append((oom.time, oom_lines(oom, width)))
        for rejected in control.rejected:
            history.append((rejected.time, _rejected_entry(rejected, narrow, width)))
        for cancelled in control.cancelled:
            history.append((cancelled.time, _cancelled_entry(cancelled, narrow, width)))
    history.sort(key=lambda item: item[0], reverse=True)
    lines += [line for _time, entry in history for line in entry]
    if not lines:
        hint = "no changes yet" if view.readonly else "no changes yet: b, a, w or p to queue one"
        lines.append(Text(hint, "dim"))
    summary = accuracy_line(control, narrow) if control is not None else None
    if summary is None:
        return lines[:limit]
    return [*lines[: max(0, limit - 1)], summary][-limit:]


def _pending_entry(
    state: RunState,
    control: ControlState,
    change: PendingChange,
    view: ViewOptions,
    narrow: bool,
    width: int,
) -> list[Text]:
    """A pending change: what, when queued, by whom and why, and its predicted peak."""
    pilot = control.autopilot
    chips = [
        Chip(Text(f"#{change.id} {format_changes(change.changes)}")),
        Chip(Text(f"queued at step {change.queued_step}", "dim")),
    ]
    theirs = AUTOPILOT if change.origin == AUTOPILOT else change.client
    if who := by_whom(who_is(theirs)):  # narrow: the autopilot's always, others if room
        style = "bold cyan" if change.origin else "cyan"
        chips.append(Chip(Text(who, style), optional=narrow and not change.origin))
    trial = pilot is not None and pilot.why and pilot.trying == change.changes
    if change.origin == AUTOPILOT and pilot is not None and trial:  # why, in words
        chips.append(Chip(Text(f"({pilot.why})", "dim"), optional=narrow))
    if change.note and not change.forced:  # a forced change's note is the warning
        chips.append(Chip(Text(f"({change.note})", "dim"), optional=narrow))
    if not view.readonly:  # narrow: the footer says it too
        chips.append(Chip(Text("c: cancel", "dim"), optional=narrow))
    lines = entry_lines(Text("pending  ", "bold yellow"), chips, width)
    if change.predicted_peak_bytes is not None:
        bands = state.thresholds.thresholds
        lines += entry_lines(Text(INDENT), prediction_chips(change, control, bands), width)
    return lines


def _unapplied_entry(change: PendingChange, width: int) -> list[Text]:
    """A change still pending when the run ended: never applied."""
    chips = [
        Chip(Text(f"#{change.id} {format_changes(change.changes)}")),
        Chip(Text(f"queued at step {change.queued_step}", "dim")),
        Chip(Text("pending at exit: the run ended before its next boundary", "yellow")),
    ]
    return entry_lines(Text("unapplied ", "bold yellow"), chips, width)


def _applied_entry(
    state: RunState, control: ControlState, applied: AppliedChange, narrow: bool, width: int
) -> list[Text]:
    """An applied change or a rollback: at which step, on how many ranks, what, by whom, its
    notes; then its measured effect, or that an out-of-memory error reverted it."""
    head = (
        Text("rollback ", "bold magenta") if applied.rollback else Text("applied  ", "bold green")
    )
    chips = [Chip(Text(f"step {applied.step}", "bold"))]
    landed, known = state.applied_on(applied)
    if known > 1:  # every rank applies the same change set at the same step
        ranks = Text(f"on {landed}/{known} ranks", "" if landed == known else "bold yellow")
        chips.append(Chip(ranks))
    diffs = diff_words(applied.changes, "→")
    chips.append(Chip(Text(diffs or "no effective change")))
    ids = Text(" ".join(f"#{i}" for i in applied.ids), "dim")
    chips.append(Chip(ids, optional=narrow))
    if not applied.rollback:  # a rollback's head says what it was
        mine = applied.origin == AUTOPILOT
        who = "the autopilot" if mine else state.who_queued(applied.ids) or "an operator"
        style = "bold cyan" if mine else "cyan"
        chips.append(Chip(Text(by_whom(who), style), optional=narrow and not mine))
    if applied.note:
        chips.append(Chip(Text(f"({applied.note})", "dim"), optional=narrow))
    if applied.lr_note:  # a warning that the LR stayed is never left out
        warned = applied.lr_factor is None
        lr = Text(applied.lr_note, "bold yellow" if warned else "cyan")
        chips.append(Chip(lr, optional=narrow and not warned))
    entry = entry_lines(head, chips, width)
    reverted = next(
        (
            later
            for later in control.applied
            if later.rollback and later.step >= applied.step and later.time > applied.time
        ),
        None,
    )
    if reverted is not None and applied.effect is None:
        undone = [Chip(Text(f"reverted at step {reverted.step} (out of memory)", "bold magenta"))]
        if applied.predicted_peak_bytes is not None:
            predicted = f"predicted {format_bytes(applied.predicted_peak_bytes)}"
            undone.append(Chip(Text(predicted, "dim"), " · "))
        entry += entry_lines(Text(INDENT), undone, width)
    elif not applied.rollback:
        measured = effect_chips(applied, state.step)
        if measured is not None:
            entry += entry_lines(Text(INDENT), measured, width)
    return entry


def _rejected_entry(rejected: RejectedChange, narrow: bool, width: int) -> list[Text]:
    """A refused change: at which step, what, the reason, who asked."""
    chips = [Chip(Text(f"step {rejected.step}", "bold"))]
    reason = Text(f"{format_changes(rejected.requested)}: ")
    reason.append(rejected.reason, "red")
    chips.append(Chip(reason))
    if who := by_whom(who_is(rejected.client)):
        chips.append(Chip(Text(who, "dim"), optional=narrow))
    return entry_lines(Text("rejected ", "bold red"), chips, width)


def _cancelled_entry(cancelled: CancelledChange, narrow: bool, width: int) -> list[Text]:
    """A cancelled pending change: at which step, which one, by whom."""
    chips = [
        Chip(Text(f"step {cancelled.step}", "bold")),
        Chip(Text(f"#{cancelled.id} {format_changes(cancelled.changes)}")),
    ]
    if who := by_whom(who_is(cancelled.client)):
        chips.append(Chip(Text(who, "dim"), optional=narrow))
    return entry_lines(Text("cancelled ", "bold yellow"), chips, width)


class ChangeLog(StateView):
    """Pending (predicted peak), applied (step, old → new, measured effect, prediction error),
    rollbacks, OOMs and rejected (reason) changes. Wide: as many lines as fit under the other
    panels; narrow (under the config panel, whose changes it shows landing): the newest
    ``NARROW_LINES``, each entry wrapped between its parts rather than cut."""

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the change log or the viewer's switches change (wide: or the height)."""
        height = None if self.narrow else self.content_size.height
        return state.control_version, view.readonly, height

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """As many lines as fit (narrow: the newest ``NARROW_LINES``, wrapped to ``width``)."""
        separator = Text("\n", no_wrap=True, overflow="ellipsis")
        if self.narrow:
            return separator.join(change_lines(state, view, NARROW_LINES, True, width))
        limit = max(1, self.content_size.height)
        return separator.join(change_lines(state, view, limit))
