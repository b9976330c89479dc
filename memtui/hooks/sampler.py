"""The sampler thread: device memory (torch allocator, NVML), host memory (/proc), at bounded rates.

It runs only in the training process (never in loader workers: threads do not survive the fork
and the tuner disables itself in forked children). The training thread never waits on it; it
publishes its samples by appending to bounded deques that the agent thread drains.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from memtui.hooks.caches import fix_mmap_threshold, mallinfo2
from memtui.hooks.errors import Report
from memtui.hooks.threadname import name_native_thread
from memtui.wire import DeviceSample, GpuProcess, HostSample

if TYPE_CHECKING:
    from memtui.hooks.device import DeviceTracker

log = logging.getLogger("memtui")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cgroup_memory_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 or v1), or None when there is none."""
    limits: list[int] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            candidates = [Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"]
            candidates += [
                p / "memory.max" for p in Path("/sys/fs/cgroup", path.lstrip("/")).parents
            ]
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            candidates = [
                base / path.lstrip("/") / "memory.limit_in_bytes",
                base / "memory.limit_in_bytes",
            ]
        else:
            continue
        for candidate in candidates:
            with contextlib.suppress(OSError, ValueError):
                text = candidate.read_text().strip()
                if text and text != "max":
                    limits.append(int(text))
    total = psutil.virtual_memory().total
    real = [limit for limit in limits if 0 < limit < total]
    return min(real) if real else None


def usable_cpus() -> int:
    """CPUs this process may use: its affinity, within its cgroup's CPU quota (v2 ``cpu.max``
    or v1 ``cfs_quota_us / cfs_period_us``), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota: float | None = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                text = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.max").read_text().split()
                if text and text[0] != "max":
                    quota = int(text[0]) / int(text[1])
            elif "cpu" in controllers.split(","):
                base = Path("/sys/fs/cgroup/cpu,cpuacct")
                if not base.exists():
                    base = Path("/sys/fs/cgroup/cpu")
                folder = base / path.lstrip("/")
                limit = int((folder / "cpu.cfs_quota_us").read_text())
                if limit > 0:
                    quota = limit / int((folder / "cpu.cfs_period_us").read_text())
    if quota is not None and quota > 0:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, cpus)


def _status_kib(text: bytes, key: bytes) -> int:
    """A ``kB`` field of /proc/PID/status, in bytes (ValueError when missing)."""
    start = text.index(key) + len(key)
    return int(text[start : text.index(b"kB", start)]) * 1024


class ProcFile:
    """One /proc file kept open and read whole with one ``pread`` at offset 0 (the kernel writes
    it anew), or written with one ``write``: one system call instead of three, each of which
    gives the GIL up. A descriptor of ``/proc/PID/...`` stays bound to that process: once it
    ended, reads fail, even if its pid was given to another one."""

    def __init__(self, path: str, size: int = 4096, flags: int = os.O_RDONLY) -> None:
        self.path = path
        self.size = size
        self._flags = flags | os.O_CLOEXEC
        self._fd = -1
        self._pid = -1
        """The process that opened it: a forked child opens its own."""

    def _opened(self) -> int:
        if self._pid != os.getpid():
            self.close()
            self._fd = os.open(self.path, self._flags)
            self._pid = os.getpid()
        return self._fd

    def read(self) -> bytes:
        """The file's content now; OSError (the file closed) where it cannot be read."""
        try:
            return os.pread(self._opened(), self.size, 0)
        except OSError:
            self.close()
            raise

    def write(self, data: bytes) -> None:
        """Write ``data`` (a ``clear_refs`` command); OSError (the file closed) where it fails."""
        try:
            os.write(self._opened(), data)
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        """Close the file (a forked child leaves its parent's descriptor alone)."""
        if self._fd >= 0 and self._pid == os.getpid():
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = -1
        self._pid = -1

    def __del__(self) -> None:
        self.close()


class HighWater:
    """The process's peak resident memory for its two readers: the kernel keeps one mark
    (``VmHWM``) that a reader resets to measure from now, so each reset hands the mark it read
    to the other reader's own mark here: memtui's sampler (at each sample of a CPU run) and the
    caller of ``peak_rss()`` (the CPU out-of-memory stand-in, or the user's own code) each see
    every peak since their own last read, whoever reset the kernel's mark in between.

    A lock spans each read-and-reset: a peak is in the kernel's mark or in the reader's own
    when it looks, never lost between the two.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sampler_peak = 0
        """The highest kernel mark ``peak_rss()`` read and reset since the sampler's last read."""
        self.caller_peak = 0
        """The highest kernel mark the sampler read and reset since the last ``peak_rss()``."""

    def take(self) -> int:
        """The process's peak RSS since the last call (bytes; 0 where the kernel does not say)."""
        with self.lock:
            try:
                with open("/proc/self/status", "rb") as status:
                    now = _status_kib(status.read(), b"VmHWM:")
                with open("/proc/self/clear_refs", "wb") as clear:
                    clear.write(b"5")
            except (OSError, ValueError):
                now = 0
            self.sampler_peak = max(self.sampler_peak, now)
            peak, self.caller_peak = max(self.caller_peak, now), 0
        return peak


HIGH_WATER = HighWater()
"""This process's peak resident memory as memtui keeps it (``peak_rss``)."""


def peak_rss() -> int:
    """The process's peak resident memory since the last call, in bytes (Linux; 0 elsewhere).

    memtui's sampler resets the kernel's peak (``VmHWM`` in ``/proc/self/status``) at each
    sample of a CPU run, so a reading of ``VmHWM`` covers only the time since that sample; this
    gives what the kernel's mark would have said since the last call without memtui.
    """
    return HIGH_WATER.take()


class PeakRss:
    """The main process's RSS and its peak since the last read (VmHWM), reset after each read.

    Linux only. Both proc files stay open: ``pread`` at offset 0 regenerates ``status`` and a
    write to ``clear_refs`` resets the mark. Two system calls a sample, not the six of opening
    and closing them: each one gives the GIL up, and a sampler that takes it back from a busy
    training thread costs that thread a forced switch.
    """

    def __init__(self) -> None:
        self._status = ProcFile("/proc/self/status", 8192)
        self._clear = ProcFile("/proc/self/clear_refs", flags=os.O_WRONLY)

    def read_and_reset(self) -> tuple[int, int] | None:
        """(RSS, peak RSS since the previous call) in bytes; None where the kernel does not say."""
        high_water = HIGH_WATER
        try:
            with high_water.lock:  # the mark read is handed on before the kernel's is reset
                text = self._status.read()
                kernel = _status_kib(text, b"VmHWM:")
                rss = _status_kib(text, b"VmRSS:")
                high_water.caller_peak = max(high_water.caller_peak, kernel)
                peak, high_water.sampler_peak = max(kernel, high_water.sampler_peak), 0
                self._clear.write(b"5")
            return rss, max(peak, rss)
        except (OSError, ValueError):
            self.close()
            return None

    def close(self) -> None:
        """Close the proc files."""
        self._status.close()
        self._clear.close()


class MemInfo:
    """RAM and swap from one read of /proc/meminfo (Linux), else from psutil's two calls."""

    def __init__(self) -> None:
        self._file = ProcFile("/proc/meminfo", 32768)

    def read(self) -> tuple[int, int, int, int]:
        """(RAM total, RAM available, swap total, swap used) in bytes."""
        try:
            text = self._file.read()
            swap_total = _status_kib(text, b"SwapTotal:")
            return (
                _status_kib(text, b"MemTotal:"),
                _status_kib(text, b"MemAvailable:"),
                swap_total,
                swap_total - _status_kib(text, b"SwapFree:"),
            )
        except (OSError, ValueError):
            vm = psutil.virtual_memory()
            swap = psutil.swap_memory()
            return vm.total, vm.available, swap.total, swap.used

    def close(self) -> None:
        """Close /proc/meminfo."""
        self._file.close()


def _read_whole(path: str) -> bytes:
    """A small file's content, opened and closed (``open`` would add a Python buffer)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def proc_descendants(
    pid: int, limit: int = 4096, skip: Callable[[int], bool] | None = None
) -> list[int]:
    """The ids of ``pid``'s descendant processes, children first, from the kernel's list of each
    thread's children (``/proc/PID/task/TID/children``, one small read per thread): a few reads
    where psutil reads the status of every process on the machine. A process that ends
    meanwhile is left out, and so is one ``skip`` names, with its own descendants."""
    found: list[int] = []
    seen = {pid}
    parents = [pid]
    while parents and len(found) < limit:
        parent = parents.pop(0)
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue  # it ended
        for tid in threads:
            try:
                listed = _read_whole(f"/proc/{parent}/task/{tid}/children").split()
            except OSError:
                continue  # the thread ended
            for child in map(int, listed):
                if child not in seen:
                    seen.add(child)
                    if skip is not None and skip(child):
                        continue
                    found.append(child)
                    parents.append(child)
    return found[:limit]


def psutil_descendants(pid: int, skip: Callable[[int], bool] | None = None) -> list[psutil.Process]:
    """``pid``'s descendants as psutil lists them (where /proc lists no children), leaving out
    one ``skip`` names, with its own descendants."""
    found: list[psutil.Process] = []
    parents = [pid]
    while parents:
        try:
            children = psutil.Process(parents.pop(0)).children()
        except psutil.Error:
            continue  # it ended
        for child in children:
            if skip is None or not skip(child.pid):
                found.append(child)
                parents.append(child.pid)
    return found


RANK_VARIABLES = (b"RANK", b"LOCAL_RANK")
"""The variables every torch launcher gives a rank (torchrun, Lightning's own launcher,
``mpirun`` through the frameworks that read them): a descendant that has them with values other
than this process's is another rank of the job."""


def rank_environment(environ: bytes) -> dict[bytes, bytes]:
    """The rank variables of a NUL-separated environment (``/proc/PID/environ``)."""
    found: dict[bytes, bytes] = {}
    for entry in environ.split(b"\0"):
        name, equals, value = entry.partition(b"=")
        if equals and name in RANK_VARIABLES:
            found[name] = value
    return found


def _read_environ(pid: int) -> bytes:
    """A process's environment as the kernel keeps it (the one it started with), read whole."""
    fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class OtherRanks:
    """Tells the job's other ranks among this process's descendants, so that they and their own
    loader workers are never counted as this rank's workers.

    A descendant is a rank when it registered as one of the job (``registered``: the pids of the
    ranks on this host, from the job's store) or when its environment (``/proc/PID/environ``,
    readable for the same user) gives it a ``RANK`` or ``LOCAL_RANK`` other than this process's:
    Lightning's launcher starts rank 1 as a child of rank 0 with ``LOCAL_RANK=1``, and a rank of
    ``torch.multiprocessing.spawn`` that sets its variables itself is known once it registered.
    A loader worker has its rank's environment (forked: the one the rank started with; spawned:
    the one it has now), so it never reads as another rank. What the environment says is kept
    per process for as long as it is listed.
    """

    def __init__(self, registered: Callable[[], Collection[int]] = tuple) -> None:
        self._registered = registered
        self.registered: frozenset[int] = frozenset()
        """The registered ranks' pids at the last listing."""
        self._by_environment: dict[int, bool] = {}
        self._asked: set[int] = set()

    def registered_now(self) -> frozenset[int]:
        """The pids of the ranks on this host that registered with the job, now."""
        try:
            return frozenset(self._registered()) - {os.getpid()}
        except Exception:  # the job's endpoints being replaced: the last set stands
            return self.registered

    def start_listing(self) -> None:
        """Take the registered ranks as they are now, for the listing that follows."""
        self.registered = self.registered_now()
        self._asked = set()

    def end_listing(self) -> None:
        """Forget what the environment said of processes the listing did not meet (ended: their
        pid may be given to another process)."""
        for pid in set(self._by_environment) - self._asked:
            del self._by_environment[pid]

    def __call__(self, pid: int) -> bool:
        """Whether ``pid`` is another rank of the job."""
        self._asked.add(pid)
        if pid in self.registered:
            return True
        known = self._by_environment.get(pid)
        if known is None:
            known = self._by_environment[pid] = self._differs(pid)
        return known

    @staticmethod
    def _differs(pid: int) -> bool:
        try:
            theirs = rank_environment(_read_environ(pid))
        except OSError:  # another user's, or it ended: counted as it always was
            return False
        for name, value in theirs.items():
            mine = os.environ.get(name.decode())
            if mine is None or mine.encode() != value:
                return True
        return False


class ProcWorker:
    """One process of the training's tree read from its kept-open /proc files: RSS (``statm``),
    CPU time (``stat``) and own memory (``smaps_rollup``); each read is one ``pread``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._statm = ProcFile(f"/proc/{pid}/statm", 256)
        self._stat = ProcFile(f"/proc/{pid}/stat", 1024)
        self._smaps = ProcFile(f"/proc/{pid}/smaps_rollup")

    def rss(self) -> int | None:
        """Resident bytes; None once it ended (a zombie, its memory gone, reads size 0)."""
        try:
            size, resident = self._statm.read().split()[:2]
        except (OSError, ValueError):
            return None
        return int(resident) * _PAGE if int(size) else None

    def cpu_s(self) -> float | None:
        """User and system CPU seconds so far (``stat``'s clock ticks); None once it ended."""
        try:
            text = self._stat.read()
            fields = text[text.rindex(b")") + 2 :].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS
        except (OSError, ValueError, IndexError):
            return None

    def uss(self) -> int | None:
        """Bytes it alone holds (``Private_*`` of ``smaps_rollup``, as psutil sums them; psutil
        where the kernel has no rollup); None once it ended."""
        try:
            text = self._smaps.read()
        except FileNotFoundError:
            try:
                return PsutilWorker(self.pid).uss()
            except psutil.Error:  # the worker ended between the two reads
                return None
        except OSError:
            return None
        private = (line.split()[1] for line in text.splitlines() if line.startswith(b"Private_"))
        return sum(map(int, private)) * 1024

    def close(self) -> None:
        """Close its files."""
        for file in (self._statm, self._stat, self._smaps):
            file.close()


class PsutilWorker:
    """One process of the training's tree read through psutil (where /proc lists no children)."""

    def __init__(self, pid: int, process: psutil.Process | None = None) -> None:
        self.pid = pid
        self._process = process or psutil.Process(pid)

    def rss(self) -> int | None:
        """Resident bytes; None once it ended."""
        try:
            return int(self._process.memory_info().rss)
        except psutil.Error:
            return None

    def cpu_s(self) -> float | None:
        """User and system CPU seconds so far; None once it ended."""
        try:
            times = self._process.cpu_times()
        except psutil.Error:
            return None
        return float(times.user + times.system)

    def uss(self) -> int | None:
        """Bytes it alone holds; None once it ended."""
        try:
            return int(self._process.memory_full_info().uss)
        except psutil.Error:
            return None

    def close(self) -> None:
        """Nothing to close."""


class HostProbe:
    """Host memory and the RSS of the training's process tree, each process's /proc files kept open.

    Its loader workers are the training's descendants, listed again every ``CHILD_REFRESH_S``,
    when asked (a loader rebuilt) and when another rank registered; the job's other ranks among
    them (``OtherRanks``) are left out with their own descendants. Where the kernel keeps no
    list of a thread's children (``proc_children`` false) psutil lists them and reads every
    process, as it used to.
    """

    CHILD_REFRESH_S = 5.0
    USS_PERIOD_S = 5.0
    USS_CPU_SHARE = 0.001
    """The share of a core the workers' USS may take: to read it the kernel walks each worker's
    page tables (~20 ms for a worker forked from a 500 MiB process), so a costlier read is
    repeated less often than every ``USS_PERIOD_S``."""

    def __init__(
        self,
        pid: int | None = None,
        limit_bytes: int | None = None,
        proc_children: bool | None = None,
        ranks: Callable[[], Collection[int]] = tuple,
    ) -> None:
        self.pid = pid or os.getpid()
        self.other_ranks = OtherRanks(ranks)
        """The job's other ranks among the descendants: never this rank's workers."""
        self.limit_bytes = limit_bytes or cgroup_memory_limit() or psutil.virtual_memory().total
        """The CPU device's capacity: the budget given, else the cgroup's limit, else total RAM."""
        if proc_children is None:
            proc_children = os.path.exists(f"/proc/{self.pid}/task/{self.pid}/children")
        self.proc_children = proc_children
        """Whether /proc lists the children (else psutil, which scans every process)."""
        self._main: ProcWorker | PsutilWorker = (
            ProcWorker(self.pid) if proc_children else PsutilWorker(self.pid)
        )
        self._own = self.pid == os.getpid()
        """The process sampled is this one: its CPU time is one clock read."""
        self._workers: dict[int, ProcWorker | PsutilWorker] = {}
        """The workers found at the last listing (a fresh reader each: a pid may be reused)."""
        self._children_at = 0.0
        self._uss_next = 0.0
        self._uss_read: tuple[int, int] | None = None
        """The workers' USS and their RSS when it was read."""
        self._cpu_times: tuple[float, float] | None = None
        self._meminfo = MemInfo()
        self.refresh_requested = True

    def _refresh_children(self, now: float) -> None:
        ranks = self.other_ranks
        if ranks.registered_now() != ranks.registered:  # a rank registered: it is no worker
            self.refresh_requested = True
        if self.refresh_requested or now - self._children_at > self.CHILD_REFRESH_S:
            self.refresh_requested = False
            self._children_at = now
            before = set(self._workers)
            for old in self._workers.values():
                old.close()
            ranks.start_listing()
            found: dict[int, ProcWorker | PsutilWorker]
            if self.proc_children:
                listed = proc_descendants(self.pid, skip=ranks)
                found = {pid: ProcWorker(pid) for pid in listed}
            else:
                children = psutil_descendants(self.pid, skip=ranks)
                found = {child.pid: PsutilWorker(child.pid, child) for child in children}
            ranks.end_listing()
            self._workers = found
            if set(found) != before:
                self._uss_next = 0.0  # measure the new workers' own memory at once

    def workers(self) -> list[int]:
        """The ids of the worker processes found at the last listing that had not ended since."""
        return list(self._workers)

    def tree_rss(self, now: float, main: int | None = None) -> tuple[int, int, int]:
        """(main RSS, live workers, workers' RSS summed); ``main`` when the caller read it. A
        worker found ended is dropped."""
        self._refresh_children(now)
        if main is None:
            main = self._main.rss()
            if main is None:
                raise ProcessLookupError(f"no memory read for process {self.pid}")
        workers = 0
        workers_rss = 0
        for pid, worker in list(self._workers.items()):
            rss = worker.rss()
            if rss is None:
                worker.close()
                del self._workers[pid]
                self._uss_next = 0.0  # the USS read included it
                continue
            workers_rss += rss
            workers += 1
        return main, workers, workers_rss

    def _uss(self, now: float, workers_rss: int) -> int | None:
        """The workers' USS as last read, plus how much their RSS moved since (what they
        allocated or freed); read again every ``USS_PERIOD_S`` at most ``USS_CPU_SHARE`` of a
        core, and at once when the workers changed."""
        if now >= self._uss_next:
            start = time.thread_time()
            uss = sum(worker.uss() or 0 for worker in self._workers.values())
            cost = time.thread_time() - start
            self._uss_next = now + max(self.USS_PERIOD_S, cost / self.USS_CPU_SHARE)
            self._uss_read = (uss, workers_rss)
        if self._uss_read is None:
            return None
        uss, rss_then = self._uss_read
        return max(0, uss + workers_rss - rss_then)

    def workers_own_bytes(self, now: float, workers_rss: int) -> int:
        """The workers' memory not shared with the main process (USS), else their RSS.

        Forked loader workers share the main process's pages until they write to them, so
        their RSS counts those pages a second time; USS (``_uss``: read every few seconds,
        followed in between by their RSS) counts only what each worker holds alone.
        """
        uss = self._uss(now, workers_rss) if self._workers else None
        return uss if uss is not None else workers_rss

    def _cpu_percent(self, now: float) -> float | None:
        used = time.process_time() if self._own else (self._main.cpu_s() or 0.0)
        used += sum(worker.cpu_s() or 0.0 for worker in self._workers.values())
        previous = self._cpu_times
        self._cpu_times = (now, used)
        if previous is None or now <= previous[0]:
            return None
        return max(0.0, 100.0 * (used - previous[1]) / (now - previous[0]))

    def sample(self) -> HostSample:
        """One host sample."""
        now = time.monotonic()
        ram_total, ram_available, swap_total, swap_used = self._meminfo.read()
        main, workers, workers_rss = self.tree_rss(now)
        return HostSample(
            time=time.time(),
            ram_total_bytes=ram_total,
            ram_available_bytes=ram_available,
            ram_used_bytes=ram_total - ram_available,
            swap_total_bytes=swap_total,
            swap_used_bytes=swap_used,
            limit_bytes=self.limit_bytes,
            main_rss_bytes=main,
            workers=workers,
            workers_rss_bytes=workers_rss,
            workers_uss_bytes=self._uss(now, workers_rss) if workers else None,
            cpu_percent=self._cpu_percent(now),
        )


class CpuDeviceProbe:
    """On CPU runs the host is the device: the process tree's memory against the memory limit.

    Like CUDA's allocated and reserved, ``allocated`` is the memory in use (the main process's
    RSS minus what glibc's malloc holds free, from ``mallinfo2``, plus the workers' RSS) and
    ``reserved`` what the tree holds resident (RSS). Peaks are the main process's high-water
    mark since the previous sample plus the workers'. A worker counts with its own memory
    (USS), not its RSS: forked workers share the main process's pages, and summing RSS
    counted them twice (2 demo workers doubled the peak with no more memory really used).

    As a device's stand-in (a memory limit given), it fixes glibc's mmap threshold, so that the
    peak follows the live tensors as a device allocator's peak counter does and a smaller batch
    frees what it frees.
    """

    kind = "cpu"

    def __init__(self, host: HostProbe, stand_in: bool = False) -> None:
        self.host = host
        self._mallinfo = mallinfo2()
        self._peak_rss = PeakRss()
        self.returns_freed = stand_in and fix_mmap_threshold()
        """Whether freed large blocks go back to the OS at once (the stand-in fixed glibc's mmap
        threshold): a peak seen after a decrease is then the smaller batch's own."""

    def _malloc_free_bytes(self) -> int:
        if self._mallinfo is None:
            return 0
        try:
            return int(self._mallinfo().fordblks)
        except Exception:
            self._mallinfo = None
            return 0

    def sample(self, step: int) -> DeviceSample:
        """One sample; the peak is the main process's high-water mark since the last one."""
        free_in_malloc = self._malloc_free_bytes()
        now = time.monotonic()
        status = self._peak_rss.read_and_reset()
        main, _workers, workers_rss = self.host.tree_rss(now, status[0] if status else None)
        workers_own = self.host.workers_own_bytes(now, workers_rss)
        resident = main + workers_own
        live = max(0, main - free_in_malloc) + workers_own
        peak = max(resident, (status[1] if status else main) + workers_own)
        return DeviceSample(
            time=time.time(),
            step=step,
            kind="cpu",
            index=-1,
            name="cpu",
            capacity_bytes=self.host.limit_bytes,
            allocated_bytes=live,
            peak_allocated_bytes=peak,
            reserved_bytes=resident,
            peak_reserved_bytes=peak,
        )


class CudaDeviceProbe:
    """Torch allocator statistics and NVML for one CUDA device.

    ``cuda`` is ``torch.cuda`` and ``nvml`` the ``pynvml`` module; tests on machines without a
    GPU pass stand-ins with the same calls (the only fakes in the suite: no CUDA, no NVML here).
    The peaks are torch's counters as they stand: since memtui's last applied change or rollback
    (or the training's own ``reset_peak_memory_stats``), or since the previous sample when
    ``reset_peaks`` resets them after each read.
    """

    kind = "cuda"
    NVML_PERIOD_S = 1.0

    def __init__(self, cuda: Any, index: int, nvml: Any = None, reset_peaks: bool = False) -> None:
        self.cuda = cuda
        self.index = index
        self.reset_peaks = reset_peaks
        props = cuda.get_device_properties(index)
        self.name = str(getattr(props, "name", f"cuda:{index}"))
        self.capacity = int(props.total_memory)
        self.nvml = nvml
        self.handle: Any = None
        self._nvml_at = 0.0
        self._nvml_last: tuple[int | None, int | None, float | None, list[GpuProcess]] = (
            None,
            None,
            None,
            [],
        )
        if nvml is not None:
            self.handle = _nvml_handle(nvml, props, index)

    def sample(self, step: int) -> DeviceSample:
        """One sample; the allocator's peaks are reset after the read only with ``reset_peaks``."""
        stats = self.cuda.memory_stats(self.index)
        if self.reset_peaks:
            self.cuda.reset_peak_memory_stats(self.index)
        used, total, util, others = self._nvml()
        return DeviceSample(
            time=time.time(),
            step=step,
            kind="cuda",
            index=self.index,
            name=self.name,
            capacity_bytes=self.capacity,
            allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
            peak_allocated_bytes=int(stats.get("allocated_bytes.all.peak", 0)),
            reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
            peak_reserved_bytes=int(stats.get("reserved_bytes.all.peak", 0)),
            inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
            alloc_retries=int(stats.get("num_alloc_retries", 0)),
            ooms=int(stats.get("num_ooms", 0)),
            nvml_used_bytes=used,
            nvml_total_bytes=total,
            utilization_pct=util,
            other_processes=others,
        )

    def _nvml(self) -> tuple[int | None, int | None, float | None, list[GpuProcess]]:
        if self.handle is None:
            return None, None, None, []
        now = time.monotonic()
        if now - self._nvml_at < self.NVML_PERIOD_S:
            return self._nvml_last
        self._nvml_at = now
        nvml = self.nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(self.handle)
        util: float | None = None
        with contextlib.suppress(Exception):
            util = float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        others: list[GpuProcess] = []
        with contextlib.suppress(Exception):
            me = os.getpid()
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if proc.pid == me:
                    continue
                used = proc.usedGpuMemory or 0
                name = "?"
                with contextlib.suppress(psutil.Error):
                    name = psutil.Process(proc.pid).name()
                others.append(GpuProcess(pid=int(proc.pid), name=name, used_bytes=int(used)))
        self._nvml_last = (int(memory.used), int(memory.total), util, others)
        return self._nvml_last


def _nvml_handle(nvml: Any, props: Any, index: int) -> Any:
    """The NVML handle of the torch device: matched by UUID, else by index."""
    try:
        nvml.nvmlInit()
    except Exception as exc:
        log.info("memtui: NVML unavailable (%s); device memory from torch only", exc)
        return None
    uuid = str(getattr(props, "uuid", "") or "")
    with contextlib.suppress(Exception):
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            found = nvml.nvmlDeviceGetUUID(handle)
            found = found.decode() if isinstance(found, bytes) else str(found)
            if uuid and found.replace("GPU-", "") == uuid.replace("GPU-", ""):
                return handle
    with contextlib.suppress(Exception):
        return nvml.nvmlDeviceGetHandleByIndex(index)
    return None


def make_device_probe(
    cuda_index: int | None, host: HostProbe, reset_peaks: bool = False, stand_in: bool = False
) -> CpuDeviceProbe | CudaDeviceProbe:
    """The CUDA probe if the training process has initialised CUDA, else the CPU one (a device's
    stand-in where ``stand_in``: a memory limit was given)."""
    torch = sys.modules.get("torch")
    if torch is not None and cuda_index is not None:
        try:
            import pynvml
        except ImportError:
            pynvml = None
        return CudaDeviceProbe(torch.cuda, cuda_index, pynvml, reset_peaks)
    return CpuDeviceProbe(host, stand_in)


class Waker:
    """Ends one thread's timed wait early: a held lock that ``set`` releases and the wait takes
    back. One lock acquired with a timeout, without ``threading.Event``'s condition and its
    lock per wait: about a third less CPU per wake-up beside a busy training thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """End the current wait at once (or the next one, if none is under way)."""
        with contextlib.suppress(RuntimeError):  # released already: a wake-up is pending
            self._lock.release()

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` or until ``set``; True when set (the wake-up is taken)."""
        return self._lock.acquire(True, max(0.0, seconds))


class Sampler(threading.Thread):
    """Samples the device every ``device_period_s`` (``idle_device_period_s`` while nobody
    watches) and the host every ``host_period_s``."""

    def __init__(
        self,
        device: DeviceTracker,
        step: Callable[[], int],
        report: Report,
        *,
        model: Callable[[], Any] = lambda: None,
        watched: Callable[[], bool] = lambda: False,
        ranks: Callable[[], Collection[int]] = tuple,
        memory_limit: int | None = None,
        stand_in_heap: bool = True,
        reset_peaks: bool = False,
        device_period_s: float = 0.2,
        host_period_s: float = 1.0,
        idle_device_period_s: float | None = None,
    ) -> None:
        super().__init__(name="memtui-sampler", daemon=True)
        self._device = device
        self._step = step
        self._report = report
        self._model = model
        self._watched = watched
        """Whether a viewer is subscribed or a recording written (the agent says)."""
        self._ranks = ranks
        """The pids of the job's ranks on this host, as they registered (none of them a worker)."""
        self._memory_limit = memory_limit
        self._stand_in = memory_limit is not None and stand_in_heap
        """Whether a CPU probe is a device's stand-in (a memory limit given) fixing glibc's mmap
        threshold."""
        self._reset_peaks = reset_peaks
        self.device_period_s = device_period_s
        self.idle_device_period_s = max(idle_device_period_s or device_period_s, device_period_s)
        self.host_period_s = host_period_s
        self.wake = Waker()
        """Set to end the current wait early (a viewer arrived, or stop)."""
        self.device_samples: deque[DeviceSample] = deque(maxlen=512)
        self.host_samples: deque[HostSample] = deque(maxlen=64)
        self.host: HostProbe | None = None
        self.probe: CpuDeviceProbe | CudaDeviceProbe | None = None
        self._workers_changed = False
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """Ask the thread to end."""
        self._stop_event.set()
        self.wake.set()

    def workers_changed(self) -> None:
        """Look for the loader's worker processes again at the next host sample (a rebuild)."""
        self._workers_changed = True

    def returns_freed(self) -> bool:
        """Whether the device is the CPU stand-in giving freed large blocks back at once."""
        probe = self.probe
        return isinstance(probe, CpuDeviceProbe) and probe.returns_freed

    def period(self) -> float:
        """Seconds to the next device sample: short while watched, long while not."""
        return self.device_period_s if self._watched() else self.idle_device_period_s

    def _wait(self, seconds: float) -> None:
        self.wake.wait(seconds)

    def run(self) -> None:
        """Sample until stopped; a failing probe is reported and retried later."""
        name_native_thread(self.name)
        next_host = 0.0
        failures = 0
        device = self._device
        while not self._stop_event.is_set():
            now = time.monotonic()
            try:
                if self.host is None:
                    self.host = HostProbe(limit_bytes=self._memory_limit, ranks=self._ranks)
                if self._workers_changed:
                    self._workers_changed = False
                    self.host.refresh_requested = True
                if device.cuda_index is None:
                    device.detect_late(self._model())
                wanted = device.kind
                if self.probe is None or self.probe.kind != wanted:
                    self.probe = make_device_probe(
                        device.cuda_index,
                        self.host,
                        self._reset_peaks,
                        stand_in=self._stand_in,
                    )
                self.device_samples.append(self.probe.sample(self._step()))
                if now >= next_host:
                    next_host = now + self.host_period_s
                    self.host_samples.append(self.host.sample())
                failures = 0
            except Exception as exc:  # a probe failed: report, back off, keep going
                failures += 1
                self._report(exc, "sampler")
                self.probe = None
                self._wait(min(30.0, self.device_period_s * 2**failures))
                continue
            self._wait(self.period())
