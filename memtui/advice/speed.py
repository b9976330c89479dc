"""What a change of the knobs will do to samples/s, from the steps the run has timed (pure).

One estimate serves the recommendations (their expected samples/s) and the hook, which predicts
every applied change's speed from the steps before it, so that the prediction is checked against
the measured effect as the memory prediction is (``speed_accuracy``).

The data-loader estimate assumes loading is waiting (storage, network, decoding in C) that
workers overlap: with ``W`` workers a micro-batch of ``n`` samples is ready after
``n * d / W`` seconds, where ``d`` is the per-sample load time. Without workers ``d`` is the
measured wait per sample; with workers it is known only while they fall short (the run waits
for data): then the workers' supply is the step. Loading that burns the CPU scales no further
than the free cores, which this does not model (the measured effect then says so).

The micro-batch estimate needs the compute time at two micro-batch sizes at least: the compute
of one micro-batch is taken as a line, a fixed cost (the optimizer step, kernel launches, Python)
plus a cost per sample, through the sizes the run has been timed at (now, and before and after
every measured change of the micro-batch). With one size timed the two parts cannot be told
apart, and the estimate says so instead of giving a number. The data wait per sample is kept as
it is (a loader that starves with workers stays as slow per sample: the step is then the longer
of compute and loading).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from memtui.advice.effect import interval
from memtui.advice.predict import line_fit
from memtui.advice.verdict import THRESHOLDS
from memtui.core.stats import StepStats
from memtui.wire import AppliedChange, Effect, Knobs, KnobValue

WORKER_KNOBS = frozenset({"num_workers"})
BATCH_KNOBS = frozenset({"batch_size", "grad_accum"})


@dataclass(frozen=True)
class SpeedBasis:
    """What a speed estimate is made from: the config, its timed steps, earlier changes."""

    config: Knobs
    steps: StepStats
    samples_per_step: float
    """Samples in one optimizer step on one rank (micro-batch x accumulation, measured)."""
    applied: tuple[AppliedChange, ...] = ()
    """Earlier applied changes, oldest first: their measured effects time other micro-batches."""
    starved_wait_fraction: float = THRESHOLDS.starved_wait_fraction

    @property
    def starved(self) -> bool:
        """The run waits for data past the verdict's STARVED threshold."""
        return self.steps.data_wait_fraction >= self.starved_wait_fraction


@dataclass(frozen=True)
class SpeedEstimate:
    """An expected relative change of samples/s (None: unknown), and how it was made or why not."""

    delta: float | None
    note: str


def predict_speed(basis: SpeedBasis, changes: Mapping[str, KnobValue]) -> SpeedEstimate:
    """The expected change of samples/s if ``changes`` were applied to ``basis.config``."""
    config = basis.config
    moved = {k for k, v in changes.items() if getattr(config, k, None) != v}
    if not moved:
        return SpeedEstimate(0.0, "no knob changes")
    if moved <= BATCH_KNOBS:
        batch = changes.get("batch_size", config.batch_size)
        accum = changes.get("grad_accum", config.grad_accum)
        if not isinstance(batch, int) or not _count(batch):
            return SpeedEstimate(None, "speed unknown: the micro-batch is not a count")
        if accum is not None and (not isinstance(accum, int) or not _count(accum)):
            return SpeedEstimate(None, "speed unknown: the accumulation is not a count")
        return batch_speed(basis, batch, accum)
    if moved <= WORKER_KNOBS:
        workers = changes.get("num_workers")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            return SpeedEstimate(None, "speed unknown: num_workers is not a count")
        return workers_speed(basis, workers)
    names = ", ".join(sorted(moved))
    what = f"{names} together" if len(moved) > 1 else f"a {names} change"
    return SpeedEstimate(None, f"speed unknown until measured: no estimate for {what}")


def _count(value: object) -> bool:
    """``value`` is a positive integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class LoaderModel:
    """The loader's numbers per step: compute seconds, load seconds per sample, samples."""

    compute_s: float
    load_per_sample_s: float
    samples: float

    def step_time(self, workers: int) -> float:
        """Seconds per step with ``workers`` loader workers."""
        load = self.load_per_sample_s * self.samples
        return max(self.compute_s, load / workers) if workers else self.compute_s + load


