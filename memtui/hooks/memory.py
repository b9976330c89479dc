"""Exact memory of the model and optimizer, from their tensors (called at install and boundaries).

Runs on the training thread, never on the per-step path: it walks the parameters and the
optimizer's state (a few thousand tensors take about a millisecond), which must not race with
the optimizer creating that state on its first step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from memtui.wire import StaticMemory

MOMENTS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1}
"""Optimizer state tensors per parameter, for the estimate before the first step."""


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _nbytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _on(tensor: Any, kind: str) -> bool:
    return str(tensor.device.type) == kind


def static_memory(model: Any, optimizer: Any, kind: str, baseline_bytes: int = 0) -> StaticMemory:
    """Parameters, buffers, gradients (as during backward) and optimizer state on ``kind``."""
    by_dtype: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
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
    parameters = gradients = 0
    for param in params:
        size = _nbytes(param)
        parameters += size
        by_dtype["parameters"][_dtype(param)] += size
        if param.requires_grad:
            grad = param.grad
            grad_size = _nbytes(grad) if grad is not None else size
            gradients += grad_size
            by_dtype["gradients"][_dtype(grad if grad is not None else param)] += grad_size
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
            name = type(optimizer).__name__
            moments = MOMENTS.get(name)
            if name == "SGD":
                momentum = any(group.get("momentum", 0) for group in optimizer.param_groups)
                moments = 1 if momentum else 0
            if moments is None:
                note = f"{name}: unknown until its first step"
            else:
                optimizer_bytes = moments * sum(_nbytes(p) for p in params if p.requires_grad)
                note = f"expected before the first step: {name} keeps {moments} tensor(s) per parameter"
                if optimizer_bytes:
                    by_dtype["optimizer"][_dtype(params[0]) if params else "float32"] += (
                        optimizer_bytes
                    )
    return StaticMemory(
        kind=kind,
        parameters_bytes=parameters,
        gradients_bytes=gradients,
        optimizer_bytes=optimizer_bytes,
        buffers_bytes=buffers,
        by_dtype={part: dict(sizes) for part, sizes in by_dtype.items()},
        optimizer_note=note,
        baseline_bytes=baseline_bytes,
    )
