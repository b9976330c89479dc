"""What the hook measures of its own run: the memory-model observation and the effect of changes.

Pure functions over the hook's device samples and step records, so they are unit-tested without a
hook: ``observe`` turns the samples taken at the current micro-batch into one ``Observation`` for
the model fit, ``model_moved`` says when a refit is news, and ``effects_due`` compares the steps
before and after each applied change once enough ran.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from memtui.advice.effect import (
    SETTLE_STEPS,
    SETTLED_AHEAD,
    WARMUP_LIMIT,
    Warmup,
    drift_of,
    measure,
    warmup,
)
from memtui.advice.predict import Observation, predict_peak
from memtui.advice.speed import SpeedBasis, SpeedEstimate, predict_speed
from memtui.core.knobs import knobs_with, new_values
from memtui.core.stats import process_tree, summarize_steps
from memtui.wire import (
    AppliedChange,
    DeviceSample,
    Effect,
    HostSample,
    Knobs,
    MemoryModel,
    OomEvent,
    StaticMemory,
    StepRecord,
)

EFFECT_STEPS = 20
"""Steps compared before and after an applied change for its measured effect."""
LONG_STEPS = 200
"""The most steps a side the autopilot times a trial over where the run's steps vary too much
for ``EFFECT_STEPS`` to tell a small gain from the noise."""

PEAK_SAMPLES = 3
"""Device samples at a change's new config before its peak is taken (its effect waits for them)."""
RawStepT = tuple[int, float, float, float, int, int, int]
"""A step as the hook's ledger keeps it (its first field is the step number)."""


