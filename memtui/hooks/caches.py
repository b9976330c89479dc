"""Giving cached memory back: after an out-of-memory rollback, and when a change shrinks the run.

A smaller micro-batch, fewer workers or pinning off free memory that the allocators keep for later:
torch's CUDA caching allocator keeps its segments reserved, and on the CPU glibc's malloc keeps
freed heap pages. Left there, a decrease is not seen in the device's numbers (CPU decreases peaked
27-34% over their prediction while glibc kept the freed heap). Called on the training thread at a
checkpoint boundary or after a rollback, never on the per-step path.
"""

from __future__ import annotations

import gc
import sys
from typing import Any


def release_caches() -> None:
    """Give cached memory back: torch's CUDA cache, and on CPU glibc's free heap (malloc_trim)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim_heap()


MMAP_THRESHOLD_BYTES = 128 * 1024
"""The mmap threshold the CPU stand-in fixes: glibc's own starting value, kept from moving."""


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold so that blocks from ``threshold`` up are unmapped when freed;
    whether glibc took it (False elsewhere)."""
    # By default glibc raises the threshold to a large block's size once one is freed, and later
    # blocks of that size stay on the heap: the peak RSS no longer follows the live tensors
    # (benchmarks/advice_truth.py: the CPU kept 0-100% of what a decrease freed). Fixing it also
    # turns the moving threshold off for the process's life.
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold) == 1)
    except (OSError, AttributeError):
        return False


_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (malloc.h)."""


def trim_heap() -> None:
    """Return free heap memory to the OS (glibc only; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mallinfo2() -> Any:
    """glibc's ``mallinfo2`` (bytes malloc holds free, among others), or None elsewhere."""
    try:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (name, ctypes.c_size_t)
                for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
                )
            ]  # fmt: skip

        # PyDLL keeps the GIL for the call (a few microseconds): releasing it would cost the
        # training thread a forced switch to give it back
        function = ctypes.PyDLL("libc.so.6").mallinfo2
        function.restype = MallInfo2
        function()
        return function
    except (OSError, AttributeError):
        return None
