"""Lightning ``Trainer`` (``lightning.pytorch`` or ``pytorch_lightning``): ``hooks.install(trainer)``.

The change lands inside the running ``fit``, right after the checkpoint:

* the boundary is ``trainer.save_checkpoint`` (wrapped on the instance: memtui runs after the
  save, on every rank, where ``ModelCheckpoint`` and your own calls save);
* ``grad_accum`` is ``trainer.accumulate_grad_batches``, which Lightning's loop reads at every
  batch; memtui counts the next accumulation group from the boundary, so it is whole;
* ``batch_size``, ``num_workers``, ``pin_memory`` and ``prefetch_factor`` follow the training
  loader: memtui's own ``tuner.loader(factory)`` (pass it to ``trainer.fit(model,
  train_dataloaders=loader)`` or return it from ``train_dataloader``), or else the script's own
  torch ``DataLoader`` (from ``train_dataloader()``, a DataModule or ``trainer.fit``), which memtui
  takes over when Lightning has set it up (its distributed sampler in place) and rebuilds from
  its own arguments (``memtui.hooks.rebuild``); ``trainer.train_dataloader`` is then memtui's
  loader. When Lightning sets the loader up again (``reload_dataloaders_every_n_epochs``, each
  trial of a ``BatchSizeFinder``), the knobs memtui has not set take that loader's values, as
  without memtui. A loader memtui cannot rebuild faithfully (a custom batch sampler, an
  ``IterableDataset``, a ``DataLoader`` subclass, several training loaders) keeps its own
  values, those knobs are not tunable, and the run says why (``memtui status``, ``memtui set``).
  Lightning prefetches one batch, so the new batch size shows one batch after the boundary;
  the data position is kept exactly either way. The position of a loader memtui took over is
  saved in the checkpoint under its own ``memtui`` key, not among Lightning's loader states, so
  the checkpoint restarts without memtui as well (from the epoch's start, as Lightning does);
* steps are Lightning's optimizer steps (``trainer.global_step``); the data wait and the samples
  are measured by the loader (or, for a loader memtui does not own, the gap between training
  batches, a validation pass left out, and ``batch_samples`` of each training batch):
  validation and sanity-check batches are never counted.

Lightning counts an epoch's batches once, when it sets the loader up (``num_training_batches``,
the data fetcher's length, ``val_check_batch``): after a batch-size change memtui sets them to
the batches the epoch really has at the new size, and to a whole epoch's from its end on, so the
epoch ends when memtui's loader does (a smaller batch would otherwise be cut off at the old
count), its last short accumulation group steps there, and the default validation at the
epoch's end stays there. The counts stay finite, as Lightning's own, so progress bars (Rich,
tqdm, your own) and callbacks read a real total; Lightning's bar is given the running epoch's
new total. A run restarted from a checkpoint in an epoch begun at another batch size gets that
epoch's real count too (the loader resumes after the samples it had delivered).

The audit log and the tuned config go to the Trainer's ``default_root_dir`` unless ``state_dir``
is given: ``hooks.install(trainer, resume=True)`` with ``trainer.fit(..., ckpt_path=...)``
restarts with the tuned knobs.

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

from memtui.core.knobs import DEFAULT_PREFETCH_FACTOR
from memtui.hooks.batches import batch_samples, missed_once
from memtui.hooks.knobstore import LOADER_KNOBS, loader_values
from memtui.hooks.loader import TunedLoader
from memtui.hooks.persist import ScriptDir
from memtui.hooks.rebuild import OWN_LOADER, rebuild_factory, why_not_rebuilt
from memtui.hooks.tracker import TAG, TrackerEvent, event_text, event_values
from memtui.hooks.tuner import Tuner

log = logging.getLogger("memtui")

CHECKPOINT_KEY = "memtui"
"""memtui's entry in a Lightning checkpoint: the position of the training loader it took over."""


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
        """When the last training batch ended, or the epoch or a validation pass within it did:
        the wait for the next batch of a loader memtui does not own runs from there."""
        self.missed = missed_once(self.tuner.report)
        self.planned: float | None = None
        """The optimizer steps Lightning estimated at the start (``estimated_stepping_batches``)."""
        self.counting = False
        """Whether memtui keeps Lightning's batch counts (a batch-size change made them wrong)."""
        self.in_epoch = False
        """From an epoch's first batch to its end (a change between epochs counts a whole one)."""
        self.recount = False
        """Count the epoch again at the next batch (a restart began it at another count)."""
        self.taken_over: TunedLoader | None = None
        """The script's own training loader, rebuilt by memtui (None: memtui's own, or none)."""
        self.saved_position: dict[str, int] | None = None
        """That loader's position in the checkpoint ``fit`` resumes from."""
        self.changed = {knob for knob, diff in self.tuner.resumed.items() if diff.new is not None}
        """The knobs memtui set in this run (resumed, applied, rolled back): the others follow
        the values of a loader Lightning sets up again."""
        callback_base = importlib.import_module(f"{package}.callbacks").Callback
        trainer.callbacks.append(_make_callback(callback_base, self))
        self._wrap_save()
        self._wrap_loader_setup()
        self.tuner.on_event(self.log_event)
        self.tuner.on_event(self.note_changed)

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

    def note_changed(self, event: TrackerEvent, step: int) -> None:
        """Count the knobs an applied change or a rollback set."""
        changes = getattr(event, "changes", None)
        if isinstance(changes, dict):
            self.changed.update(changes)

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

    def _wrap_loader_setup(self) -> None:
        """Take the training loader over each time Lightning sets it up: after its own processing
        (a distributed sampler), before it reads the checkpoint's loader states and counts."""
        loop = self.trainer.fit_loop
        load_states = getattr(loop, "_load_combined_loader_states", None)  # Lightning's
        if load_states is None:
            self._refuse_loader_knobs(
                "this Lightning version sets its training loader up where memtui cannot reach it; "
                f"to make them tunable, {OWN_LOADER.removeprefix('or ')}, passed to fit"
            )
            return

        @functools.wraps(load_states)
        def take_over_then_load() -> None:
            try:
                self._take_over_train_loader()
            except Exception as exc:  # the run goes on with its own loader
                self.tuner.report(exc, "lightning training loader")
            load_states()

        loop._load_combined_loader_states = take_over_then_load  # noqa: SLF001

    def _take_over_train_loader(self) -> None:
        """Put a ``TunedLoader`` rebuilt from the script's own training ``DataLoader`` in its place
        (or say why the loader knobs stay the loader's own)."""
        combined = self.trainer.fit_loop._combined_loader  # noqa: SLF001
        if combined is None:
            return
        loaders = list(combined.flattened)
        if any(isinstance(loader, TunedLoader) for loader in loaders):
            return  # memtui's own: ``tuner.loader(factory)``
        previous, self.taken_over = self.taken_over, None
        if previous is not None:  # Lightning reloaded it (``reload_dataloaders_every_n_epochs``)
            previous.close()
        if len(loaders) != 1:
            self._refuse_loader_knobs(
                f"Lightning trains on {len(loaders)} loaders at once; memtui rebuilds a single "
                "one; to make them tunable, train on one loader"
            )
            return
        own = loaders[0]
        why = why_not_rebuilt(own)
        if why:
            self._refuse_loader_knobs(why, own)
            return
        try:
            self._follow_own_values(own)
            loader = self.tuner.loader(rebuild_factory(own))
        except Exception as exc:  # torch refused the loader's own arguments: it stays the script's
            self.tuner.report(exc, "lightning training loader")
            self._refuse_loader_knobs(
                f"memtui could not rebuild the training DataLoader ({exc}); to make them "
                f"tunable, {OWN_LOADER.removeprefix('or ')}, passed to fit"
            )
            return
        loader.shard = (0, 1)  # Lightning's sampler (distributed under DDP) gives each rank its own
        limits = combined.limits
        if len(loader) != len(own):  # built at a tuned batch size resumed from the config
            try:
                limits = [self._train_limit(len(loader))]
            except Exception as exc:  # Lightning's own limit stands
                self.tuner.report(exc, "lightning batch count")
        combined.flattened = [loader]
        combined.limits = limits
        # its position goes in memtui's own entry of the checkpoint (``save_position``): among
        # Lightning's loader states, a restart without memtui would find a state for a loader
        # that has none and refuse the checkpoint
        combined._state_dicts = list  # noqa: SLF001
        self.taken_over = loader

    def _follow_own_values(self, own: Any) -> None:
        """The loader knobs memtui has not set take the values of the loader Lightning has set up
        again (a batch size finder's next trial, a reload at an epoch): the script's own, as
        without memtui."""
        store = self.tuner.store
        values = {
            "batch_size": own.batch_sampler.batch_size,
            "num_workers": own.num_workers,
            "pin_memory": own.pin_memory,
            "prefetch_factor": own.prefetch_factor or DEFAULT_PREFETCH_FACTOR,
        }
        follow = {
            knob: value
            for knob, value in values.items()
            if knob not in self.changed and store.value(knob) not in (None, value)
        }
        if follow:
            store.apply(follow, self.tuner.ledger.step)

    def _train_limit(self, length: int) -> int | float:
        """The batches Lightning trains of a loader of ``length`` (``limit_train_batches``)."""
        stages = importlib.import_module(f"{self.package}.trainer.states")
        connector = importlib.import_module(f"{self.package}.trainer.connectors.data_connector")
        parse = connector._parse_num_batches  # noqa: SLF001
        limit: int | float = parse(
            stages.RunningStage.TRAINING, length, self.trainer.limit_train_batches
        )
        return limit

    def _refuse_loader_knobs(self, why: str, own: Any = None) -> None:
        """Say why the loader knobs are not tunable, with the values of the script's loader
        ``own`` where it is known; name those that have a value (resumed from the tuned config,
        or taken before Lightning reloaded the loader) that nothing applies."""
        store = self.tuner.store
        held = [knob for knob in LOADER_KNOBS if store.value(knob) is not None]
        values = loader_values(own) if own is not None else {}
        for knob in LOADER_KNOBS:
            if knob not in held:
                store.refuse(knob, why, values.get(knob))
        if held:
            log.warning(
                "memtui: the training loader keeps its own %s (memtui's are not applied): %s",
                ", ".join(held),
                why,
            )

    def save_position(self, checkpoint: dict[str, Any]) -> None:
        """Save the position of the loader memtui took over in the checkpoint being written."""
        loader = self.taken_over
        if loader is not None:
            checkpoint[CHECKPOINT_KEY] = {"train_loader": loader.state_dict()}

    def load_position(self, checkpoint: dict[str, Any]) -> None:
        """Keep the position saved in the checkpoint ``fit`` resumes from, for the loader taken over
        (set up before or after the checkpoint is read, iterated after both)."""
        entry = checkpoint.get(CHECKPOINT_KEY)
        position = entry.get("train_loader") if isinstance(entry, dict) else None
        self.saved_position = dict(position) if isinstance(position, dict) else None

    def _resume_position(self) -> None:
        """At ``fit``'s start from a checkpoint: the loader taken over resumes where it was."""
        position, self.saved_position = self.saved_position, None
        loader = self.taken_over
        loop = self.trainer.fit_loop
        if loader is None or loader.resume_position is not None or not loop.restarting:
            return
        if position is not None:
            loader.load_state_dict(position)
            return
        trained = int(loop.epoch_loop.batch_progress.current.ready)
        if 0 < trained < loop.max_batches:  # Lightning warns so of a loader it cannot resume
            log.warning(
                "memtui: the checkpoint holds no position of the training loader (saved without "
                "memtui): its epoch starts again from its first sample, %d of its batches "
                "already trained",
                trained,
            )

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
        recounted = False
        if "batch_size" in changes:
            try:
                recounted = self._count_batches()
            except Exception as exc:
                self.tuner.report(exc, "lightning batch_size")
        if "grad_accum" in changes or "batch_size" in changes:
            try:
                self._keep_step_count()
            except Exception as exc:
                self.tuner.report(exc, "lightning step count")
        if recounted:
            try:
                self._show_count()
            except Exception as exc:
                self.tuner.report(exc, "lightning progress bar")

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

    def _counted_loader(self) -> TunedLoader | None:
        """memtui's loader, where memtui keeps Lightning's batch counts: the one loader trained on,
        whole (``limit_train_batches`` 1.0), its position kept exactly."""
        trainer = self.trainer
        limit = trainer.limit_train_batches
        if not (isinstance(limit, float) and limit == 1.0) or trainer.overfit_batches:
            return None  # a limit stays Lightning's count (an int is a count, even 1)
        loader = trainer.train_dataloader
        if not isinstance(loader, TunedLoader) or loader.mode != "exact":
            return None
        return loader

    def _batches_after(self, loader: TunedLoader, consumed: int) -> int:
        """The batches ``loader`` takes for its epoch's samples after the first ``consumed``, at
        the batch size it iterates next (as its batch sampler counts them)."""
        size = int(self.tuner.store.value("batch_size") or loader.batch_size or 1)
        size *= loader.shard[1]  # one global batch, each rank its slice
        left = max(loader.epoch_samples - consumed, 0)
        drop_last = bool(getattr(loader.dataloader.batch_sampler, "drop_last", False))
        return left // size if drop_last else math.ceil(left / size)

    def _count_batches(self) -> bool:
        """Give Lightning the batches the epoch really has at the loader's batch size; True if the
        running epoch's count changed."""
        # Lightning counts an epoch's batches once, when it sets the loader up
        # (``num_training_batches``, the data fetcher's length, which marks the last batch, and
        # ``val_check_batch``, where the end-of-epoch validation runs): after a batch-size change
        # that count would cut a smaller batch's epoch short, or end a larger one's without its
        # last batch (its short accumulation group unstepped, its validation skipped). They
        # become the batches the epoch has (those trained, then those the loader has left at
        # the new size), from the epoch's end on a whole epoch's, and stay finite counts, as
        # Lightning's own: progress bars and callbacks read them.
        loader = self._counted_loader()
        if loader is None:
            return False
        # Lightning's data fetcher; no public handle
        fetcher = getattr(self.trainer.fit_loop, "_data_fetcher", None)
        if self.in_epoch and fetcher is not None:
            stream = loader.epoch_stream
            consumed = stream.consumed if stream is not None else 0
            count = int(fetcher.fetched) + self._batches_after(loader, consumed)
            fetcher.length = count
            if fetcher.iterator is not None:
                fetcher.done = fetcher.fetched >= count
        else:  # between epochs: the next one is whole (the fetcher's reset gives it its length)
            count = self._batches_after(loader, 0)
        self.counting = True
        if fetcher is not None:
            self._fetch_whole_epochs(fetcher)
        return self._set_count(count) and self.in_epoch

    def _count_the_resumed_epoch(self) -> None:
        """At ``fit``'s start from a checkpoint: count the epoch it resumes, which may have begun at
        another batch size (the loader goes on after the samples it had delivered)."""
        loader = self._counted_loader()
        if loader is None:
            return
        loop = self.trainer.fit_loop
        states = getattr(loop, "_combined_loader_states_to_load", None)  # Lightning's
        if loop.restarting and states and len(states) == 1 and loader.resume_position is None:
            # Lightning hands the checkpoint's loader state over only when it sets the loader
            # up, which ``trainer.estimated_stepping_batches`` (in ``configure_optimizers``, the
            # usual place) did before the checkpoint was read: the loader would start the
            # epoch again while Lightning goes on from the checkpoint's batch
            loader.load_state_dict(states[0])
            states.clear()
        resume = loader.resume_position  # (epoch, samples) its load_state_dict took
        if resume is None:
            return  # a whole epoch starts: Lightning counted the loader as it is
        trained = int(loop.epoch_loop.batch_progress.current.ready)
        epoch, consumed = int(resume[0]), int(resume[1])
        if consumed >= loader.epoch_samples:
            # saved at its epoch's last batch: Lightning starts the next epoch (it tells the
            # end from the epoch's batches against its count), and so does the loader, instead
            # of the empty rest of the old one (where ``fit`` would stop); whole from its first
            # batch on
            loader.load_state_dict({"epoch": epoch + 1, "samples_in_epoch": 0})
            count, length = trained, self._batches_after(loader, 0)
        else:
            count = length = trained + self._batches_after(loader, consumed)
        if count == length == loop.max_batches:
            return  # Lightning's own count is right
        self.counting = True
        self.recount = count != length
        fetcher = getattr(loop, "_data_fetcher", None)  # Lightning's; no public handle
        if fetcher is not None:
            self._fetch_whole_epochs(fetcher)
            fetcher.length = length  # its count of fetched batches takes in the checkpoint's
        self._set_count(count)

    def _set_count(self, count: int) -> bool:
        """Make ``count`` the epoch's number of batches where Lightning reads it; True if it
        changed."""
        trainer = self.trainer
        changed = count != trainer.fit_loop.max_batches
        trainer.fit_loop.max_batches = count
        interval = trainer.val_check_interval
        if (
            isinstance(interval, float)
            and trainer.val_check_batch is not None  # None: validation by time
            and trainer.check_val_every_n_epoch is not None  # else a count across epochs
        ):
            trainer.val_check_batch = max(1, int(count * interval))  # as Lightning computes it
        return changed

    def _fetch_whole_epochs(self, fetcher: Any) -> None:
        """Make the data fetcher mark an epoch's last batch at memtui's count of a whole epoch
        (Lightning's length of the loader is the one it had before the next epoch rebuilds it)."""
        if "reset" in vars(fetcher):
            return
        reset = fetcher.reset

        def reset_to_the_count() -> None:
            reset()
            try:
                loader = self._counted_loader()
                if loader is not None and fetcher.length is not None:
                    fetcher.length = self._batches_after(loader, 0)
                    fetcher.done = fetcher.length == 0
            except Exception as exc:
                self.tuner.report(exc, "lightning epoch length")

        fetcher.reset = reset_to_the_count

    def _show_count(self) -> None:
        """Give Lightning's own progress bar (Rich or tqdm) the running epoch's new total: it reads
        the count when the epoch starts."""
        bar = self.trainer.progress_bar_callback
        if bar is None or not getattr(bar, "is_enabled", False):
            return
        progress = importlib.import_module(f"{self.package}.callbacks.progress")
        total = bar.total_train_batches
        if isinstance(bar, progress.RichProgressBar):
            if bar.progress is not None and bar.train_progress_bar_id is not None:
                bar.progress.update(bar.train_progress_bar_id, total=total)
        elif isinstance(bar, progress.TQDMProgressBar):
            train_bar = bar.train_progress_bar
            train_bar.total = total
            train_bar.refresh()

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
        try:
            self._resume_position()
            self._count_the_resumed_epoch()
        except Exception as exc:
            self.tuner.report(exc, "lightning batch count")

    def epoch_end(self) -> None:
        """After an epoch whose count memtui keeps: the next one is whole, at the new size."""
        self.in_epoch = False
        if self.counting:
            try:
                self._count_batches()
            except Exception as exc:
                self.tuner.report(exc, "lightning batch count")

    def batch_start(self, batch: Any) -> None:
        """For a loader memtui does not own: the wait is the gap since the last training batch
        ended (or the epoch began, or a validation pass ended), the samples those of ``batch``."""
        self.in_epoch = True
        if self.recount:  # the epoch a restart began at the old one's count, now begun
            self.recount = False
            try:
                self._count_batches()
            except Exception as exc:
                self.tuner.report(exc, "lightning batch count")
        if self.batch_end is not None and not self.tuner.loaders:
            waited = time.perf_counter() - self.batch_end
            samples = batch_samples(batch)
            if not samples:
                self.missed(batch)
            self.tuner.ledger.on_batch(waited, samples)

    def clock_from_now(self) -> None:
        """The wait for the next training batch starts now: an epoch starts, or a validation
        pass ended (its time is no wait for training data)."""
        self.batch_end = time.perf_counter()

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
            adapter.clock_from_now()

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            adapter.epoch_end()

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, *args: Any, **kwargs: Any
        ) -> None:
            adapter.batch_start(batch)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            adapter.clock_from_now()

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            adapter.batch_end_event(trainer)

        def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
            try:
                adapter.save_position(checkpoint)
            except Exception as exc:  # the checkpoint is saved without it
                adapter.tuner.report(exc, "lightning loader position")

        def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
            try:
                adapter.load_position(checkpoint)
            except Exception as exc:
                adapter.tuner.report(exc, "lightning loader position")

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            loader = adapter.taken_over
            if loader is not None:  # its workers end with ``fit``, as Lightning ends its own's
                try:
                    loader.close()
                except Exception as exc:
                    adapter.tuner.report(exc, "lightning loader workers")

    return MemtuiCallback()


def _placement(trainer: Any) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) as the Trainer knows them before ``fit`` starts the group."""
    try:
        return int(trainer.global_rank), int(trainer.local_rank), int(trainer.world_size)
    except Exception:
        return None


def install(trainer: Any, **tuner_kwargs: Any) -> Tuner:
    """Hook memtui into a Lightning ``trainer`` and return its Tuner."""
    # the audit log and the tuned config go beside ``lightning_logs/`` unless told otherwise,
    # where the restarted script's ``resume=True`` looks (a remote root keeps memtui's default)
    if tuner_kwargs.get("state_dir") is None:
        root = str(getattr(trainer, "default_root_dir", "") or "")
        if root and "://" not in root:
            tuner_kwargs["state_dir"] = ScriptDir(root)
    module = type(trainer).__module__
    package = "pytorch_lightning" if module.startswith("pytorch_lightning") else "lightning.pytorch"
    return LightningAdapter(trainer, package, tuner_kwargs).tuner