def loader_model(basis: SpeedBasis) -> LoaderModel | None:
    """The loader's numbers, or None where the per-sample load time is not measured (workers that
    keep up leave only a bound on it)."""
    workers = basis.config.num_workers
    if workers is None or basis.samples_per_step <= 0:
        return None
    steps, samples = basis.steps, basis.samples_per_step
    if workers <= 0:
        per_sample = steps.data_wait_s / samples
    elif basis.starved:  # the wait is what the workers' supply falls short of the compute time
        per_sample = (steps.data_wait_s + steps.compute_s) * workers / samples
    else:
        return None
    return LoaderModel(steps.compute_s, per_sample, samples)


def workers_speed(basis: SpeedBasis, workers: int) -> SpeedEstimate:
    """The expected change of samples/s with ``workers`` loader workers."""
    now = basis.config.num_workers
    model = loader_model(basis)
    if model is None:
        if now is not None and now > 0 and workers > now:
            return SpeedEstimate(
                0.0, f"the {now} workers keep up (the run waits little for data): no faster"
            )
        return SpeedEstimate(
            None, "speed unknown until measured: the workers keep up, by a margin not measured"
        )
    before, after = model.step_time(now or 0), model.step_time(workers)
    if after <= 0:
        return SpeedEstimate(None, "speed unknown: no step time")
    return SpeedEstimate(
        before / after - 1,
        f"loading {model.load_per_sample_s * 1000:.2f} ms per sample, overlapped by the workers; "
        f"compute {model.compute_s * 1000:.1f} ms per step",
    )


def batch_speed(basis: SpeedBasis, batch: int, accum: int | None) -> SpeedEstimate:
    """The expected change of samples/s at micro-batch ``batch`` x ``accum``."""
    steps, now = basis.steps, basis.config.batch_size
    if not basis.samples_per_step or not now or steps.step_time_s <= 0:
        return SpeedEstimate(None, "speed unknown until measured: no timed steps yet")
    points = timed_micro_batches(basis)
    line = compute_line(points)
    sizes = ", ".join(map(str, sorted(points)))
    if line is None:
        why = (
            f"only micro-batch {sizes} has been timed, and one size cannot tell a micro-batch's "
            "fixed cost from its cost per sample"
            if len(points) < 2
            else f"the compute timed at micro-batches {sizes} does not grow with the size (noise)"
        )
        return SpeedEstimate(None, f"speed unknown until measured: {why}")
    fixed, per_sample = line
    accum_now = basis.config.grad_accum or 1
    new_accum = accum or 1
    growth = batch * new_accum / (now * accum_now)  # samples per step, new over now
    modelled_now = accum_now * (fixed + per_sample * now)
    compute = steps.compute_s * new_accum * (fixed + per_sample * batch) / modelled_now
    wait = steps.data_wait_s * growth
    if (basis.config.num_workers or 0) > 0 and basis.starved:  # the workers' loading bounds it
        step = max(compute, steps.step_time_s * growth)
    else:
        step = compute + wait
    if step <= 0:
        return SpeedEstimate(None, "speed unknown: no step time")
    return SpeedEstimate(
        growth * steps.step_time_s / step - 1,
        f"speed estimated from the compute timed at micro-batches {sizes}: "
        f"{fixed * 1000:.1f} ms per micro-batch + {per_sample * 1000:.2f} ms per sample; "
        "data wait per sample as now",
    )


def _compute_per_sample(effect: Effect, after: bool) -> float | None:
    """Compute seconds per sample on one side of a measured effect (samples per step is
    samples/s x step time: both are totals over the same steps)."""
    step = effect.step_time_s_after if after else effect.step_time_s_before
    wait = effect.data_wait_s_after if after else effect.data_wait_s_before
    rate = effect.samples_per_s_after if after else effect.samples_per_s_before
    if step <= 0 or rate <= 0:
        return None
    return max(0.0, step - wait) / (rate * step)


