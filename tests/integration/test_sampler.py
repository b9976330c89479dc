"""The CPU device's memory: forked loader workers count with their own memory, not their RSS."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from memtui.hooks.sampler import CpuDeviceProbe, HostProbe, ProcWorker, Waker, proc_descendants
from tests.support.clock import patience
from tests.support.processes import wait_for


class Ballast(torch.utils.data.Dataset[torch.Tensor]):
    """Samples from a large array the main process allocated before the workers forked."""

    def __init__(self) -> None:
        self.array = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB shared with the workers

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.array[index * 1024 : index * 1024 + 8].clone()


def test_workers_count_with_their_own_memory() -> None:
    import psutil

    # children this test process already has (a test worker's fork server) count as workers too
    others = len(psutil.Process().children(recursive=True))
    loader = DataLoader(Ballast(), batch_size=4, num_workers=2, persistent_workers=True)
    iterator = iter(loader)
    next(iterator)  # the workers are up
    try:
        host = HostProbe(os.getpid())
        device = CpuDeviceProbe(host)

        def own() -> tuple[int, int, int, int]:
            """(main RSS + workers' USS, main RSS, workers, workers' RSS) now."""
            main, workers, workers_rss = host.tree_rss(0.0)
            return main + host.workers_own_bytes(0.0, workers_rss), main, workers, workers_rss

        # read before and after the sample: workers still warming up (slower under load) grow
        # between two reads, and the sample must lie between them
        before, _, _, _ = own()
        sample = device.sample(step=1)
        after, main, workers, workers_rss = own()
        assert workers == others + 2
        assert 0 < after - main < workers_rss, (
            "USS leaves out the pages shared with the main process"
        )
        # the device's resident memory is the main RSS plus the workers' USS, not their RSS
        assert sample.reserved_bytes < main + workers_rss
        low, high = min(before, after), max(before, after)
        assert low - (16 << 20) < sample.reserved_bytes < high + (16 << 20)
    finally:
        del iterator


def _hold(ready: Any, done: Any, grandchild: Any) -> None:
    """A forked child as a loader worker is: 64 MiB of its own, and a forked child of its own."""
    ballast = bytearray(64 << 20)
    ballast[:: 1 << 12] = b"x" * len(ballast[:: 1 << 12])  # touch every page: resident
    pid = os.fork()
    if pid == 0:
        done.wait(patience(120))
        os._exit(0)
    grandchild.value = pid
    ready.set()
    done.wait(patience(120))
    os.waitpid(pid, 0)
    os._exit(0)


@pytest.fixture
def forked() -> Iterator[tuple[Any, int, Any]]:
    """A forked child holding 64 MiB and its grandchild: (process, grandchild's pid, its end)."""
    context = multiprocessing.get_context("fork")
    ready, done, grandchild = context.Event(), context.Event(), context.Value("i", 0)
    child = context.Process(target=_hold, args=(ready, done, grandchild), daemon=True)
    child.start()
    try:
        assert ready.wait(patience(60)), "the child did not start"
        yield child, grandchild.value, done
    finally:
        done.set()
        child.join(patience(30))
        if child.is_alive():
            child.kill()
            child.join(patience(10))


def test_proc_readers_find_a_forked_child_and_read_it_as_psutil_does(forked: Any) -> None:
    """Children and grandchildren listed from /proc, as psutil finds them by scanning every
    process (the fallback: the same workers); each read from its kept files as psutil reads it."""
    child, grandchild, _done = forked
    assert {child.pid, grandchild} <= set(proc_descendants(os.getpid()))
    probe = HostProbe(os.getpid())
    fallback = HostProbe(os.getpid(), proc_children=False)
    assert probe.proc_children and not fallback.proc_children
    for host in (probe, fallback):
        main, workers, workers_rss = host.tree_rss(0.0)
        assert {child.pid, grandchild} <= set(host.workers()) and workers == len(host.workers())
        assert abs(main - psutil.Process().memory_info().rss) < 64 << 20
        assert workers_rss > 2 * (64 << 20), "both hold the ballast (shared after the fork)"

    worker, process = ProcWorker(child.pid), psutil.Process(child.pid)
    rss, uss, cpu_s = worker.rss(), worker.uss(), worker.cpu_s()
    times = process.cpu_times()
    assert rss is not None and abs(rss - process.memory_info().rss) < 1 << 20
    assert rss > 64 << 20
    assert uss is not None and abs(uss - process.memory_full_info().uss) < 4 << 20
    assert cpu_s is not None and abs(cpu_s - (times.user + times.system)) < 0.05
    worker.close()


def test_a_worker_that_ended_is_dropped_at_once(forked: Any) -> None:
    """An ended worker (reaped, or a zombie nobody reaped yet) is dropped at the next read, not
    counted until the next listing."""
    child, grandchild, done = forked
    context = multiprocessing.get_context("fork")
    zombie = context.Process(target=time.sleep, args=(120,), daemon=True)
    zombie.start()
    try:
        host = HostProbe(os.getpid())
        host.tree_rss(0.0)
        assert {child.pid, grandchild, zombie.pid} <= set(host.workers())
        done.set()
        child.join(patience(30))  # the child reaps the grandchild, then is reaped
        assert zombie.pid is not None
        os.kill(zombie.pid, signal.SIGKILL)
        wait_for(
            lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE,
            30,
            what="the killed child to be a zombie",
        )
        _main, workers, _rss = host.tree_rss(0.0)  # the same moment: no new listing
        assert not {child.pid, grandchild, zombie.pid} & set(host.workers())
        assert workers == len(host.workers())
    finally:
        zombie.kill()
        zombie.join(patience(10))


def test_workers_uss_is_read_within_its_cpu_share_and_follows_their_rss(forked: Any) -> None:
    """Reading a worker's USS walks its page tables (ms); between reads, the workers' RSS
    change is added to it, and a read that costs more than its share of a core waits longer
    than ``USS_PERIOD_S``."""
    host = HostProbe(os.getpid())
    host.USS_CPU_SHARE = 1e-9  # any read is costly: the next one waits longer than the period
    now = 1000.0
    _main, _workers, rss = host.tree_rss(now)
    uss = host.workers_own_bytes(now, rss)
    assert 0 < uss < rss
    later = now + 2 * HostProbe.USS_PERIOD_S
    assert host.workers_own_bytes(later, rss + (8 << 20)) == uss + (8 << 20), "allocated"
    assert host.workers_own_bytes(later, rss - (1 << 20)) == uss - (1 << 20), "freed"

    cheap = HostProbe(os.getpid())
    cheap.USS_CPU_SHARE = 1.0  # any read is cheap: read again after the period
    _main, _workers, rss = cheap.tree_rss(now)
    first = cheap.workers_own_bytes(now, rss)
    again = cheap.workers_own_bytes(now + HostProbe.USS_PERIOD_S, rss + (64 << 20))
    assert abs(again - first) < 8 << 20, "read again after the period: the RSS moved, not USS"


def test_host_cpu_is_the_process_time_over_the_wall_time() -> None:
    """The host sample's CPU: this process's CPU time (one clock read) over the time between
    two samples, in percent of a core."""
    host = HostProbe()
    before = time.monotonic()  # the samples' window lies inside [before, after]: a bound that
    assert host.sample().cpu_percent is None, "the first sample has nothing to compare with"
    cpu = time.process_time()  # holds however long the test is descheduled under load
    while time.process_time() - cpu < 0.2:
        pass
    percent = host.sample().cpu_percent
    after = time.monotonic()
    assert percent is not None and percent >= 100 * 0.2 / (after - before) * 0.95


def test_proc_readers_agree_with_psutil_and_the_peak_resets() -> None:
    """The kept-open /proc files read what psutil reads; the peak is reset after each read."""
    import psutil

    from memtui.hooks.sampler import MemInfo, PeakRss

    total, available, swap_total, swap_used = MemInfo().read()
    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    assert total == vm.total and swap_total == swap.total
    assert abs(available - vm.available) < 256 << 20 and abs(swap_used - swap.used) < 256 << 20

    peak_rss = PeakRss()
    assert peak_rss.read_and_reset() is not None
    ballast = bytearray(256 << 20)
    ballast[:: 1 << 12] = b"x" * len(ballast[:: 1 << 12])  # touch every page: resident
    del ballast
    status = peak_rss.read_and_reset()
    assert status is not None
    rss, peak = status
    assert peak - rss > 200 << 20, "the 256 MiB spike is in the peak"
    again = peak_rss.read_and_reset()
    assert again is not None and again[1] - again[0] < 64 << 20, "and reset after the read"
    assert abs(rss - psutil.Process().memory_info().rss) < 64 << 20
    peak_rss.close()


HEAP_PATTERN = """
import ctypes, sys
from memtui.hooks.sampler import CpuDeviceProbe, HostProbe

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
probe = CpuDeviceProbe(HostProbe(limit_bytes=1 << 30), stand_in=sys.argv[1] == "stand-in")


def touched(size):
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block


libc.free(touched(16 << 20))  # glibc's default moves its mmap threshold up to 16 MiB here
before = probe.sample(0).reserved_bytes
blocks = [touched(8 << 20) for _ in range(3)]  # a micro-batch's activations
for block in blocks:
    libc.free(block)
print(probe.returns_freed, probe.sample(1).reserved_bytes - before)
"""


def test_the_cpu_stand_in_gives_freed_blocks_back_as_a_device_allocator_would() -> None:
    """With glibc's moving mmap threshold the process kept 24 MiB of freed blocks (a
    smaller batch's peak inflated by the larger one's); the stand-in (a memory limit given) fixes
    the threshold and keeps none of it."""
    import subprocess
    import sys

    kept: dict[str, tuple[str, int]] = {}
    for mode in ("default", "stand-in"):
        done = subprocess.run(
            [sys.executable, "-c", HEAP_PATTERN, mode],
            capture_output=True,
            text=True,
            timeout=patience(120),
        )
        assert done.returncode == 0, done.stderr
        said, grown = done.stdout.split()
        kept[mode] = (said, int(grown))
    assert kept["default"][0] == "False" and kept["default"][1] > 16 << 20, kept
    assert kept["stand-in"][0] == "True" and kept["stand-in"][1] < 4 << 20, kept


def test_the_stand_in_heap_switch_leaves_glibc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEMTUI_STAND_IN_HEAP=0``: a CPU run under a memory limit samples with glibc as it is."""
    from memtui.hooks import Options
    from memtui.hooks.device import DeviceTracker
    from memtui.hooks.sampler import Sampler
    from tests.support.processes import wait_for

    monkeypatch.setenv("MEMTUI_STAND_IN_HEAP", "0")
    options = Options()
    assert not options.stand_in_heap
    errors: list[BaseException] = []
    sampler = Sampler(
        DeviceTracker(lambda exc, where: errors.append(exc)),
        lambda: 0,
        lambda exc, where: errors.append(exc),
        memory_limit=1 << 30,
        stand_in_heap=options.stand_in_heap,
        device_period_s=0.05,
    )
    sampler.start()
    try:
        wait_for(lambda: sampler.device_samples, 30.0, what="a device sample")
        assert sampler.probe is not None and sampler.probe.kind == "cpu"
        assert not sampler.returns_freed() and not errors
    finally:
        sampler.stop()
        sampler.join(patience(10.0))


def test_the_samplers_waker_ends_one_wait_per_set() -> None:
    """``set`` ends the wait under way or the next one, once however often it was called; a
    wait nobody ends lasts its timeout."""
    waker = Waker()
    start = time.monotonic()
    assert not waker.wait(patience(0.05)) and time.monotonic() - start >= 0.04
    waker.set()
    waker.set()
    assert waker.wait(patience(30.0)), "a wake-up set before the wait ends it at once"
    assert not waker.wait(patience(0.0)), "and only that one"
    threading.Timer(0.05, waker.set).start()
    assert waker.wait(patience(30.0)), "a wake-up set during the wait ends it"


def _kernel_mark() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _touch(size: int) -> None:
    """Make the process's resident memory ``size`` bytes higher for a moment."""
    block = bytearray(size)
    block[::4096] = b"x" * len(block[::4096])
    del block


def test_a_peak_the_sampler_reset_reaches_peak_rss_and_one_peak_rss_reset_reaches_the_sampler() -> (
    None
):
    from memtui.hooks.sampler import PeakRss, peak_rss

    size = 160 << 20
    sampler = PeakRss()
    peak_rss(), sampler.read_and_reset()  # both measure from here
    base = _kernel_mark()
    _touch(size)
    read = sampler.read_and_reset()  # a sample after the peak resets the kernel's mark
    assert read is not None and read[1] >= base + size * 0.9
    assert _kernel_mark() < base + size * 0.5, "the kernel's own mark lost the peak"
    assert peak_rss() >= base + size * 0.9  # memtui's kept it
    assert peak_rss() < base + size * 0.5  # since the last call only
    _touch(size)
    assert peak_rss() >= base + size * 0.9  # the caller resets the kernel's mark now
    after = sampler.read_and_reset()
    assert after is not None and after[1] >= base + size * 0.9  # the sampler still sees it
    sampler.close()


def test_the_peak_between_samples_reaches_peak_rss_while_the_sampler_resets_every_millisecond() -> (
    None
):
    from memtui.hooks.sampler import PeakRss, peak_rss

    size = 160 << 20
    sampler, stop = PeakRss(), threading.Event()

    def sample() -> None:
        while not stop.is_set():
            sampler.read_and_reset()
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        peak_rss()
        base = _kernel_mark()
        for _ in range(5):
            _touch(size)
            time.sleep(0.01)  # several resets between the peak and the check
            assert peak_rss() >= base + size * 0.9
    finally:
        stop.set()
        thread.join()
        sampler.close()


SLEEPER = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
sys.stdin.read()
os.kill(pid, 9)
"""
"""A process and its own forked child (its loader worker), until its stdin closes."""


@pytest.fixture
def trees() -> Iterator[Any]:
    """Start child processes with the environment given, each with a child of its own: the
    ``(process, its child's pid)`` of each; all ended after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(**env: str) -> tuple[subprocess.Popen[str], int]:
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
        proc = subprocess.Popen(
            [sys.executable, "-c", SLEEPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**base, **env},
        )
        started.append(proc)
        assert proc.stdout is not None
        return proc, int(proc.stdout.readline())

    try:
        yield start
    finally:
        for proc in started:
            proc.communicate(timeout=patience(30))


@pytest.mark.parametrize("proc_children", [True, False], ids=["proc", "psutil"])
def test_a_child_that_is_another_rank_is_no_worker_nor_are_its_own_workers(
    trees: Any, monkeypatch: pytest.MonkeyPatch, proc_children: bool
) -> None:
    """A descendant with another rank's variables (Lightning's launcher starts rank 1 from rank 0
    with ``LOCAL_RANK=1``), or one that registered as a rank of the job (a rank of
    ``torch.multiprocessing.spawn`` sets its variables only once it runs), is left out of this
    rank's workers with its own children; a child with this rank's own variables (a spawned
    loader worker) is a worker."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("RANK", raising=False)
    by_environment, its_worker = trees(LOCAL_RANK="1")
    registered, its_own = trees()
    worker, workers_child = trees(LOCAL_RANK="0")
    ranks: list[int] = []
    host = HostProbe(os.getpid(), proc_children=proc_children, ranks=lambda: ranks)
    host.tree_rss(0.0)
    found = set(host.workers())
    assert {worker.pid, workers_child, registered.pid, its_own} <= found
    assert not found & {by_environment.pid, its_worker}, "the rank by its environment"
    ranks.append(registered.pid)  # it registered with the job: listed again at once
    _main, workers, workers_rss = host.tree_rss(1.0)
    found = set(host.workers())
    assert {worker.pid, workers_child} <= found and workers == len(found)
    assert not found & {by_environment.pid, its_worker, registered.pid, its_own}
    # the memory of the workers is theirs alone: no rank's counted in it
    theirs = sum(psutil.Process(pid).memory_info().rss for pid in found)
    assert abs(workers_rss - theirs) < 4 << 20
