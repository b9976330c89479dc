"""``memtui gpus``: the real no-driver path, and the NVML reader on a stand-in NVML.

The suite runs without an NVIDIA GPU or NVML library, so the reader's tests use ``FakeNvml``,
an object with the pynvml calls ``read_gpus`` makes (the only kind of fake the suite allows:
CUDA/NVML). The no-driver path runs the real command with the real pynvml.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from memtui.core.stats import format_bytes
from memtui.planning.gpus import GpuInfo, NoDriver, format_gpus, load_nvml, pick, read_gpus
from tests.support.cli import memtui_cli

GiB = 2**30


@dataclass
class Memory:
    total: int
    used: int
    free: int


@dataclass
class Utilization:
    gpu: int
    memory: int = 0


@dataclass
class Process:
    pid: int
    usedGpuMemory: int | None


class FakeNvml:
    """A stand-in for pynvml on a host with four 24 GiB cards (the suite needs no GPU)."""

    def __init__(self) -> None:
        self.cards = [
            # (used GiB, utilisation %, processes)
            (21, 97, [Process(4242, 20 * GiB), Process(4343, None)]),
            (2, 5, [Process(5151, GiB)]),
            (2, 40, []),
            (12, 60, [Process(6161, 11 * GiB)]),
        ]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA GeForce RTX 4090"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-0000000{handle}-aaaa-bbbb-cccc-dddddddddddd"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Memory:
        used = self.cards[handle][0] * GiB
        return Memory(24 * GiB, used, 24 * GiB - used)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Utilization:
        return Utilization(self.cards[handle][1])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Process]:
        return self.cards[handle][2]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Process]:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def describe(pid: int) -> tuple[str, str]:
    return ("alice", f"python train.py --pid {pid}")


def test_reader_sorts_freest_first_and_lists_processes() -> None:
    gpus = read_gpus(FakeNvml(), describe)
    assert [g.index for g in gpus] == [1, 2, 3, 0], "most free first; utilisation breaks ties"
    busiest = gpus[-1]
    assert busiest.free_bytes == 3 * GiB and busiest.utilization_pct == 97
    assert [(p.pid, p.used_bytes, p.user) for p in busiest.processes] == [
        (4242, 20 * GiB, "alice"),
        (4343, None, "alice"),
    ]
    assert gpus[0].name == "NVIDIA GeForce RTX 4090"


def test_pick_gives_cuda_visible_devices() -> None:
    gpus = read_gpus(FakeNvml(), describe)
    assert pick(gpus, 1) == "1"
    assert pick(gpus, 2) == "1,2"
    assert pick(gpus, 1, uuid=True).startswith("GPU-00000001")


def test_table_and_json_fields() -> None:
    gpus = read_gpus(FakeNvml(), describe)
    table = format_gpus(gpus, format_bytes)
    assert table.splitlines()[1].split()[0] == "1"
    assert "pid 4242" in table and "20.0 GiB" in table
    fields = gpus[0].as_dict()
    assert set(fields) == set(GpuInfo.__dataclass_fields__)
    assert fields["processes"][0]["command"].startswith("python train.py")
    json.dumps([g.as_dict() for g in gpus])


def no_driver_here() -> bool:
    try:
        load_nvml()
    except NoDriver:
        return True
    return False


@pytest.mark.skipif(not no_driver_here(), reason="this host has an NVIDIA driver")
@pytest.mark.parametrize("args", [(), ("--json",), ("--pick",), ("--pick", "2")])
def test_no_driver_says_so_and_exits_non_zero(args: Any) -> None:
    """The real command on this driverless machine: one plain line on stderr, exit 1."""
    result = memtui_cli("gpus", *args)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("memtui: no NVIDIA driver on this host")


def test_watch_refreshes_until_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--watch`` reads NVML again at every refresh (the stand-in NVML; no GPU here)."""
    from click.testing import CliRunner

    import memtui.planning.gpus
    from memtui.cli import main

    reads: list[int] = []

    def host_gpus() -> list[GpuInfo]:
        reads.append(1)
        return read_gpus(FakeNvml(), describe)

    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(memtui.planning.gpus, "host_gpus", host_gpus)
    monkeypatch.setattr("memtui.commands.gpus.time.sleep", sleep)
    result = CliRunner().invoke(main, ["gpus", "--watch", "--interval", "0.5"])
    assert result.exit_code == 0, result.output
    assert len(reads) == 3 and sleeps == [0.5, 0.5, 0.5]
    assert result.output.count("GPU  NAME") == 3, "one table per refresh"
