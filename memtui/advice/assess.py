"""One assessment of a run from its snapshots: verdict, memory breakdown, recommendations, limits.

Pure: the CLI (``memtui status --json``) and anything else that holds snapshots get the same
answers from the same numbers. The verdict is the worst rank's; the breakdown, model and
recommendations are rank 0's (the ranks run the same config).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from memtui.advice.breakdown import Breakdown, breakdown
from memtui.advice.predict import confidence, safe_batch
from memtui.advice.recommend import Inputs as RecommendInputs
from memtui.advice.recommend import Recommendation, bands, options
from memtui.advice.verdict import THRESHOLDS, State, Thresholds, Verdict, decide
from memtui.advice.verdict import Inputs as VerdictInputs
from memtui.core.knobs import KnownConfig, known_config, merge
from memtui.core.stats import (
    MemoryStats,
    StepStats,
    process_tree,
    ram_fraction,
    summarize_device,
    summarize_steps,
)
from memtui.wire import ControlState, HostSample, RunInfo, Snapshot

STATE_NAMES = {state: state.name for state in State}
"""The scripting names of the states (``OOM_RISK``, not ``OOM RISK``)."""


@dataclass(frozen=True)
class Assessment:
    """What memtui concludes about a run now."""

    verdict: Verdict
    breakdown: Breakdown | None
    recommendations: list[Recommendation]
    max_safe_batch_size: int | None
    model_confidence: str
    max_safe: str = ""
    """The largest safe micro-batch in words (a guess, or under what ran out of memory)."""


@dataclass(frozen=True)
class Advice:
    """The memory breakdown, the ranked options and the model's limits (no verdict)."""

    breakdown: Breakdown | None
    recommendations: list[Recommendation]
    max_safe_batch_size: int | None
    model_confidence: str
    max_safe: str = ""
    """The largest safe micro-batch in words (a guess, or under what ran out of memory)."""
    held_for_pending: tuple[str, ...] = ()
    """The options held back until the pending changes land (they move a knob one sets)."""


def capacity_is_limit(memory: MemoryStats | None, host: HostSample | None) -> bool:
    """The capacity bounds the run: a device's memory, or on CPU a limit below the host's RAM
    (a cgroup's, or the demo's ``--memory-limit``), not the whole RAM other processes share."""
    if memory is None or memory.kind != "cpu":
        return True
    return host is not None and 0 < memory.capacity_bytes < host.ram_total_bytes


def loader_memory(host: HostSample | None) -> int | None:
    """What the loader workers hold: USS where measured (shared pages counted once), else RSS
    (``core.stats.process_tree``, as the viewer and ``memtui status`` count them)."""
    if host is None or not host.workers:
        return None
    return process_tree(host).workers_bytes


def known_of(control: ControlState, steps: StepStats | None) -> KnownConfig:
    """The run's knobs as far as memtui knows them, from its control state and its steps (the
    one source of the knob figures the viewer, the exporter and ``memtui status`` show)."""
    return known_config(
        control.config, control.tunable, control.untunable_values, steps, control.world_size
    )


def advise(
    control: ControlState,
    memory: MemoryStats | None,
    steps: StepStats | None,
    samples_per_step: float | None,
    host: HostSample | None,
    verdict: Verdict,
    thresholds: Thresholds | None = None,
    run: RunInfo | None = None,
) -> Advice:
    """Breakdown, recommendations and limits from one rank's live numbers (``memtui status
    --json`` and the viewer both use this), against the verdict's thresholds in force and what
    the run says of itself (``run``: the CPUs it may use, its CUDA allocator settings)."""
    limits = thresholds or THRESHOLDS
    model = control.model
    split = None
    if memory is not None:
        split = breakdown(memory, control.static, model, loader_memory(host))
    known = known_of(control, steps)
    offered, held = options(
        RecommendInputs(
            config=known.as_knobs(),
            tunable=tuple(control.tunable),
            world_size=control.world_size,
            steps=steps,
            samples_per_step=samples_per_step,
            memory=memory,
            model=model,
            host=host,
            host_pressure=verdict.state is State.HOST_PRESSURE,
            device_kind=memory.kind if memory is not None else "cpu",
            applied=tuple(control.applied),
            ceiling=control.ceiling,
            cpus=run.cpus if run is not None else 0,
            alloc_conf=run.alloc_conf if run is not None else None,
            pending=merge(c.changes for c in control.pending if c.changes),
            **bands(limits),
        )
    )
    safe = (
        safe_batch(model, limits.memory_edge_fraction, control.ceiling)
        if model is not None
        else None
    )
    return Advice(
        breakdown=split,
        recommendations=offered,
        max_safe_batch_size=safe.size if safe is not None else None,
        model_confidence=confidence(model) if model is not None else "no model yet",
        max_safe=safe.describe() if safe is not None else "",
        held_for_pending=tuple(o.title for o in held),
    )


HOST_WINDOW_S = 30.0
"""How far back swap growth is measured (the viewer and ``memtui status`` alike)."""


