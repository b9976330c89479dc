"""Predicting peak device memory from the micro-batch: steady + per_sample x batch, learned live.

Pure. The steady part is what does not grow with the batch: on CUDA the parameters, gradients
and optimizer state computed exactly from the tensors (or the lowest allocation seen between
steps, if higher); on CPU the process's memory when the hook was installed plus the gradients
and optimizer state created since. The per-sample part comes from the run itself: the step peak
minus the steady part, over the micro-batch (one point). Every applied change of the micro-batch
adds an observed (batch, peak) point; with two or more distinct batches the model is a least-
squares line through them, and its fit error is reported. The device total adds the allocator's
reserve overhead (peak reserved over peak allocated: seed 004's 3.18 GiB "reserved but
unallocated" that its hand-made guess left out) and the memory outside torch (CUDA context,
NCCL, other processes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from memtui.wire import MemoryModel, ModelPoint


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


def fit(observation: Observation, history: Sequence[ModelPoint] = ()) -> MemoryModel:
    """The model from the current observation and the points seen at other micro-batches."""
    now = ModelPoint(observation.batch_size, observation.peak_allocated_bytes, observation.samples)
    points = {p.batch_size: p for p in history}
    # On the CPU the process keeps the memory it held at a larger micro-batch (its heap is not
    # given back), so a peak seen after a decrease says little about the smaller batch: such a
    # point would flatten the line (issue 15: decreases seen 27-34% high, max safe overshooting).
    # On CUDA the model reads allocated bytes, which do come down.
    retained = observation.kind == "cpu" and any(
        p.batch_size > observation.batch_size for p in history
    )
    if not retained:
        points[now.batch_size] = now
    ordered = sorted(points.values(), key=lambda p: p.batch_size)
    overhead = 1.0
    if observation.peak_allocated_bytes > 0:
        overhead = max(1.0, observation.peak_reserved_bytes / observation.peak_allocated_bytes)
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


def predict_allocated(model: MemoryModel, batch_size: int) -> int:
    """Peak allocated (before the allocator's overhead) at ``batch_size``."""
    return int(model.steady_bytes + model.per_sample_bytes * batch_size)


def predict_peak(model: MemoryModel, batch_size: int) -> int:
    """The device total at peak with ``batch_size``: allocated x overhead + memory beyond torch."""
    return int(predict_allocated(model, batch_size) * model.overhead_ratio) + model.beyond_bytes


def fraction(model: MemoryModel, batch_size: int) -> float:
    """The predicted peak over capacity."""
    return predict_peak(model, batch_size) / model.capacity_bytes if model.capacity_bytes else 0.0


def max_batch(model: MemoryModel, band: float) -> int | None:
    """The largest micro-batch predicted to stay under ``band`` x capacity (None: no bound)."""
    if model.capacity_bytes <= 0 or model.per_sample_bytes <= 0:
        return None
    budget = (band * model.capacity_bytes - model.beyond_bytes) / model.overhead_ratio
    room = budget - model.steady_bytes
    return max(0, int(room // model.per_sample_bytes))


def confidence(model: MemoryModel) -> str:
    """How sure the model is, in words."""
    if len(model.points) < 2:
        return "low: one micro-batch seen"
    assert model.fit_error is not None
    return f"{len(model.points)} micro-batches seen, fit error {model.fit_error:.1%}"
