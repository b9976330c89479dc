"""The memory parts say what was measured: the optimizer's tensors exactly, what stays in use
between steps as read there, and on a CPU run the rest of the process as its runtime and
workers, never as activations; what is not known yet is said to be, not guessed."""

from __future__ import annotations

import pytest

from memtui.advice.breakdown import NOT_KNOWN, breakdown
from memtui.core.stats import MemoryStats
from memtui.wire import MemoryModel, StaticMemory

MIB = 1 << 20
GIB = 1 << 30


def cpu(peak: int, limit: int = 24 * GIB) -> MemoryStats:
    """A CPU run's memory: its peak is the main process's peak RSS plus the workers' USS."""
    return MemoryStats(
        kind="cpu",
        capacity_bytes=limit,
        current_bytes=peak,
        reserved_bytes=peak,
        peak_bytes=peak,
        peak_allocated_bytes=peak,
        fragmentation_bytes=0,
        nvml_used_bytes=None,
        ooms=0,
        alloc_retries=0,
    )


def cuda(peak_allocated: int, peak_reserved: int) -> MemoryStats:
    """A CUDA device's memory: the allocator's peaks, and NVML's 1 GiB beyond them."""
    return MemoryStats(
        kind="cuda",
        capacity_bytes=24 * GIB,
        current_bytes=peak_allocated // 2,
        reserved_bytes=peak_reserved,
        peak_bytes=peak_reserved,
        peak_allocated_bytes=peak_allocated,
        fragmentation_bytes=0,
        nvml_used_bytes=peak_reserved + GIB,
        ooms=0,
        alloc_retries=0,
    )


# a small model (litgpt's smallest config under ``memtui run``): 10 MB of parameters, gradients
# and AdamW state, in a process holding 520 MiB between steps (Python, torch, the data set)
SMALL = StaticMemory(
    kind="cpu",
    parameters_bytes=2 * MIB,
    gradients_bytes=2 * MIB,
    optimizer_bytes=4 * MIB,
    gradients_held_bytes=2 * MIB,
    between_steps_bytes=520 * MIB,
    between_steps_resident_bytes=526 * MIB,
)


def test_a_cpu_process_before_its_optimizer_is_known_is_not_known_yet() -> None:
    """Before the hook has the optimizer (``memtui run`` finds it at its first step) the whole
    peak is one part that says it is not known yet: the process's RSS is no activation."""
    parts = breakdown(cpu(559 * MIB), None).as_dict()
    assert parts == {NOT_KNOWN: 559 * MIB, "free": 24 * GIB - 559 * MIB}
    assert not breakdown(cpu(559 * MIB), None).known


def test_a_cpu_process_splits_into_the_optimizer_the_step_and_the_runtime() -> None:
    """The optimizer's tensors exactly; what stays in use between steps beyond them is the
    runtime (and the workers' own memory); what malloc held free there is said apart; the
    step's rise over what was resident between steps is in-step."""
    split = breakdown(cpu(559 * MIB), SMALL, workers_bytes=18 * MIB)
    parts = split.as_dict()
    assert split.known
    assert (parts["parameters"], parts["gradients"], parts["optimizer"]) == (
        2 * MIB,
        2 * MIB,
        4 * MIB,
    )
    assert parts["runtime and workers"] == 520 * MIB - 8 * MIB + 18 * MIB
    assert parts["malloc free"] == 6 * MIB
    assert parts["in-step"] == 559 * MIB - 526 * MIB - 18 * MIB
    assert "activations" not in parts
    assert sum(v for k, v in parts.items() if k != "free") == 559 * MIB


def test_a_cpu_run_read_before_the_first_steps_end_is_not_split() -> None:
    """The optimizer known (an explicit install) but nothing read between steps yet: the rest
    of the peak is not known yet rather than a guess from the RSS at install."""
    static = StaticMemory(
        kind="cpu", parameters_bytes=2 * MIB, gradients_bytes=2 * MIB, baseline_bytes=330 * MIB
    )
    parts = breakdown(cpu(400 * MIB), static).as_dict()
    assert parts[NOT_KNOWN] == 396 * MIB and "activations" not in parts
    assert "runtime and workers" not in parts


def test_gradients_freed_before_the_steps_end_count_as_gradients_not_runtime() -> None:
    """A loop that frees its gradients before its step ends (``zero_grad(set_to_none=True)``)
    holds less between steps: the gradients are made in each step, and count as gradients."""
    freed = StaticMemory(
        kind="cpu",
        parameters_bytes=2 * MIB,
        gradients_bytes=2 * MIB,
        optimizer_bytes=4 * MIB,
        gradients_held_bytes=0,
        between_steps_bytes=518 * MIB,
    )
    parts = breakdown(cpu(559 * MIB), freed).as_dict()
    assert parts["runtime and workers"] == 512 * MIB and parts["in-step"] == 39 * MIB


def test_cuda_activations_are_the_allocators_peak_over_what_stays_between_steps() -> None:
    """On CUDA the allocator measures them: its step peak over the memory in use between
    steps; what else stays is "other steady"."""
    static = StaticMemory(
        kind="cuda",
        parameters_bytes=2 * GIB,
        gradients_bytes=2 * GIB,
        optimizer_bytes=4 * GIB,
        gradients_held_bytes=2 * GIB,
        between_steps_bytes=9 * GIB,
    )
    parts = breakdown(cuda(16 * GIB, 19 * GIB), static).as_dict()
    assert parts["other steady"] == GIB and parts["activations"] == 7 * GIB
    assert parts["fragmentation"] == 3 * GIB and parts["beyond torch"] == GIB
    assert sum(v for k, v in parts.items()) == 24 * GIB


@pytest.mark.parametrize("static", [None, StaticMemory(kind="cuda", parameters_bytes=GIB)])
def test_cuda_before_anything_is_read_between_steps_is_not_known_yet(
    static: StaticMemory | None,
) -> None:
    parts = breakdown(cuda(16 * GIB, 19 * GIB), static).as_dict()
    exact = static.parameters_bytes if static is not None else 0
    assert parts[NOT_KNOWN] == 16 * GIB - exact and "activations" not in parts
    assert parts["fragmentation"] == 3 * GIB


def test_an_older_hooks_memory_model_still_splits_the_peak() -> None:
    """A recording of a hook that read nothing between steps: the memory model's steady part
    (what its samples saw stay across steps) stands in for the reading."""
    static = StaticMemory(kind="cpu", parameters_bytes=MIB, gradients_bytes=MIB)
    model = MemoryModel(
        kind="cpu", batch_size=8, capacity_bytes=GIB, steady_bytes=360 * MIB, per_sample_bytes=0
    )
    parts = breakdown(cpu(400 * MIB, GIB), static, model).as_dict()
    assert parts["runtime and workers"] == 358 * MIB and parts["in-step"] == 40 * MIB
