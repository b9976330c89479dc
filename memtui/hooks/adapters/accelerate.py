"""Hugging Face Accelerate: ``hooks.install(accelerator, config=args, model=..., optimizer=...)``.

An Accelerate script owns its loop, so the change lands inside it, at the step after the save:

* the boundary is ``accelerator.save_state`` (wrapped on the instance: memtui runs right after
  the save, on every rank, as ``save_state`` itself must be called on every rank);
* ``grad_accum`` is ``accelerator.gradient_accumulation_steps`` (what ``accelerator.accumulate``
  reads at every micro-batch); memtui also resets ``accelerator.step`` so the next accumulation
  group starts whole, and writes the value into ``config`` when the script keeps it there;
* ``batch_size``, ``num_workers`` and ``pin_memory`` belong to ``tuner.loader(factory)``: the
  loader memtui builds from your DataLoader factory instead of ``accelerator.prepare(loader)``.
  Under several processes each rank takes its slice of one global batch (the position in the
  data is counted in global samples, the same on every rank), and batches are moved to
  ``accelerator.device``;
* optimizer steps are counted from the optimizer's post-step hook, which Accelerate only reaches
  when gradients are synchronised (``tuner.step()`` by hand works too).

How long the loop runs is the script's. A change of batch size or accumulation changes the
optimizer steps an epoch takes: a loop that runs a number of epochs then makes more or fewer
steps than an LR schedule sized from them expects (a OneCycleLR raises past its ``total_steps``;
prepared by the accelerator it stops stepping there, and the rest of the run keeps its last LR).
memtui warns at such a change; a loop bounded by optimizer steps (``tuner.step_count``) keeps
its schedule whole.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

from memtui.hooks.tuner import Tuner

log = logging.getLogger("memtui")


class AccelerateAdapter:
    """memtui hooked into one ``accelerate.Accelerator``."""

    def __init__(
        self,
        accelerator: Any,
        config: Any,
        knobs: Mapping[str, str] | None,
        optimizer: Any,
        tuner_kwargs: dict[str, Any],
    ) -> None:
        self.accelerator = accelerator
        self.staged: dict[str, Any] | None = None
        if config is None:
            self.staged = {"gradient_accumulation_steps": accelerator.gradient_accumulation_steps}
            config = self.staged
        base = getattr(optimizer, "optimizer", optimizer)
        self.tuner = Tuner(config, knobs=knobs, optimizer=base, **tuner_kwargs).start()
        self.tuner.adapter = self
        accum = self.tuner.store.value("grad_accum")
        if accum is not None and accum != accelerator.gradient_accumulation_steps:
            accelerator.gradient_accumulation_steps = int(accum)  # a tuned config resumed
        self.tuner.loader_options = {
            "shard": (accelerator.process_index, accelerator.num_processes),
            "place": self._placer(),
        }
        if base is not None:
            self.tuner.watch_optimizer(base)
        self._wrap_save_state()

    def _placer(self) -> Any:
        """Move batches to the accelerator's device (None on CPU: nothing to do)."""
        device = self.accelerator.device
        if getattr(device, "type", "cpu") == "cpu":
            return None
        from accelerate.utils import send_to_device

        return functools.partial(send_to_device, device=device, non_blocking=True)

    def _wrap_save_state(self) -> None:
        """Make ``save_state`` the boundary: the save first, then memtui, on every rank."""
        save_state = self.accelerator.save_state

        @functools.wraps(save_state)
        def save_state_then_boundary(*args: Any, **kwargs: Any) -> Any:
            result = save_state(*args, **kwargs)
            self.boundary()
            return result

        self.accelerator.save_state = save_state_then_boundary

    def boundary(self) -> None:
        """Apply the pending changes; the accumulation goes to the accelerator now."""
        applied = self.tuner.checkpoint()
        if applied is None:
            return
        if "grad_accum" in applied.changes or "batch_size" in applied.changes:
            self._warn_steps_per_epoch()
        if "grad_accum" not in applied.changes:
            return
        try:
            self.accelerator.gradient_accumulation_steps = int(applied.changes["grad_accum"].new)
            self.accelerator.step = 0  # the next micro-batch starts a whole accumulation group
        except Exception as exc:
            self.tuner.report(exc, "accelerate grad_accum")

    def _warn_steps_per_epoch(self) -> None:
        """Say that an epoch's optimizer steps changed, and what that does to a sized schedule."""
        sized = [
            f"{type(s.scheduler).__name__} total_steps={s.scheduler.total_steps}"
            for s in getattr(self.accelerator, "_schedulers", None) or []
            if hasattr(getattr(s, "scheduler", None), "total_steps")
        ]
        log.warning(
            "memtui: the optimizer steps per epoch changed: a loop that runs a number of epochs "
            "now makes more or fewer steps than an LR schedule sized from them expects%s; bound "
            "the loop by optimizer steps (tuner.step_count) to keep the schedule whole",
            f" ({', '.join(sized)})" if sized else "",
        )


def install(
    accelerator: Any,
    *,
    config: Any = None,
    knobs: Mapping[str, str] | None = None,
    optimizer: Any = None,
    **tuner_kwargs: Any,
) -> Tuner:
    """Hook memtui into ``accelerator`` and return its Tuner."""
    return AccelerateAdapter(accelerator, config, knobs, optimizer, tuner_kwargs).tuner
