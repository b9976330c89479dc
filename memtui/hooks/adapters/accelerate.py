"""Hugging Face Accelerate: ``hooks.install(accelerator, config=args, model=..., optimizer=...)``.

An Accelerate script owns its loop, so the change lands inside it, at the step after the save:

* the boundary is ``accelerator.save_state`` (wrapped on the instance: memtui runs right after
  the save, on every rank, as ``save_state`` itself must be called on every rank);
* ``grad_accum`` is ``accelerator.gradient_accumulation_steps`` (what ``accelerator.accumulate``
  reads at every micro-batch); memtui also resets ``accelerator.step`` so the next accumulation
  group starts whole, and writes the value into ``config`` when the script keeps it there. A
  script that steps its optimizer on a count of its own (no ``accumulate()``, and no
  ``gradient_accumulation_steps`` in the config it gave memtui) would not train the value memtui
  wrote: there ``grad_accum`` is not tunable, and memtui says how to make it so;
* ``batch_size``, ``num_workers`` and ``pin_memory`` belong to ``tuner.loader(factory)``: the
  loader memtui builds from your DataLoader factory instead of ``accelerator.prepare(loader)``.
  Under several processes each rank takes its slice of one global batch (the position in the
  data is counted in global samples, the same on every rank), and batches are moved to
  ``accelerator.device``;
* optimizer steps are counted from the optimizer's post-step hook, which Accelerate only reaches
  when gradients are synchronised (``tuner.step()`` by hand works too);
* a restart: ``save_state`` also writes memtui's place (``tuner.state_dict()``: the step, each
  loader's epoch and samples consumed) into the checkpoint, one small file per process
  (``memtui_state_<process index>.json``, beside Accelerate's ``random_states_<i>.pkl``), and
  ``load_state`` restores it when it is there: the step and each loader's epoch at once, the
  samples consumed in it at the script's ``skip_first_batches`` (a script that skips its first
  batches itself, with ``continue``, gets the epoch from its first sample, said once);
  ``accelerator.skip_first_batches(loader, n)`` on a memtui loader returns that loader itself,
  its next epoch starting after n batches (memtui keeps timing it and can still rebuild it), or
  at the place memtui restored, which wins (a disagreeing n is said in one line). All of this
  happens under ``MEMTUI_DISABLE=1`` too: the training is the same with memtui switched off.

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
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from memtui.hooks.loader import TunedLoader
from memtui.hooks.tuner import Tuner
from memtui.storage import ownfiles

log = logging.getLogger("memtui")

PLACE_FILE = "memtui_state_{}.json"
"""memtui's place in a checkpoint ``save_state`` writes, one per process (its index)."""


