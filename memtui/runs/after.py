"""After the run: what a run spent and what the next one should start with (``memtui report``),
two runs side by side (``memtui compare``) and the bounds a CI job holds a run to (``memtui
check``). One typed schema each, built once from the runs' summaries; the JSON encodes it and
the text is drawn from it alone. The JSON keys are a scripting interface: added, never renamed.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Sequence

import msgspec
from msgspec import Struct

from memtui.advice.compare import Bounds, Checked, Figure, check, compare, value_words
from memtui.advice.summary import start_with, yaml_of
from memtui.core.knobs import KNOBS, KnobValue, format_value
from memtui.core.stats import format_bytes, format_duration, quantile
from memtui.runs.report import Applied, Diff, applied_of, diff_words, outcome_words
from memtui.runs.summaries import Found
from memtui.wire import (
    AppliedChange,
    OomEvent,
    PendingChange,
    RankFigures,
    RunSummary,
    SummaryOption,
    VerdictSpan,
)

TUNED_FILE = "memtui-tuned.yaml"
"""The tuned config a run writes in its state directory at every applied change."""


class StepTimes(Struct):
    """The run's step time over the steps it kept: median, percentiles, mean over every step."""

    median_s: float
    p10_s: float
    p90_s: float
    mean_s: float
    """Over every step recorded (its first steps included)."""
    kept: int
    """Steps the percentiles are over (a uniform sample of the run's, its first steps left out)."""


class TimeReport(Struct):
    """Where the run's time went."""

    steps: int
    first_step: int
    last_step: int
    training_s: float
    """The steps' time, summed (checkpoint saves excluded)."""
    wall_s: float
    """From the run's start to the summary."""
    step_time: StepTimes | None
    data_wait_fraction: float | None
    """Data wait over step time, over the run (None: not measured, no DataLoader seen)."""
    samples_per_s: float | None
    """Samples over step time, over the run (None: not counted)."""


class MemoryReport(Struct):
    """The run's peaks and the room left under its limits."""

    kind: str
    capacity_bytes: int
    device_peak_bytes: int
    device_peak_fraction: float
    device_headroom_bytes: int
    device_peak_step: int
    host_peak_bytes: int
    host_limit_bytes: int
    host_headroom_bytes: int
    swap_peak_bytes: int


class VerdictReport(Struct):
    """The verdict over the run: the state that held longest, the last one, and every span."""

    state: str
    """The state that held the largest share of the run's time ("" before a look)."""
    share: float
    at_end: str
    headline: str
    """The last span's headline."""
    seconds: dict[str, float]
    spans: list[VerdictSpan]
    spans_dropped: int = 0


class ChangeReport(Applied, kw_only=True):
    """A change applied during the run, who made it, what was predicted and what it bought."""

    who: str
    """``an operator``, ``the autopilot``, ``a rollback after an out-of-memory error``."""
    summary: str
    """The change and its effect in one line."""


class NextRun(Struct):
    """The config the next run should start with, and how to use it."""

    config: dict[str, KnobValue]
    changed: dict[str, Diff]
    reasons: list[str]
    source: str
    yaml: str
    """The config as a tuned YAML's ``config:`` section."""
    tuned_path: str
    """The run's tuned config, which ``hooks.install(..., resume=PATH)`` starts from ("" when the
    run wrote none: no change was applied)."""
    command: list[str]
    """The run's command with its own flags for these knobs set ([]: its command has none)."""
    measured_peak_bytes: int | None
    """The device peak measured with this config (since the last change; None: not measured)."""
    untested: list[SummaryOption]


class AfterReport(Struct):
    """Everything ``memtui report`` says about a run."""

    run: str
    source: str
    live: bool
    ended: str
    """``ended``, ``interrupted``, ``out of memory``, ``failed: ...`` ("": still running, or
    stopped without its last summary: ``note`` says which)."""
    note: str
    written: float
    started: float
    command: list[str]
    host: str
    pid: int
    world_size: int
    device: str
    state_dir: str
    verdict: VerdictReport
    time: TimeReport
    memory: MemoryReport | None
    changes: list[ChangeReport]
    ooms: list[OomEvent]
    rollbacks: int
    rejected: int
    cancelled: int
    unapplied: list[PendingChange]
    next: NextRun | None
    ranks: list[RankFigures]
    records_dropped: int


