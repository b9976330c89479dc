"""Where the device memory goes: one stacked bar, exact parts from the tensors, live parts measured.

Pure. On CUDA the bar is the device's capacity: parameters, gradients and optimizer state
(exactly, from the tensors), activations and temporaries (the step peak of allocated memory
minus those), reserved but unallocated (the caching allocator's fragmentation at peak), memory
beyond torch (CUDA context, NCCL, other processes, from NVML) and what is free. On CPU runs the
host is the device and the bar is the memory limit: the same exact parts, activations (the
peak over the steady part), the rest of the process tree's memory (the Python and torch
runtime, allocator caches, loader workers) and what is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui.core.stats import MemoryStats
from memtui.wire import MemoryModel, StaticMemory


@dataclass(frozen=True)
class Part:
    """One segment of the bar."""

    name: str
    bytes: int
    exact: bool
    """Computed from the tensors (True) or measured live (False)."""


@dataclass(frozen=True)
class Breakdown:
    """The parts of the device's memory at peak, adding up to its capacity."""

    kind: str
    capacity_bytes: int
    parts: tuple[Part, ...]

    def as_dict(self) -> dict[str, int]:
        """Bytes by part name (for ``memtui status --json``)."""
        return {part.name: part.bytes for part in self.parts}


def breakdown(
    memory: MemoryStats, static: StaticMemory | None, model: MemoryModel | None = None
) -> Breakdown:
    """Split the peak into parts; without ``static`` the exact parts are one 'steady' segment."""
    capacity = max(memory.capacity_bytes, 0)
    peak_allocated = memory.peak_allocated_bytes
    parts: list[Part] = []
    if static is not None:
        exact = [
            Part("parameters", static.parameters_bytes + static.buffers_bytes, True),
            Part("gradients", static.gradients_bytes, True),
            Part("optimizer", static.optimizer_bytes, True),
        ]
        exact_total = sum(p.bytes for p in exact)
    else:
        exact = []
        exact_total = 0
    if memory.kind == "cuda":
        steady = max(exact_total, model.steady_bytes if model else 0)
        parts += exact
        if steady > exact_total:
            parts.append(Part("other steady", steady - exact_total, False))
        parts.append(Part("activations", max(0, peak_allocated - steady), False))
        reserved_peak = max(memory.peak_bytes, peak_allocated)
        parts.append(Part("fragmentation", max(0, reserved_peak - peak_allocated), False))
        parts.append(Part("beyond torch", memory.beyond_torch_bytes or 0, False))
    else:
        runtime_base = static.baseline_bytes if static is not None else 0
        steady = model.steady_bytes if model else max(runtime_base, exact_total)
        parts += exact
        parts.append(Part("activations", max(0, peak_allocated - steady), False))
        parts.append(
            Part("runtime and workers", max(0, min(steady, peak_allocated) - exact_total), False)
        )
    used = sum(p.bytes for p in parts)
    parts.append(Part("free", max(0, capacity - used), False))
    return Breakdown(memory.kind, capacity, tuple(parts))
