"""Exact memory of the model and optimizer, from their tensors (called at install and boundaries).

Runs on the training thread, never on the per-step path: it walks the parameters and the
optimizer's state (a few thousand tensors take about a millisecond), which must not race with
the optimizer creating that state on its first step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from memtui.core import memmath
from memtui.wire import StaticMemory


def _dtype(tensor: Any) -> str:
    return memmath.dtype_name(tensor.dtype)


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _on(tensor: Any, kind: str) -> bool:
    return str(tensor.device.type) == kind


def tensor_specs(params: list[Any]) -> list[memmath.TensorSpec]:
    """The shared arithmetic's view of live parameters: size, dtype and whether they train."""
    return [
        memmath.TensorSpec(str(i), int(p.numel()), _dtype(p), bool(p.requires_grad))
        for i, p in enumerate(params)
    ]


def _expected_optimizer(
    optimizer: Any, params: list[Any], kind: str
) -> tuple[list[memmath.StateBytes], str]:
    """The optimizer's states before its first step, by the shared arithmetic, and a note."""
    name = type(optimizer).__name__
    groups = list(getattr(optimizer, "param_groups", []))
    momentum = any(group.get("momentum", 0) for group in groups)
    optimizer_kind = memmath.torch_optimizer_kind(name, momentum)
    if optimizer_kind is None:
        return [], f"{name}: unknown until its first step"
    held = {id(p) for group in groups for p in group["params"]}
    trainable = [
        spec
        for spec, p in zip(tensor_specs(params), params, strict=True)
        if spec.trainable and id(p) in held
    ]
    on_device = kind == "cpu" or any(g.get("fused") or g.get("capturable") for g in groups)
    states = memmath.optimizer_states(trainable, optimizer_kind, step_on_device=on_device)
    named = ", ".join(s.name for s in states if s.bytes) or "no state"
    return states, f"expected before the first step: {name} keeps {named}"


STEP_TEMPORARIES = {"Adam": 2, "AdamW": 2, "RMSprop": 1, "Adagrad": 1}
"""Tensors of one parameter's size that torch's per-tensor step of each optimizer holds at once
(Adam's ``exp_avg_sq.sqrt() / bias_correction``: two; RMSprop's and Adagrad's square root: one;
measured on torch 2.13; SGD's momentum is updated in place: none)."""


def step_temporaries(optimizer: Any, kind: str) -> int:
    """The most memory the optimizer's step allocates and frees within itself on ``kind``: per
    tensor (torch's default off CUDA), its factor times the largest trainable parameter; a
    foreach step (the default on CUDA), every parameter of a group at once; fused, none. 0 for an
    optimizer whose step is not known (its temporaries then count with the micro-batch's)."""
    factor = STEP_TEMPORARIES.get(type(optimizer).__name__, 0)
    most = 0
    for group in list(getattr(optimizer, "param_groups", [])) if factor else []:
        if group.get("fused") or group.get("differentiable"):
            continue
        sizes = [
            _nbytes(p)
            for p in group["params"]
            if getattr(p, "requires_grad", False) and _on(p, kind)
        ]
        foreach = group.get("foreach")
        if foreach is None:  # torch's default: foreach where the parameters are on CUDA
            foreach = kind == "cuda"
        most = max(most, sum(sizes) if foreach else factor * max(sizes, default=0))
    return most


def static_memory(
    model: Any,
    optimizer: Any,
    kind: str,
    baseline_bytes: int = 0,
    between_steps: bool = False,
    in_use_bytes: int | None = None,
    resident_bytes: int | None = None,
) -> StaticMemory:
    """Parameters, buffers, gradients (as during backward) and optimizer state on ``kind``.

    Parameters and gradients come from the shared arithmetic (``memtui.core.memmath``) over the
    live tensors; the optimizer state is measured from ``optimizer.state`` once it exists, and
    the same arithmetic's expectation before the first step. ``between_steps`` (a step's end or
    a checkpoint boundary) also counts the gradients that exist there, and keeps ``in_use_bytes``
    (the memory in use read there) as what stays allocated between steps, with
    ``resident_bytes`` (on CPU, the main process's resident memory at that reading).
    """
    seen: set[int] = set()
    params: list[Any] = []
    sources = []
    if model is not None:
        sources.append(model.parameters())
    if optimizer is not None:
        sources += [group["params"] for group in optimizer.param_groups]
    for source in sources:
        for param in source:
            if id(param) not in seen and _on(param, kind):
                seen.add(id(param))
                params.append(param)
    static = memmath.static_estimate(tensor_specs(params), "sgd")
    by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for part in ("parameters", "gradients"):
        for dtype, size in static.by_dtype.get(part, {}).items():
            by_dtype[part][dtype] += size
    buffers = 0
    if model is not None:
        for buffer in model.buffers():
            if _on(buffer, kind):
                buffers += _nbytes(buffer)
                by_dtype["buffers"][_dtype(buffer)] += _nbytes(buffer)
    optimizer_bytes, note = 0, ""
    if optimizer is not None:
        state = getattr(optimizer, "state", {})
        for values in list(state.values()):
            for value in list(values.values()) if isinstance(values, dict) else []:
                if hasattr(value, "element_size") and _on(value, kind):
                    optimizer_bytes += _nbytes(value)
                    by_dtype["optimizer"][_dtype(value)] += _nbytes(value)
        if optimizer_bytes:
            note = "measured"
        else:
            expected, note = _expected_optimizer(optimizer, params, kind)
            optimizer_bytes = sum(s.bytes for s in expected)
            for s in expected:
                if s.bytes:
                    by_dtype["optimizer"][s.dtype.split("/")[0]] += s.bytes
    held = None
    if between_steps:
        held = sum(_nbytes(p.grad) for p in params if getattr(p, "grad", None) is not None)
    return StaticMemory(
        kind=kind,
        parameters_bytes=static.parameters,
        gradients_bytes=static.gradients,
        optimizer_bytes=optimizer_bytes,
        buffers_bytes=buffers,
        by_dtype={part: dict(sizes) for part, sizes in by_dtype.items()},
        optimizer_note=note,
        baseline_bytes=baseline_bytes,
        gradients_held_bytes=held,
        between_steps_bytes=in_use_bytes if between_steps else None,
        between_steps_resident_bytes=resident_bytes if between_steps else None,
        step_temporaries_bytes=step_temporaries(optimizer, kind) if optimizer is not None else 0,
    )
