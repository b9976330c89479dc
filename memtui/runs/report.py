"""The ``memtui status`` report: one typed schema, built once, encoded for ``--json`` and
rendered to text by one function.

The JSON is a public scripting interface: fields are added, never renamed or removed. Every
field below is a key of ``memtui status --json``; the text view reads nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
from msgspec import UNSET, Struct, UnsetType

from memtui.advice.assess import STATE_NAMES, assess, known_of
from memtui.advice.autopilot import describe_state as describe_autopilot
from memtui.advice.effect import describe as describe_effect
from memtui.advice.measure import accuracy, error_words, prediction_error
from memtui.advice.prediction import ceiling_words
from memtui.advice.speed import describe_speed, speed_accuracy, speed_error
from memtui.advice.verdict import Reason, ThresholdConfig, Thresholds
from memtui.core.knobs import (
    KNOBS,
    KnobValue,
    KnownConfig,
    OldNew,
    format_changes,
    format_diffs,
    format_value,
)
from memtui.core.stats import (
    StepStats,
    format_bytes,
    format_duration,
    format_rate,
    process_tree,
    summarize_device,
    summarize_steps,
)
from memtui.runs.throughput import Throughput, job_throughput, samples_words, step_words
from memtui.transport.security import exposure, tcp_endpoints
from memtui.wire import (
    AppliedChange,
    AutopilotState,
    CancelledChange,
    Ceiling,
    Effect,
    HookCounters,
    HostSample,
    LrState,
    MemoryModel,
    OomEvent,
    PendingChange,
    RankInfo,
    RejectedChange,
    Snapshot,
    StaticMemory,
    StepRecord,
)

StructT = TypeVar("StructT", bound=Struct)

Config = dict[str, KnobValue | None]
"""Every knob by name with its value, tunable or not (``tunable`` says which memtui can change,
``config_unused`` which the loader does not use now); ``None`` where memtui does not know it."""


class Metrics(Struct):
    """Step timing over the snapshot's window of steps, of one rank."""

    window_steps: int
    step_time_s: float
    data_wait_s: float
    data_wait_fraction: float
    samples_per_s: float
    """This rank's own samples/s: the rows of its training batches over its steps' time (the
    job's is ``throughput.samples_per_s``)."""
    steps_per_s: float
    data_wait_measured: bool = True
    """False where no step drew a batch memtui timed (no DataLoader seen): the wait is unknown,
    and ``samples_per_s`` (0) was not counted."""
    micro_batches_per_step: float = 0.0
    """Mean training micro-batches a step drew on this rank (an optimizer step is made of them)."""
    samples_per_step: float = 0.0
    """Mean samples a step trained on this rank."""
    samples_counted: bool = True
    """False where no step counted a sample (a batch with no tensor memtui could find):
    ``samples_per_s`` (0) is not known."""


class JobThroughput(Struct):
    """The job's samples/s: every answering rank's own summed (``memtui.runs.throughput``, the
    figure the viewer's header and the exporter's ``memtui_job_samples_per_second`` give)."""

    samples_per_s: float
    """The ranks' samples/s summed (0 where none was counted)."""
    ranks: int
    """The ranks summed: those that answered with counted samples."""
    world_size: int
    """The job's ranks."""
    micro_batches_per_step: float
    """Micro-batches one optimizer step draws on a rank (the lowest rank summed)."""
    samples_per_step: float
    """The samples of one optimizer step over the ranks summed (the global batch)."""
    summary: str
    """``1,654 samples/s (2 ranks)``, or ``samples not counted``."""
    step: str
    """What memtui's step is, in words ("" before a batch was counted)."""


class Memory(Struct):
    """Device memory now and at peak (on CPU: the main process's RSS plus the workers' USS)."""

    kind: str
    capacity_bytes: int
    current_bytes: int
    reserved_bytes: int
    peak_bytes: int
    peak_allocated_bytes: int
    peak_fraction: float
    fragmentation_bytes: int
    nvml_used_bytes: int | None
    beyond_torch_bytes: int | None
    ooms: int
    alloc_retries: int


class Diff(Struct):
    """One knob's value before and after a change."""

    old: KnobValue | None
    new: KnobValue


class EffectReport(Effect, kw_only=True):
    """A change's measured effect, with its one-line summary."""

    summary: str


