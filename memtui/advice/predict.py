"""Predicting peak device memory from the micro-batch: steady + per_sample x batch, learned live.

Pure. The steady part is what does not grow with the batch: what stays allocated between steps
(read by the hook between two steps, else the lowest memory sampled; on CUDA at least the
parameters, gradients and optimizer state computed exactly from the tensors; on CPU less the
loader workers'), plus the gradients each step makes where the loop frees them before its step
ends (``measure.gradients_made_per_step``) and the temporaries of the optimizer's step, up to the
peak (``measure.between_steps``). The per-sample part comes from the run itself: the step peak
minus the steady part, over the micro-batch (one point); where the optimizer's step may have
set that peak, the interval's high end lets all of the peak over what stays between steps grow
with the batch (``per_sample_bound_bytes``). Every applied change of the micro-batch
adds an observed (batch, peak) point; with two or more distinct batches the model is a least-
squares line through them, and its fit error is reported. The device total adds the allocator's
reserve overhead (peak reserved over peak allocated: the 3.18 GiB "reserved but unallocated"
that a hand-made 12-16 GB guess for a doubled batch left out, and the batch ran out of memory
at 18.5 GB) and the memory outside torch (CUDA context,
NCCL, other processes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from memtui.core.stats import format_bytes
from memtui.wire import Ceiling, MemoryModel, ModelPoint


@dataclass(frozen=True)
class Observation:
    """What the run shows at its current micro-batch."""

    kind: str
    batch_size: int
    capacity_bytes: int
    steady_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    beyond_bytes: int = 0
    samples: int = 0
    noise_bytes: int = 0
    """How much the peak readings spread."""
    workers: int | None = None
    """Loader workers running (None: the run has no ``num_workers`` knob)."""
    per_worker_bytes: int = 0
    """Memory of one worker of its own (0: not measured)."""
    returns_freed: bool = False
    """A CPU run that gives freed large blocks back at once (``MemoryModel.returns_freed``)."""
    unseen_bytes: int = 0
    """The part of ``steady_bytes`` over what stays between steps: the optimizer's step
    temporaries, which may have hidden what the micro-batch itself grows by."""


def fit(observation: Observation, history: Sequence[ModelPoint] = ()) -> MemoryModel:
    """The model from the current observation and the points seen before (the observation
    replaces the point at its micro-batch, unless it is left out)."""
    now = ModelPoint(
        observation.batch_size,
        observation.peak_allocated_bytes,
        observation.samples,
        observation.noise_bytes,
    )
    points = {p.batch_size: p for p in history}
    # On the CPU the process keeps the memory it held at a larger micro-batch (its heap is not
    # given back), so a peak seen after a decrease says little about the smaller batch: such a
    # point would flatten the line (decreases peaked 27-34% over their prediction because glibc
    # kept the freed heap, and the flattened line put the max safe batch too high).
    # On CUDA the model reads allocated bytes, which do come down.
    # The CPU stand-in fixes glibc's mmap threshold: its freed blocks go back, and the point counts.
    retained = (
        observation.kind == "cpu"
        and not observation.returns_freed
        and any(p.batch_size > observation.batch_size for p in history)
    )
    if not retained:
        points[now.batch_size] = now
    ordered = sorted(points.values(), key=lambda p: p.batch_size)
    overhead = 1.0
    if observation.peak_allocated_bytes > 0:
        overhead = max(1.0, observation.peak_reserved_bytes / observation.peak_allocated_bytes)
    bound = 0.0
    if len(ordered) >= 2:
        steady, slope, error = _least_squares(ordered)
        basis = (
            f"a line through {len(ordered)} observed micro-batches "
            f"({', '.join(str(p.batch_size) for p in ordered)})"
        )
    else:
        seen = ordered[0] if retained else now
        steady = observation.steady_bytes
        activations = max(0, seen.peak_bytes - steady)
        slope = activations / max(1, seen.batch_size)
        error = None
        basis = (
            f"one micro-batch ({seen.batch_size}): step peak minus the steady part, "
            "assuming activations grow linearly with the batch"
        )
    unseen = observation.unseen_bytes if not retained else 0
    largest = ordered[-1].batch_size
    if unseen > 0 and (len(ordered) == 1 or slope * largest < unseen):
        # The peak is the larger of the step's (its temporaries over what stays between steps)
        # and the backward pass's (the activations over it): while the step's sets the points,
        # the batch's own growth is hidden under it, from one point, or past the largest point
        # of a line it kept flat (an MLP with AdamW peaked at 537-542 MiB from micro-batch 12 to
        # 512, then at 728 MiB at 3072, predicted 569): the high end lets the step's share of
        # the largest point's peak grow with the batch too
        bound = slope + unseen / max(1, largest)
        where = "that peak" if len(ordered) == 1 else f"these peaks, up to micro-batch {largest}"
        basis += (
            f"; the optimizer's step may have set {where} ({unseen / 2**20:.0f} MiB of "
            "temporaries over the memory between steps), so the high end lets up to "
            f"{bound / 2**20:.2f} MiB per sample grow with the batch"
        )
    if retained:
        basis += (
            f"; micro-batch {observation.batch_size} left out: seen after a larger one, whose "
            "memory the process still holds"
        )
    return MemoryModel(
        kind=observation.kind,
        batch_size=observation.batch_size,
        capacity_bytes=observation.capacity_bytes,
        steady_bytes=int(max(0, steady)),
        per_sample_bytes=max(0.0, slope),
        overhead_ratio=overhead,
        beyond_bytes=max(0, observation.beyond_bytes),
        points=ordered,
        fit_error=error,
        basis=basis,
        workers=observation.workers,
        per_worker_bytes=observation.per_worker_bytes,
        returns_freed=observation.returns_freed,
        per_sample_bound_bytes=bound,
    )


def _least_squares(points: Sequence[ModelPoint]) -> tuple[float, float, float]:
    """(intercept, slope, RMS relative error) of peak against batch size."""
    xs = [float(p.batch_size) for p in points]
    ys = [float(p.peak_bytes) for p in points]
    intercept, slope = line_fit(xs, ys)
    residuals = [(intercept + slope * x - y) / y for x, y in zip(xs, ys, strict=True) if y > 0]
    error = math.sqrt(sum(r * r for r in residuals) / len(residuals)) if residuals else 0.0
    return intercept, slope, error


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through two or more distinct ``xs``."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return mean_y - slope * mean_x, slope


NOISE_FLOOR = 0.01
"""A peak reading is taken as noisy by at least this share of the peak (the samples fall all over
the step cycle; allocators round and cache)."""
ONE_POINT_SPREAD = 0.3
"""With one micro-batch seen, the per-sample memory is known to +-this share only: the steady
part it is measured against is not a second point, and what grows with the batch need not grow
in proportion (a starving run's batch, doubled on a one-point guess of 12-16 GB, ran out of
memory at 18.5 GB: the guess was about 25% low)."""
NONLINEAR_PER_DOUBLING = 0.05
"""Past the largest micro-batch measured, a line's per-sample memory may grow by this share per
doubling (allocator rounding, workspaces that grow with the batch): added to the upper bound."""
Z = 2.0
"""Standard errors in the interval where the noise is the measured spread (about 95%)."""
GUESS_MULTIPLE = 4
"""A max safe batch beyond this multiple of the largest micro-batch measured is a guess."""
WORKER_PRIOR_BYTES = 8 * 2**20
"""Before a worker's memory is measured, the prediction counts this much per new worker: its own
memory (USS, as the hook counts it) measured at 7.6-9.5 MiB a worker on the benchmark scripts'
0 -> 2 and 2 -> 4 worker changes (the transformer, the CNN, the MLP; torch 2.13 on CPU). 16 MiB
predicted every first change of workers 9-16 MiB high (+2.0% to +3.7%)."""
WORKER_GUESS_BYTES = 64 * 2**20
"""Before a worker's memory is measured, the high end counts this much per new worker."""
RETAINED_ON_DECREASE = 0.5
"""On the CPU, after a smaller micro-batch, the share of the memory it frees that the process is
predicted to keep anyway (glibc's heap, even trimmed, kept 40-70% of it in the benchmark)."""


