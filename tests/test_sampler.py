"""The CPU device's memory: forked loader workers count with their own memory, not their RSS."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

from memtui.hooks.sampler import CpuDeviceProbe, HostProbe


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
        sample = device.sample(step=1)
        main, workers, workers_rss = host.tree_rss(0.0)
        assert workers == others + 2
        uss = host.workers_own_bytes(0.0, workers_rss)
        assert 0 < uss < workers_rss, "USS leaves out the pages shared with the main process"
        # the device's resident memory is the main RSS plus the workers' USS, not their RSS
        assert sample.reserved_bytes < main + workers_rss
        assert abs(sample.reserved_bytes - (main + uss)) < 32 << 20
    finally:
        del iterator


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
