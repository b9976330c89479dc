"""Where the device memory goes: one stacked bar, exact parts from the tensors, live parts measured.

Pure. The exact parts are the parameters, gradients and optimizer state of the optimizer the
hook knows (the one given to it, or the one the no-code watch counts), computed from their
tensors. What stays in use between two steps is read by the hook at a known moment of the step
cycle (the first step's end and every boundary). Until both are known, all of the peak the exact
parts do not explain is one part, "not known yet": no part is guessed.

On CUDA the bar is the device's capacity: the exact parts, what else stays allocated between
steps ("other steady"), activations and temporaries (the allocator's step peak over what stays
allocated between steps: the device measures them), reserved but unallocated (the caching
allocator's fragmentation at peak), memory beyond torch (CUDA context, NCCL, other processes,
from NVML) and what is free.

On CPU runs the host is the device and the bar is the memory limit: the exact parts, "in-step"
(what the main process's resident memory rose to at the step's peak over what was resident
between steps: the step's activations, temporaries and batch where malloc did not already hold
the room for them; no counter isolates the activations), "runtime and workers" (the rest of the
main process's memory in use between steps: the Python and torch runtime, imported libraries,
the data set, caches, frozen weights and buffers; plus the loader workers' own memory), "malloc
free" (what glibc's malloc held resident but free between steps: room a step may reuse) and
what is free.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui.advice.measure import gradients_made_per_step
from memtui.core.stats import MemoryStats
from memtui.wire import MemoryModel, StaticMemory

NOT_KNOWN = "not known yet"
"""The part of the peak not split yet: before the optimizer is known and the memory between
steps is read (the first step's end)."""


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

    @property
    def known(self) -> bool:
        """Whether the peak is split (no part is ``not known yet``)."""
        return all(part.name != NOT_KNOWN for part in self.parts)


def held_between_steps(static: StaticMemory | None, model: MemoryModel | None) -> int | None:
    """What stays in use between two steps (the main process's on a CPU run): the hook's reading
    there, with the gradients the loop frees before its step ends; else the memory model's
    steady part (a recording of an older hook); None where neither is known."""
    if static is not None and static.between_steps_bytes is not None:
        return static.between_steps_bytes + gradients_made_per_step(static)
    return model.steady_bytes if model is not None else None


def malloc_free_between_steps(static: StaticMemory) -> int:
    """What glibc's malloc held resident but free where the memory between steps was read (a
    CPU run's resident memory there less its memory in use; 0 where not read)."""
    resident, in_use = static.between_steps_resident_bytes, static.between_steps_bytes
    if resident is None or in_use is None:
        return 0
    return max(0, resident - in_use)


def breakdown(
    memory: MemoryStats,
    static: StaticMemory | None,
    model: MemoryModel | None = None,
    workers_bytes: int | None = None,
) -> Breakdown:
    """Split the peak into parts (``workers_bytes``: the loader workers' own memory, which a CPU
    run's peak holds); what cannot be split yet is one ``not known yet`` part."""
    capacity = max(memory.capacity_bytes, 0)
    peak_allocated = memory.peak_allocated_bytes
    parts: list[Part] = []
    if static is not None:
        parts += [
            Part("parameters", static.parameters_bytes + static.buffers_bytes, True),
            Part("gradients", static.gradients_bytes, True),
            Part("optimizer", static.optimizer_bytes, True),
        ]
    exact_total = sum(p.bytes for p in parts)
    held = held_between_steps(static, model) if static is not None or model is not None else None
    if memory.kind == "cuda":
        if held is None:
            parts.append(Part(NOT_KNOWN, max(0, peak_allocated - exact_total), False))
        else:
            steady = max(exact_total, held, model.steady_bytes if model else 0)
            if steady > exact_total:
                parts.append(Part("other steady", steady - exact_total, False))
            parts.append(Part("activations", max(0, peak_allocated - steady), False))
        reserved_peak = max(memory.peak_bytes, peak_allocated)
        parts.append(Part("fragmentation", max(0, reserved_peak - peak_allocated), False))
        parts.append(Part("beyond torch", memory.beyond_torch_bytes or 0, False))
    elif held is None or static is None:
        parts.append(Part(NOT_KNOWN, max(0, peak_allocated - exact_total), False))
    else:
        workers = min(max(0, workers_bytes or 0), peak_allocated)
        held = max(held, exact_total)
        free_in_malloc = malloc_free_between_steps(static)
        in_step = peak_allocated - held - free_in_malloc - workers
        parts.append(Part("in-step", max(0, in_step), False))
        parts.append(Part("runtime and workers", held - exact_total + workers, False))
        parts.append(Part("malloc free", free_in_malloc, False))
    used = sum(p.bytes for p in parts)
    parts.append(Part("free", max(0, capacity - used), False))
    return Breakdown(memory.kind, capacity, tuple(parts))