# ---------------------------------------------------------------------------- building


def build_after(found: Found) -> AfterReport:
    """The report on one run's summary."""
    summary = found.summary
    info = summary.info
    control = summary.control
    applied = list(control.applied) if control is not None else []
    return AfterReport(
        run=summary.run,
        source=found.source,
        live=found.live,
        ended=summary.ended,
        note=found.note,
        written=summary.written,
        started=info.started,
        command=list(info.command),
        host=info.host,
        pid=info.pid,
        world_size=info.world_size,
        device=info.device,
        state_dir=info.state_dir,
        verdict=_verdict(summary),
        time=_time(summary),
        memory=_memory(summary),
        changes=[_change(a) for a in applied],
        ooms=list(control.ooms) if control is not None else [],
        rollbacks=sum(a.rollback for a in applied),
        rejected=len(control.rejected) if control is not None else 0,
        cancelled=len(control.cancelled) if control is not None else 0,
        unapplied=list(control.unapplied) if control is not None else [],
        next=_next(summary),
        ranks=list(summary.ranks),
        records_dropped=summary.records_dropped,
    )


def _verdict(summary: RunSummary) -> VerdictReport:
    seconds = dict(summary.verdict_seconds)
    state = max(seconds, key=lambda k: seconds[k], default="")
    total = sum(seconds.values())
    last = summary.verdicts[-1] if summary.verdicts else None
    return VerdictReport(
        state=state,
        share=seconds[state] / total if state and total > 0 else 0.0,
        at_end=last.state if last is not None else "",
        headline=last.headline if last is not None else "",
        seconds=seconds,
        spans=list(summary.verdicts),
        spans_dropped=summary.verdicts_dropped,
    )


def _time(summary: RunSummary) -> TimeReport:
    kept = sorted(k.step_time_s for k in summary.kept)
    steps = summary.steps
    step_time = None
    if steps:
        step_time = StepTimes(
            median_s=quantile(kept, 0.5) if kept else summary.step_time_s / steps,
            p10_s=quantile(kept, 0.1) if kept else 0.0,
            p90_s=quantile(kept, 0.9) if kept else 0.0,
            mean_s=summary.step_time_s / steps,
            kept=len(kept),
        )
    training = summary.step_time_s
    return TimeReport(
        steps=steps,
        first_step=summary.first_step,
        last_step=summary.last_step,
        training_s=training,
        wall_s=max(0.0, summary.written - summary.info.started) if summary.info.started else 0.0,
        step_time=step_time,
        data_wait_fraction=summary.data_wait_s / training
        if summary.data_wait_measured and training > 0
        else None,
        samples_per_s=summary.samples / training if summary.samples and training > 0 else None,
    )


def _memory(summary: RunSummary) -> MemoryReport | None:
    memory = summary.memory
    if memory is None:
        return None
    capacity = memory.capacity_bytes
    return MemoryReport(
        kind=memory.kind,
        capacity_bytes=capacity,
        device_peak_bytes=memory.device_peak_bytes,
        device_peak_fraction=memory.device_peak_bytes / capacity if capacity else 0.0,
        device_headroom_bytes=max(0, capacity - memory.device_peak_bytes) if capacity else 0,
        device_peak_step=memory.device_peak_step,
        host_peak_bytes=memory.host_peak_bytes,
        host_limit_bytes=memory.host_limit_bytes,
        host_headroom_bytes=max(0, memory.host_limit_bytes - memory.host_peak_bytes)
        if memory.host_limit_bytes
        else 0,
        swap_peak_bytes=memory.swap_peak_bytes,
    )


def _who(applied: Applied) -> str:
    if applied.rollback:
        return "a rollback after an out-of-memory error"
    return f"the {applied.origin}" if applied.origin else "an operator"


