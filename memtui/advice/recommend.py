"""Ranked recommendations, like an operator's options table after an out-of-memory error (a
smaller batch, more accumulation, checkpointing: each with its memory, speed and effective batch),
computed from the run's live numbers.

Pure. Each option says what it would change, the memory it is expected to add or free (from the
memory model, or the measured per-worker memory), the expected change of samples/s where the
numbers allow an estimate (``None``: not known until measured, and the option says why), the
resulting effective batch, and whether memtui can apply it (a queued change) or it is advice
the operator must act on (a restart, a code change).

The expected samples/s of an option comes from ``memtui.advice.speed``, the same estimate
the hook records for every applied change and checks against its measured effect.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TypedDict

from memtui.advice.effect import interval, measurable, speedup, steps_margin
from memtui.advice.measure import per_worker_bytes
from memtui.advice.predict import predict_peak, safe_batch
from memtui.advice.prediction import Prediction
from memtui.advice.speed import SpeedBasis, batch_speed, loader_model, workers_speed
from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.core.knobs import (
    DEFAULT_PREFETCH_FACTOR,
    accumulation_for,
    effective_batch,
    format_diffs,
    knobs_with,
    max_workers,
)
from memtui.core.stats import MemoryStats, StepStats, format_bytes
from memtui.wire import (
    AppliedChange,
    Ceiling,
    HostSample,
    KnobDiff,
    Knobs,
    KnobValue,
    MemoryModel,
)

FRAGMENTED = 0.10
"""Reserved-but-unallocated over this share of what torch reserved: fragmentation matters."""
HOST_RAM_FOR_WORKERS = 0.5
"""New workers may use at most this share of the host's available RAM."""


@dataclass(frozen=True)
class Inputs:
    """The live numbers the recommendations are computed from."""

    config: Knobs
    tunable: tuple[str, ...]
    world_size: int = 1
    steps: StepStats | None = None
    samples_per_step: float | None = None
    """Samples in one optimizer step on one rank (micro-batch x accumulation, measured)."""
    memory: MemoryStats | None = None
    model: MemoryModel | None = None
    host: HostSample | None = None
    host_pressure: bool = False
    device_kind: str = "cpu"
    cpus: int = 0
    """CPUs the run may use (its affinity within its cgroup's quota; 0: unknown, an older hook):
    loader workers beyond them compete with training for the same cores."""
    ceiling: Ceiling | None = None
    """What ran out of memory: no option reaches it."""
    starved_wait_fraction: float = THRESHOLDS.starved_wait_fraction
    """The verdict's STARVED threshold in force (the YAML config may change it)."""
    underused_memory_fraction: float = THRESHOLDS.underused_memory_fraction
    """The verdict's UNDERUSED threshold in force."""
    memory_edge_fraction: float = THRESHOLDS.memory_edge_fraction
    """The verdict's OOM edge in force: bigger batches stay under it, smaller ones get back."""
    memory_danger_fraction: float = THRESHOLDS.memory_danger_fraction
    """The verdict's danger band in force (named in the reasons)."""
    applied: tuple[AppliedChange, ...] = ()
    """The run's applied changes, oldest first: their measured effects time other micro-batches."""
    alloc_conf: str | None = None
    """The run's CUDA allocator settings (``RunInfo.alloc_conf``; None: the hook did not say)."""
    pending: Mapping[str, KnobValue] = field(default_factory=dict)
    """What the pending changes will set: no option repeats them or moves their knobs (the
    numbers behind it are the config's before they land), and an option's predicted peak is the
    config's once they and it land (the queue's own prediction of it)."""

    def speed_basis(self) -> SpeedBasis | None:
        """What the speed estimates are made from (None: no timed steps yet)."""
        if self.steps is None or not self.samples_per_step:
            return None
        return SpeedBasis(
            self.config,
            self.steps,
            self.samples_per_step,
            self.applied,
            self.starved_wait_fraction,
        )


class Bands(TypedDict):
    """The ``Inputs`` fields that carry the verdict's thresholds in force."""

    starved_wait_fraction: float
    underused_memory_fraction: float
    memory_edge_fraction: float
    memory_danger_fraction: float