def predict_allocated(model: MemoryModel, batch_size: int) -> int:
    """Peak allocated (before the allocator's overhead) at ``batch_size``."""
    return int(model.steady_bytes + model.per_sample_bytes * batch_size)


def _workers_bytes(model: MemoryModel, workers: int | None, high: bool) -> int:
    """The loader workers' own memory on a CPU run (the host is its device; on CUDA workers take
    host memory, not device memory): ``workers`` of them, or as many as the run has now. Before
    one is measured, the high end counts ``WORKER_GUESS_BYTES`` for each new one."""
    if model.kind != "cpu" or model.workers is None:
        return 0
    count = model.workers if workers is None else workers
    total = model.per_worker_bytes * count
    if model.per_worker_bytes <= 0 and count > model.workers:
        total += (WORKER_GUESS_BYTES if high else WORKER_PRIOR_BYTES) * (count - model.workers)
    return int(total)


def _retained(model: MemoryModel, batch_size: int) -> int:
    """On the CPU, what a smaller micro-batch will not give back at once: ``RETAINED_ON_DECREASE``
    of the drop from the peak at the current batch (none on CUDA, where ``empty_cache`` gives it
    back, nor on the CPU stand-in, whose freed blocks are unmapped)."""
    if model.kind != "cpu" or model.returns_freed or batch_size >= model.batch_size:
        return 0
    now = next((p.peak_bytes for p in model.points if p.batch_size == model.batch_size), None)
    if now is None:
        now = predict_allocated(model, model.batch_size)
    return int(RETAINED_ON_DECREASE * max(0, now - predict_allocated(model, batch_size)))