def _change(change: AppliedChange) -> ChangeReport:
    base = applied_of(change)
    who = _who(base)
    line = f"step {base.step}: {diff_words(base.changes) or 'no effective change'} by {who}"
    line += outcome_words(base)
    return ChangeReport(**msgspec.structs.asdict(base), who=who, summary=line)


def _next(summary: RunSummary) -> NextRun | None:
    chosen = start_with(summary)
    if chosen is None:
        return None
    control = summary.control
    applied = list(control.applied) if control is not None else []
    since = applied[-1].time if applied else 0.0
    peaks = [w.device_peak_bytes for w in summary.windows if w.start >= since]
    state_dir = summary.info.state_dir
    tuned = f"{state_dir.rstrip('/')}/{TUNED_FILE}" if state_dir and applied else ""
    return NextRun(
        config=chosen.config,
        changed={k: Diff(old, new) for k, (old, new) in chosen.changed.items()},
        reasons=chosen.reasons,
        source=chosen.source,
        yaml=yaml_of(chosen.config),
        tuned_path=tuned,
        command=command_with(summary.info.command, chosen.config),
        measured_peak_bytes=max(peaks) if peaks and max(peaks) > 0 else None,
        untested=chosen.untested,
    )


FLAGS: dict[str, tuple[str, ...]] = {
    "batch_size": (
        "--batch_size",
        "--batch-size",
        "--per_device_train_batch_size",
        "--per-device-train-batch-size",
        "--train_batch_size",
        "--micro_batch_size",
    ),
    "grad_accum": (
        "--grad_accum",
        "--grad-accum",
        "--gradient_accumulation_steps",
        "--gradient-accumulation-steps",
        "--accumulate_grad_batches",
    ),
    "num_workers": (
        "--num_workers",
        "--num-workers",
        "--workers",
        "--dataloader_num_workers",
        "--dataloader-num-workers",
    ),
    "pin_memory": ("--pin_memory", "--pin-memory", "--dataloader_pin_memory"),
    "prefetch_factor": (
        "--prefetch_factor",
        "--prefetch-factor",
        "--dataloader_prefetch_factor",
    ),
}
"""The command-line flags scripts commonly take for each knob (their own names, the Hugging Face
Trainer's, nanoGPT's ``--key=value``, the demo's)."""


def command_with(command: Sequence[str], config: dict[str, KnobValue]) -> list[str]:
    """``command`` with each knob's flag it already has set to ``config``'s value ([] where the
    command has no flag for a knob ``config`` changes from the command's own value)."""
    words = list(command)
    found = False
    for knob, value in config.items():
        shown = ("True" if value else "False") if isinstance(value, bool) else str(value)
        for index, word in enumerate(words):
            name, sep, _value = word.partition("=")
            if name not in FLAGS.get(knob, ()):
                continue
            if sep:
                words[index] = f"{name}={shown}"
                found = True
            elif index + 1 < len(words) and not words[index + 1].startswith("--"):
                words[index + 1] = shown
                found = True
    return words if found and words != list(command) else []


def after_json(report: Struct) -> str:
    """A report as an indented JSON object."""
    return msgspec.json.format(msgspec.json.encode(report), indent=2).decode()


# ---------------------------------------------------------------------------- text


def render_after(report: AfterReport, now: float | None = None) -> str:
    """The human ``memtui report`` text (one screen), from the report alone."""
    lines = [*_head(report, now), *_time_lines(report), *_memory_lines(report)]
    lines += _change_lines(report)
    lines += _next_lines(report)
    lines += _rank_lines(report)
    return "\n".join(lines)


def _ended_words(report: AfterReport) -> str:
    if report.ended:
        return report.ended
    return "running" if report.live else "no last summary"