class Applied(Struct):
    """A change applied at a checkpoint, with its prediction's error and its effect."""

    ids: list[int]
    step: int
    time: float
    changes: dict[str, Diff]
    note: str
    rollback: bool
    predicted_peak_bytes: int | None
    observed_peak_bytes: int | None
    prediction_error: float | None
    """Predicted over observed peak, minus one (None until both are known)."""
    effect: EffectReport | None
    predicted_speed_delta: float | None = None
    """The change of samples/s predicted from the steps before it (None: no estimate)."""
    speed_note: str = ""
    """How that speed was predicted, or why not."""
    speed_error: float | None = None
    """Predicted minus measured change of samples/s (None until both are known)."""
    origin: str = ""
    """Who asked for it: "" an operator, "autopilot" the autopilot."""
    lr_factor: float | None = None
    """What the LR was multiplied by with the change (None: it stayed)."""
    lr_note: str = ""
    """The LR change in words, or the warning that it did not follow the effective batch."""
    effect_note: str = ""
    """What the change could not do on this run (``pin_memory does nothing without an
    accelerator: its effect is not measured``)."""


class VerdictReport(Struct):
    """The verdict, the thresholds it was decided with and the numbers behind it."""

    state: str
    severity: int
    headline: str
    thresholds_from: str
    thresholds: Thresholds
    reasons: list[Reason]


class Option(Struct):
    """One recommended change and what it is expected to do."""

    title: str
    changes: dict[str, KnobValue]
    applicable: bool
    needs_restart: bool
    why: str
    memory_delta_bytes: int | None
    host_delta_bytes: int | None
    speed_delta: float | None
    speed_note: str
    predicted_peak_bytes: int | None
    effective_batch: int | None


class ModelReport(MemoryModel, kw_only=True):
    """The fitted memory model, with how much to trust it."""

    confidence: str


class Accuracy(Struct):
    """How far the memory predictions of applied changes were from what was observed; the
    changes that ran out of memory are misses, counted apart (not in the mean)."""

    changes_measured: int
    mean_abs_error: float | None
    changes_out_of_memory: int = 0
    note: str = ""


class SpeedAccuracyReport(Struct):
    """How far the speed predictions of applied changes were from their measured effects."""

    changes_measured: int
    mean_abs_error: float | None
    """Mean |predicted - measured| change of samples/s (0.05: 5 points)."""
    within_noise: int
    """Predictions inside the measured effect's 95% interval."""
    no_estimate: int
    note: str = ""


class Checkpoint(Struct):
    """One checkpoint the run saved."""

    step: int
    time: float
    save_s: float


class Counters(HookCounters, omit_defaults=False):
    """The hook's counters, every one shown (zero included: what peers were refused above all)."""


class ProcessTreeMemory(Struct):
    """A rank's process tree in host memory: its main process's RSS and its loader workers (its
    descendants, the job's other ranks left out) by their own memory (USS) where the hook read
    it, else by their RSS; the viewer's per-rank table counts it the same way."""

    main_rss_bytes: int
    workers: int
    workers_bytes: int
    workers_measure: str
    """``USS`` or ``RSS`` ("" without workers)."""
    total_bytes: int
    """``main_rss_bytes + workers_bytes``."""


def process_tree_memory(host: HostSample | None) -> ProcessTreeMemory | None:
    """The report's form of ``core.stats.process_tree`` (None without a host sample)."""
    if host is None:
        return None
    tree = process_tree(host)
    return ProcessTreeMemory(
        main_rss_bytes=tree.main_rss_bytes,
        workers=tree.workers,
        workers_bytes=tree.workers_bytes,
        workers_measure=tree.measure,
        total_bytes=tree.total_bytes,
    )


class RankReport(Struct):
    """One rank: where it runs and, when it answered, its own numbers."""

    rank: int
    local_rank: int
    host: str
    pid: int
    reachable: bool
    step: int | UnsetType = UNSET
    config: Config | UnsetType = UNSET
    applied: list[Applied] | UnsetType = UNSET
    metrics: Metrics | UnsetType | None = UNSET
    memory: Memory | UnsetType | None = UNSET
    host_memory: HostSample | UnsetType | None = UNSET
    counters: Counters | UnsetType = UNSET
    process_tree: ProcessTreeMemory | UnsetType | None = UNSET
    """The rank's process tree in host memory (its own loader workers, never another rank)."""


