"""The hook's threads named in the kernel too, so that tools outside the process can find them.

Python (before 3.14) names a thread for itself only; the kernel's name (``/proc/PID/task/TID/
comm``, ``top -H``, ``py-spy``) stays the interpreter's. ``memtui export`` reads the CPU time of
the threads named ``memtui-*`` from ``/proc`` (the hook's own overhead, as the kernel counts it),
so the hook's threads name themselves once, when they start.
"""

from __future__ import annotations

import sys

PR_SET_NAME = 15
"""prctl's option that names the calling thread (15 bytes at most)."""


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel (Linux; elsewhere nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except Exception:  # no ctypes, no libc prctl: the name stays the interpreter's, and the
        return  # thread (the hook's agent or sampler) goes on