def predict_peak(model: MemoryModel, batch_size: int, workers: int | None = None) -> int:
    """The device total at peak with ``batch_size`` (and ``workers`` loader workers): allocated
    x overhead + memory beyond torch."""
    allocated = predict_allocated(model, batch_size) + _retained(model, batch_size)
    return (
        int(allocated * model.overhead_ratio)
        + model.beyond_bytes
        + _workers_bytes(model, workers, high=False)
    )


def _noise(point: ModelPoint) -> float:
    """A point's peak reading noise: its measured spread, at least ``NOISE_FLOOR`` of it."""
    return max(float(point.noise_bytes), NOISE_FLOOR * point.peak_bytes)


def margin(model: MemoryModel, batch_size: int) -> int:
    """Half-width of the interval of peak allocated at ``batch_size``, from the data behind the
    model: its points' noise and residuals, how far ``batch_size`` is from them, and how far it
    extrapolates past the largest one."""
    points = model.points
    if not points:
        return int(ONE_POINT_SPREAD * model.per_sample_bytes * batch_size)
    noise = math.sqrt(sum(_noise(p) ** 2 for p in points) / len(points))
    xs = [float(p.batch_size) for p in points]
    if len(points) == 1:
        width = Z * noise + ONE_POINT_SPREAD * model.per_sample_bytes * abs(batch_size - xs[0])
    else:
        n = len(points)
        mean_x = sum(xs) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sigma = noise
        if n > 2:  # the residuals say how well a line fits: the larger of the two counts
            residuals = [
                p.peak_bytes - (model.steady_bytes + model.per_sample_bytes * p.batch_size)
                for p in points
            ]
            sigma = max(sigma, math.sqrt(sum(r * r for r in residuals) / (n - 2)))
        # Z, not Student's t: with 3 points (1 degree of freedom) t is 12.7, and one noisy point
        # made the max safe batch 0 in the benchmark; the noise floor keeps sigma honest instead
        width = Z * sigma * math.sqrt(1 + 1 / n + (batch_size - mean_x) ** 2 / sxx)
    largest = max(xs)
    if len(points) > 1 and batch_size > largest:  # (one point's spread covers it already)
        doublings = math.log2(batch_size / largest)
        width += NONLINEAR_PER_DOUBLING * doublings * model.per_sample_bytes * batch_size
    # what the optimizer's step may hide (``per_sample_bound_bytes``): from one point, either
    # way from it; from a line, past its largest point
    hidden = max(0.0, model.per_sample_bound_bytes - model.per_sample_bytes)
    reach = abs(batch_size - largest) if len(points) == 1 else max(0.0, batch_size - largest)
    return int(width + hidden * reach)


def predict_range(
    model: MemoryModel, batch_size: int, workers: int | None = None, *, kept: bool = True
) -> tuple[int, int]:
    """The device total at peak, low and high ends of its interval (after a decrease on the CPU,
    from none to all of the freed memory kept; without it where not ``kept``: what the smaller
    batch needs once the process reuses what it keeps)."""
    retained = _retained(model, batch_size) if kept else 0
    allocated = predict_allocated(model, batch_size) + retained
    width = margin(model, batch_size) + retained
    beyond = model.beyond_bytes
    low = int(max(0, allocated - width) * model.overhead_ratio) + beyond
    low += _workers_bytes(model, workers, high=False)
    high = int((allocated + width) * model.overhead_ratio) + beyond
    high += _workers_bytes(model, workers, high=True)
    return low, high


def predict_high(
    model: MemoryModel, batch_size: int, workers: int | None = None, *, kept: bool = True
) -> int:
    """The high end of the interval of the device total at peak (what the gate and max safe use)."""
    return predict_range(model, batch_size, workers, kept=kept)[1]


def fraction(model: MemoryModel, batch_size: int) -> float:
    """The predicted peak over capacity."""
    return predict_peak(model, batch_size) / model.capacity_bytes if model.capacity_bytes else 0.0