class StatusReport(Struct):
    """Everything ``memtui status`` says about a run."""

    run: str
    pid: int
    host: str
    started: float
    command: list[str]
    world_size: int
    device: str
    step: int
    config: Config
    tunable: list[str]
    effective_batch: int | None
    pending: list[PendingChange]
    applied: list[Applied]
    rejected: list[RejectedChange]
    metrics: Metrics | None
    memory: Memory | None
    verdict: VerdictReport
    breakdown: dict[str, int] | None
    """Bytes by part of the peak, with the capacity they share: ``parameters``, ``gradients``
    and ``optimizer`` from the tensors of the optimizer the hook knows; on CUDA ``other
    steady``, ``activations`` (the allocator's step peak over what stays allocated between
    steps), ``fragmentation`` and ``beyond torch``; on CPU ``in-step`` (the peak RSS over what
    was resident between steps), ``runtime and workers`` and ``malloc free``; ``not known yet``
    for what cannot be split before the optimizer is known and the memory between steps is
    read; ``free``."""
    static_memory: StaticMemory | None
    recommendations: list[Option]
    max_safe_batch_size: int | None
    """The largest micro-batch the memory model predicts under the edge band; where ``max_safe``
    starts with ``>`` it is a guess past the micro-batches measured, and the text says only
    that floor."""
    model: ModelReport | None
    prediction_accuracy: Accuracy
    ooms: list[OomEvent]
    disabled: str
    ranks: list[RankReport]
    last_step: StepRecord | None
    host_memory: HostSample | None
    checkpoints: list[Checkpoint]
    counters: Counters
    state_dir: str
    tuned_path: str
    requeue: str
    tuned_unsaved_step: int | None
    audit_path: str
    security: str = ""
    """How the run's sockets are protected (``ipc``, ``curve``, ...)."""
    exposure: str = ""
    """A warning when the run listens on TCP without protection (empty when it does not)."""
    max_safe: str = ""
    """``max_safe_batch_size`` in words: a guess far past the micro-batches measured, or under
    one that ran out of memory."""
    ceiling: Ceiling | None = None
    """What ran out of memory: the gate, the max safe batch and the advice stay under it."""
    speed_accuracy: SpeedAccuracyReport | None = None
    """How the speed predictions of the applied changes fared (None: an older report)."""
    cancelled: list[CancelledChange] = []
    """Pending changes cancelled, from any shell or viewer, most recent last."""
    autopilot: AutopilotState | None = None
    """The autopilot's state (None: an older hook)."""
    config_unused: dict[str, str] = {}
    """The knobs of ``config`` the run's loader does not use now, with why (``prefetch_factor``
    without loader workers): ``config`` keeps their value, the one used once they apply."""
    lr: LrState | None = None
    """The factor the optimizers' LR carries over the script's own, as the hook last read it
    before a step, and whether the script sets its LR itself (None: an older hook)."""
    untunable: dict[str, str] = {}
    """Why each knob this run cannot change is not tunable, by knob (where the hook knows)."""
    boundary: str = ""
    """Where queued changes apply, in words ("" the run's next checkpoint)."""
    config_measured: list[str] = []
    """The knobs of ``config`` whose value was measured from the steps (the samples of a
    micro-batch, the micro-batches of a step), not read: the run holds them where memtui
    cannot read them."""
    unapplied: list[PendingChange] = []
    """Changes still pending when the run ended: never applied."""
    process_tree: ProcessTreeMemory | None = None
    """The control rank's process tree in host memory (None: no host sample)."""
    throughput: JobThroughput | None = None
    """The job's samples/s (every answering rank's own summed) and what one step is (None: an
    older report)."""


def untunable_lines(untunable: Mapping[str, str]) -> list[str]:
    """``not tunable: batch_size, grad_accum: why``, one line per reason, knobs in order."""
    by_reason: dict[str, list[str]] = {}
    for knob in KNOBS:
        if knob in untunable:
            by_reason.setdefault(untunable[knob], []).append(knob)
    return [f"not tunable: {', '.join(knobs)}: {why}" for why, knobs in by_reason.items()]


# ---------------------------------------------------------------------------- building


def _known(snapshot: Snapshot) -> KnownConfig:
    """The knobs of the run (of the rank that sent ``snapshot``) as far as memtui knows them."""
    return known_of(snapshot.control, summarize_steps(snapshot.steps))


def _config(known: KnownConfig) -> Config:
    return dict(known.values)


