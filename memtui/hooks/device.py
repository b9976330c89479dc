"""The device tracker: which device the training uses, and the exact memory of model and optimizer.

The training thread notes the CUDA device at install and at every boundary (``refresh``); the
sampler thread notices CUDA initialised later (``detect_late``). The static memory (parameters,
gradients, optimizer state, buffers) is computed from the tensors on the training thread.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import psutil

from memtui.hooks.caches import mallinfo2
from memtui.hooks.errors import Report
from memtui.hooks.memory import static_memory
from memtui.wire import StaticMemory


def _model_device(model: Any) -> int | None:
    """The CUDA index of the model's first parameter (None: no model, or not on CUDA)."""
    if model is None:
        return None
    for param in model.parameters():
        return param.device.index if param.device.type == "cuda" else None
    return None


def allocator_settings() -> str | None:
    """The CUDA caching allocator's settings as torch holds them (``PYTORCH_CUDA_ALLOC_CONF``,
    ``PYTORCH_ALLOC_CONF`` or set at run time), else the environment's; None without torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    # torch >= 2.9 keeps the string it parsed (the environment's, or the last one set at run time)
    getter = getattr(getattr(torch, "_C", None), "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            return str(getter())
        except Exception:
            pass
    # older torch: the environment (the CUDA variable wins where both are set)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if name in os.environ:
            return os.environ[name]
    return ""


def _malloc_free_reader() -> Callable[[], int]:
    """A reader of the bytes glibc's malloc holds free (``mallinfo2``'s ``fordblks``, as the CPU
    sampler subtracts them from the RSS); one that reads 0 where there is no ``mallinfo2``."""
    function = mallinfo2()
    if function is None:
        return lambda: 0
    return lambda: int(function().fordblks)


class DeviceTracker:
    """The CUDA device index (None on CPU), the install baseline, and the static memory."""

    def __init__(self, report: Report) -> None:
        self.cuda_index: int | None = None
        """The CUDA device the training uses (None: CPU, or CUDA not initialised yet)."""
        self.baseline_bytes = 0
        """Device allocated (CUDA) or the process's RSS (CPU) at install."""
        self._report = report
        self._accelerator: bool | None = None
        """Whether torch sees an accelerator (None: not asked yet)."""
        self._malloc_free: Callable[[], int] | None = None
        """Reads the bytes malloc holds free (None: not looked up yet)."""
        self._between_low: tuple[int, int | None] | None = None
        """The lowest memory in use read between steps since the config last changed, with the
        main process's resident memory at that reading on CPU (None: none read yet)."""

    def has_accelerator(self) -> bool:
        """Whether torch sees an accelerator, as its DataLoader asks before pinning memory."""
        if self._accelerator is None:
            torch = sys.modules.get("torch")
            if torch is None:
                return True  # no torch loaded: no loader of torch's to warn; nothing to refuse
            try:  # torch.accelerator since torch 2.6; before, CUDA was the one torch pinned for
                self._accelerator = bool(getattr(torch, "accelerator", torch.cuda).is_available())
            except Exception as exc:
                self._report(exc, "device")
                return True  # unknown: the loader decides, as without memtui
        return self._accelerator

    @property
    def kind(self) -> str:
        """``cuda`` or ``cpu``."""
        return "cpu" if self.cuda_index is None else "cuda"

    def refresh(self, model: Any) -> None:
        """Note which CUDA device the training thread uses (none until CUDA is initialised)."""
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                return
            index = _model_device(model)
            self.cuda_index = torch.cuda.current_device() if index is None else index
        except Exception as exc:
            self._report(exc, "device")

    def detect_late(self, model: Any) -> None:
        """From the sampler thread: notice CUDA initialised after install (model moved later)."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        index = _model_device(model)
        if index is None:
            count = max(1, torch.cuda.device_count())
            index = int(os.environ.get("LOCAL_RANK", "0") or 0) % count
        self.cuda_index = index

    def reset_peaks(self) -> None:
        """Reset torch's peak memory counters of the CUDA device (a no-op on CPU); a host-side
        call into the allocator, no device synchronisation. The memory read between steps is
        read afresh too: what stays between steps may differ under the new config."""
        self._between_low = None
        torch = sys.modules.get("torch")
        if self.cuda_index is None or torch is None:
            return
        try:
            torch.cuda.reset_peak_memory_stats(self.cuda_index)
        except Exception as exc:
            self._report(exc, "reset peaks")

    def note_baseline(self) -> None:
        """Take the install baseline: device allocated (CUDA) or the main process's RSS (CPU)."""
        try:
            torch = sys.modules.get("torch")
            if self.cuda_index is not None and torch is not None:
                self.baseline_bytes = int(torch.cuda.memory_allocated(self.cuda_index))
            else:
                self.baseline_bytes = int(psutil.Process().memory_info().rss)
        except Exception:
            self.baseline_bytes = 0

    def in_use(self) -> int | None:
        """Memory in use now: torch's allocated bytes on CUDA (a host-side counter, no device
        synchronisation), on CPU the main process's resident memory less what malloc holds free
        (as the CPU sampler counts it); None where it cannot be read."""
        reading = self.memory_now()
        return reading[0] if reading is not None else None

    def memory_now(self) -> tuple[int, int | None] | None:
        """Memory in use now (``in_use``) and, on CPU, the main process's resident memory it was
        taken from (in use plus what malloc holds free); None where it cannot be read."""
        try:
            torch = sys.modules.get("torch")
            if self.cuda_index is not None and torch is not None:
                return int(torch.cuda.memory_allocated(self.cuda_index)), None
            if self._malloc_free is None:
                self._malloc_free = _malloc_free_reader()
            resident = int(psutil.Process().memory_info().rss)
            return max(0, resident - self._malloc_free()), resident
        except Exception as exc:
            self._report(exc, "memory in use")
            return None

    def _between_steps(self) -> tuple[int, int | None] | None:
        """The lowest memory in use read between steps since the config last changed (with the
        resident memory of that reading on CPU): a boundary whose script still holds something
        of its own there (a copy made for its checkpoint) does not raise what stays across
        steps."""
        reading = self.memory_now()
        if reading is not None:
            low = self._between_low
            self._between_low = reading if low is None or reading[0] < low[0] else low
        return self._between_low

    def static(
        self, model: Any, optimizer: Any, between_steps: bool = False
    ) -> StaticMemory | None:
        """Parameters, gradients and optimizer state from the tensors (None without either);
        ``between_steps`` at a checkpoint boundary, where the gradients held are counted too."""
        if model is None and optimizer is None:
            return None
        try:
            between = self._between_steps() if between_steps else None
            return static_memory(
                model,
                optimizer,
                self.kind,
                self.baseline_bytes,
                between_steps=between_steps,
                in_use_bytes=between[0] if between is not None else None,
                resident_bytes=between[1] if between is not None else None,
            )
        except Exception as exc:
            self._report(exc, "static memory")
            return None
