"""``memtui gpus``: every GPU on this host, its memory, utilisation and the processes holding it.

The reading is a pure function of an NVML-like object (``pynvml`` from nvidia-ml-py, imported
only when asked), so it is tested with a stand-in where there is no driver. No torch here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


class NoDriver(Exception):
    """NVML could not start: no NVIDIA driver (or library) on this host."""


@dataclass(frozen=True)
class GpuProcessInfo:
    """A process holding memory on a GPU."""

    pid: int
    used_bytes: int | None
    """None where NVML does not say (another container's process, or no permission)."""
    user: str = "?"
    command: str = "?"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU: identity, memory, utilisation and the processes on it."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization_pct: float | None = None
    processes: list[GpuProcessInfo] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``memtui gpus --json``)."""
        return asdict(self)


def describe_process(pid: int) -> tuple[str, str]:
    """(user, command line) of a pid on this host, ``?`` where it cannot be read."""
    import psutil

    user = command = "?"
    with contextlib.suppress(psutil.Error, OSError):
        process = psutil.Process(pid)
        with contextlib.suppress(psutil.Error, OSError):
            user = process.username()
        with contextlib.suppress(psutil.Error, OSError):
            command = " ".join(process.cmdline()) or process.name()
    return user, command


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpus(
    nvml: Any, describe: Callable[[int], tuple[str, str]] = describe_process
) -> list[GpuInfo]:
    """Every GPU NVML sees (``nvml`` already initialised), freest first.

    Freest: most free memory, then lowest utilisation, then lowest index. Processes come from
    the compute and graphics lists (a pid once), largest first.
    """
    gpus = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = uuid = "?"
        with contextlib.suppress(Exception):
            name = _text(nvml.nvmlDeviceGetName(handle))
        with contextlib.suppress(Exception):
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        utilization: float | None = None
        with contextlib.suppress(Exception):
            utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        by_pid: dict[int, int | None] = {}
        for getter in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
        ):
            with contextlib.suppress(Exception):
                for proc in getattr(nvml, getter)(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    used = int(used) if used is not None and int(used) < 2**63 else None
                    if by_pid.get(int(proc.pid)) is None:
                        by_pid[int(proc.pid)] = used
        processes = [
            GpuProcessInfo(pid, used, *describe(pid))
            for pid, used in sorted(by_pid.items(), key=lambda item: -(item[1] or 0))
        ]
        total, used = int(memory.total), int(memory.used)
        free = int(getattr(memory, "free", total - used))
        gpus.append(GpuInfo(index, name, uuid, total, used, free, utilization, processes))
    return sorted(
        gpus,
        key=lambda g: (
            -g.free_bytes,
            g.utilization_pct if g.utilization_pct is not None else 100.0,
            g.index,
        ),
    )


def load_nvml() -> Any:
    """``pynvml``, initialised; NoDriver (with NVML's reason) where there is no driver."""
    try:
        import pynvml
    except ImportError as exc:
        raise NoDriver(f"nvidia-ml-py is not installed ({exc})") from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        raise NoDriver(f"no NVIDIA driver on this host (NVML: {exc})") from None
    return pynvml


def host_gpus() -> list[GpuInfo]:
    """Every GPU on this host, freest first; NoDriver where there is no driver."""
    nvml = load_nvml()
    try:
        return read_gpus(nvml)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def pick(gpus: list[GpuInfo], count: int, uuid: bool = False) -> str:
    """The ``count`` freest GPUs as ``CUDA_VISIBLE_DEVICES`` takes them (``3,5`` or UUIDs)."""
    chosen = gpus[:count]
    return ",".join(g.uuid if uuid else str(g.index) for g in chosen)


def format_gpus(gpus: list[GpuInfo], format_bytes: Callable[[float | None], str]) -> str:
    """The human table: one line per GPU, its processes under it."""
    lines = [f"{'GPU':>3}  {'NAME':<24} {'FREE':>10} {'USED':>10} {'TOTAL':>10} {'UTIL':>5}"]
    for gpu in gpus:
        util = f"{gpu.utilization_pct:.0f}%" if gpu.utilization_pct is not None else "-"
        lines.append(
            f"{gpu.index:>3}  {gpu.name[:24]:<24} {format_bytes(gpu.free_bytes):>10} "
            f"{format_bytes(gpu.used_bytes):>10} {format_bytes(gpu.total_bytes):>10} {util:>5}"
        )
        for proc in gpu.processes:
            used = format_bytes(proc.used_bytes) if proc.used_bytes is not None else "?"
            lines.append(
                f"       pid {proc.pid:<8} {proc.user:<12} {used:>10}  {proc.command[:60]}"
            )
    if not gpus:
        lines.append("  (the driver sees no GPU)")
    return "\n".join(lines)