def applied_of(applied: AppliedChange) -> Applied:
    """The report's form of an applied change: its prediction's error and its effect in words."""
    error = prediction_error(applied)
    effect = None
    if applied.effect is not None:
        effect = EffectReport(
            **msgspec.structs.asdict(applied.effect), summary=describe_effect(applied.effect)
        )
    return Applied(
        ids=applied.ids,
        step=applied.step,
        time=applied.time,
        changes={k: Diff(d.old, d.new) for k, d in applied.changes.items()},
        note=applied.note,
        rollback=applied.rollback,
        predicted_peak_bytes=applied.predicted_peak_bytes,
        observed_peak_bytes=applied.observed_peak_bytes,
        prediction_error=error,
        effect=effect,
        predicted_speed_delta=applied.predicted_speed_delta,
        speed_note=applied.speed_note,
        speed_error=speed_error(applied),
        origin=applied.origin,
        lr_factor=applied.lr_factor,
        lr_note=applied.lr_note,
        effect_note=applied.effect_note,
    )


def _wait_words(metrics: Metrics) -> str:
    """``data wait 12 ms (9%)``, or that it is not measured (no batch memtui timed)."""
    if not metrics.data_wait_measured:
        return "data wait not measured (no DataLoader seen)"
    return f"data wait {format_duration(metrics.data_wait_s)} ({metrics.data_wait_fraction:.0%})"


def _rank_samples_words(metrics: Metrics) -> str:
    """A rank's own ``827``, or ``-`` where its samples were not counted."""
    if not (metrics.data_wait_measured and metrics.samples_counted):
        return "-"
    return format_rate(metrics.samples_per_s)


def _fields_of(schema: type[StructT], source: object, **renamed: str) -> StructT:
    """``schema`` filled from ``source``'s attributes of the same names (``renamed``: field ->
    attribute where they differ)."""
    names = schema.__struct_fields__
    return schema(**{f: getattr(source, renamed.get(f, f)) for f in names})


def _metrics(steps: StepStats | None) -> Metrics | None:
    return None if steps is None else _fields_of(Metrics, steps, window_steps="steps")


def _throughput(found: Throughput) -> JobThroughput:
    return JobThroughput(
        samples_per_s=found.samples_per_s,
        ranks=found.ranks,
        world_size=found.world_size,
        micro_batches_per_step=found.micro_batches_per_step,
        samples_per_step=found.samples_per_step,
        summary=samples_words(found),
        step=step_words(found),
    )


def _memory(snapshot: Snapshot) -> Memory | None:
    memory = summarize_device(snapshot.device)
    return None if memory is None else _fields_of(Memory, memory)


def _counters(counters: HookCounters | None) -> Counters:
    if counters is None:
        return Counters()
    return Counters(**msgspec.structs.asdict(counters))


def _rank(rank: RankInfo, snapshot: Snapshot | None, steps: StepStats | None) -> RankReport:
    entry = RankReport(
        rank=rank.rank,
        local_rank=rank.local_rank,
        host=rank.host,
        pid=rank.pid,
        reachable=snapshot is not None,
    )
    if snapshot is not None:
        entry.step = snapshot.step
        entry.config = _config(_known(snapshot))
        entry.applied = [applied_of(a) for a in snapshot.control.applied]
        entry.metrics = _metrics(steps)
        entry.memory = _memory(snapshot)
        entry.host_memory = snapshot.host[-1] if snapshot.host else None
        entry.process_tree = process_tree_memory(entry.host_memory)
        entry.counters = _counters(snapshot.counters)
    return entry


def _option_of(r: Any) -> Option:
    return Option(
        title=r.title,
        changes=r.changes,
        applicable=r.applicable,
        needs_restart=r.needs_restart,
        why=r.why,
        memory_delta_bytes=r.memory_delta_bytes,
        host_delta_bytes=r.host_delta_bytes,
        speed_delta=r.speed_delta,
        speed_note=r.speed_note,
        predicted_peak_bytes=r.predicted_peak_bytes,
        effective_batch=r.effective_batch,
    )