def _head(report: AfterReport, now: float | None) -> list[str]:
    when = (
        time.strftime("%Y-%m-%d %H:%M", time.localtime(report.started)) if report.started else "?"
    )
    device = report.device or "?"
    ranks = f"{report.world_size} rank{'s' if report.world_size != 1 else ''}"
    lines = [f"run {report.run}  {_ended_words(report)}  started {when}  {ranks}  {device}"]
    if report.note:
        lines.append(f"  ({report.note})")
    verdict = report.verdict
    if verdict.state:
        others = ", ".join(
            f"{state} {seconds / max(1e-9, sum(verdict.seconds.values())):.0%}"
            for state, seconds in sorted(verdict.seconds.items(), key=lambda kv: -kv[1])
            if state != verdict.state
        )
        line = f"verdict over the run: {verdict.state} {verdict.share:.0%} of the time"
        if others:
            line += f" (then {others})"
        lines.append(line)
        lines.append(f"  at the end: {verdict.at_end}: {verdict.headline}")
    else:
        lines.append("verdict over the run: none yet (no step looked at)")
    return lines


def _time_lines(report: AfterReport) -> list[str]:
    times = report.time
    if not times.steps:
        return ["time: no step recorded"]
    lines = [
        f"time: {times.steps} steps (steps {times.first_step}-{times.last_step}) in "
        f"{format_duration(times.training_s)} of training, {format_duration(times.wall_s)} of wall time"
    ]
    step = times.step_time
    if step is not None:
        wait = (
            f"data wait {times.data_wait_fraction:.1%} of it"
            if times.data_wait_fraction is not None
            else "data wait not measured (no DataLoader seen)"
        )
        samples = (
            f"{times.samples_per_s:,.1f} samples/s"
            if times.samples_per_s is not None
            else "samples not counted"
        )
        spread = (
            f" (p10 {format_duration(step.p10_s)}, p90 {format_duration(step.p90_s)})"
            if step.kept
            else ""
        )
        lines.append(f"  step {format_duration(step.median_s)} median{spread}; {wait}; {samples}")
    return lines


def _memory_lines(report: AfterReport) -> list[str]:
    memory = report.memory
    if memory is None:
        return ["memory: not sampled"]
    label = "device" if memory.kind == "cuda" else "device (CPU: main RSS + workers)"
    line = f"memory: {label} peak {format_bytes(memory.device_peak_bytes)}"
    if memory.capacity_bytes:
        line += (
            f" of {format_bytes(memory.capacity_bytes)} ({memory.device_peak_fraction:.0%}) at "
            f"step {memory.device_peak_step}: {format_bytes(memory.device_headroom_bytes)} left"
        )
    lines = [line]
    if memory.kind == "cuda" and memory.host_peak_bytes:
        host = f"  host: process tree peak {format_bytes(memory.host_peak_bytes)}"
        if memory.host_limit_bytes:
            host += (
                f" of {format_bytes(memory.host_limit_bytes)}: "
                f"{format_bytes(memory.host_headroom_bytes)} left"
            )
        lines.append(host)
    if memory.swap_peak_bytes:
        lines.append(f"  swap in use at peak: {format_bytes(memory.swap_peak_bytes)}")
    for oom in report.ooms[-3:]:
        what = "rolled back, training went on" if oom.rolled_back else "not rolled back"
        lines.append(f"  OUT OF MEMORY at step {oom.step}: {what}; {oom.batch}")
    return lines


def _change_lines(report: AfterReport) -> list[str]:
    lines: list[str] = []
    if not report.changes:
        lines.append("changes: none applied")
    else:
        shown = report.changes[-6:]
        skipped = len(report.changes) - len(shown)
        lines.append(
            f"changes: {len(report.changes)} applied"
            + (
                f" ({report.rollbacks} rollback{'s' if report.rollbacks != 1 else ''})"
                if report.rollbacks
                else ""
            )
            + (f", the first {skipped} not shown" if skipped else "")
        )
        lines += [f"  {c.summary}" for c in shown]
    refused = []
    if report.rejected:
        refused.append(f"{report.rejected} refused")
    if report.cancelled:
        refused.append(f"{report.cancelled} cancelled")
    if report.unapplied:
        refused.append(f"{len(report.unapplied)} pending when the run ended, never applied")
    if refused:
        lines.append(f"  and {', '.join(refused)}")
    return lines


