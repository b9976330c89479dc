"""One assessment of a run from its snapshots: verdict, memory breakdown, recommendations, limits.

Pure: the CLI (``memtui status --json``) and anything else that holds snapshots get the same
answers from the same numbers. The verdict is the worst rank's; the breakdown, model and
recommendations are rank 0's (the ranks run the same config).
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui.advice.breakdown import Breakdown, breakdown
from memtui.advice.predict import confidence, max_batch
from memtui.advice.recommend import Inputs as RecommendInputs
from memtui.advice.recommend import Recommendation, recommend
from memtui.advice.verdict import THRESHOLDS, State, Thresholds, Verdict, decide
from memtui.advice.verdict import Inputs as VerdictInputs
from memtui.stats import MemoryStats, StepStats, ram_fraction, summarize_device, summarize_steps
from memtui.wire import ControlState, HostSample, Snapshot

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


@dataclass(frozen=True)
class Advice:
    """The memory breakdown, the ranked options and the model's limits (no verdict)."""

    breakdown: Breakdown | None
    recommendations: list[Recommendation]
    max_safe_batch_size: int | None
    model_confidence: str


def capacity_is_limit(memory: MemoryStats | None, host: HostSample | None) -> bool:
    """The capacity bounds the run: a device's memory, or on CPU a limit below the host's RAM
    (a cgroup's, or the demo's ``--memory-limit``), not the whole RAM other processes share."""
    if memory is None or memory.kind != "cpu":
        return True
    return host is not None and 0 < memory.capacity_bytes < host.ram_total_bytes


def loader_memory(host: HostSample | None) -> int | None:
    """What the loader workers hold: USS where measured (shared pages counted once), else RSS."""
    if host is None or not host.workers:
        return None
    return host.workers_uss_bytes or host.workers_rss_bytes


def advise(
    control: ControlState,
    memory: MemoryStats | None,
    steps: StepStats | None,
    samples_per_step: float | None,
    host: HostSample | None,
    verdict: Verdict,
    thresholds: Thresholds | None = None,
) -> Advice:
    """Breakdown, recommendations and limits from one rank's live numbers (``memtui status
    --json`` and the viewer both use this), against the verdict's thresholds in force."""
    limits = thresholds or THRESHOLDS
    model = control.model
    split = breakdown(memory, control.static, model) if memory is not None else None
    options = recommend(
        RecommendInputs(
            config=control.config,
            tunable=tuple(control.tunable),
            world_size=control.world_size,
            steps=steps,
            samples_per_step=samples_per_step,
            memory=memory,
            model=model,
            host=host,
            host_pressure=verdict.state is State.HOST_PRESSURE,
            device_kind=memory.kind if memory is not None else "cpu",
            starved_wait_fraction=limits.starved_wait_fraction,
            underused_memory_fraction=limits.underused_memory_fraction,
            memory_edge_fraction=limits.memory_edge_fraction,
            memory_danger_fraction=limits.memory_danger_fraction,
            applied=tuple(control.applied),
        )
    )
    return Advice(
        breakdown=split,
        recommendations=options,
        max_safe_batch_size=(
            max_batch(model, limits.memory_edge_fraction) if model is not None else None
        ),
        model_confidence=confidence(model) if model is not None else "no model yet",
    )


def _verdict_inputs(snapshots: list[Snapshot], multi: bool) -> VerdictInputs:
    worst_wait: tuple[float, int, float, float] | None = None
    worst_memory: tuple[float, int, int, int, str, bool] | None = None
    host = None
    swap_growth = 0
    for snapshot in snapshots:
        rank = snapshot.info.rank
        steps = summarize_steps(snapshot.steps)
        if steps is not None and (worst_wait is None or steps.data_wait_fraction > worst_wait[0]):
            worst_wait = (steps.data_wait_fraction, rank, steps.step_time_s, steps.data_wait_s)
        memory = summarize_device(snapshot.device)
        if memory is not None and memory.capacity_bytes:
            fraction = memory.peak_used_fraction
            if worst_memory is None or fraction > worst_memory[0]:
                worst_memory = (
                    fraction,
                    rank,
                    memory.peak_used_bytes,
                    memory.capacity_bytes,
                    memory.kind,
                    capacity_is_limit(memory, snapshot.host[-1] if snapshot.host else None),
                )
        if snapshot.host:
            sample = snapshot.host[-1]
            if host is None or ram_fraction(sample) > ram_fraction(host):
                host = sample
                swap_growth = sample.swap_used_bytes - snapshot.host[0].swap_used_bytes
    return VerdictInputs(
        data_wait_fraction=worst_wait[0] if worst_wait else None,
        step_time_s=worst_wait[2] if worst_wait else None,
        data_wait_s=worst_wait[3] if worst_wait else None,
        wait_rank=worst_wait[1] if worst_wait and multi else None,
        peak_memory_fraction=worst_memory[0] if worst_memory else None,
        peak_memory_bytes=worst_memory[2] if worst_memory else None,
        capacity_bytes=worst_memory[3] if worst_memory else None,
        device_kind=worst_memory[4] if worst_memory else "cpu",
        capacity_is_limit=worst_memory[5] if worst_memory else True,
        memory_rank=worst_memory[1] if worst_memory and multi else None,
        host_ram_fraction=ram_fraction(host) if host else None,
        workers=host.workers if host else None,
        workers_bytes=loader_memory(host),
        pin_memory=snapshots[0].control.config.pin_memory,
        swap_used_bytes=host.swap_used_bytes if host else 0,
        swap_growth_bytes=swap_growth,
    )


def assess(
    snapshot: Snapshot,
    ranks: list[Snapshot | None] | None = None,
    thresholds: Thresholds | None = None,
) -> Assessment:
    """Assess a run from rank 0's snapshot (and every rank's, when there are several); one-shot,
    so the verdict has no hysteresis."""
    snapshots = [s for s in (ranks or [snapshot]) if s is not None] or [snapshot]
    verdict = decide(_verdict_inputs(snapshots, len(snapshots) > 1), thresholds)
    last = snapshot.steps[-1] if snapshot.steps else None
    advice = advise(
        snapshot.control,
        summarize_device(snapshot.device),
        summarize_steps(snapshot.steps),
        float(last.samples) if last is not None and last.samples else None,
        snapshot.host[-1] if snapshot.host else None,
        verdict,
        thresholds,
    )
    return Assessment(
        verdict=verdict,
        breakdown=advice.breakdown,
        recommendations=advice.recommendations,
        max_safe_batch_size=advice.max_safe_batch_size,
        model_confidence=advice.model_confidence,
    )