def build_status(
    snapshot: Snapshot,
    ranks: list[Snapshot | None] | None = None,
    thresholds: ThresholdConfig | None = None,
) -> StatusReport:
    """The report on rank 0's ``snapshot`` (and every rank's, where ``ranks`` is given)."""
    config = thresholds or ThresholdConfig(Thresholds(), "built-in defaults")
    found = assess(snapshot, ranks, config.thresholds)
    info, control = snapshot.info, snapshot.control
    known = _known(snapshot)
    rank_infos = snapshot.ranks or []
    per_rank = ranks if ranks is not None else [snapshot] * max(1, len(rank_infos))
    own_steps = summarize_steps(snapshot.steps)
    answered = ranks if ranks is not None else [snapshot]
    rank_steps = [
        own_steps if s is snapshot else summarize_steps(s.steps) if s is not None else None
        for s in answered
    ]
    # rank 0's own snapshot stands for every rank only where no other was read
    per_rank_steps = rank_steps if ranks is not None else [own_steps] * len(per_rank)
    scored = accuracy(control.applied, control.ooms)
    speeds = speed_accuracy(control.applied)
    model = None
    if control.model is not None:
        model = ModelReport(
            **msgspec.structs.asdict(control.model), confidence=found.model_confidence
        )
    breakdown = None
    if found.breakdown is not None:
        breakdown = {"capacity_bytes": found.breakdown.capacity_bytes, **found.breakdown.as_dict()}
    counters = _counters(snapshot.counters)
    return StatusReport(
        run=info.run,
        pid=info.pid,
        host=info.host,
        started=info.started,
        command=info.command,
        world_size=info.world_size,
        device=info.device,
        step=snapshot.step,
        config=_config(known),
        config_unused=known.unused,
        config_measured=list(known.measured),
        untunable=dict(control.untunable),
        boundary=control.boundary,
        tunable=control.tunable,
        effective_batch=known.effective_batch(),
        pending=list(control.pending),
        unapplied=list(control.unapplied),
        applied=[applied_of(a) for a in control.applied],
        rejected=list(control.rejected),
        cancelled=list(control.cancelled),
        metrics=_metrics(own_steps),
        throughput=_throughput(job_throughput(rank_steps, info.world_size)),
        memory=_memory(snapshot),
        verdict=VerdictReport(
            state=STATE_NAMES[found.verdict.state],
            severity=found.verdict.severity,
            headline=found.verdict.headline,
            thresholds_from=config.source,
            thresholds=config.thresholds,
            reasons=list(found.verdict.reasons),
        ),
        breakdown=breakdown,
        static_memory=control.static,
        recommendations=[_option_of(r) for r in found.recommendations],
        max_safe_batch_size=found.max_safe_batch_size,
        max_safe=found.max_safe,
        ceiling=control.ceiling,
        model=model,
        prediction_accuracy=Accuracy(
            changes_measured=scored.measured,
            mean_abs_error=scored.mean_abs_error,
            changes_out_of_memory=scored.out_of_memory,
            note=scored.describe(),
        ),
        speed_accuracy=SpeedAccuracyReport(
            changes_measured=speeds.measured,
            mean_abs_error=speeds.mean_abs_error,
            within_noise=speeds.within_noise,
            no_estimate=speeds.unknown,
            note=describe_speed(speeds),
        ),
        ooms=list(control.ooms),
        disabled=control.disabled,
        autopilot=control.autopilot,
        lr=control.lr,
        ranks=[
            _rank(r, snap, steps)
            for r, snap, steps in zip(rank_infos, per_rank, per_rank_steps, strict=False)
        ],
        last_step=snapshot.steps[-1] if snapshot.steps else None,
        host_memory=snapshot.host[-1] if snapshot.host else None,
        process_tree=process_tree_memory(snapshot.host[-1] if snapshot.host else None),
        checkpoints=[Checkpoint(c.step, c.time, c.save_s) for c in snapshot.checkpoints[-5:]],
        counters=counters,
        state_dir=info.state_dir,
        tuned_path=info.tuned_path,
        requeue=info.requeue,
        tuned_unsaved_step=counters.tuned_unsaved_step,
        audit_path=info.audit_path,
        security=info.security,
        exposure=exposure(info.security, tcp_endpoints(snapshot.ranks)) or "",
    )


_ENCODER = msgspec.json.Encoder()


def status_json(report: StatusReport) -> str:
    """``memtui status --json``: the report as an indented JSON object."""
    return msgspec.json.format(_ENCODER.encode(report), indent=2).decode()


# ---------------------------------------------------------------------------- text


def diff_words(diffs: Mapping[str, OldNew], arrow: str = "->") -> str:
    """``batch_size 16 -> 32, prefetch_factor default -> 4``: each knob from its old value to
    its new one, a knob the run had not set named as its loader's ``default``."""
    return format_diffs(diffs, arrow)