def timed_micro_batches(basis: SpeedBasis) -> dict[int, float]:
    """Compute seconds of one micro-batch, by micro-batch size, as the run has measured them."""
    points: dict[int, float] = {}
    for applied in basis.applied:
        diff = applied.changes.get("batch_size")
        if applied.rollback or applied.effect is None or diff is None:
            continue
        for size, after in ((diff.old, False), (diff.new, True)):
            per_sample = _compute_per_sample(applied.effect, after)
            if isinstance(size, int) and _count(size) and per_sample:
                points[size] = per_sample * size
    batch = basis.config.batch_size
    if basis.samples_per_step and batch:  # now: the latest
        points[batch] = basis.steps.compute_s / basis.samples_per_step * batch
    return points


def compute_line(points: Mapping[int, float]) -> tuple[float, float] | None:
    """(fixed seconds, seconds per sample) of one micro-batch: a least-squares line through the
    timed sizes (None: fewer than two sizes, or times that do not grow with the size)."""
    if len(points) < 2:
        return None
    xs, ys = [float(x) for x in points], list(points.values())
    fixed, slope = line_fit(xs, ys)
    if fixed < 0:  # no negative fixed cost: a line through the origin
        fixed, slope = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    if slope <= 0:
        return None
    return fixed, slope


@dataclass(frozen=True)
class SpeedAccuracy:
    """How the speed predictions of applied changes fared against their measured effects."""

    measured: int
    """Changes with both a predicted and a measured speed."""
    mean_abs_error: float | None
    """Mean |predicted - measured| change of samples/s, in fractions (0.05: 5 points)."""
    within_noise: int
    """Of those, the ones whose prediction lies inside the measured effect's 95% interval."""
    unknown: int
    """Changes measured whose speed was not predicted (the estimate said why)."""


def speed_error(applied: AppliedChange) -> float | None:
    """Predicted minus measured change of samples/s (None until both are known)."""
    effect = applied.effect
    if applied.predicted_speed_delta is None or effect is None:
        return None
    if effect.samples_per_s_before <= 0:
        return None
    measured = effect.samples_per_s_after / effect.samples_per_s_before - 1.0
    return applied.predicted_speed_delta - measured


def inside_noise(applied: AppliedChange) -> bool:
    """The speed prediction lies inside the measured effect's 95% interval."""
    error = speed_error(applied)
    bounds = interval(applied.effect) if applied.effect is not None else None
    if error is None or bounds is None or applied.predicted_speed_delta is None:
        return False
    return bounds[0] <= applied.predicted_speed_delta <= bounds[1]


def speed_accuracy(applied: Sequence[AppliedChange]) -> SpeedAccuracy:
    """The accuracy of the speed predictions behind ``applied`` (rollbacks left out)."""
    errors: list[float] = []
    within = unknown = 0
    for change in applied:
        if change.rollback or change.effect is None or not change.speed_note:
            continue
        error = speed_error(change)
        if error is None:
            unknown += 1
            continue
        errors.append(abs(error))
        within += inside_noise(change)
    mean = sum(errors) / len(errors) if errors else None
    return SpeedAccuracy(len(errors), mean, within, unknown)


def describe_speed(accuracy: SpeedAccuracy) -> str:
    """``3 changes: the predicted change of samples/s was 6 points from the measured one on
    average (+40% predicted, +46% measured: 6 points); 2 inside the measured noise``."""
    if not accuracy.measured:
        return "" if not accuracy.unknown else f"{accuracy.unknown} change(s) with no estimate"
    assert accuracy.mean_abs_error is not None
    words = (
        f"{accuracy.measured} change{'s' if accuracy.measured > 1 else ''}: the predicted "
        f"change of samples/s was {accuracy.mean_abs_error * 100:.0f} points from the measured "
        f"one on average; {accuracy.within_noise} inside the measured noise"
    )
    if accuracy.unknown:
        words += f"; {accuracy.unknown} with no estimate"
    return words