@dataclass(frozen=True)
class SafeBatch:
    """The largest micro-batch whose predicted peak, high end, stays under a band."""

    size: int
    guess: bool
    """The model puts it beyond ``GUESS_MULTIPLE`` x the largest micro-batch measured, an
    extrapolation: ``size`` is then that multiple, the most the measured points justify."""
    largest_measured: int
    capped_by_oom: bool = False
    """An out-of-memory error at a larger micro-batch set it (the ceiling), not the model."""

    @property
    def figure(self) -> str:
        """The number the viewer and ``memtui status`` show: the size, or for a guess only the
        floor that is not one (``> 32``: ``GUESS_MULTIPLE`` x the largest micro-batch measured)."""
        return f"> {GUESS_MULTIPLE * self.largest_measured}" if self.guess else str(self.size)

    def describe(self) -> str:
        """``48``, ``> 32 (4x the largest micro-batch measured, 8; past it the model only
        guesses)`` or ``31 (under micro-batch 32, which ran out of memory)``."""
        if self.capped_by_oom:
            return f"{self.size} (under micro-batch {self.size + 1}, which ran out of memory)"
        if self.guess:
            return (
                f"{self.figure} ({GUESS_MULTIPLE}x the largest micro-batch measured, "
                f"{self.largest_measured}; past it the model only guesses)"
            )
        return self.figure


def safe_batch(model: MemoryModel, band: float, ceiling: Ceiling | None = None) -> SafeBatch | None:
    """The largest micro-batch whose predicted peak's high end stays under ``band`` x capacity,
    below the smallest micro-batch that ran out of memory (the ``ceiling``'s); None: no bound."""
    largest = max((p.batch_size for p in model.points), default=model.batch_size)
    limit = ceiling.batch_size if ceiling is not None else None
    flat = model.per_sample_bytes <= 0
    unseen = len(model.points) < 2 and model.per_sample_bound_bytes <= 0
    if model.capacity_bytes <= 0 or (flat and unseen):
        if limit is None:
            return None
        return SafeBatch(max(0, limit - 1), False, largest, capped_by_oom=True)
    budget = band * model.capacity_bytes
    budget_allocated = (budget - model.beyond_bytes) / model.overhead_ratio
    # Past the guess multiple of the largest micro-batch measured the model only extrapolates:
    # the search stops there (a slope of ~0 from one point solved to a "max safe" micro-batch
    # of 803,085,751, which the gate then refused as out of range)
    top = GUESS_MULTIPLE * largest + 1
    if not flat:  # (micro-batches peaking alike, a parameter-heavy MLP's, give no slope)
        top = min(
            top, max(0, int((budget_allocated - model.steady_bytes) // model.per_sample_bytes))
        )
    low, high = 0, top  # the high end grows with the batch: the largest under the budget
    while low < high:
        middle = (low + high + 1) // 2
        if predict_high(model, middle, kept=False) <= budget:
            low = middle
        else:
            high = middle - 1
    # the points were seen without the loader workers' memory (taken out), which the run now adds
    workers = _workers_bytes(model, None, high=True)
    low = max(
        low, _seen_safe(model, (budget - model.beyond_bytes - workers) / model.overhead_ratio)
    )
    if limit is not None and low >= limit:
        return SafeBatch(max(0, limit - 1), False, largest, capped_by_oom=True)
    if low > GUESS_MULTIPLE * largest:
        return SafeBatch(GUESS_MULTIPLE * largest, True, largest)
    return SafeBatch(low, False, largest)


def _seen_safe(model: MemoryModel, budget_allocated: float) -> int:
    """The largest micro-batch seen running with its peak, plus its noise, under the budget left
    beside the workers the run has now, and the line there too: what was observed is safe
    whatever a wide interval says (a demo whose peak rose 8% over its stay at each micro-batch
    got an interval so wide that no batch was called safe, at 74% of the limit at micro-batch
    8), unless the other points put it over (a reading that missed the step's peak)."""
    return max(
        (
            p.batch_size
            for p in model.points
            if max(p.peak_bytes + _noise(p), predict_allocated(model, p.batch_size))
            <= budget_allocated
        ),
        default=0,
    )


def max_batch(model: MemoryModel, band: float, ceiling: Ceiling | None = None) -> int | None:
    """The largest micro-batch predicted (high end) to stay under ``band`` x capacity."""
    found = safe_batch(model, band, ceiling)
    return found.size if found is not None else None


def confidence(model: MemoryModel) -> str:
    """How sure the model is, in words: what it saw and its interval at the current batch (the
    interval of any other batch is ``predict_range``'s, wider the farther it is)."""
    batch = model.batch_size
    low, high = predict_range(model, batch)
    peak = predict_peak(model, batch)
    spread = f"+-{(high - low) / 2 / peak:.0%} at {batch}" if peak > 0 else "no interval"
    if len(model.points) < 2:
        unseen = model.per_sample_bound_bytes - model.per_sample_bytes
        if unseen > 0:  # what the high end allows and the point prediction does not
            return (
                f"low: one micro-batch seen, {spread}; its peak may be the optimizer's step, "
                f"with up to {format_bytes(int(model.per_sample_bound_bytes))} per sample unseen"
            )
        return f"low: one micro-batch seen, {spread}"
    if len(model.points) == 2 or model.fit_error is None:
        return f"{len(model.points)} micro-batches seen, {spread}"
    return f"{len(model.points)} micro-batches seen, fit error {model.fit_error:.1%}, {spread}"