def predicted_speed_words(predicted: float, measured_effect: Effect | None) -> str:
    """``predicted speed +118%, measured +233%`` (``predicted speed +118% samples/s`` until
    measured)."""
    words = f"predicted speed {signed(predicted)}"
    if measured_effect is None or measured_effect.samples_per_s_before <= 0:
        return words + " samples/s" if round(predicted, 2) else words
    rate = measured_effect.samples_per_s_after / measured_effect.samples_per_s_before - 1
    return words + f", measured {signed(rate)}"


def signed(change: float) -> str:
    """A relative change as ``+35%``, or ``no change`` where it rounds to 0% (``+0%`` reads as a
    gain)."""
    return f"{change:+.0%}" if round(change, 2) else "no change"


def lr_line(lr: LrState, world_size: int = 1) -> str:
    """The LR in one line: the factor over the script's own and where it comes from, or that
    the script sets its LR itself ("" while the LR is the script's own and memtui may scale it)."""
    if lr.script_schedule:
        return f"lr: the script's own schedule, not scaled by memtui ({lr.script_schedule})"
    if lr.factor == 1.0:
        return ""
    text = f"lr: x{round(lr.factor, 4)} the script's own"
    if lr.rule and lr.anchor_batch:
        text += f" ({lr.rule} from effective batch {lr.anchor_batch * world_size})"
    if lr.fields:
        text += f", with {', '.join(lr.fields)}"
    return text


def render_status(report: StatusReport, now: float | None = None) -> str:
    """The human ``memtui status`` text, from the report alone."""
    sections = (
        _run_lines(report, now),
        _memory_lines(report),
        _config_lines(report),
        _change_lines(report),
        _accuracy_lines(report),
        _advice_lines(report),
        _rank_lines(report),
        _hook_lines(report),
    )
    return "\n".join(line for section in sections for line in section)


def _run_lines(report: StatusReport, now: float | None) -> list[str]:
    """The run, its exposure, the verdict and the step line."""
    lines: list[str] = []
    age = format_duration(max(0.0, (time.time() if now is None else now) - report.started))
    lines.append(
        f"run {report.run}  pid {report.pid}  host {report.host}  ranks {report.world_size}  up {age}"
    )
    if report.exposure:
        lines.append(report.exposure)
    verdict = report.verdict
    lines.append(f"verdict: {verdict.state}: {verdict.headline}")
    metrics = report.metrics
    if metrics:
        job = report.throughput
        if job is not None:  # the job's figure, as the viewer and the exporter give it
            samples = job.summary
        elif metrics.data_wait_measured:
            samples = f"{metrics.samples_per_s:.0f} samples/s"
        else:
            samples = "samples not counted"
        lines.append(
            f"step {report.step}  {format_duration(metrics.step_time_s)}/step  "
            f"{_wait_words(metrics)}  {samples}  {metrics.steps_per_s:.2f} steps/s"
        )
        if job is not None and job.step:
            lines.append(job.step)
    else:
        lines.append(f"step {report.step}  (no timed steps yet)")
    return lines


def _memory_lines(report: StatusReport) -> list[str]:
    """Device memory, its breakdown, the memory model, the ceiling and the host."""
    lines: list[str] = []
    memory = report.memory
    if memory:
        label = (
            "device cpu (main RSS + workers USS)"
            if memory.kind == "cpu"
            else f"device {report.device}"
        )
        line = (
            f"{label}: {format_bytes(memory.current_bytes)} now, peak {format_bytes(memory.peak_bytes)} "
            f"of {format_bytes(memory.capacity_bytes)} ({memory.peak_fraction:.0%})"
        )
        if memory.kind == "cuda":
            line += f", fragmentation {format_bytes(memory.fragmentation_bytes)}"
            if memory.beyond_torch_bytes is not None:
                line += f", beyond torch {format_bytes(memory.beyond_torch_bytes)}"
        lines.append(line)
    if report.breakdown:
        parts = [
            f"{k} {format_bytes(v)}"
            for k, v in report.breakdown.items()
            if k != "capacity_bytes" and v
        ]
        lines.append("breakdown at peak: " + ", ".join(parts))
    model = report.model
    if model:
        safe = report.max_safe_batch_size
        edge = report.verdict.thresholds.memory_edge_fraction
        lines.append(
            f"memory model: {format_bytes(model.steady_bytes)} steady + "
            f"{format_bytes(model.per_sample_bytes)} per sample ({model.confidence})"
            + (
                f"; largest micro-batch under {edge:.0%}: {report.max_safe or safe}"
                if safe is not None
                else ""
            )
        )
    if report.ceiling is not None:
        ceiling = report.ceiling
        lines.append(
            f"out-of-memory ceiling: {ceiling_words(ceiling)}; stays under it ({ceiling.note})"
        )
    host = report.host_memory
    if host:
        lines.append(
            f"host: RAM {format_bytes(host.ram_used_bytes)} / {format_bytes(host.ram_total_bytes)} used, "
            f"swap {format_bytes(host.swap_used_bytes)}, main RSS {format_bytes(host.main_rss_bytes)}, "
            + workers_memory(host)
        )
    return lines