class RankNumbers(Protocol):
    """One rank's numbers the verdict weighs: its speed and its memory over the recent window."""

    @property
    def rank(self) -> int: ...

    @property
    def steps(self) -> StepStats | None: ...

    @property
    def memory(self) -> MemoryStats | None: ...


@dataclass(frozen=True)
class RankStats:
    """A rank's numbers computed from its records (``memtui status``'s snapshots)."""

    rank: int
    steps: StepStats | None
    memory: MemoryStats | None


R = TypeVar("R", bound=RankNumbers)


def swap_growth(samples: Sequence[HostSample], window_s: float = HOST_WINDOW_S) -> int:
    """Swap growth over the last ``window_s`` seconds of host samples (oldest first)."""
    if not samples:
        return 0
    latest = samples[-1]
    oldest = latest
    for sample in reversed(samples):
        if latest.time - sample.time > window_s:
            break
        oldest = sample
    return latest.swap_used_bytes - oldest.swap_used_bytes


def verdict_host(
    primary: Sequence[HostSample], others: Iterable[HostSample | None]
) -> tuple[HostSample | None, int]:
    """The host sample the verdict weighs and its swap growth: the control rank's, unless another
    rank's host is fuller (its growth is not known: 0)."""
    host = primary[-1] if primary else None
    growth = swap_growth(primary)
    for other in others:
        if other is not None and (host is None or ram_fraction(other) > ram_fraction(host)):
            host, growth = other, 0
    return host, growth


def verdict_inputs(
    ranks: Sequence[R],
    host: HostSample | None,
    swap_growth_bytes: int,
    pin_memory: bool | None = None,
) -> tuple[VerdictInputs, R | None, R | None]:
    """The verdict's inputs (the worst rank for each number), the waiting and the fullest rank:
    the one computation behind the viewer's verdict and ``memtui status``'s."""
    timed = [r for r in ranks if r.steps is not None]
    measured = [r for r in ranks if r.memory is not None and r.memory.capacity_bytes]
    waiting = max(timed, key=lambda r: r.steps.data_wait_fraction if r.steps else 0.0, default=None)
    fullest = max(
        measured, key=lambda r: r.memory.peak_used_fraction if r.memory else 0.0, default=None
    )
    steps = waiting.steps if waiting else None
    memory = fullest.memory if fullest else None
    several = len(ranks) > 1
    inputs = VerdictInputs(
        data_wait_fraction=steps.data_wait_fraction if steps else None,
        step_time_s=steps.step_time_s if steps else None,
        data_wait_s=steps.data_wait_s if steps else None,
        data_wait_measured=steps.data_wait_measured if steps else True,
        peak_memory_fraction=memory.peak_used_fraction if memory else None,
        peak_memory_bytes=memory.peak_used_bytes if memory else None,
        capacity_bytes=memory.capacity_bytes if memory else None,
        device_kind=memory.kind if memory else "cuda",
        capacity_is_limit=capacity_is_limit(memory, host),
        host_ram_fraction=ram_fraction(host) if host else None,
        swap_used_bytes=host.swap_used_bytes if host else 0,
        swap_growth_bytes=swap_growth_bytes,
        workers=host.workers if host else None,
        workers_bytes=loader_memory(host),
        pin_memory=pin_memory,
        wait_rank=waiting.rank if several and waiting else None,
        memory_rank=fullest.rank if several and fullest else None,
    )
    return inputs, waiting, fullest


def snapshot_inputs(control: Snapshot, snapshots: Sequence[Snapshot]) -> VerdictInputs:
    """The verdict's inputs from the control rank's snapshot and every rank's."""
    ranks = [
        RankStats(s.info.rank, summarize_steps(s.steps), summarize_device(s.device))
        for s in sorted(snapshots, key=lambda s: s.info.rank)
    ]
    host, growth = verdict_host(control.host, (s.host[-1] for s in snapshots if s.host))
    inputs, _waiting, _fullest = verdict_inputs(
        ranks, host, growth, control.control.config.pin_memory
    )
    return inputs


def assess(
    snapshot: Snapshot,
    ranks: list[Snapshot | None] | None = None,
    thresholds: Thresholds | None = None,
) -> Assessment:
    """Assess a run from rank 0's snapshot (and every rank's, when there are several); one-shot,
    so the verdict has no hysteresis."""
    snapshots = [s for s in (ranks or [snapshot]) if s is not None] or [snapshot]
    verdict = decide(snapshot_inputs(snapshot, snapshots), thresholds)
    last = snapshot.steps[-1] if snapshot.steps else None
    advice = advise(
        snapshot.control,
        summarize_device(snapshot.device),
        summarize_steps(snapshot.steps),
        float(last.samples) if last is not None and last.samples else None,
        snapshot.host[-1] if snapshot.host else None,
        verdict,
        thresholds,
        snapshot.info,
    )
    return Assessment(
        verdict=verdict,
        breakdown=advice.breakdown,
        recommendations=advice.recommendations,
        max_safe_batch_size=advice.max_safe_batch_size,
        model_confidence=advice.model_confidence,
        max_safe=advice.max_safe,
    )