OWN_COUNT = (
    "the script steps its optimizer on a count memtui cannot see: it does not use "
    "accelerator.accumulate() and the config given to hooks.install holds no "
    "gradient_accumulation_steps; to make it tunable, use `with accelerator.accumulate(model):` "
    "(memtui then sets "
    "the accelerator's count), or keep the count in that config and read it from there"
)
"""Why ``grad_accum`` is not tunable in an Accelerate script that accumulates by itself."""


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
        self.accumulates = False
        """Whether the script has entered ``accelerator.accumulate()``: where the config holds no
        accumulation of its own, the only place memtui can change it."""
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
            # the examples count their epochs from their steps: a checkpoint at an epoch's end
            # resumes at the next one's start
            "ended_epoch_is_next": True,
        }
        if base is not None:
            self.tuner.watch_optimizer(base)
        self._wrap_accumulate()
        if self.tuner.store.value("grad_accum") is None:
            self.tuner.store.refuse("grad_accum", OWN_COUNT)
        elif self.staged is not None and base is not None:
            self._check_accumulate_at_first_step(base)
        self._wrap_save_state()
        self._wrap_load_state()
        self._wrap_skip_first_batches()

    def _placer(self) -> Any:
        """Move batches to the accelerator's device (None on CPU: nothing to do)."""
        device = self.accelerator.device
        if getattr(device, "type", "cpu") == "cpu":
            return None
        from accelerate.utils import send_to_device

        return functools.partial(send_to_device, device=device, non_blocking=True)

    def _wrap_accumulate(self) -> None:
        """Note the script's first ``accelerator.accumulate()`` (what the accumulation memtui
        writes into the accelerator drives), then give the accelerator its own method back."""
        accelerator = self.accelerator
        accumulate = accelerator.accumulate
        own = "accumulate" in vars(accelerator)  # else deleting ours finds the class's again

        @functools.wraps(accumulate)
        def noted_accumulate(*args: Any, **kwargs: Any) -> Any:
            if own:
                accelerator.accumulate = accumulate
            else:
                del accelerator.accumulate
            try:
                self.took_accumulate()
            except Exception as exc:  # never into training
                self.tuner.report(exc, "looking for accelerator.accumulate()")
            return accumulate(*args, **kwargs)

        accelerator.accumulate = noted_accumulate

    def took_accumulate(self) -> None:
        """The script accumulates through the accelerator: ``grad_accum`` is the accelerator's
        count, tunable even where the config given to memtui holds none."""
        self.accumulates = True
        store = self.tuner.store
        if store.value("grad_accum") is None and store.why_not.get("grad_accum") == OWN_COUNT:
            del store.why_not["grad_accum"]
            store.adopt({"grad_accum": int(self.accelerator.gradient_accumulation_steps)})

    def _check_accumulate_at_first_step(self, optimizer: Any) -> None:
        """At the first optimizer step, withdraw ``grad_accum`` if the script has not entered
        ``accumulate()`` (its loop steps on a count memtui cannot see)."""
        handle: Any = None

        def first_step(*_args: Any) -> None:
            try:
                handle.remove()
                if not self.accumulates:
                    self.tuner.store.withdraw("grad_accum", OWN_COUNT)
            except Exception as exc:  # never into training
                self.tuner.report(exc, "looking for accelerator.accumulate()")

        try:
            handle = optimizer.register_step_post_hook(first_step)
        except Exception as exc:
            self.tuner.report(exc, "looking for accelerator.accumulate()")

    def _wrap_save_state(self) -> None:
        """Make ``save_state`` the boundary: the save first, then memtui, on every rank."""
        save_state = self.accelerator.save_state

        @functools.wraps(save_state)
        def save_state_then_boundary(*args: Any, **kwargs: Any) -> Any:
            result = save_state(*args, **kwargs)
            self.boundary()
            given = args[0] if args else kwargs.get("output_dir")
            self.save_place(result if isinstance(result, (str, os.PathLike)) else given)
            return result

        self.accelerator.save_state = save_state_then_boundary

    def _wrap_load_state(self) -> None:
        """Make ``load_state`` restore memtui's place from the checkpoint too (when it has it)."""
        load_state = self.accelerator.load_state

        @functools.wraps(load_state)
        def load_state_then_place(input_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
            result = load_state(input_dir, *args, **kwargs)
            self.load_place(input_dir)
            return result

        self.accelerator.load_state = load_state_then_place

    def _wrap_skip_first_batches(self) -> None:
        """Make ``skip_first_batches`` of a memtui loader skip inside that loader."""
        skip_first_batches = self.accelerator.skip_first_batches

        @functools.wraps(skip_first_batches)
        def skip_in_tuned_loader(dataloader: Any, num_batches: int = 0) -> Any:
            if isinstance(dataloader, TunedLoader):
                return self.skip(dataloader, num_batches)
            return skip_first_batches(dataloader, num_batches)

        self.accelerator.skip_first_batches = skip_in_tuned_loader

    def skip(self, loader: TunedLoader, batches: int) -> TunedLoader:
        """The loader itself, its next epoch starting after ``batches`` batches (a position memtui
        restored wins: a disagreeing count is said)."""
        try:
            said = loader.skip_batches(batches)
            if said:
                log.warning("%s", said)
        except Exception as exc:  # never into training
            self.tuner.report(exc, "skip_first_batches")
        return loader

    def _place_path(self, directory: Any) -> Path:
        return Path(directory) / PLACE_FILE.format(self.accelerator.process_index)

    def save_place(self, directory: Any) -> None:
        """Write memtui's place (``tuner.state_dict()``, kept whole) into the checkpoint directory
        (this process's own file, the user's own 0600 file)."""
        if directory is None:
            return
        try:
            state = msgspec.json.encode(self.tuner.state_dict())
            ownfiles.replace_file(self._place_path(directory), state)
        except Exception as exc:  # the checkpoint is saved: the run goes on without it
            self.tuner.report(exc, "saving memtui's place in the checkpoint")

    def load_place(self, input_dir: Any) -> None:
        """Restore memtui's place from the checkpoint ``load_state`` read (nothing, and nothing
        said, when it has none)."""
        try:
            directory = input_dir if input_dir is not None else self._latest_checkpoint()
            if directory is None:
                return
            path = self._place_path(os.path.expanduser(str(directory)))
            if not path.exists():
                return
            fd = ownfiles.open_read(path)
            with os.fdopen(fd, "rb") as handle:
                state = msgspec.json.decode(handle.read())
            if not isinstance(state, dict):
                raise ValueError(f"{path} holds no memtui state")
            # a loader's samples wait for the script's skip_first_batches: a script that resumes
            # an epoch by skipping its first batches itself (``continue``) skips them once
            self.tuner.load_state_dict(state, held=True)
            places = [loader.state_dict() for loader in self.tuner.loaders]  # held included
            log.info(
                "memtui: resumed its place from %s: step %s%s",
                path,
                state.get("step"),
                "".join(
                    f", a loader at sample {p['samples_in_epoch']} of epoch {p['epoch']}"
                    for p in places
                ),
            )
        except Exception as exc:  # the script's own resume goes on
            self.tuner.report(exc, "restoring memtui's place from the checkpoint")

    def _latest_checkpoint(self) -> str | None:
        """The checkpoint ``load_state()`` picks with automatic checkpoint naming (None: none)."""
        accelerator = self.accelerator
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            return None
        base = os.path.join(accelerator.project_dir, "checkpoints")
        folders = [os.path.join(base, name) for name in os.listdir(base)]
        numbered = [(int(m[0]), f) for f in folders if (m := re.findall(r"([0-9]+)[^/]*$", f))]
        return max(numbered)[1] if numbered else None

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