def config_word(report: StatusReport, knob: str) -> str:
    """``batch_size=16``; ``prefetch_factor=2 (unused: no loader workers)`` for a value the
    loader does not use now; ``grad_accum=2 (measured)`` for one the steps measured; ``?`` where
    memtui does not know it."""
    value = report.config.get(knob)
    if value is None:
        return f"{knob}=?"
    if knob in report.config_unused:
        return f"{knob}={format_value(value)} (unused: {report.config_unused[knob]})"
    measured = " (measured)" if knob in report.config_measured else ""
    return f"{knob}={format_value(value)}{measured}"


def _config_lines(report: StatusReport) -> list[str]:
    """The knobs, which cannot change and why, where changes apply, the LR factor."""
    lines: list[str] = []
    config = " ".join(config_word(report, knob) for knob in report.config)
    eff = report.effective_batch
    lines.append(f"config: {config}" + (f"  (effective batch {eff})" if eff else ""))
    lines += untunable_lines(report.untunable)
    if report.boundary:
        lines.append(f"changes apply at {report.boundary}")
    if report.lr is not None and (line := lr_line(report.lr, report.world_size)):
        lines.append(line)
    return lines


def _change_lines(report: StatusReport) -> list[str]:
    """Pending changes and the last five applied, each with its effect and prediction."""
    lines: list[str] = []
    for change in report.pending:
        note = f"  [{change.note}]" if change.note else ""
        predicted = ""
        if change.predicted_peak_bytes:
            predicted = f", predicted peak {format_bytes(change.predicted_peak_bytes)}"
        lines.append(
            f"pending #{change.id}: {format_changes(change.changes)} (queued at step {change.queued_step}{predicted}){note}"
        )
    for change in report.unapplied:
        lines.append(
            f"never applied #{change.id}: {format_changes(change.changes)} (queued at step "
            f"{change.queued_step}; pending at exit: the run ended before its next boundary)"
        )
    for applied in report.applied[-5:]:
        diffs = diff_words(applied.changes)
        ids = ",".join(f"#{i}" for i in applied.ids) or "rollback"
        line = f"applied at step {applied.step}: {diffs or 'no effective change'} ({ids})"
        if applied.origin:
            line += f" by the {applied.origin}"
        elif not applied.rollback:
            line += " by an operator"
        lines.append(line + outcome_words(applied))
    return lines


def outcome_words(applied: Applied) -> str:
    """What an applied change did and what was predicted of it, to follow its line:
    ``: +6% samples/s ...; predicted peak 596 MiB (1% high)`` ('' when nothing is known)."""
    words = ""
    if applied.effect is not None:
        words += f": {applied.effect.summary}"
    if applied.effect_note:
        words += (
            f"; {applied.effect_note}" if applied.effect is not None else f": {applied.effect_note}"
        )
    if applied.prediction_error is not None and applied.predicted_peak_bytes:
        words += (
            f"; predicted peak {format_bytes(applied.predicted_peak_bytes)} "
            f"({error_words(applied.prediction_error)})"
        )
    if applied.predicted_speed_delta is not None:
        words += "; " + predicted_speed_words(applied.predicted_speed_delta, applied.effect)
    if applied.lr_note:
        words += f"; {applied.lr_note}"
    return words


