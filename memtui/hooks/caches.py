"""Giving cached memory back: after an out-of-memory rollback, and when a change shrinks the run.

A smaller micro-batch, fewer workers or pinning off free memory that the allocators keep for
later: torch's CUDA caching allocator keeps its segments reserved, and on the CPU glibc's malloc
keeps freed heap pages. Left there, a decrease is not seen in the device's numbers (issue 15: CPU
decreases observed 27-34% over their prediction). Called on the training thread at a checkpoint
boundary or after a rollback, never on the per-step path.
"""

from __future__ import annotations

import gc
import sys


def release_caches() -> None:
    """Give cached memory back: torch's CUDA cache, and on CPU glibc's free heap (malloc_trim)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim_heap()


def trim_heap() -> None:
    """Return free heap memory to the OS (glibc only; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
