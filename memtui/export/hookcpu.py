"""The hook's own CPU time, as the kernel counts it, for the ranks that run on this node.

The hook's threads name themselves ``memtui-agent`` and ``memtui-sampler`` in the kernel
(:mod:`memtui.hooks.threadname`), and libzmq names its own ``ZMQbg/...``; their on-CPU time is
read from ``/proc/PID/task/TID/schedstat`` (nanoseconds). Nothing is asked of the run.
"""

from __future__ import annotations

from pathlib import Path

HOOK_THREADS = ("memtui-", "ZMQbg/")
"""Kernel thread names (prefixes) of the hook's threads: memtui's own and ZeroMQ's I/O thread."""
OWN_THREADS = 2
"""memtui's own threads in a hooked process (agent, sampler): until both are seen, look again."""


class HookCpu:
    """Reads the CPU time of the hook's threads of processes on this node (their ids cached)."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._threads: dict[int, tuple[str, ...]] = {}
        """The hook's thread ids of each process read before."""

    def seconds(self, pid: int) -> float | None:
        """CPU seconds the hook's threads of process ``pid`` used (None: no such process here,
        or none of its threads is the hook's)."""
        if pid <= 0:
            return None
        threads = self._threads.get(pid)
        total = self._read(pid, threads) if threads else None
        if total is None:
            threads, complete = self._find(pid)
            if complete:
                self._threads[pid] = threads
            total = self._read(pid, threads) if threads else None
        return total

    def forget(self, keep: set[int]) -> None:
        """Drop what is cached about processes other than ``keep``."""
        for pid in [p for p in self._threads if p not in keep]:
            del self._threads[pid]

    def _find(self, pid: int) -> tuple[tuple[str, ...], bool]:
        """The hook's thread ids in ``pid``, and whether memtui's own threads are all there."""
        tasks = self.proc / str(pid) / "task"
        found = []
        own = 0
        try:
            entries = list(tasks.iterdir())
        except OSError:
            return (), False
        for entry in entries:
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name.startswith(HOOK_THREADS):
                found.append(entry.name)
                own += name.startswith(HOOK_THREADS[0])
        return tuple(found), own >= OWN_THREADS

    def _read(self, pid: int, threads: tuple[str, ...]) -> float | None:
        """The threads' CPU seconds summed (None when one is gone: look for them again)."""
        total = 0
        for tid in threads:
            try:
                with open(self.proc / str(pid) / "task" / tid / "schedstat", "rb") as stats:
                    total += int(stats.read().split()[0])
            except (OSError, ValueError, IndexError):
                return None
        return total / 1e9