def _accuracy_lines(report: StatusReport) -> list[str]:
    """How the memory and speed predictions fared."""
    lines: list[str] = []
    scored = report.prediction_accuracy
    if scored.mean_abs_error is not None or scored.changes_out_of_memory:
        parts = []
        if scored.mean_abs_error is not None:
            plural = "s" if scored.changes_measured > 1 else ""
            parts.append(
                f"off by {scored.mean_abs_error:.1%} on average over {scored.changes_measured} "
                f"change{plural} measured"
            )
        lines.append(
            "predicted peaks: " + "; ".join([*parts, *([scored.note] if scored.note else [])])
        )
    speeds = report.speed_accuracy
    if speeds is not None and speeds.note:
        lines.append("predicted speeds: " + speeds.note)
    return lines


def _advice_lines(report: StatusReport) -> list[str]:
    """Out-of-memory errors, recommendations, refusals, cancellations, the autopilot."""
    lines: list[str] = []
    for oom in report.ooms[-3:]:
        lines.append(
            f"OUT OF MEMORY at step {oom.step}: {'rolled back' if oom.rolled_back else 'not rolled back'}; {oom.batch}"
        )
    for index, option in enumerate(report.recommendations[:3], 1):
        delta = option.speed_delta
        speed = ", speed unknown until measured"
        if delta is not None:
            speed = f", {delta:+.0%} samples/s" if round(delta, 2) else ", speed unchanged"
        lines.append(f"option {index}: {option.title}{speed}  ({option.why})")
    for rejected in report.rejected[-3:]:
        lines.append(f"rejected {format_changes(rejected.requested)}: {rejected.reason}")
    for gone in report.cancelled[-3:]:
        who = f" by {gone.client}" if gone.client else ""
        lines.append(
            f"cancelled #{gone.id} {format_changes(gone.changes)} at step {gone.step}{who}"
        )
    if report.disabled:
        lines.append(f"changes are OFF: {report.disabled}")
    if report.autopilot is not None and report.autopilot.mode != "off":
        lines.append(describe_autopilot(report.autopilot))
    return lines


def _rank_lines(report: StatusReport) -> list[str]:
    """One row per rank of a job with several."""
    lines: list[str] = []
    if len(report.ranks) > 1:
        lines.append(
            "rank  host          step   step time  data wait  samples/s  peak mem  host mem"
        )
        for entry in report.ranks:
            if not entry.reachable:
                lines.append(f"{entry.rank:>4}  {entry.host[:12]:<12}  (no answer)")
                continue
            m = entry.metrics if isinstance(entry.metrics, Metrics) else None
            mem = entry.memory if isinstance(entry.memory, Memory) else None
            tree = entry.process_tree if isinstance(entry.process_tree, ProcessTreeMemory) else None
            step_time = format_duration(m.step_time_s) if m else "-"
            wait = f"{m.data_wait_fraction:.0%}" if m and m.data_wait_measured else "-"
            samples = _rank_samples_words(m) if m else "-"
            peak = f"{mem.peak_fraction:.0%}" if mem else "-"
            host = format_bytes(tree.total_bytes) if tree else "-"
            if tree is not None and tree.workers:
                host += f" (main RSS + {tree.workers} workers {tree.workers_measure})"
            lines.append(
                f"{entry.rank:>4}  {entry.host[:12]:<12}  {entry.step:>5}  {step_time:>9}  "
                f"{wait:>9}  {samples:>9}  {peak:>8}  {host:>8}"
            )
    return lines


def _hook_lines(report: StatusReport) -> list[str]:
    """What the hook could not do: a lost change, an unsaved config, its errors, its peers."""
    lines: list[str] = []
    counters = report.counters
    if report.requeue:
        lines.append(
            f"queued before the restart and never applied; to queue it again: {report.requeue}"
        )
    if report.tuned_unsaved_step is not None:
        lines.append(
            f"tuned config not saved since step {report.tuned_unsaved_step} "
            f"({report.tuned_path}; retried at every checkpoint)"
        )
    if counters.errors:
        lines.append(f"hook errors: {counters.errors} (last: {counters.last_error})")
    if counters.requests_refused or counters.requests_rate_limited or counters.auth_failures:
        line = (
            f"peers: {counters.requests_refused} requests refused (out of bounds), "
            f"{counters.requests_rate_limited} rate limited, "
            f"{counters.auth_failures} failed authentications"
        )
        if counters.control_rests:
            line += f"; the control socket paused {counters.control_rests} times to spare training"
        lines.append(line)
    return lines


def workers_memory(host: HostSample) -> str:
    """The loader workers and their memory, labelled: USS (their own pages, as the device total
    counts them) once measured, else RSS (which counts pages shared with the main process)."""
    return process_tree(host).workers_words()
