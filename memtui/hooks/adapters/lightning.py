"""Lightning ``Trainer`` (``lightning.pytorch`` or ``pytorch_lightning``): ``hooks.install(trainer)``.

The change lands inside the running ``fit``, right after the checkpoint:

* the boundary is ``trainer.save_checkpoint`` (wrapped on the instance: memtui runs after the
  save, on every rank, where ``ModelCheckpoint`` and your own calls save);
* ``grad_accum`` is ``trainer.accumulate_grad_batches``, which Lightning's loop reads at every
  batch; memtui counts the next accumulation group from the boundary, so it is whole;
* ``batch_size``, ``num_workers`` and ``pin_memory`` belong to ``tuner.loader(factory)``: pass it
  to ``trainer.fit(model, train_dataloaders=loader)`` (or return it from ``train_dataloader``).
  Lightning prefetches one batch, so the new batch size shows one batch after the boundary;
  the data position is kept exactly either way;
* steps are Lightning's optimizer steps (``trainer.global_step``); the data wait is measured by
  the loader (or, for a loader memtui does not own, the gap between batches).

Several processes (``strategy="ddp"``, Lightning's own launcher or torchrun): install on every
rank before ``fit``, as usual. The rank and world size come from the Trainer (Lightning's
launcher sets no ``RANK``); Lightning starts ``torch.distributed`` inside ``fit``, so the ranks
start coordinating at the callback's ``setup`` (every rank, right after the process group is up,
before the first batch): they take rank 0's run id, exchange endpoints, and from then on every
boundary applies the same change at the same step on every rank.
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Any

from memtui.hooks.tuner import Tuner


class LightningAdapter:
    """memtui hooked into one Lightning ``Trainer``."""

    def __init__(self, trainer: Any, package: str, tuner_kwargs: dict[str, Any]) -> None:
        self.trainer = trainer
        self.staged = {"gradient_accumulation_steps": int(trainer.accumulate_grad_batches)}
        self.tuner = Tuner(self.staged, placement=_placement(trainer), **tuner_kwargs)
        self.tuner.adapter = self
        accum = self.tuner.values.get("grad_accum")
        if accum is not None:
            trainer.accumulate_grad_batches = int(accum)  # a tuned config resumed
        self.tuner.loader_options = {"shard": (trainer.global_rank, trainer.world_size)}
        self.offset = 0
        """Batches of the epoch before the last accumulation change (groups count from it)."""
        self.last_step = 0
        self.batch_end: float | None = None
        callback_base = importlib.import_module(f"{package}.callbacks").Callback
        trainer.callbacks.append(_make_callback(callback_base, self))
        self._wrap_save()

    def _wrap_save(self) -> None:
        """Make ``save_checkpoint`` the boundary: the save first, then memtui."""
        save = self.trainer.save_checkpoint

        @functools.wraps(save)
        def save_then_boundary(*args: Any, **kwargs: Any) -> Any:
            # ModelCheckpoint saves in on_train_batch_end before memtui's callback counts the
            # step: close it first, so the boundary is at the step Lightning saved
            self.count_steps(self.trainer)
            result = save(*args, **kwargs)
            self.boundary()
            return result

        self.trainer.save_checkpoint = save_then_boundary

    def boundary(self) -> None:
        """Apply the pending changes; a new accumulation counts its groups from here."""
        applied = self.tuner.checkpoint()
        if applied is None or "grad_accum" not in applied.changes:
            return
        try:
            loop = self.trainer.fit_loop.epoch_loop
            self.offset = int(loop.batch_progress.current.ready)
            self.trainer.accumulate_grad_batches = int(applied.changes["grad_accum"][1])
            if "_accumulated_batches_reached" not in vars(loop):
                trainer, adapter = self.trainer, self

                def accumulated_batches_reached() -> bool:
                    ready = loop.batch_progress.current.ready - adapter.offset
                    return bool(ready % trainer.accumulate_grad_batches == 0)

                loop._accumulated_batches_reached = accumulated_batches_reached
        except Exception as exc:
            self.tuner._report(exc, "lightning grad_accum")

    # ------------------------------------------------------------------ callback events

    def setup(self) -> None:
        """The process group exists now (every rank is here): start coordinating."""
        tuner = self.tuner
        if tuner.world_size > 1 and tuner.coordinator is None and not tuner.coordinate():
            tuner.control.disabled = tuner.control.disabled or (
                "torch.distributed is not initialised: ranks cannot be coordinated"
            )

    def train_start(self, trainer: Any, module: Any) -> None:
        """Start the clock; the tuner's steps follow ``global_step``."""
        self.tuner._step = self.last_step = int(trainer.global_step)
        self.tuner._t_last = time.perf_counter()
        self.tuner.model = module
        optimizers = getattr(trainer, "optimizers", None) or []
        self.tuner.optimizer = optimizers[0] if optimizers else None

    def batch_start(self) -> None:
        """For a loader memtui does not own: the wait is the gap since the last batch ended."""
        if self.batch_end is not None and not self.tuner._loaders:
            self.tuner._wait_acc += time.perf_counter() - self.batch_end
            self.tuner._micro_acc += 1

    def count_steps(self, trainer: Any) -> None:
        """One tuner step per optimizer step Lightning made since the last count."""
        step = int(trainer.global_step)
        if step > self.last_step:
            self.last_step = step
            self.tuner.step()

    def batch_end_event(self, trainer: Any) -> None:
        """After each batch: count the optimizer step, if the batch made one."""
        self.count_steps(trainer)
        self.batch_end = time.perf_counter()


def _make_callback(base: type, adapter: LightningAdapter) -> Any:
    """A ``Callback`` of the user's Lightning package that forwards to ``adapter``."""

    class MemtuiCallback(base):
        """memtui's timing and epoch bookkeeping inside Lightning's loop."""

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            adapter.setup()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            adapter.train_start(trainer, pl_module)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            adapter.offset = 0

        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            adapter.batch_start()

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            adapter.batch_end_event(trainer)

    return MemtuiCallback()


def _placement(trainer: Any) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) as the Trainer knows them before ``fit`` starts the group."""
    try:
        return int(trainer.global_rank), int(trainer.local_rank), int(trainer.world_size)
    except Exception:
        return None


def install(trainer: Any, **tuner_kwargs: Any) -> Tuner:
    """Hook memtui into a Lightning ``trainer`` and return its Tuner."""
    module = type(trainer).__module__
    package = "pytorch_lightning" if module.startswith("pytorch_lightning") else "lightning.pytorch"
    return LightningAdapter(trainer, package, tuner_kwargs).tuner
