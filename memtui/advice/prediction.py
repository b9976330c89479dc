"""One prediction: what the memory model says of a micro-batch, against the memory bands in force.

The hook's gate (a change over the danger band needs ``force``) and the viewer's editor (the
prediction shown while a value is typed) both use this one class.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui.advice.predict import confidence, max_batch, predict_peak
from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.stats import format_bytes
from memtui.wire import MemoryModel


@dataclass(frozen=True)
class Prediction:
    """The memory model's peak for a micro-batch, and where it falls in the bands in force."""

    peak_bytes: int | None = None
    capacity_bytes: int | None = None
    max_safe_batch_size: int | None = None
    confidence: str = ""
    edge: float = THRESHOLDS.memory_edge_fraction
    """The top of the safe band (the largest safe micro-batch stays under it)."""
    danger: float = THRESHOLDS.memory_danger_fraction
    """Over this share of capacity a change needs ``force``."""

    @classmethod
    def of(
        cls, model: MemoryModel | None, batch_size: int | None, thresholds: Thresholds = THRESHOLDS
    ) -> Prediction:
        """The prediction of ``model`` at ``batch_size`` (empty without either)."""
        if model is None or batch_size is None or isinstance(batch_size, bool):
            return cls(
                edge=thresholds.memory_edge_fraction, danger=thresholds.memory_danger_fraction
            )
        edge = thresholds.memory_edge_fraction
        return cls(
            predict_peak(model, batch_size),
            model.capacity_bytes,
            max_batch(model, edge),
            confidence(model),
            edge,
            thresholds.memory_danger_fraction,
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
    def over_danger(self) -> bool:
        """Predicted over the danger band: the hook refuses it unless forced."""
        return self.fraction > self.danger

    @property
    def warning(self) -> str:
        """Why the change is risky, with the numbers ("" when it is not)."""
        if not self.over_danger:
            return ""
        safe = (
            f"; the largest micro-batch predicted under {self.edge:.0%} is {self.max_safe_batch_size}"
            if self.max_safe_batch_size
            else ""
        )
        return (
            f"predicted peak {format_bytes(self.peak_bytes)} = {self.fraction:.0%} of "
            f"{format_bytes(self.capacity_bytes)}, over the {self.danger:.0%} danger band "
            f"({self.confidence}){safe}; queue it with --force (or confirm in the viewer) if you mean it"
        )

    def describe(self) -> str:
        """``predicted peak 1.3 GiB = 72% of 1.8 GiB, headroom 500 MiB (confidence ...)``."""
        peak, capacity = self.peak_bytes or 0, self.capacity_bytes or 0
        headroom = capacity - peak
        room = (
            f"headroom {format_bytes(headroom)}"
            if headroom >= 0
            else f"over by {format_bytes(-headroom)}"
        )
        return (
            f"predicted peak {format_bytes(peak)} = {self.fraction:.0%} of "
            f"{format_bytes(capacity)}, {room} ({self.confidence})"
        )
