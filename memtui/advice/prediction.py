"""One prediction: what the memory model says of a micro-batch, against the memory bands in force.

The hook's gate (a change whose predicted peak's high end is over the danger band, or that
reaches what ran out of memory, needs ``force``) and the viewer's editor (the prediction shown
while a value is typed) both use this one class.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui.advice.predict import (
    SafeBatch,
    confidence,
    predict_peak,
    predict_range,
    safe_batch,
)
from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.core.stats import format_bytes
from memtui.wire import Ceiling, Knobs, MemoryModel


@dataclass(frozen=True)
class Prediction:
    """The memory model's peak for a config, its interval, and where its high end falls in the
    bands in force and against what ran out of memory."""

    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    max_safe_batch_size: int | None = None
    confidence: str = ""
    edge: float = THRESHOLDS.memory_edge_fraction
    """The top of the safe band (the largest safe micro-batch stays under it, high end)."""
    danger: float = THRESHOLDS.memory_danger_fraction
    """Over this share of capacity (high end) a change needs ``force``."""
    peak_high_bytes: int | None = None
    """The high end of the predicted peak's interval (what the gate uses)."""
    safe: SafeBatch | None = None
    """The largest safe micro-batch, and whether it is a guess or the OOM ceiling."""
    ran_out: str = ""
    """The change reaches a value that ran out of memory in this run, in words ("": it does not)."""
    grows: bool = True
    """The config takes more memory than the run's now (a bigger micro-batch, more workers,
    pinning): only such a change can be risky."""

    @classmethod
    def of(
        cls,
        model: MemoryModel | None,
        batch_size: int | None,
        thresholds: Thresholds = THRESHOLDS,
        *,
        workers: int | None = None,
        pin_memory: bool | None = None,
        ceiling: Ceiling | None = None,
    ) -> Prediction:
        """The prediction of ``model`` for ``batch_size`` and ``workers`` loader workers (empty
        without a model), checked against the ``ceiling`` that out-of-memory errors set."""
        edge = thresholds.memory_edge_fraction
        danger = thresholds.memory_danger_fraction
        ran_out = reached(ceiling, batch_size, workers, pin_memory)
        if model is None or batch_size is None or isinstance(batch_size, bool):
            return cls(edge=edge, danger=danger, ran_out=ran_out)
        low_high = predict_range(model, batch_size, workers)
        safe = safe_batch(model, edge, ceiling)
        grows = batch_size > model.batch_size or bool(pin_memory)
        if workers is not None and model.workers is not None and workers > model.workers:
            grows = True
        return cls(
            predict_peak(model, batch_size, workers),
            model.capacity_bytes,
            safe.size if safe is not None else None,
            confidence(model),
            edge,
            danger,
            peak_high_bytes=low_high[1],
            safe=safe,
            ran_out=ran_out,
            grows=grows,
        )

    @classmethod
    def of_config(
        cls,
        model: MemoryModel | None,
        config: Knobs,
        thresholds: Thresholds = THRESHOLDS,
        ceiling: Ceiling | None = None,
    ) -> Prediction:
        """The prediction for a whole config: its micro-batch, workers and pinning."""
        return cls.of(
            model,
            config.batch_size,
            thresholds,
            workers=config.num_workers,
            pin_memory=config.pin_memory,
            ceiling=ceiling,
        )

    @property
    def known(self) -> bool:
        """Whether there is a prediction (a model and a capacity)."""
        return bool(self.peak_bytes) and bool(self.capacity_bytes)

    @property
    def fraction(self) -> float:
        """Predicted peak over capacity (0 without a prediction)."""
        if not self.peak_bytes or not self.capacity_bytes:
            return 0.0
        return self.peak_bytes / self.capacity_bytes

    @property
    def high_fraction(self) -> float:
        """The high end of the predicted peak over capacity (0 without a prediction)."""
        high = self.peak_high_bytes or self.peak_bytes
        if not high or not self.capacity_bytes:
            return 0.0
        return high / self.capacity_bytes

    @property
    def over_danger(self) -> bool:
        """Risky: a change that grows the run with its high end over the danger band, or one that
        reaches a value that ran out of memory; the hook refuses it unless forced."""
        return (self.grows and self.high_fraction > self.danger) or bool(self.ran_out)

    @property
    def safe_words(self) -> str:
        """The largest safe micro-batch in words ("" when unknown)."""
        return self.safe.describe() if self.safe is not None else ""

    @property
    def warning(self) -> str:
        """Why the change is risky and how to queue it anyway ("" when it is not risky)."""
        risk = self.risk
        return (
            f"{risk}; queue it with --force (or confirm in the viewer) if you mean it"
            if risk
            else ""
        )

    @property
    def risk(self) -> str:
        """Why the change is risky, with the numbers ("" when it is not): a forced change's note."""
        if not self.over_danger:
            return ""
        safe = (
            f"; the largest micro-batch predicted under {self.edge:.0%} is {self.safe_words}"
            if self.safe_words
            else ""
        )
        if self.ran_out and self.high_fraction <= self.danger:
            return f"{self.ran_out}{safe}"
        why = (
            f"predicted peak {format_bytes(self.peak_bytes)}, up to "
            f"{format_bytes(self.peak_high_bytes)} = {self.high_fraction:.0%} of "
            f"{format_bytes(self.capacity_bytes)}, over the {self.danger:.0%} danger band "
            f"({self.confidence})"
        )
        if self.ran_out:
            why = f"{self.ran_out}; {why}"
        return f"{why}{safe}"

    def describe(self) -> str:
        """``predicted peak 1.3 GiB (up to 1.4 GiB) = 72% of 1.8 GiB, headroom 500 MiB (...)``."""
        peak, capacity = self.peak_bytes or 0, self.capacity_bytes or 0
        headroom = capacity - peak
        room = (
            f"headroom {format_bytes(headroom)}"
            if headroom >= 0
            else f"over by {format_bytes(-headroom)}"
        )
        high = self.peak_high_bytes
        upto = f" (up to {format_bytes(high)})" if high is not None and high > peak else ""
        return (
            f"predicted peak {format_bytes(peak)}{upto} = {self.fraction:.0%} of "
            f"{format_bytes(capacity)}, {room} ({self.confidence})"
        )


def reached(
    ceiling: Ceiling | None,
    batch_size: int | None,
    workers: int | None = None,
    pin_memory: bool | None = None,
) -> str:
    """What of a config already ran out of memory, in words ("": nothing)."""
    if ceiling is None:
        return ""
    parts = []
    if (
        ceiling.batch_size is not None
        and isinstance(batch_size, int)
        and not isinstance(batch_size, bool)
        and batch_size >= ceiling.batch_size
    ):
        parts.append(f"micro-batch {ceiling.batch_size}")
    if ceiling.num_workers is not None and workers is not None and workers >= ceiling.num_workers:
        parts.append(f"{ceiling.num_workers} loader workers")
    if ceiling.pin_memory and pin_memory:
        parts.append("pin_memory on")
    said = " and ".join(f"{part} ran out of memory" for part in parts)
    return f"{said} at step {ceiling.step}" if parts else ""


def ceiling_words(ceiling: Ceiling) -> str:
    """Everything a ceiling holds in words: ``micro-batch 32 ran out of memory at step 40``."""
    return reached(ceiling, ceiling.batch_size, ceiling.num_workers, ceiling.pin_memory)