def bands(source: Thresholds | Inputs) -> Bands:
    """The ``Inputs`` fields of the verdict's thresholds in force (``Inputs(..., **bands(t))``),
    from the thresholds or from inputs that carry them."""
    return Bands(
        starved_wait_fraction=source.starved_wait_fraction,
        underused_memory_fraction=source.underused_memory_fraction,
        memory_edge_fraction=source.memory_edge_fraction,
        memory_danger_fraction=source.memory_danger_fraction,
    )


def thresholds_of(inputs: Inputs) -> Thresholds:
    """The verdict's thresholds in force that ``inputs`` carries (the rest at their defaults)."""
    return replace(THRESHOLDS, **bands(inputs))


@dataclass(frozen=True)
class Recommendation:
    """One option, with its expected effects."""

    title: str
    changes: dict[str, KnobValue]
    """What memtui would queue ({} for advice it cannot apply)."""
    why: str
    """The numbers behind it."""
    memory_delta_bytes: int | None = None
    """Expected change of peak device memory (None: unknown)."""
    host_delta_bytes: int | None = None
    """Expected change of host memory."""
    speed_delta: float | None = None
    """Expected relative change of samples/s (+0.4 = 40% faster; None: unknown)."""
    speed_note: str = ""
    """How ``speed_delta`` was estimated, or why it is unknown."""
    predicted_peak_bytes: int | None = None
    effective_batch: int | None = None
    needs_restart: bool = False
    score: float = 0.0
    """Higher first."""
    for_speed: bool = False
    """Offered for speed alone: not offered when its expected gain is inside the noise."""

    @property
    def applicable(self) -> bool:
        """memtui can queue it (a knob change that needs no restart)."""
        return bool(self.changes) and not self.needs_restart


def recommend(inputs: Inputs) -> list[Recommendation]:
    """Every option that applies to the run now, best first (``options``'s first part)."""
    return options(inputs)[0]


def options(inputs: Inputs) -> tuple[list[Recommendation], list[Recommendation]]:
    """Every option that applies to the run now, best first; after a change measured slower,
    its revert first and nothing that moves its knobs further the same way. An option offered
    for speed whose expected gain is inside the estimate's noise is left out: +0% is no reason
    to spend a checkpoint boundary. Second, the options held back until the pending changes
    land (they move a knob one of them sets)."""
    options: list[Recommendation] = []
    options += _loader_options(inputs)
    options += _batch_options(inputs)
    options += _memory_advice(inputs)
    noise = speed_noise(inputs)
    options = [o for o in options if not _no_measurable_gain(o, noise)]
    harmful = measured_harm(inputs)
    if harmful is not None:
        options = [o for o in options if not _more_of_the_same(o, harmful)]
        options.append(_revert(harmful, inputs))
    held = [o for o in options if _moves_pending(o, inputs)]
    offered = [_with_prediction(o, inputs) for o in options if not _moves_pending(o, inputs)]
    return sorted(offered, key=lambda r: -r.score), held


def _moves_pending(option: Recommendation, inputs: Inputs) -> bool:
    """``option`` changes a knob a pending change sets: it would repeat that change, or undo
    it from numbers measured before it lands."""
    return bool(set(option.changes) & set(inputs.pending))


def predicted_config(inputs: Inputs, changes: Mapping[str, KnobValue]) -> Knobs:
    """The config once the pending changes and ``changes`` land (what the queue predicts)."""
    return knobs_with(knobs_with(inputs.config, inputs.pending), changes)


def _with_prediction(option: Recommendation, inputs: Inputs) -> Recommendation:
    """``option`` with the memory model's peak for the config it makes, the one prediction of a
    change (the queue's gate, the viewer's editor and ``memtui set`` make it the same way, workers
    and pinning included), and the change of peak from the config before it."""
    model = inputs.model
    if not option.applicable or model is None:
        return option
    if "num_workers" in option.changes and model.kind == "cpu" and model.workers is None:
        return option  # a model that cannot count the workers (an older hook's): not predicted
    thresholds = thresholds_of(inputs)
    before = Prediction.of_config(model, predicted_config(inputs, {}), thresholds).peak_bytes
    after = Prediction.of_config(model, predicted_config(inputs, option.changes), thresholds)
    if after.peak_bytes is None or before is None:
        return option
    return replace(
        option, predicted_peak_bytes=after.peak_bytes, memory_delta_bytes=after.peak_bytes - before
    )


