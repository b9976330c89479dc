"""Reading an out-of-memory error: what was asked for, what the device had, where memory went.

Pure. Parses the messages of ``torch.OutOfMemoryError`` (torch >= 2.1, and the older
``(GPU 0; ... total capacity; ...)`` form) and of a CPU allocation failure. The message of a
batch doubled to fix a starving loader, guessed by hand at 12-16 GB, that ran out of memory:

    CUDA out of memory. Tried to allocate 1.23 GiB. GPU 0 has a total capacity of 19.58 GiB of
    which 1.06 GiB is free. Including non-PyTorch memory, this process has 18.50 GiB memory in
    use. Of the allocated memory 14.94 GiB is allocated by PyTorch, and 3.18 GiB is reserved by
    PyTorch but unallocated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_UNITS = {"B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
_UNITS |= {"KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4, "BYTES": 1}

_SIZE = r"([\d.]+)\s*([KMGT]i?B|B|bytes)"


def parse_size(number: str, unit: str) -> int:
    """``"1.23", "GiB"`` -> bytes."""
    return int(float(number) * _UNITS[unit.upper()])


def _find(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text, re.IGNORECASE | re.DOTALL)
    return parse_size(match.group(1), match.group(2)) if match else None


def _first(*values: int | None) -> int | None:
    """The first value found (0 included: "0 bytes is free" is the usual case)."""
    return next((v for v in values if v is not None), None)


@dataclass(frozen=True)
class OomReport:
    """The numbers in one out-of-memory message (None where the message does not say)."""

    kind: str
    """``"cuda"`` or ``"cpu"``."""
    message: str
    device_index: int | None = None
    tried_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    process_in_use_bytes: int | None = None
    """Everything this process holds on the device, the CUDA context included."""
    allocated_bytes: int | None = None
    """Allocated by PyTorch (live tensors)."""
    reserved_unallocated_bytes: int | None = None
    """Reserved by PyTorch's caching allocator but not allocated: fragmentation."""
    other_processes: dict[int, int] = field(default_factory=dict)
    """pid -> bytes for other processes the message names."""

    @property
    def reserved_bytes(self) -> int | None:
        """Reserved by PyTorch in total (allocated plus reserved-but-unallocated)."""
        if self.allocated_bytes is None or self.reserved_unallocated_bytes is None:
            return None
        return self.allocated_bytes + self.reserved_unallocated_bytes

    @property
    def non_pytorch_bytes(self) -> int | None:
        """This process's device memory outside PyTorch's reserve (CUDA context, NCCL, ...)."""
        if self.process_in_use_bytes is None or self.reserved_bytes is None:
            return None
        return max(0, self.process_in_use_bytes - self.reserved_bytes)

    @property
    def fragmentation_fraction(self) -> float | None:
        """Reserved-but-unallocated over what PyTorch reserved."""
        reserved = self.reserved_bytes
        if not reserved or self.reserved_unallocated_bytes is None:
            return None
        return self.reserved_unallocated_bytes / reserved


def is_oom(exc: BaseException) -> bool:
    """True for a CUDA out-of-memory error or a CPU allocation failure."""
    if isinstance(exc, MemoryError):
        return True
    name = type(exc).__name__
    text = str(exc)
    return name == "OutOfMemoryError" or "out of memory" in text.lower()


def parse_oom(exc: BaseException | str) -> OomReport:
    """The numbers of an out-of-memory error (its message, or the message itself)."""
    text = exc if isinstance(exc, str) else str(exc)
    kind = "cpu" if isinstance(exc, MemoryError) or "CPU" in text[:40] else "cuda"
    gpu = re.search(r"GPU\s+(\d+)", text)
    others = {
        int(pid): parse_size(number, unit)
        for pid, number, unit in re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", text)
    }
    # the newer form first, then the older; torch 2.1 and 2.2 spell it "capacty"
    capacity = _first(
        _find(r"total capac(?:i)?ty of " + _SIZE, text), _find(_SIZE + r" total capacity", text)
    )
    free = _first(_find(r"of which " + _SIZE + r" is free", text), _find(_SIZE + r" free", text))
    allocated = _first(
        _find(_SIZE + r" is allocated by PyTorch", text), _find(_SIZE + r" already allocated", text)
    )
    unallocated = _find(_SIZE + r" is reserved by PyTorch but unallocated", text)
    reserved_total = _find(_SIZE + r" reserved in total by PyTorch", text)
    if unallocated is None and reserved_total is not None and allocated is not None:
        unallocated = max(0, reserved_total - allocated)
    return OomReport(
        kind=kind,
        message=text.strip()[:2000],
        device_index=int(gpu.group(1)) if gpu else None,
        tried_bytes=_find(r"Tried to allocate " + _SIZE, text),
        capacity_bytes=capacity,
        free_bytes=free,
        process_in_use_bytes=_find(r"this process has " + _SIZE + r" memory in use", text),
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        other_processes=others,
    )