def _next_lines(report: AfterReport) -> list[str]:
    nxt = report.next
    if nxt is None:
        return ["next run: the run told no config memtui could read"]
    config = " ".join(f"{k}={format_value(v)}" for k, v in nxt.config.items())
    lines = [f"start the next run with: {config}"]
    if not nxt.changed:
        lines.append(f"  ({nxt.source}: what it started with)")
    else:
        lines.append(f"  ({nxt.source})")
    lines += [f"  {reason}" for reason in nxt.reasons]
    if nxt.measured_peak_bytes:
        lines.append(f"  device peak measured with it: {format_bytes(nxt.measured_peak_bytes)}")
    if nxt.changed:
        if nxt.command:
            lines.append(f"  command: {shlex.join(nxt.command)}")
        if nxt.tuned_path:
            lines.append(f'  or hooks.install(..., resume="{nxt.tuned_path}"), which holds:')
        else:
            lines.append("  or in your config:")
        lines += [f"    {line}" for line in nxt.yaml.splitlines()]
    for option in nxt.untested[:2]:
        changes = " ".join(f"{k}={format_value(v)}" for k, v in option.changes.items())
        speed = f", {option.speed_delta:+.0%} samples/s expected" if option.speed_delta else ""
        lines.append(f"  untested: {changes} ({option.title}{speed}; not measured in this run)")
    return lines


MAX_RANK_LINES = 8
"""Ranks the text lists at most (rank 0, the slowest, the hungriest): ``--json`` has every one."""


def shown_ranks(ranks: Sequence[RankFigures]) -> list[RankFigures]:
    """The ranks the text lists, in rank order: every one up to ``MAX_RANK_LINES``, else rank 0,
    then the slowest steps and the highest peaks, in turn."""
    if len(ranks) <= MAX_RANK_LINES:
        return list(ranks)
    slowest = sorted(ranks, key=lambda r: -r.step_time_s)
    hungriest = sorted(ranks, key=lambda r: -r.device_peak_bytes)
    chosen = {ranks[0].rank: ranks[0]}
    for pair in zip(slowest, hungriest, strict=True):
        for rank in pair:
            if len(chosen) < MAX_RANK_LINES:
                chosen.setdefault(rank.rank, rank)
    return [chosen[r] for r in sorted(chosen)]


def _rank_lines(report: AfterReport) -> list[str]:
    if len(report.ranks) < 2:
        return []
    shown = shown_ranks(report.ranks)
    lines = ["rank  steps  step time  data wait  samples/s  peak mem"]
    if len(shown) < len(report.ranks):
        lines[0] += (
            f"  ({len(shown)} of {len(report.ranks)} ranks: rank 0, the slowest and the "
            "hungriest; --json lists every one)"
        )
    for r in shown:
        wait = f"{r.data_wait_fraction:.0%}" if r.data_wait_measured else "-"
        lines.append(
            f"{r.rank:>4}  {r.steps:>5}  {format_duration(r.step_time_s):>9}  {wait:>9}  "
            f"{r.samples_per_s:>9,.1f}  {format_bytes(r.device_peak_bytes):>8}"
        )
    return lines


# ---------------------------------------------------------------------------- two runs


class RunLabel(Struct):
    """Which run a side of a comparison is."""

    run: str
    source: str
    steps: int
    ended: str
    config: dict[str, KnobValue]


class SpreadReport(Struct):
    """One run's figure: median, 10th and 90th percentile, over ``n`` values."""

    median: float
    p10: float
    p90: float
    n: int


class FigureReport(Struct):
    """One figure of two runs and the verdict on it."""

    key: str
    name: str
    unit: str
    first: SpreadReport | None
    second: SpreadReport | None
    change: float | None
    change_low: float | None
    change_high: float | None
    p_value: float | None
    verdict: str
    note: str


class CompareReport(Struct):
    """Everything ``memtui compare A B`` says: B against A, figure by figure."""

    first: RunLabel
    second: RunLabel
    figures: list[FigureReport]


def _label(found: Found) -> RunLabel:
    summary = found.summary
    control = summary.control
    config: dict[str, KnobValue] = {}
    if control is not None:
        raw = msgspec.structs.asdict(control.config)
        config = {k: raw[k] for k in KNOBS if raw.get(k) is not None}
    return RunLabel(summary.run, found.source, summary.steps, summary.ended, config)