NOISE_FLOOR = 0.05
"""The least noise a speed estimate is taken to have, as a share of samples/s (two timed
micro-batches called a faster one no faster)."""


def speed_noise(inputs: Inputs) -> float:
    """A speed estimate's own noise: the widest 95% interval of the measured effects it is made
    from (the run's applied changes), from the spread of their steps (the machine's load
    moving the run's speed makes an effect harder to measure, not an estimate worse), at least
    ``NOISE_FLOOR``."""
    margins = [m for a in inputs.applied if a.effect is not None and (m := steps_margin(a.effect))]
    return max([NOISE_FLOOR, *margins])


def _no_measurable_gain(option: Recommendation, noise: float) -> bool:
    """``option`` is offered for speed and its expected gain, known, is within ``noise``."""
    return option.for_speed and option.speed_delta is not None and option.speed_delta <= noise


SLOWER = 0.05
"""A change measured slower beyond its interval's noise, and by at least this much, is harm:
its revert is advised (a smaller loss, even if real, is not worth a change)."""


def measured_harm(inputs: Inputs) -> AppliedChange | None:
    """The latest applied change, if it was measured slower (outside the noise, and by more than
    ``SLOWER``) and the run still has its values."""
    changes = [a for a in inputs.applied if a.changes and not a.rollback]
    if not changes:
        return None
    last = changes[-1]
    effect = last.effect
    if effect is None or speedup(effect) > -SLOWER or not measurable(effect):
        return None
    if any(getattr(inputs.config, k, None) != d.new for k, d in last.changes.items()):
        return None
    return last


def _more_of_the_same(option: Recommendation, harmful: AppliedChange) -> bool:
    """``option`` moves a knob of ``harmful`` further in the direction that was measured slower."""
    for knob, diff in harmful.changes.items():
        new = option.changes.get(knob)
        if new is None or diff.old is None or isinstance(new, bool):
            continue
        step = float(diff.new) - float(diff.old)
        if step and (float(new) - float(diff.new)) * step > 0:
            return True
    return False


def _revert(harmful: AppliedChange, inputs: Inputs) -> Recommendation:
    """Undo ``harmful``: back to the values it replaced."""
    assert harmful.effect is not None
    back = {k: d.old for k, d in harmful.changes.items() if d.old is not None}
    ids = ",".join(f"#{i}" for i in harmful.ids)
    shown = format_diffs(
        {k: KnobDiff(d.new, d.old) for k, d in harmful.changes.items() if d.old is not None}
    )
    effect = harmful.effect
    bounds = interval(effect)
    return Recommendation(
        title=f"revert {ids}: {shown}",
        changes=back,
        why=(
            f"measured {-speedup(effect):.0%} slower"
            + (f" ({bounds[0]:+.0%} to {bounds[1]:+.0%})" if bounds is not None else "")
            + f" after it landed at step {harmful.step} "
            f"({effect.samples_per_s_before:.0f} -> {effect.samples_per_s_after:.0f} samples/s "
            f"over {effect.steps_before} and {effect.steps_after} steps)"
        ),
        speed_delta=effect.samples_per_s_before / effect.samples_per_s_after - 1
        if effect.samples_per_s_after > 0
        else None,
        speed_note="measured: the speed before the change"
        + (
            f" ({1 / (1 + bounds[1]) - 1:+.0%} to {1 / (1 + bounds[0]) - 1:+.0%})"
            if bounds is not None and bounds[0] > -1
            else ""
        ),
        effective_batch=_effective(knobs_with(inputs.config, back), inputs.world_size),
        score=5.0,
    )


# ----------------------------------------------------------------------------- data loader


def _per_worker_bytes(inputs: Inputs) -> int | None:
    return per_worker_bytes(inputs.host) or None


