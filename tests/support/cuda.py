"""Whether the tests marked ``gpu`` can run here, and why not."""

from __future__ import annotations

import pytest


def skip_gpu_tests_without_cuda(items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` are skipped, each with the reason, where torch sees no CUDA device
    (kept in the run as skips, not deselected: the report says what did not run)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    reason = no_cuda_reason() if gpu else None
    for item in gpu if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))


def no_cuda_reason() -> str | None:
    """Why the gpu tests cannot run here (None: a CUDA device is available)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if torch.cuda.is_available():
        return None
    build = "a CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
    return (
        f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, {build}); "
        "the gpu tests run the real CUDA paths on a machine with one (make test-gpu)"
    )
