"""Hugging Face ``transformers.Trainer``: one ``hooks.install(trainer)`` line before ``train()``.

What it hooks: a ``TrainerCallback`` (step timing at ``on_step_end``, the checkpoint boundary at
``on_save``, right after the Trainer's own save, on every rank), the Trainer's
``get_batch_samples`` (the data wait of each optimizer step and its samples, each micro-batch's
rows counted by ``batch_samples``: evaluation batches are not drawn there), and ``train`` itself.

The Trainer reads its batch size, accumulation and loader settings once, when ``train()``
builds its loop (the loader, ``num_update_steps_per_epoch`` and the accumulation grouping), so
a change cannot land inside that loop. An applied change instead stops the loop at the
checkpoint just saved and ``train`` resumes in-process from it with the new ``TrainingArguments``:
the Trainer's own resume restores the global step, the optimizer, the LR scheduler, the RNG
states and the callbacks' state. memtui keeps what the Trainer's resume would get wrong with new
settings: ``max_steps`` stays the one computed at the start (so the LR schedule is the same),
and the position in the data is kept in samples (the Trainer counts it in batches of the new
size): memtui's sampler replays the epoch's order and leaves out exactly the samples already
consumed, and the resumed epoch's loop is sized to the samples it has left.

A restart (``train(resume_from_checkpoint=...)`` in a new process) meets the same arithmetic: the
Trainer places it at ``global_step // steps per epoch`` in steps of the config it restarts with,
while the epochs before ran at others. So once memtui has changed the run (a change applied, or
a tuned config or a place resumed), every checkpoint the Trainer saves also gets memtui's place,
``memtui_state.json`` (``tuner.state_dict()``: the step and the tuned config, with the epoch,
the samples consumed in it over all ranks and the run's ``max_steps``), written by the processes
that write ``trainer_state.json``; a run memtui never changed saves the Trainer's files alone,
byte for byte. A ``train`` that resumes a checkpoint holding that file starts from its tuned
config (``tuner.load_state_dict``) and at its place, as the in-process resume does; one without
it resumes as the Trainer does on its own.

Under torchrun or ``accelerate launch``, ``TrainingArguments`` starts ``torch.distributed``, so it
is up at install and the ranks coordinate from the start: the change lands at the same save on
every rank and every rank resumes from that checkpoint at the same global step.

The resume needs the checkpoint's optimizer and LR scheduler state (the Trainer's own resume
silently starts both afresh when their files are missing). With ``save_only_model=True`` (or
``save_strategy="no"``: no save, no boundary) changes are refused from the start, with the
reason; a checkpoint found without that state at the boundary (deleted or pruned by hand) gets
the pending changes refused there. The end of the stopped ``train`` is not the end of the run:
``load_best_model_at_end`` and the ``save_total_limit=1`` clean-up (which deletes every
checkpoint but the best, the one to resume from included) wait for the run's real end.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from transformers import TrainerCallback

from memtui.hooks.batches import batch_samples, missed_once
from memtui.hooks.persist import ScriptDir
from memtui.hooks.tracker import TAG, TrackerEvent, event_text, event_values
from memtui.hooks.tuner import Tuner
from memtui.storage import ownfiles

log = logging.getLogger("memtui")

RESUME_STATE = ("optimizer", "scheduler.pt")
"""What a checkpoint needs to resume from besides the model and ``trainer_state.json``: a name
with ``optimizer`` in it (``optimizer.pt``/``.bin``, FSDP's ``optimizer_0``) and the scheduler."""

HF_KNOBS = {
    "batch_size": "per_device_train_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "num_workers": "dataloader_num_workers",
    "pin_memory": "dataloader_pin_memory",
    "prefetch_factor": "dataloader_prefetch_factor",
}
"""memtui knob to the ``TrainingArguments`` field it sets."""

TORCH_PREFETCH = 2
"""torch's ``prefetch_factor`` when a loader with workers is given none (the Trainer's None)."""

PLACE_FILE = "memtui_state.json"
"""memtui's place in a checkpoint the Trainer saved after memtui changed the run."""

PLACE_KEY = "trainer"
"""The section of the place file that says where the Trainer's loop was in the data."""


def staged_knobs(args: Any) -> dict[str, Any]:
    """The knobs as memtui holds them, read from the ``TrainingArguments`` (the Trainer's
    prefetch factor None is torch's default: a number memtui can change)."""
    staged = {name: getattr(args, name) for name in HF_KNOBS.values()}
    if staged["dataloader_prefetch_factor"] is None:
        staged["dataloader_prefetch_factor"] = TORCH_PREFETCH
    return staged


def set_args(args: Any, staged: dict[str, Any]) -> None:
    """Write the knobs into the ``TrainingArguments`` (a prefetch factor only with workers: the
    Trainer hands it to the DataLoader, which refuses one without workers)."""
    for name, value in staged.items():
        if name == "dataloader_prefetch_factor" and not staged["dataloader_num_workers"]:
            value = None
        setattr(args, name, value)


def place_in_epoch(epoch: int, consumed: int, size: int | None) -> tuple[int, int]:
    """(epoch, samples consumed in it), an epoch consumed whole being the next one's start."""
    if size is not None and size > 0 and consumed >= size:
        return epoch + 1, 0
    return epoch, max(0, consumed)


def whole_groups(consumed: int, per_batch: int, accumulation: int) -> tuple[int, int]:
    """Of ``consumed`` samples, those the resumed loop skips as whole optimizer steps of the
    config it resumes with (``per_batch`` samples a micro-batch over all ranks, ``accumulation``
    of them a step), and the micro-batches that is (each rank's ``skip_first_batches``); the
    samples between are left out by memtui's sampler."""
    group = max(1, per_batch * accumulation)
    kept = (consumed // group) * group
    return kept, kept // max(1, per_batch)


def epoch_of(epoch: int, consumed: int, size: int) -> float:
    """The Trainer's ``state.epoch`` (epochs done, fractional) after ``consumed`` samples of
    ``epoch``, of ``size`` each."""
    return epoch + min(max(consumed, 0), size) / size if size > 0 else float(epoch)


class EpochOrderSampler:
    """The training sampler: a seeded order per epoch that a resume can continue mid-epoch.

    It stands in for the Trainer's ``RandomSampler`` (or ``SequentialSampler``): the order of
    epoch ``e`` is a permutation seeded with ``seed + e`` (identical on every rank and after a
    restart). For the epoch a resume lands in, ``cut = (epoch, kept, consumed)`` yields the
    first ``kept`` indices (the Trainer skips them as whole batches of the new size), then the
    order from ``consumed`` on: the ``consumed - kept`` samples between are not delivered again.
    """

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        self.size = size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cut: tuple[int, int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration yields."""
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        """The full order of ``epoch``."""
        import torch

        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        if self.cut is not None and self.cut[0] == self.epoch:
            _, kept, consumed = self.cut
            order = order[:kept] + order[consumed:]
        return iter(order)

    def __len__(self) -> int:
        """The samples the next iteration yields (fewer in the epoch a resume cuts)."""
        if self.cut is not None and self.cut[0] == self.epoch:
            _, kept, consumed = self.cut
            return kept + max(0, self.size - consumed)
        return self.size


class MemtuiCallback(TrainerCallback):
    """The Trainer's side of memtui: timing, the boundary at each save, and restart requests."""

    def __init__(self, adapter: HFAdapter) -> None:
        self.adapter = adapter

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the step clock; the tuner's step count follows the Trainer's global step."""
        self.adapter.train_begin(state)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Count epochs and reset the samples consumed in the epoch."""
        self.adapter.epoch_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """One optimizer step is done (in an epoch memtui cut, the epoch counted in samples)."""
        adapter = self.adapter
        adapter.tuner.step()
        if adapter.cut_epoch is not None:
            adapter.true_epoch(state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The boundary, right after the Trainer saved: apply, and stop to resume if needed."""
        self.adapter.boundary(state, control)


class HFAdapter:
    """memtui hooked into one ``transformers.Trainer``."""

    def __init__(self, trainer: Any, tuner_kwargs: dict[str, Any]) -> None:
        self.trainer = trainer
        args = trainer.args
        self.staged: dict[str, Any] = staged_knobs(args)
        """The knobs as memtui sees them; written at a boundary, copied into the args on resume."""
        self.world = max(1, int(getattr(args, "world_size", 1) or 1))
        self.user_optimizer = trainer.optimizer is not None
        self.max_steps: int | None = None
        self.epoch = -1
        self.consumed = 0
        """Samples (over all ranks) of the current epoch delivered to the loop."""
        self.resume_at: tuple[int, int] | None = None
        """(epoch, samples consumed in it) for the next resumed ``train`` call."""
        self.start_place: tuple[int, int] | None = None
        """(epoch, samples consumed in it) the loop of the running ``train`` call starts from:
        memtui's resume place, or the Trainer's own where it resumes a checkpoint without one."""
        self.cut_epoch: tuple[int, int] | None = None
        """(epoch, its samples) of the resumed epoch memtui's sampler cut: the Trainer's
        fractional epoch, counted in batches of that shorter epoch, is replaced in samples."""
        self.resumed_step: int | None = None
        """The global step of the checkpoint a new process resumes from memtui's place."""
        self.place_size: int | None = None
        """The samples of an epoch where that place was saved (None: not said)."""
        self.keeps_place = False
        """Whether each checkpoint gets memtui's place: once memtui changed the run (a change
        applied, a tuned config or a place resumed), the Trainer's own restart arithmetic (the
        global step in steps of the config it restarts with) no longer finds it."""
        self.restart: tuple[str, int, int] | None = None
        """(checkpoint directory, epoch, consumed): set by a boundary that changed something."""
        self.sampler: EpochOrderSampler | None = None
        self.restarts = 0
        self.lr_unsaved = 1.0
        """The LR factor applied at the boundary the loop resumes from: the checkpoint saved
        there lacks it, so the optimizer and scheduler loaded from it get it again."""
        """In-process resumes done to apply changes."""
        self.refusal = ""
        """Why the boundary now running refuses the pending changes (rank 0); empty: it may apply."""
        self.suspended: dict[str, Any] = {}
        """End-of-``train`` settings set aside while a stopped ``train`` is not the run's end."""
        self.tuner = Tuner(self.staged, model=trainer.model, **tuner_kwargs).start()
        self.tuner.adapter = self
        self.keeps_place = bool(self.tuner.resumed)
        self._refuse_when_told()
        control, refusal = self.tuner.control, cannot_resume(args)
        if refusal and not control.disabled:
            control.disable(refusal)
        set_args(args, self.staged)  # a tuned config loaded by resume=True
        # transformers keeps the micro-batch here; no public setter
        trainer._train_batch_size = args.train_batch_size  # noqa: SLF001
        self.callback = MemtuiCallback(self)
        trainer.add_callback(self.callback)
        self._wrap()
        self.tuner.on_event(self.log_event)

    def log_event(self, event: TrackerEvent, step: int) -> None:
        """Log a memtui event with ``trainer.log`` (every ``report_to`` gets it at the Trainer's
        global step, the save it landed at): each knob's new value and the line as text."""
        self.trainer.log({**event_values(event), TAG: event_text(event)})

    def _refuse_when_told(self) -> None:
        """Make the boundary's taking of the pending changes refuse them while ``refusal`` says so.

        In the same step as the taking, so a change queued meanwhile is not applied in their place.
        """
        control = self.tuner.control
        take_pending = control.take_pending
        adapter = self

        def take_unless_refused() -> list[Any]:
            taken = take_pending()
            if taken and adapter.refusal:
                control.record_rejected(taken, adapter.refusal, adapter.tuner.step_count)
                return []
            return taken

        control.take_pending = take_unless_refused  # type: ignore[method-assign]

    # ------------------------------------------------------------------ the Trainer's methods

    def _wrap(self) -> None:
        """Wrap the Trainer's methods on the instance (the class is left alone)."""
        trainer = self.trainer
        train = trainer.train
        get_batch_samples = trainer.get_batch_samples
        # the Trainer's own seams for its sampler, state and epoch loop; no public hook
        get_sampler = trainer._get_train_sampler  # noqa: SLF001
        # the Trainer's own seams for its sampler, state and epoch loop; no public hook
        init_state = trainer._init_training_state  # noqa: SLF001
        initial_values = trainer.set_initial_training_values
        # the Trainer's own seams for its sampler, state and epoch loop; no public hook
        run_epoch_of_trainer = trainer._run_epoch  # noqa: SLF001
        tuner = self.tuner
        perf = time.perf_counter
        adapter = self

        missed = missed_once(tuner.report)

        def timed_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            t0 = perf()
            batches, items = get_batch_samples(epoch_iterator, num_batches, device)
            waited = perf() - t0
            count = len(batches)
            size = adapter.staged["per_device_train_batch_size"]
            samples = 0
            for batch in batches:  # each micro-batch's rows: an epoch's last one may be short
                rows = batch_samples(batch)
                if not rows:
                    missed(batch)
                samples += rows
            tuner.ledger.on_batch(waited, samples, micro=count)
            adapter.consumed += count * size * adapter.world
            return batches, items

        def sampler(dataset: Any = None) -> Any:
            base = get_sampler(dataset)
            return adapter._own_sampler(base)

        def init_training_state(*a: Any, **kw: Any) -> tuple[int, int]:
            epochs_trained, skip = init_state(*a, **kw)
            return adapter._resume_position(epochs_trained, skip)

        def set_initial_training_values(*a: Any, **kw: Any) -> tuple[Any, ...]:
            values = list(initial_values(*a, **kw))
            if adapter.resume_at is not None:
                # the resumed epoch is partial: leave the loop room for every step still to run
                epoch = adapter.resume_at[0]
                per_epoch = max(1, int(values[1]))
                done = adapter.resumed_step
                if done is None:
                    done = int(trainer.state.global_step or 0)
                left = max(0, int(values[6]) - done)
                values[0] = max(int(values[0]), epoch + 2 + math.ceil(left / per_epoch))
            return tuple(values)

        def run_epoch(*a: Any, **kw: Any) -> Any:
            own = adapter.sampler
            cut = own.cut if own is not None else None
            resumed = cut is not None and kw.get("epoch") == cut[0] and "train_dataloader" in kw
            if own is not None and cut is not None and resumed:
                # the resumed epoch is shorter than the one the loop was sized for: without
                # this the loop waits for batches that never come and the epoch's last optimizer
                # step runs into the next epoch
                own.set_epoch(cut[0])
                steps = len(kw["train_dataloader"])
                kw["steps_in_epoch"] = steps
                kw["num_update_steps_per_epoch"] = max(
                    1, math.ceil(steps / trainer.args.gradient_accumulation_steps)
                )
            return run_epoch_of_trainer(*a, **kw)

        def train_with_memtui(*a: Any, **kw: Any) -> Any:
            adapter._restore_place(a[0] if a else kw.get("resume_from_checkpoint"))
            output = train(*a, **kw)
            while adapter.restart is not None:
                checkpoint, epoch, consumed = adapter.restart
                adapter.restart = None
                adapter._prepare_resume(epoch, consumed)
                kw.pop("resume_from_checkpoint", None)
                rest = a[1:] if a else ()
                output = train(checkpoint, *rest, **kw)
            adapter.resume_at = adapter.resumed_step = adapter.place_size = None
            return output

        trainer.get_batch_samples = timed_batch_samples
        # the Trainer's own seams for its sampler, state and epoch loop; no public hook
        trainer._get_train_sampler = sampler  # noqa: SLF001
        # the Trainer's own seams for its sampler, state and epoch loop; no public hook
        trainer._init_training_state = init_training_state  # noqa: SLF001
        trainer.set_initial_training_values = set_initial_training_values
        # the Trainer's own seams for its sampler, state and epoch loop; no public hook
        trainer._run_epoch = run_epoch  # noqa: SLF001
        trainer.train = train_with_memtui

    def _own_sampler(self, base: Any) -> Any:
        """Replace a random or sequential sampler with the resumable one (others stay)."""
        from torch.utils.data import RandomSampler, SequentialSampler

        if type(base) not in (RandomSampler, SequentialSampler):
            return base
        if self.sampler is None or self.sampler.size != len(base):
            args = self.trainer.args
            seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
            self.sampler = EpochOrderSampler(len(base), type(base) is RandomSampler, int(seed))
        return self.sampler

    def _resume_position(self, epochs_trained: int, skip: int) -> tuple[int, int]:
        """Where a resumed loop starts: memtui's (epoch, whole batches to skip), else the Trainer's."""
        args = self.trainer.args
        per_batch = args.per_device_train_batch_size * self.world
        self.cut_epoch = None
        if self.resume_at is not None and self._place_fits():
            epoch, consumed = self.resume_at
            if self.resumed_step is not None and getattr(args, "ignore_data_skip", False):
                consumed = 0  # told not to skip data: the epoch from its start, as the Trainer does
            kept, batches = whole_groups(consumed, per_batch, args.gradient_accumulation_steps)
            if self.sampler is not None:
                self.sampler.cut = (epoch, kept, consumed)
                if kept != consumed:
                    self.cut_epoch = (epoch, self.sampler.size)
            elif kept != consumed:
                log.warning(
                    "memtui: the Trainer's sampler is not memtui's; the resumed epoch skips %d "
                    "samples, not %d",
                    kept,
                    consumed,
                )
            self.start_place = (epoch, consumed)
            return epoch, batches
        self.start_place = (epochs_trained, skip * per_batch) if epochs_trained or skip else None
        return epochs_trained, skip

    def _place_fits(self) -> bool:
        """Whether memtui's place fits the data this loop iterates (a restart's data set may not
        be the one the place was counted in: the Trainer's own place then stands, said)."""
        size = self.sampler.size if self.sampler is not None else None
        if self.place_size is None or size is None or size == self.place_size:
            return True
        log.warning(
            "memtui: the checkpoint's place was counted in epochs of %d samples and this run's "
            "have %d: the Trainer's own resume stands (its global step in steps of this config)",
            self.place_size,
            size,
        )
        return False

    def true_epoch(self, state: Any) -> None:
        """In the epoch memtui's sampler cut, make ``state.epoch`` its samples consumed."""
        cut = self.cut_epoch
        if cut is not None and cut[0] == self.epoch:
            state.epoch = epoch_of(self.epoch, self.consumed, cut[1])

    # ------------------------------------------------------------------ a restart's place

    def _restore_place(self, resume_from: Any) -> None:
        """A ``train`` resuming a checkpoint: memtui's place and tuned config from its file, if
        it has one (else the Trainer's own resume stands, and where the tuned config memtui
        resumed takes another number of samples a step than the script's, that is said)."""
        if resume_from is None or resume_from is False:
            return
        try:
            checkpoint = self._checkpoint_of(resume_from)
            if checkpoint is None:
                return
            path = Path(checkpoint) / PLACE_FILE
            if not path.exists():
                self._say_placed_by_the_trainer(checkpoint)
                return
            fd = ownfiles.open_read(path)
            with os.fdopen(fd, "rb") as handle:
                state = msgspec.json.decode(handle.read())
            place = state.get(PLACE_KEY) if isinstance(state, dict) else None
            if not isinstance(place, Mapping):
                raise ValueError(f"{path} holds no place of the Trainer's loop")
            epoch, consumed = int(place["epoch"]), int(place["samples_in_epoch"])
            size = place.get("samples_per_epoch")
            self.place_size = int(size) if isinstance(size, int) and size > 0 else None
            self.tuner.load_state_dict(state)
            self._resume_max_steps(place)
            args = self.trainer.args
            set_args(args, self.staged)
            # transformers keeps the micro-batch here; no public setter
            self.trainer._train_batch_size = args.train_batch_size  # noqa: SLF001
            self.resume_at = place_in_epoch(epoch, consumed, self.place_size)
            self.resumed_step = int(state.get("step", 0))
            self.keeps_place = True
            log.info(
                "memtui: resuming %s at sample %d of epoch %d (memtui's place, over all ranks), "
                "step %d",
                os.path.basename(os.path.normpath(checkpoint)),
                self.resume_at[1],
                self.resume_at[0],
                self.resumed_step,
            )
        except Exception as exc:  # the Trainer's own resume goes on
            self.resume_at = self.resumed_step = self.place_size = None
            self.tuner.report(exc, "restoring memtui's place from the checkpoint")

    def _checkpoint_of(self, resume_from: Any) -> str | None:
        """The checkpoint directory ``train(resume_from_checkpoint=...)`` resumes (``True``: the
        last one in the output directory, as the Trainer picks it; None: none)."""
        if resume_from is True:
            from transformers.trainer_utils import get_last_checkpoint

            output_dir = self.trainer.args.output_dir
            found = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
            return str(found) if found else None
        if isinstance(resume_from, (str, os.PathLike)):
            return os.fspath(resume_from)
        return None

    def _resume_max_steps(self, place: Mapping[str, Any]) -> None:
        """An epoch-bounded run keeps the ``max_steps`` it computed at its start (the LR schedule
        was sized on it; the tuned config's steps per epoch would size another)."""
        args = self.trainer.args
        saved, epochs = place.get("max_steps"), place.get("num_train_epochs")
        same_epochs = isinstance(epochs, (int, float)) and epochs == args.num_train_epochs
        if args.max_steps <= 0 and isinstance(saved, int) and saved > 0 and same_epochs:
            args.max_steps = saved

    def _say_placed_by_the_trainer(self, checkpoint: str) -> None:
        """One line where the Trainer alone places a restart in steps of a tuned config memtui
        resumed, which takes another number of samples a step than the script's own."""
        store = self.tuner.store
        knobs, own = store.knobs, store.own
        tuned = (knobs.batch_size or 0) * (knobs.grad_accum or 1)
        script = int(own.get("batch_size") or 0) * int(own.get("grad_accum") or 1)
        if not tuned or not script or tuned == script or self.tuner.rank != 0:
            return
        log.warning(
            "memtui: %s keeps no place of memtui's (saved before memtui changed the run, or "
            "without memtui): the Trainer places the resume by its global step in steps of the "
            "tuned config (%d samples a rank, the script's own %d), right only if the checkpoint "
            "was trained at it; to resume where it stopped, restart from a checkpoint saved "
            "after the change, or without resume=True",
            os.path.basename(os.path.normpath(checkpoint)),
            tuned,
            script,
        )

    def _save_place(self, checkpoint: str) -> None:
        """Write memtui's place into the checkpoint the Trainer just saved (where it writes
        ``trainer_state.json``; the user's own 0600 file, replaced whole)."""
        args = self.trainer.args
        if not getattr(args, "should_save", True) or not os.path.isdir(checkpoint):
            return
        try:
            size = self.sampler.size if self.sampler is not None else None
            epoch, consumed = place_in_epoch(max(self.epoch, 0), self.consumed, size)
            place = {
                "epoch": epoch,
                "samples_in_epoch": consumed,
                "samples_per_epoch": size,
                "max_steps": self.max_steps,
                "num_train_epochs": args.num_train_epochs,
            }
            state = {**self.tuner.state_dict(), PLACE_KEY: place}
            ownfiles.replace_file(Path(checkpoint) / PLACE_FILE, msgspec.json.encode(state))
        except Exception as exc:  # the checkpoint is saved: a restart resumes as the Trainer does
            self.tuner.report(exc, "saving memtui's place in the checkpoint")

    # ------------------------------------------------------------------ callbacks

    def train_begin(self, state: Any) -> None:
        """Start the clock; remember the run's ``max_steps`` (kept across resumes)."""
        tuner = self.tuner
        tuner.ledger.resume_at(int(state.global_step or 0))
        if self.max_steps is None:
            self.max_steps = int(state.max_steps)
        # transformers keeps the micro-batch here; no public setter
        state.train_batch_size = self.trainer._train_batch_size  # noqa: SLF001
        optimizer = getattr(self.trainer, "optimizer", None)
        tuner.optimizer = getattr(optimizer, "optimizer", optimizer)
        scheduler = getattr(self.trainer, "lr_scheduler", None)
        if self.restarts:  # loaded from the checkpoint saved before the change's LR factor
            tuner.lr.replace(tuner.optimizer, scheduler, self.lr_unsaved)
        else:
            tuner.lr.watch_optimizer(tuner.optimizer)
            tuner.watch_scheduler(scheduler)
        self.lr_unsaved = 1.0
        tuner.model = self.trainer.model
        if self.start_place is not None:
            self.epoch = self.start_place[0] - 1

    def epoch_begin(self) -> None:
        """A new epoch of the loop (the resumed one continues its sample count)."""
        self.epoch += 1
        if self.start_place is not None and self.start_place[0] == self.epoch:
            self.consumed = self.start_place[1]
        else:
            self.consumed = 0

    def boundary(self, state: Any, control: Any) -> None:
        """The checkpoint boundary: apply, then stop the loop so ``train`` resumes with the change."""
        trainer = self.trainer
        checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{state.global_step}")
        if self.tuner.rank == 0:  # rank 0 takes the pending changes and decides for every rank
            deepspeed = bool(getattr(trainer, "is_deepspeed_enabled", False))
            self.refusal = missing_resume_state(checkpoint, deepspeed)
        try:
            applied = self.tuner.checkpoint()
        finally:
            self.refusal = ""
        if applied is not None and applied.changes:
            self.keeps_place = True
        if self.keeps_place:
            self._save_place(checkpoint)
        try:
            if applied is None or not applied.changes:
                return
            if state.global_step >= (self.max_steps or state.max_steps):
                log.info("memtui: %s; the run is at its last step: kept for a resume", applied)
                return
            self.restart = (checkpoint, self.epoch, self.consumed)
            self.lr_unsaved *= applied.lr_factor or 1.0
            control.should_training_stop = True
            self._suspend_end_of_train()
            log.info("memtui: resuming from %s with the new settings", checkpoint)
        except Exception as exc:
            self.tuner.report(exc, "hf boundary")

    def _suspend_end_of_train(self) -> None:
        """The stopped ``train`` is not the run's end: no best-model load, no clean-up.

        With ``save_total_limit=1`` and a best checkpoint, the Trainer's end of ``train`` deletes
        every other checkpoint, the one to resume from included; both settings come back at the
        resume, so the run's real end does what it should.
        """
        args = self.trainer.args
        for name, off in (("save_total_limit", None), ("load_best_model_at_end", False)):
            if hasattr(args, name):
                self.suspended.setdefault(name, getattr(args, name))
                setattr(args, name, off)

    def _prepare_resume(self, epoch: int, consumed: int) -> None:
        """Copy the applied knobs into the ``TrainingArguments`` and pin ``max_steps``."""
        trainer = self.trainer
        args = trainer.args
        set_args(args, self.staged)
        for name, value in self.suspended.items():
            setattr(args, name, value)
        self.suspended = {}
        if self.max_steps is not None:
            args.max_steps = self.max_steps
        # transformers keeps the micro-batch here; no public setter
        trainer._train_batch_size = args.train_batch_size  # noqa: SLF001
        if not self.user_optimizer:
            trainer.optimizer = None
            trainer.lr_scheduler = None
        if self.sampler is not None:
            self.sampler.cut = None  # the loop is sized on whole epochs; the cut comes later
        size = self.sampler.size if self.sampler is not None else None
        self.resume_at = place_in_epoch(epoch, consumed, size)
        self.resumed_step = self.place_size = None  # a restart's place is behind this one
        self.restarts += 1


def cannot_resume(args: Any) -> str:
    """Why a run with these ``TrainingArguments`` cannot resume at a save to apply a change."""
    if getattr(args, "save_only_model", False):
        return (
            "the Trainer saves only the model (save_only_model=True): resuming from its "
            "checkpoint to apply a change would start the optimizer and the LR schedule afresh; "
            "save the full state to tune this run"
        )
    strategy = getattr(args, "save_strategy", None)
    if getattr(strategy, "value", strategy) == "no":
        return (
            "the Trainer never saves (save_strategy='no'): memtui applies changes at a save, "
            "resuming from it"
        )
    return ""


def missing_resume_state(checkpoint: str, deepspeed: bool = False) -> str:
    """Why ``checkpoint`` cannot be resumed from with the optimizer and LR schedule; "" if it can."""
    name = os.path.basename(checkpoint)
    try:
        names = os.listdir(checkpoint)
    except OSError:
        return f"{name} is not there (deleted or pruned): there is no state to resume from"
    if deepspeed:  # DeepSpeed keeps both in its own global_step* folder, with the model
        return ""
    optimizer, scheduler = RESUME_STATE
    missing = [
        what
        for what, found in (
            ("optimizer", any(optimizer in n for n in names)),
            ("LR scheduler", scheduler in names),
        )
        if not found
    ]
    if not missing:
        return ""
    return (
        f"{name} holds no {' or '.join(missing)} state: resuming from it to apply the change "
        "would start that state afresh"
    )


def install(trainer: Any, **tuner_kwargs: Any) -> Tuner:
    """Hook memtui into ``trainer`` and return its Tuner (``trainer.train()`` runs as usual)."""
    tuner_kwargs.pop("config", None)
    tuner_kwargs.pop("knobs", None)
    tuner_kwargs.pop("auto_step", None)
    if tuner_kwargs.get("state_dir") is None:
        tuner_kwargs["state_dir"] = ScriptDir(trainer.args.output_dir)
    tuner_kwargs.pop("model", None)
    tuner_kwargs.pop("optimizer", None)
    return HFAdapter(trainer, tuner_kwargs).tuner