def observe(
    samples: Iterable[DeviceSample],
    batch_size: int,
    since_step: int,
    static: StaticMemory | None,
    *,
    workers: int | None = None,
    host: HostSample | None = None,
    returns_freed: bool = False,
) -> Observation | None:
    """The model's observation from the samples taken at ``batch_size`` after it settled (steps
    after ``since_step + SETTLE_STEPS``: the micro-batch or the loader last changed at
    ``since_step``), with ``workers`` loader workers, the latest ``host`` sample (for their
    memory) and whether the CPU stand-in gives freed blocks back at once; None with fewer than
    three samples."""
    window = read_after(samples, since_step + SETTLE_STEPS)
    if len(window) < 3:
        return None
    last = window[-1]
    peaks = sorted(max(s.peak_allocated_bytes, s.allocated_bytes) for s in window)
    peak_allocated = peaks[-1]
    # the readings that caught a whole step's peak are the top ones; their spread is the noise
    top = peaks[len(peaks) // 2 :]
    noise = max(top[-1] - top[len(top) // 2], rising_by(window))
    peak_reserved = max(max(s.peak_reserved_bytes, s.reserved_bytes) for s in window)
    floor = min(s.allocated_bytes for s in window)
    beyond = 0
    if last.kind == "cuda" and last.nvml_used_bytes is not None:
        beyond = max(0, last.nvml_used_bytes - last.reserved_bytes)
    per_worker = per_worker_bytes(host)
    in_workers = 0
    if last.kind != "cuda":
        # CPU: the samples fall all over the step cycle, and the lowest ones between steps. The
        # loader workers' own memory is taken out (the model adds it back per worker): points
        # taken at other worker counts then stay on one line. A worker count the run has no
        # knob for is not known: their memory stays in the points, as the model adds none back
        counted = workers is not None and host is not None and host.workers
        in_workers = per_worker * workers if counted and workers is not None else 0
        peak_allocated = max(0, peak_allocated - in_workers)
        peak_reserved = max(0, peak_reserved - in_workers)
    between = between_steps(static, max(0, floor - in_workers), last.kind)
    # The optimizer's step allocates its temporaries after backward freed the activations: a
    # peak they explain does not grow with the batch (a 9.4M-parameter MLP with AdamW peaked at
    # its step, 32 MiB over the memory between steps, from micro-batch 8 to 512)
    steady = min(peak_allocated, between + (static.step_temporaries_bytes if static else 0))
    if last.kind == "cuda":  # the tensors' exact size holds even where no sample caught the peak
        steady = max(steady, between)
    return Observation(
        kind=last.kind,
        batch_size=batch_size,
        capacity_bytes=last.capacity_bytes,
        steady_bytes=steady,
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        beyond_bytes=beyond,
        samples=len(window),
        noise_bytes=noise,
        workers=workers,
        per_worker_bytes=per_worker,
        returns_freed=returns_freed and last.kind == "cpu",
        unseen_bytes=max(0, steady - min(between, peak_allocated)),
    )


def between_steps(static: StaticMemory | None, floor: int, kind: str) -> int:
    """What stays allocated across steps, with the gradients each step makes: the memory read
    between two steps where the hook read it (at the first step's end and at each boundary),
    else the lowest sample (``floor``, without the loader workers'), and never less than the
    parameters, gradients and optimizer state counted from the tensors. A sample is taken at any
    moment of the step cycle: the lowest one moved with the machine's load (a quiet run's missed
    the moment between steps, a loaded run's caught it; the same run's per-sample memory read
    0.0 and 4.24 MiB), and a dip below what is known to stay is no evidence of a smaller part."""
    if static is None:
        return floor
    exact = static.parameters_bytes + static.buffers_bytes
    exact += static.gradients_bytes + static.optimizer_bytes
    if static.between_steps_bytes is not None:
        measured = static.between_steps_bytes + gradients_made_per_step(static)
    elif kind == "cuda":
        measured = floor
    else:
        measured = floor + gradients_made_per_step(static)
    return max(exact, measured)


def gradients_made_per_step(static: StaticMemory | None) -> int:
    """The gradients a step makes and the loop frees before its boundary (``zero_grad(set_to_none=
    True)``): the lowest memory between steps lacks them, yet they do not grow with the batch.
    Counted in the steady part, they keep a one-point model from scaling them with the batch
    (a parameter-heavy MLP, 38 MiB of gradients and ~3 MiB of activations at micro-batch 32: its
    32 -> 64 was predicted 12.7% over what it peaked at in benchmarks/advice_truth.py without
    them). 0 until the first step's end has counted them, and where the loop keeps them."""
    if static is None or static.gradients_held_bytes is None:
        return 0
    return max(0, static.gradients_bytes - static.gradients_held_bytes)


def rising_by(window: Sequence[DeviceSample]) -> int:
    """How much higher the later half of ``window`` peaked than the earlier half: a peak still
    rising with the time spent at a config (variable-length inputs, whose longest batch comes
    late; an allocator's fragmentation) is not yet the config's peak, and the rise counts as
    noise (a transformer on variable-length data rose 15% after its first 5 samples at a
    micro-batch, and a line through such points called a batch safe that peaked 16% higher)."""
    half = len(window) // 2
    if half == 0:
        return 0

    def peak(part: Sequence[DeviceSample]) -> int:
        return max(max(s.peak_allocated_bytes, s.allocated_bytes) for s in part)

    return max(0, peak(window[half:]) - peak(window[:half]))


def per_worker_bytes(host: HostSample | None) -> int:
    """One loader worker's own memory (USS, else RSS) from a host sample (0: no workers)."""
    if host is None or not host.workers:
        return 0
    return int(process_tree(host).workers_bytes / host.workers)


def model_moved(old: MemoryModel | None, new: MemoryModel, batch_size: int) -> bool:
    """Whether a refit model differs enough from the published one to publish it again."""
    if old is None or len(old.points) != len(new.points) or old.batch_size != new.batch_size:
        return True
    drift = abs(predict_peak(old, batch_size) - predict_peak(new, batch_size))
    return drift > 0.01 * max(new.capacity_bytes, 1)


def peak_between(samples: Iterable[DeviceSample], first_step: int, last_step: int) -> int | None:
    """The device total at peak over the samples read in steps (first, last] (``read_after``)."""
    return peak_of(read_after(samples, first_step, last_step))


def read_after(
    samples: Iterable[DeviceSample], first_step: int, last_step: int | None = None
) -> list[DeviceSample]:
    """The samples taken after step ``first_step`` (and by ``last_step``) whose readings began
    after it too: a sample's peak is the high-water mark since the sample before it (the CPU's
    VmHWM; CUDA's counters where reset at every sample), so the first sample after a change can
    hold the old config's peak. A run whose steps outpace the sampler showed it: the
    transformer's 16 -> 3 was "observed" at exactly micro-batch 16's peak (+24%, in
    benchmarks/advice_truth.py). The first sample of ``samples`` counts by its own step (what
    came before it is not known)."""
    found: list[DeviceSample] = []
    previous: DeviceSample | None = None
    for sample in samples:
        began = previous.step if previous is not None else first_step
        previous = sample
        after = began >= first_step and sample.step > first_step
        if after and (last_step is None or sample.step <= last_step):
            found.append(sample)
    return found


def peak_of(window: Sequence[DeviceSample]) -> int | None:
    """The device total at peak over ``window`` (None: no samples)."""
    if not window:
        return None
    if window[-1].kind == "cuda":
        return max(
            max(s.peak_reserved_bytes, s.reserved_bytes)
            + max(0, (s.nvml_used_bytes or 0) - s.reserved_bytes)
            for s in window
        )
    return max(max(s.peak_allocated_bytes, s.allocated_bytes) for s in window)


@dataclass(frozen=True)
class Measured:
    """An applied change's measured effect and the peak after it; or, for a change that cannot
    act on this run, no effect and why (``note``)."""

    applied: AppliedChange
    effect: Effect | None
    peak_after: int | None
    note: str = ""
    """What the change could not do here (``pin_memory does nothing without an accelerator``)."""


def cannot_act_words(change: AppliedChange, cannot_act: Mapping[str, str]) -> tuple[str, bool]:
    """What ``change`` could not do on this run, from what each knob cannot do here
    (``cannot_act``: knob -> why), and whether none of its knobs can act ('' and False: all can)."""
    idle = [k for k in change.changes if k in cannot_act]
    if not idle:
        return "", False
    why = "; ".join(cannot_act[k] for k in idle)
    if len(idle) == len(change.changes):
        return f"{why}: its effect is not measured", True
    others = ", ".join(k for k in change.changes if k not in cannot_act)
    return f"{why}: the effect measured is {others}'s", False


def configs_left(applied: Sequence[AppliedChange], now: Knobs | None) -> list[Knobs | None]:
    """The config each applied change left (oldest first), worked back from the run's config
    ``now`` (the latest change's); None for each where ``now`` is not known."""
    if now is None or not applied:
        return [None] * len(applied)
    configs: list[Knobs | None] = [now]
    for change in reversed(applied[1:]):
        later = configs[-1]
        assert later is not None
        configs.append(knobs_with(later, {k: d.old for k, d in change.changes.items()}))
    return configs[::-1]


def config_before(applied: Sequence[AppliedChange], now: Knobs | None) -> Knobs | None:
    """The config the first of ``applied`` changed (``now`` itself without changes)."""
    if now is None or not applied:
        return now
    first = configs_left(applied, now)[0]
    assert first is not None
    return knobs_with(first, {k: d.old for k, d in applied[0].changes.items()})


def _between(records: list[StepRecord], first: int, last: int | None = None) -> list[StepRecord]:
    """The records (in step order) of steps (first, last]."""
    start = bisect.bisect_right(records, first, key=lambda r: r.step)
    end = len(records) if last is None else bisect.bisect_right(records, last, key=lambda r: r.step)
    return records[start:end]


@dataclass(frozen=True)
class Periods:
    """The steps at each config of the run: where each applied change's warm-up ended."""

    records: list[StepRecord]
    """Every step kept, oldest first."""
    started: Warmup | None
    """The run's own start, taken as a warm-up like a rebuilt loader's (None: not over yet)."""
    warmups: list[Warmup | None]
    """Each applied change's warm-up (None: not over yet)."""

    def between(self, first: int, last: int | None = None) -> list[StepRecord]:
        """The records of steps (first, last] (to the newest without ``last``)."""
        return _between(self.records, first, last)

    @classmethod
    def of(
        cls,
        applied: Sequence[AppliedChange],
        records: list[StepRecord],
        now: Knobs | None,
        final: bool = False,
    ) -> Periods:
        """The periods of ``records`` between the ``applied`` changes (the run's config ``now``
        says how many workers each rebuilt loader started)."""
        lookahead = WARMUP_LIMIT + SETTLED_AHEAD + 1
        if any(a.step > b.step for a, b in itertools.pairwise(records)):  # a resume went back
            records = sorted(records, key=lambda r: r.step)
        first = config_before(applied, now)
        opening = _between(records, 0, lookahead)
        started = None
        if records and records[0].step <= 1:
            started = warmup(
                0,
                opening,
                first.num_workers if first is not None else None,
                first.prefetch_factor if first is not None else None,
                final=final or len(records) > lookahead,
                started=True,
            )
        warmups: list[Warmup | None] = []
        ends: list[int | None] = [c.step for c in applied[1:]]
        ends += [None] * bool(applied)
        for change, config, end in zip(applied, configs_left(applied, now), ends, strict=True):
            bound = change.step + lookahead if end is None else min(end, change.step + lookahead)
            after = _between(records, change.step, bound)
            # a warm-up the next change cut short ends there: what ran until it says
            done = final or end is not None or bool(records and records[-1].step > bound)
            workers = config.num_workers if config is not None else None
            prefetch = config.prefetch_factor if config is not None else None
            warmups.append(warmup(change.step, after, workers, prefetch, final=done))
        return cls(records, started, warmups)

    @property
    def opening(self) -> bool:
        """Whether the steps kept begin at the run's start (the first segment is its start)."""
        return bool(self.records) and self.records[0].step <= 1

    def settled(self, applied: Sequence[AppliedChange], index: int) -> int:
        """The last step left out after the change at ``index`` (-1: the run's start)."""
        if index < 0:
            return self.started.last if self.started is not None else 0
        warm = self.warmups[index]
        return warm.last if warm is not None else applied[index].step + SETTLE_STEPS

    def segments(self, applied: Sequence[AppliedChange], through: int) -> list[list[StepRecord]]:
        """The settled steps of each config up to the change at ``through`` (the config before
        it last), oldest first: what the run's drift is measured over."""
        out: list[list[StepRecord]] = []
        for index in range(-1, through):
            if index >= 0 and self.warmups[index] is None:
                continue
            first, last = self.settled(applied, index), applied[index + 1].step
            out.append(self.between(first, last))
        return out


def effects_due(
    applied: Sequence[AppliedChange],
    steps: Sequence[RawStepT],
    samples: Sequence[DeviceSample],
    records: Callable[[Iterable[RawStepT]], list[StepRecord]],
    *,
    final: bool = False,
    now: Knobs | None = None,
    cannot_act: Mapping[str, str] | None = None,
) -> list[Measured]:
    """The effects of the applied changes not measured yet whose steps after have run (all that
    can be measured at all when ``final``); ``records`` makes wire records of raw steps, ``now``
    is the run's config (how many workers a rebuilt loader started), ``cannot_act`` what each
    knob that cannot act on this run does not do (a change of those knobs alone is not
    measured, and says why)."""
    pending = [
        i
        for i, c in enumerate(applied)
        if c.effect is None and not c.rollback and not c.effect_note
    ]
    if not pending:
        return []
    periods = Periods.of(applied, records(steps), now, final)
    found: list[Measured] = []
    for index in pending:
        change = applied[index]
        note, idle = cannot_act_words(change, cannot_act or {})
        next_change = applied[index + 1].step if index + 1 < len(applied) else None
        if idle:
            found.append(Measured(change, None, None, note))
            continue
        warm = periods.warmups[index]
        if warm is None:
            continue
        start = warm.last
        end = min(start + EFFECT_STEPS, next_change or start + EFFECT_STEPS)
        after = periods.between(start, end)
        if len(after) < min(EFFECT_STEPS, end - start) and not final:
            continue
        if len(after) < 3:
            continue
        # The peaks: every device sample at each config, not only those within the steps
        # compared (the sampler is timed, steps may be fast: 20 steps of a fast run can fall
        # between two samples), and the after side waits for PEAK_SAMPLES of them. A sample
        # carries the step count when it was taken: samples counted ``step`` ran during the
        # step after it, so the last one before the change is ``step - 1``.
        peak_end = next_change - 1 if next_change is not None else None
        at_new = read_after(samples, change.step + SETTLE_STEPS, peak_end)
        if len(at_new) < PEAK_SAMPLES and next_change is None and not final:
            continue
        first = max(change.step - EFFECT_STEPS, periods.settled(applied, index - 1))
        before = periods.between(first, change.step)
        earlier = applied[index - 1].step if index > 0 else -1
        peak_before = peak_between(samples, earlier + SETTLE_STEPS, change.step - 1)
        drift = drift_of(periods.segments(applied, index), EFFECT_STEPS, opening=periods.opening)
        peak_after = peak_of(at_new)
        effect = measure(before, after, peak_before, peak_after, drift=drift, warm=warm)
        if effect is not None:
            found.append(Measured(change, effect, peak_after, note))
    return found


def measuring(applied: Sequence[AppliedChange]) -> bool:
    """Whether ``effects_due`` or ``speed_prediction_due`` may find something: a change waits
    for its effect, or the latest for its speed prediction."""
    if not applied:
        return False
    latest = applied[-1]
    if latest.changes and not latest.rollback and not latest.speed_note:
        return True
    return any(
        change.effect is None and not change.rollback and not change.effect_note
        for change in applied
    )


def speed_prediction_due(
    applied: Sequence[AppliedChange],
    steps: Sequence[RawStepT],
    records: Callable[[Iterable[RawStepT]], list[StepRecord]],
    knobs: Knobs,
    starved_wait_fraction: float,
    cannot_act: Mapping[str, str] | None = None,
) -> tuple[AppliedChange, SpeedEstimate] | None:
    """The speed prediction of the latest applied change if it has none yet, made from the steps
    before it and the earlier changes' effects only (``knobs``: the config it left; a rollback
    predicts nothing; a change of knobs that cannot act on this run, ``cannot_act``, none)."""
    if not applied:
        return None
    latest = applied[-1]
    if latest.rollback or latest.speed_note or not latest.changes:
        return None
    note, idle = cannot_act_words(latest, cannot_act or {})
    if idle:
        return latest, SpeedEstimate(None, note)
    before = records(r for r in steps if latest.step - EFFECT_STEPS < r[0] <= latest.step)
    stats = summarize_steps(before, window=len(before) or 1)
    if stats is None:
        return latest, SpeedEstimate(None, "speed unknown: no steps timed before it")
    was = knobs_with(knobs, {k: d.old for k, d in latest.changes.items()})
    samples_per_step = stats.samples_per_s * stats.step_time_s  # total samples / steps
    basis = SpeedBasis(was, stats, samples_per_step, tuple(applied[:-1]), starved_wait_fraction)
    return latest, predict_speed(basis, new_values(latest.changes))


@dataclass(frozen=True)
class Accuracy:
    """How the memory predictions of applied changes fared: the mean error over the changes
    measured, and the changes that ran out of memory (misses, outside the mean)."""

    measured: int
    mean_abs_error: float | None
    out_of_memory: int

    def describe(self) -> str:
        """The misses in words ('' when there are none)."""
        if not self.out_of_memory:
            return ""
        plural = "s" if self.out_of_memory > 1 else ""
        return f"{self.out_of_memory} change{plural} ran out of memory (misses, not in the mean)"


def prediction_error(applied: AppliedChange) -> float | None:
    """Predicted over observed peak, minus one (None until both are known)."""
    if not applied.predicted_peak_bytes or not applied.observed_peak_bytes:
        return None
    return applied.predicted_peak_bytes / applied.observed_peak_bytes - 1


def error_words(error: float) -> str:
    """A prediction's error (predicted over observed, minus one) in words: ``3% high``, ``3%
    low`` or ``on the mark`` (under half a percent)."""
    if round(error * 100) == 0:
        return "on the mark"
    return f"{abs(error):.0%} " + ("high" if error > 0 else "low")


def accuracy(applied: Sequence[AppliedChange], ooms: Sequence[OomEvent] = ()) -> Accuracy:
    """The accuracy of the predictions behind ``applied``. A change ran out of memory when the
    run did, at the change's values, after it landed and before the next change landed: a miss,
    left out of the mean."""
    changes = [a for a in applied if a.changes and not a.rollback]
    missed: list[AppliedChange] = []
    for index, change in enumerate(changes):
        end = changes[index + 1].step if index + 1 < len(changes) else None
        for oom in ooms:
            if oom.step < change.step or (end is not None and oom.step >= end):
                continue
            if all(getattr(oom.config, k, None) == d.new for k, d in change.changes.items()):
                missed.append(change)
                break
    errors = [abs(e) for a in applied if a not in missed and (e := prediction_error(a)) is not None]
    return Accuracy(len(errors), sum(errors) / len(errors) if errors else None, len(missed))


def timed_longer(
    applied: Sequence[AppliedChange],
    steps: Sequence[StepRecord],
    now: Knobs | None = None,
) -> Measured | None:
    """The latest of ``applied``'s effect over every step timed on each side (up to
    ``LONG_STEPS`` a side: the steps at the config before it since the change before settled,
    those after it since its warm-up ended), its peaks as first measured (None: no effect
    measured yet, or too few steps); ``now``: the run's config."""
    if not applied or applied[-1].effect is None:
        return None
    change, index = applied[-1], len(applied) - 1
    assert change.effect is not None
    periods = Periods.of(applied, list(steps), now)
    warm = periods.warmups[index]
    if warm is None:
        return None
    timed = [r for r in steps if r.step_time_s > 0]  # as the effect counts them
    settled = periods.settled(applied, index - 1)
    before = [r for r in timed if settled < r.step <= change.step]
    after = [r for r in timed if r.step > warm.last]
    peaks = change.effect.peak_bytes_before, change.effect.peak_bytes_after
    drift = drift_of(periods.segments(applied, index), EFFECT_STEPS, opening=periods.opening)
    effect = measure(before[-LONG_STEPS:], after[:LONG_STEPS], *peaks, drift=drift, warm=warm)
    if effect is None:
        return None
    return Measured(change, effect, change.observed_peak_bytes, change.effect_note)
