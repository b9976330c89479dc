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

Lightning counts an epoch's batches when it starts (``num_training_batches``): after a
batch-size change every epoch ends when memtui's loader does (a smaller batch would otherwise be
cut off at the old count), its last short accumulation group steps there, and the default
validation at the epoch's end stays there.

A change of batch size or accumulation changes the number of optimizer steps an epoch takes. A
run bounded by epochs with a step-interval LR scheduler (typically sized from
``trainer.estimated_stepping_batches``, as a OneCycleLR) keeps the step count Lightning estimated
at the start: the run ends at that step, however many epochs it takes (more steps would make a
OneCycleLR raise, fewer would end the run inside its schedule). Without a step-interval scheduler
the run keeps its epochs.

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
import logging
import math
import time
from typing import Any

from memtui.hooks.tracker import TAG, TrackerEvent, event_text, event_values
from memtui.hooks.tuner import Tuner

log = logging.getLogger("memtui")


class LightningAdapter:
    """memtui hooked into one Lightning ``Trainer``."""

    def __init__(self, trainer: Any, package: str, tuner_kwargs: dict[str, Any]) -> None:
        self.trainer = trainer
        self.package = package
        self.staged = {"gradient_accumulation_steps": int(trainer.accumulate_grad_batches)}
        self.tuner = Tuner(self.staged, placement=_placement(trainer), **tuner_kwargs).start()
        self.tuner.adapter = self
        accum = self.tuner.store.value("grad_accum")
        if accum is not None:
            trainer.accumulate_grad_batches = int(accum)  # a tuned config resumed
        self.tuner.loader_options = {"shard": (trainer.global_rank, trainer.world_size)}
        self.offset = 0
        """Batches of the epoch before the last accumulation change (groups count from it)."""
        self.last_step = 0
        self.batch_end: float | None = None
        self.planned: float | None = None
        """The optimizer steps Lightning estimated at the start (``estimated_stepping_batches``)."""
        callback_base = importlib.import_module(f"{package}.callbacks").Callback
        trainer.callbacks.append(_make_callback(callback_base, self))
        self._wrap_save()
        self.tuner.on_event(self.log_event)

    def log_event(self, event: TrackerEvent, step: int) -> None:
        """Log a memtui event to every logger of the Trainer at ``step``, then save it: each knob's
        new value with ``log_metrics``, the line as text where the logger takes text."""
        values, text = event_values(event), event_text(event)
        for logger in self.trainer.loggers:
            if values:
                logger.log_metrics(values, step)
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            if callable(add_text):
                add_text(TAG, text, step)
            logger.save()  # flushed: an out-of-memory error that is not rolled back ends the run

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
        if applied is None:
            return
        changes = applied.changes
        if "grad_accum" in changes:
            try:
                self._accumulate(int(changes["grad_accum"].new))
            except Exception as exc:
                self.tuner.report(exc, "lightning grad_accum")
        if "batch_size" in changes:
            try:
                self._epoch_ends_with_the_loader()
            except Exception as exc:
                self.tuner.report(exc, "lightning batch_size")
        if "grad_accum" in changes or "batch_size" in changes:
            try:
                self._keep_step_count()
            except Exception as exc:
                self.tuner.report(exc, "lightning step count")

    def _accumulate(self, accum: int) -> None:
        """Accumulate ``accum`` batches from the next one on, in whole groups."""
        loop = self.trainer.fit_loop.epoch_loop
        self.offset = int(loop.batch_progress.current.ready)
        self.trainer.accumulate_grad_batches = accum
        if "_accumulated_batches_reached" not in vars(loop):
            trainer, adapter = self.trainer, self

            def accumulated_batches_reached() -> bool:
                ready = loop.batch_progress.current.ready - adapter.offset
                return bool(ready % trainer.accumulate_grad_batches == 0)

            # the epoch loop's accumulation test; no public hook
            loop._accumulated_batches_reached = accumulated_batches_reached  # noqa: SLF001

    def _epoch_ends_with_the_loader(self) -> None:
        """After a batch-size change every epoch ends when the loader does, not at the old count.

        Lightning counts an epoch's batches when it starts (``num_training_batches``, and the
        data fetcher's length, which marks the last batch): with a smaller batch that count
        would cut the epoch short. memtui drops the count, as for a loader with no length: the
        fetcher looks one batch ahead to tell the last one, where the epoch's last (short)
        accumulation group steps and the whole-epoch validation runs. A ``limit_train_batches``
        stays a count of batches.
        """
        trainer = self.trainer
        limit = trainer.limit_train_batches
        if not self.tuner.loaders or not (isinstance(limit, float) and limit == 1.0):
            return  # no loader of memtui's, or a limit (an int is a count, even 1)
        loop = trainer.fit_loop
        loop.max_batches = math.inf
        interval = trainer.val_check_interval
        if isinstance(interval, float) and interval == 1.0 and trainer.val_check_batch is not None:
            trainer.val_check_batch = math.inf
        fetcher = getattr(loop, "_data_fetcher", None)
        if fetcher is None or not hasattr(fetcher, "batches") or "reset" in vars(fetcher):
            return  # not the look-ahead fetcher (training_step takes the iterator), or done
        reset = fetcher.reset

        def reset_without_length() -> None:
            reset()
            fetcher.length = None  # every epoch: its end is the loader's

        fetcher.reset = reset_without_length
        if fetcher.length is None or fetcher.done or fetcher.iterator is None or fetcher.batches:
            return
        fetcher.length = None  # this epoch: look one batch ahead from now on
        # Lightning's fetcher; no public way to drop its length
        fetch = importlib.import_module(f"{self.package}.loops.fetchers")._DataFetcher.__next__  # noqa: SLF001
        try:
            fetcher.batches.append(fetch(fetcher))
        except StopIteration:
            fetcher.done = True

    def _keep_step_count(self) -> None:
        """An epoch-bounded run with a step-interval LR scheduler ends at its estimated step."""
        trainer = self.trainer
        planned = self.planned
        if planned is None or not math.isfinite(planned):
            return
        configs = getattr(trainer, "lr_scheduler_configs", None) or []
        if not any(getattr(config, "interval", "") == "step" for config in configs):
            return
        loop = trainer.fit_loop
        if loop.epoch_loop.max_steps == planned and loop.max_epochs == -1:
            return
        epochs = loop.max_epochs
        loop.epoch_loop.max_steps = int(planned)
        loop.max_epochs = -1
        log.warning(
            "memtui: the steps per epoch changed; the LR schedule steps per optimizer step and "
            "Lightning estimated %d steps at the start: the run ends at step %d (max_epochs %s "
            "lifted)",
            planned,
            planned,
            epochs,
        )

    # ------------------------------------------------------------------ callback events

    def setup(self) -> None:
        """The process group exists now (every rank is here): start coordinating."""
        tuner = self.tuner
        uncoordinated = tuner.world_size > 1 and tuner.coordinator is None
        if uncoordinated and not tuner.coordinate() and not tuner.control.disabled:
            tuner.control.disable(
                "torch.distributed is not initialised: ranks cannot be coordinated"
            )

    def train_start(self, trainer: Any, module: Any) -> None:
        """Start the clock; the tuner's steps follow ``global_step``."""
        self.last_step = int(trainer.global_step)
        self.tuner.ledger.resume_at(self.last_step)
        self.tuner.model = module
        optimizers = getattr(trainer, "optimizers", None) or []
        self.tuner.optimizer = optimizers[0] if optimizers else None
        for optimizer in optimizers:  # their LR follows a change of the effective batch
            self.tuner.lr.watch_optimizer(optimizer)
        for config in getattr(trainer, "lr_scheduler_configs", None) or []:
            self.tuner.watch_scheduler(getattr(config, "scheduler", None))
        if self.planned is None:
            try:
                self.planned = float(trainer.estimated_stepping_batches)
            except Exception as exc:
                self.tuner.report(exc, "lightning estimated steps")

    def batch_start(self) -> None:
        """For a loader memtui does not own: the wait is the gap since the last batch ended."""
        if self.batch_end is not None and not self.tuner.loaders:
            self.tuner.ledger.on_batch(time.perf_counter() - self.batch_end, 0)

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