def _spread(figure: Figure, first: bool) -> SpreadReport | None:
    spread = figure.first if first else figure.second
    if spread is None:
        return None
    return SpreadReport(spread.median, spread.p10, spread.p90, spread.n)


def build_compare(first: Found, second: Found) -> CompareReport:
    """``second`` against ``first``, figure by figure."""
    return CompareReport(
        first=_label(first),
        second=_label(second),
        figures=[
            FigureReport(
                key=f.key,
                name=f.name,
                unit=f.unit,
                first=_spread(f, True),
                second=_spread(f, False),
                change=f.change,
                change_low=f.change_low,
                change_high=f.change_high,
                p_value=f.p_value,
                verdict=f.verdict,
                note=f.note,
            )
            for f in compare(first.summary, second.summary)
        ],
    )


def _side(unit: str, spread: SpreadReport | None) -> str:
    if spread is None:
        return "-"
    if spread.n > 1 and spread.p10 != spread.p90:
        return (
            f"{value_words(unit, spread.median)} "
            f"[{value_words(unit, spread.p10)}-{value_words(unit, spread.p90)}]"
        )
    return value_words(unit, spread.median)


def render_compare(report: CompareReport) -> str:
    """The human ``memtui compare`` text: both runs' figures side by side, B against A."""
    a, b = report.first, report.second

    def config(label: RunLabel) -> str:
        return " ".join(f"{k}={format_value(v)}" for k, v in label.config.items()) or "?"

    lines = [
        f"A: {a.run} ({a.source}, {a.steps} steps, {a.ended or 'no last summary'}): {config(a)}",
        f"B: {b.run} ({b.source}, {b.steps} steps, {b.ended or 'no last summary'}): {config(b)}",
        "",
    ]
    rows = [("", "A [p10-p90]", "B [p10-p90]", "B against A", "verdict")]
    for f in report.figures:
        change = "-"
        if f.change is not None:
            change = f"{f.change:+.1%}"
            if f.change_low is not None and f.change_high is not None:
                change += f" ({f.change_low:+.0%}..{f.change_high:+.0%})"
        verdict = f.verdict
        if f.verdict == "within the noise":
            pass
        elif f.note:
            verdict += f" ({f.note})"
        elif f.p_value is not None:
            verdict += f" (p={f.p_value:.2g})"
        rows.append((f.name, _side(f.unit, f.first), _side(f.unit, f.second), change, verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        lines.append(
            "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4]
        )
    lines.append("")
    lines.append(
        "step times, data waits and samples/s: each run's kept steps, Mann-Whitney rank test "
        "(p under 0.05: not noise), 95% interval of the medians' ratio; peaks: one per run, "
        "noise from each run's own stretches"
    )
    return "\n".join(line.rstrip() for line in lines)


# ---------------------------------------------------------------------------- the CI gate


class CheckLine(Struct):
    """One bound checked."""

    bound: str
    passed: bool
    line: str


class CheckReport(Struct):
    """Everything ``memtui check`` says: each bound, and whether the run passed them all."""

    run: str
    source: str
    reference: str
    passed: bool
    bounds: list[CheckLine]


def build_check(found: Found, bounds: Bounds, reference: Found | None) -> CheckReport:
    """Check ``found``'s run against ``bounds`` (and ``reference`` where given)."""
    results: list[Checked] = check(found.summary, bounds, reference.summary if reference else None)
    return CheckReport(
        run=found.summary.run,
        source=found.source,
        reference=reference.source if reference is not None else "",
        passed=all(r.passed for r in results),
        bounds=[CheckLine(r.bound, r.passed, r.line) for r in results],
    )


def render_check(report: CheckReport) -> str:
    """One line per bound: ``FAIL ...`` for each that failed, ``ok ...`` for each that held."""
    lines = [f"{'ok' if c.passed else 'FAIL'} {c.line}" for c in report.bounds]
    verdict = "passed" if report.passed else "FAILED"
    lines.append(f"memtui check {report.run}: {verdict}")
    return "\n".join(lines)