def workers_allowed(inputs: Inputs, wanted: int, per_worker: int | None) -> tuple[int, str]:
    """``wanted`` workers within the CPUs the run may use, under a worker count that ran out of
    memory, and within the host RAM free for their measured memory; with why it was capped."""
    note = ""
    usable = inputs.cpus
    if usable > 0 and wanted > usable:
        wanted, note = usable, f" (capped by the {usable} CPUs the run may use)"
    elif usable <= 0:
        wanted = min(wanted, max_workers())
    ceiling = inputs.ceiling
    if ceiling is not None and ceiling.num_workers is not None and wanted >= ceiling.num_workers:
        wanted, note = ceiling.num_workers - 1, f" (under {ceiling.num_workers}: out of memory)"
    host, workers = inputs.host, inputs.config.num_workers or 0
    if per_worker and host is not None:
        affordable = workers + int(HOST_RAM_FOR_WORKERS * host.ram_available_bytes // per_worker)
        if affordable < wanted:
            wanted, note = affordable, " (capped by free host RAM)"
    return wanted, note


def _loader_options(inputs: Inputs) -> list[Recommendation]:
    config, steps = inputs.config, inputs.steps
    out: list[Recommendation] = []
    if steps is None or config.num_workers is None or "num_workers" not in inputs.tunable:
        return out
    basis = inputs.speed_basis()
    model = loader_model(basis) if basis is not None else None
    wait = steps.data_wait_fraction
    per_worker = _per_worker_bytes(inputs)
    workers = config.num_workers
    wanted, limit_note = workers, ""
    if wait >= inputs.starved_wait_fraction and model is not None and not inputs.host_pressure:
        compute, load = model.compute_s, model.load_per_sample_s * model.samples
        wanted = math.ceil(load / compute - 1e-9) if compute > 0 else workers + 2
        wanted, limit_note = workers_allowed(inputs, max(workers + 1, wanted + 1), per_worker)
    if wanted > workers and model is not None and basis is not None:  # starved, a worker allowed
        host_delta = per_worker * (wanted - workers) if per_worker else None
        out.append(
            Recommendation(
                title=f"more loader workers: num_workers {workers} -> {wanted}{limit_note}",
                changes={"num_workers": wanted},
                why=(
                    f"{wait:.0%} of each step waits for data; loading takes "
                    f"{model.load_per_sample_s * 1000:.2f} ms per sample, "
                    f"compute {model.compute_s * 1000:.1f} ms per step"
                ),
                # on a CPU run the host is the device: the new workers' memory is its memory
                memory_delta_bytes=host_delta if inputs.device_kind == "cpu" else 0,
                host_delta_bytes=host_delta,
                speed_delta=workers_speed(basis, wanted).delta,
                effective_batch=_effective(config, inputs.world_size),
                score=3.0 + wait,
                for_speed=True,
            )
        )
        if (
            inputs.device_kind == "cuda"
            and config.pin_memory is False
            and "pin_memory" in inputs.tunable
            and not (inputs.ceiling is not None and inputs.ceiling.pin_memory)
        ):
            out.append(
                Recommendation(
                    title="pin_memory on",
                    changes={"pin_memory": True},
                    why="page-locked batches copy to the GPU faster and can overlap compute",
                    memory_delta_bytes=0,
                    host_delta_bytes=None,
                    speed_delta=None,
                    effective_batch=_effective(config, inputs.world_size),
                    score=1.0 + wait / 2,
                )
            )
    if inputs.host_pressure and workers > 0:
        fewer = workers // 2
        speed = workers_speed(basis, fewer).delta if basis is not None else None
        out.append(
            Recommendation(
                title=f"fewer loader workers: num_workers {workers} -> {fewer}",
                changes={"num_workers": fewer},
                why=f"host memory is under pressure; each worker holds about {format_bytes(per_worker)}",
                memory_delta_bytes=0,
                host_delta_bytes=-per_worker * (workers - fewer) if per_worker else None,
                speed_delta=speed,
                effective_batch=_effective(config, inputs.world_size),
                score=3.5,
            )
        )
    prefetch, default = config.prefetch_factor, DEFAULT_PREFETCH_FACTOR
    fewer_ahead = (
        prefetch is not None and prefetch > default and "prefetch_factor" in inputs.tunable
    )
    if inputs.host_pressure and workers > 0 and fewer_ahead:
        why = f"each of the {workers} workers holds {prefetch} batches in host memory"
        less = {"prefetch_factor": default}
        out.append(
            _host_relief(
                inputs, f"less prefetch: prefetch_factor {prefetch} -> {default}", less, why, 3.1
            )
        )
    if inputs.host_pressure and config.pin_memory and inputs.device_kind == "cuda":
        # without an accelerator torch pins nothing: turning it off would free nothing
        why = "page-locked host memory cannot be swapped out; under host pressure it hurts"
        out.append(_host_relief(inputs, "pin_memory off", {"pin_memory": False}, why, 3.2))
    return out


def _host_relief(
    inputs: Inputs, title: str, changes: dict[str, KnobValue], why: str, score: float
) -> Recommendation:
    """A loader change that gives host memory back under pressure (device memory unchanged)."""
    return Recommendation(
        title=title,
        changes=changes,
        why=why,
        memory_delta_bytes=0,
        effective_batch=_effective(inputs.config, inputs.world_size),
        score=score,
    )


# ----------------------------------------------------------------------------- micro-batch


def _effective(
    config: Knobs, world: int, batch: int | None = None, accum: int | None = None
) -> int | None:
    """Micro-batch x accumulation x ranks (None where either is not known)."""
    b = batch if batch is not None else config.batch_size
    a = accum if accum is not None else config.grad_accum
    if b is None or a is None:
        return None
    return effective_batch(b, a, world)


def _under_the_ceiling(ceiling: Ceiling | None) -> str:
    """``; under 32, the micro-batch that ran out of memory`` where one did ('' otherwise): a
    bigger micro-batch after a rollback stays under the one that failed, and says so."""
    if ceiling is None or ceiling.batch_size is None:
        return ""
    return f"; under {ceiling.batch_size}, the micro-batch that ran out of memory"


def _batch_options(inputs: Inputs) -> list[Recommendation]:
    config, model = inputs.config, inputs.model
    out: list[Recommendation] = []
    if model is None or config.batch_size is None or "batch_size" not in inputs.tunable:
        return out
    batch = config.batch_size
    accum = config.grad_accum
    target = batch * (accum or 1)
    peak_now = predict_peak(model, batch, config.num_workers)  # the config's own workers
    frac_now = peak_now / model.capacity_bytes if model.capacity_bytes else 0.0
    edge = inputs.memory_edge_fraction
    underused = inputs.underused_memory_fraction
    found = safe_batch(model, edge, inputs.ceiling)
    safe = found.size if found is not None else None
    # quoted as the model line of `memtui status` and the viewer quote it: past the guess
    # multiple only its floor (``> 32``), never the extrapolated size
    shown = found.figure if found is not None else None
    starved = (
        inputs.steps is not None and inputs.steps.data_wait_fraction >= inputs.starved_wait_fraction
    )
    keep = "grad_accum" in inputs.tunable and accum is not None
    # the effective batch can only be kept by trading accumulation for micro-batch: at
    # grad_accum 1 a bigger micro-batch grows the effective batch (and the title says so)
    keep_bigger = keep and (accum or 1) > 1
    bigger = batch
    if frac_now < underused and not starved and safe is not None and safe > batch:
        bigger = _friendly(min(safe, batch * 2), target if keep_bigger else None)
        if bigger <= batch:  # no divisor of the effective batch above the current micro-batch
            bigger = min(safe, batch * 2)
            keep_bigger = False
    if bigger > batch:
        changes: dict[str, KnobValue] = {"batch_size": bigger}
        new_accum = accum
        if keep_bigger:
            new_accum, _ = accumulation_for(target, bigger)
            changes["grad_accum"] = new_accum
        peak = predict_peak(model, bigger, config.num_workers)
        speed, speed_note = _batch_speed(inputs, bigger, new_accum)
        out.append(
            Recommendation(
                title=f"bigger micro-batch: batch_size {batch} -> {bigger}"
                + (
                    f", grad_accum {accum} -> {new_accum}"
                    if keep_bigger and new_accum != accum
                    else " (the effective batch grows)"
                ),
                changes=changes,
                why=f"predicted peak {frac_now:.0%} of capacity: room for a bigger micro-batch (largest under {edge:.0%}: {shown})"
                + _under_the_ceiling(inputs.ceiling),
                memory_delta_bytes=peak - peak_now,
                predicted_peak_bytes=peak,
                speed_delta=speed,
                speed_note=speed_note,
                effective_batch=_effective(config, inputs.world_size, bigger, new_accum),
                score=2.0 + (underused - frac_now),
                for_speed=True,
            )
        )
    if frac_now >= edge and batch > 1:
        smaller = _friendly(
            max(1, min(safe if safe else batch // 2, batch - 1)), target if keep else None
        )
        changes = {"batch_size": smaller}
        new_accum = accum
        if keep:
            new_accum, _ = accumulation_for(target, smaller)
            changes["grad_accum"] = new_accum
        peak = predict_peak(model, smaller, config.num_workers)
        speed, speed_note = _batch_speed(inputs, smaller, new_accum)
        out.append(
            Recommendation(
                title=f"smaller micro-batch: batch_size {batch} -> {smaller}"
                + (f", grad_accum {accum} -> {new_accum}" if keep and new_accum != accum else ""),
                changes=changes,
                why=f"predicted peak {frac_now:.0%} of capacity: {'danger' if frac_now >= inputs.memory_danger_fraction else 'edge'} band"
                + (f" (largest under {edge:.0%}: {shown})" if shown is not None else ""),
                memory_delta_bytes=peak - peak_now,
                predicted_peak_bytes=peak,
                speed_delta=speed,
                speed_note=speed_note,
                effective_batch=_effective(config, inputs.world_size, smaller, new_accum),
                score=4.0 + frac_now,
            )
        )
    return out


def _batch_speed(inputs: Inputs, batch: int, accum: int | None) -> tuple[float | None, str]:
    """The expected change of samples/s at micro-batch ``batch`` x ``accum``, and its note."""
    basis = inputs.speed_basis()
    if basis is None:
        return None, "speed unknown until measured: no timed steps yet"
    estimate = batch_speed(basis, batch, accum)
    return estimate.delta, estimate.note


def _friendly(batch: int, target: int | None) -> int:
    """Prefer a micro-batch that divides the effective batch (so it can be kept exactly)."""
    if target is None or batch <= 1:
        return max(1, batch)
    for candidate in range(batch, max(1, batch // 2) - 1, -1):
        if target % candidate == 0:
            return candidate
    return batch


# ----------------------------------------------------------------------------- advice only


def expandable_segments_on(conf: str | None) -> bool:
    """Whether allocator settings in ``PYTORCH_CUDA_ALLOC_CONF``'s form (``key:value,...``; torch
    takes ``True`` and ``False`` only, spaces allowed, the last one wins) turn on
    expandable segments."""
    on = False
    for item in (conf or "").split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"
    return on


def _memory_advice(inputs: Inputs) -> list[Recommendation]:
    memory, model = inputs.memory, inputs.model
    out: list[Recommendation] = []
    if memory is None or memory.capacity_bytes <= 0:
        return out
    peak_fraction = memory.peak_used_fraction
    expandable = expandable_segments_on(inputs.alloc_conf)
    if inputs.device_kind == "cuda" and memory.reserved_bytes > 0 and not expandable:
        share = memory.fragmentation_bytes / memory.reserved_bytes
        if share >= FRAGMENTED or memory.fragmentation_bytes >= 1 << 30:
            out.append(
                Recommendation(
                    title="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (needs a restart)",
                    changes={},
                    why=f"{format_bytes(memory.fragmentation_bytes)} reserved but unallocated ({share:.0%} of the reserve)",
                    memory_delta_bytes=-memory.fragmentation_bytes,
                    speed_delta=0.0,
                    effective_batch=_effective(inputs.config, inputs.world_size),
                    needs_restart=True,
                    score=2.5 + share,
                )
            )
    if peak_fraction >= inputs.memory_edge_fraction:
        activations = None
        if model is not None and inputs.config.batch_size:
            activations = int(model.per_sample_bytes * inputs.config.batch_size)
        out.append(
            Recommendation(
                title="gradient checkpointing (a code change)",
                changes={},
                why="recomputes activations in backward instead of keeping them",
                memory_delta_bytes=-int(activations * 0.6) if activations else None,
                speed_delta=-0.25,
                effective_batch=_effective(inputs.config, inputs.world_size),
                needs_restart=True,
                score=1.5,
            )
        )
        out.append(
            Recommendation(
                title="shorter sequences (a data change)",
                changes={},
                why="activations grow with the sequence length, attention with its square",
                memory_delta_bytes=None,
                speed_delta=None,
                effective_batch=_effective(inputs.config, inputs.world_size),
                needs_restart=True,
                score=1.0,
            )
        )
    return out
