"""The DataLoader wrapper: times the wait for each batch and rebuilds the loader when knobs change.

``tuner.loader(factory)`` calls ``factory`` (with the keyword arguments among ``batch_size``,
``num_workers``, ``pin_memory`` and ``prefetch_factor`` that it accepts) to get a ``torch.utils.data.DataLoader``,
then iterates a loader built from it with the tuner's current knob values. When a checkpoint
boundary changes one of those knobs, the next fetch shuts the old loader's workers down and
continues with a new loader.

How the data position survives a rebuild depends on the loader (``position`` says which):

* ``exact`` (a map-style dataset batched by a plain ``BatchSampler``, the usual case): the
  wrapper owns the epoch's index stream. Indices the old loader had drawn but not yet delivered
  (prefetched by workers) are handed to the new loader first, then the same sampler iterator
  continues: no sample of the epoch is lost or repeated, whatever the sampler.
* ``restart`` (an ``IterableDataset``, a custom batch sampler, or a DataLoader subclass): the
  new loader starts a fresh iterator; the rebuild report says so.

``state_dict()``/``load_state_dict()`` carry (epoch, samples consumed in the epoch) across a
restart; a resumed epoch skips that many indices of the sampler, which is exact when the
sampler's order is deterministic for the epoch (``DistributedSampler``, or a seeded generator).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from memtui.core.knobs import DEFAULT_PREFETCH_FACTOR
from memtui.hooks.knobstore import LOADER_KNOBS, KnobStore
from memtui.hooks.ledger import StepLedger
from memtui.wire import STEP_LOADER_REBUILT

log = logging.getLogger("memtui")


class _EpochStream:
    """One epoch's indices: the sampler's iterator, plus drawn-but-undelivered ones to replay."""

    def __init__(self, sampler: Any, skip: int = 0) -> None:
        self.sampler = sampler
        self.iterator: Iterator[int] | None = None
        """The sampler's iterator, started at the loader's first request for indices."""
        self.skip = skip
        """Samples of the epoch a resumed loop consumed before: left out of the first request."""
        self.replay: deque[int] = deque()
        self.inflight: deque[list[int]] = deque()
        """Index batches drawn by the current loader and not yet delivered, oldest first."""
        self.redeliver: list[int] = []
        """Delivered indices handed back (an OOM rollback): they go first after the rebuild."""
        self.consumed = skip
        """Samples of this epoch delivered to the training loop."""

    def source(self) -> Iterator[int]:
        """Replayed indices first, then the rest of the sampler's iterator.

        The sampler is iterated, and a resumed epoch's consumed samples skipped, only when the
        loader first asks for indices: a ``DataLoader`` draws its workers' base seed when its
        iterator is made, before that, from the generator a shuffling sampler draws its order
        from, so the epoch's order is the one the run had before the restart.
        ``itertools.chain`` has no ``close()``: when the old loader's batch generator is closed,
        the sampler's iterator (which the next loader continues) stays open.
        """
        if self.iterator is None:
            self.iterator = iter(self.sampler)
            for skipped in range(self.skip):
                if next(self.iterator, None) is None:
                    self.consumed -= self.skip - skipped
                    break
        replayed = list(self.replay)
        self.replay.clear()
        return itertools.chain(replayed, self.iterator)

    def requeue_inflight(self) -> int:
        """Put the undelivered batches back in front of the stream; return how many indices."""
        pending = self.redeliver + [i for batch in self.inflight for i in batch]
        self.redeliver = []
        self.inflight.clear()
        self.replay.extendleft(reversed(pending))
        return len(pending)


class _TrackedBatchSampler:
    """Batches the owner's current epoch stream, recording each batch it hands out."""

    def __init__(self, owner: TunedLoader, sampler: Any, batch_size: int, drop_last: bool) -> None:
        self.owner = owner
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        stream = self.owner.epoch_stream
        if stream is None:
            return
        source = stream.source()
        inflight = stream.inflight
        size = self.batch_size
        rank, world = self.owner.shard
        if world > 1:  # one global batch of size x world, this rank's slice of it
            while True:
                batch = list(itertools.islice(source, size * world))
                if not batch or (self.drop_last and len(batch) < size * world):
                    return
                inflight.append(batch)
                short = (-len(batch)) % world  # every rank gets as many: repeat a few, as
                padded = batch + batch[:short]  # DistributedSampler does at an epoch's end
                share = len(padded) // world
                yield padded[rank * share : (rank + 1) * share]
        # once per micro-batch, in the training process: torch's own BatchSampler loop, plus the
        # append that records the batch (every name a local)
        islice, draw, drop_last = itertools.islice, inflight.append, self.drop_last
        batch = [*islice(source, size)]
        while batch:
            if drop_last and len(batch) < size:
                return
            draw(batch)
            yield batch
            batch = [*islice(source, size)]

    def __len__(self) -> int:
        total = len(self.sampler)
        size = self.batch_size * self.owner.shard[1]
        return total // size if self.drop_last else math.ceil(total / size)


def _accepted_kwargs(factory: Callable[..., Any]) -> set[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return set(LOADER_KNOBS)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(LOADER_KNOBS)
    return {p.name for p in params if p.name in LOADER_KNOBS}


def shutdown_workers(iterator: Any, loader: Any) -> None:
    """Stop a DataLoader iterator's worker processes now (they are joined, not leaked)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    if loader is not None and getattr(loader, "_iterator", None) is iterator:
        # DataLoader's persistent iterator; no public reset
        loader._iterator = None  # noqa: SLF001


class TunedLoader:
    """A DataLoader stand-in that measures data wait and follows the tuner's loader knobs."""

    def __init__(
        self,
        ledger: StepLedger,
        store: KnobStore,
        factory: Callable[..., Any],
        shard: tuple[int, int] = (0, 1),
        place: Callable[[Any], Any] | None = None,
        on_rebuilt: Callable[[], None] = lambda: None,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._on_rebuilt = on_rebuilt
        """Told after a rebuild (the sampler looks for the new workers)."""
        self._factory = factory
        self.shard = shard
        """(rank, world size): with world > 1 each batch is this rank's slice of a global batch
        (the position is kept in global samples, the same on every rank)."""
        self._place = place
        """Applied to each batch before it is handed out (moving it to the device)."""
        self._accepts = _accepted_kwargs(factory)
        self._stream: _EpochStream | None = None
        self._loader: Any = None
        """The DataLoader currently iterated (built by the wrapper from the factory's)."""
        self._template: Any = None
        """The factory's latest DataLoader (never iterated: it only describes the loader)."""
        self._sampler: Any = None
        self.mode = "exact"
        """How the data position survives a rebuild: ``exact`` or ``restart``."""
        self.epoch = -1
        """The epoch being (or last) iterated, counted by this wrapper from 0."""
        self._resume: tuple[int, int] | None = None
        self._force_rebuild = False
        self.generation = 0
        """Counts loader rebuilds."""
        self.last_rebuild = ""
        """What the last rebuild did, in words."""
        self.knobs: dict[str, Any] = self._build(initial=True)
        """The values the loader now iterated was built with (the factory's, where it does not
        take a knob)."""

    # ---------------------------------------------------------------- building

    def _factory_kwargs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        given = {k: v for k, v in knobs.items() if k in self._accepts and v is not None}
        if not knobs.get("num_workers"):  # torch refuses a prefetch factor without workers
            given.pop("prefetch_factor", None)
        return given

    def _build(self, initial: bool = False) -> dict[str, Any]:
        """Build a loader from the factory with the tuner's current knobs; return the knobs."""
        from torch.utils.data import BatchSampler, DataLoader, IterableDataset

        wanted = dict(zip(LOADER_KNOBS, self._store.loader_knobs(), strict=True))
        # the config's own values memtui cannot take go to the factory as they are: the user's
        # code (or torch) says what is wrong with them, not a missing argument in memtui
        given = {**self._store.untunable, **self._factory_kwargs(wanted)}
        template = self._factory(**{k: v for k, v in given.items() if k in self._accepts})
        if not isinstance(template, DataLoader):
            raise TypeError(
                f"the loader factory returned {type(template).__name__}, not a DataLoader"
            )
        knobs: dict[str, Any] = {
            "batch_size": template.batch_size,
            "num_workers": template.num_workers,
            "pin_memory": template.pin_memory,
            "prefetch_factor": template.prefetch_factor or DEFAULT_PREFETCH_FACTOR,
        }
        mode = "restart"
        if type(template) is DataLoader and template.batch_size is not None:
            if isinstance(template.dataset, IterableDataset):
                mode = "iterable"
            elif type(template.batch_sampler) is BatchSampler:
                mode = "exact"
        if mode != "restart":
            knobs.update({k: v for k, v in wanted.items() if v is not None})
        else:
            for knob in LOADER_KNOBS:
                if wanted[knob] is not None and wanted[knob] != knobs[knob] and not initial:
                    log.warning(
                        "memtui: the loader factory does not take %s and its DataLoader cannot "
                        "be rebuilt by memtui (custom batch sampler or subclass): %s stays %s",
                        knob,
                        knob,
                        knobs[knob],
                    )
        self._template = template
        self.mode = "exact" if mode == "exact" else "restart"
        if self._sampler is not None and template.sampler is not None:
            epoch = getattr(self._sampler, "epoch", None)
            if epoch is not None and hasattr(template.sampler, "set_epoch"):
                template.sampler.set_epoch(epoch)
        self._sampler = template.sampler
        if mode == "exact":
            batch_sampler = _TrackedBatchSampler(
                self, template.sampler, int(knobs["batch_size"]), template.drop_last
            )
            self._loader = DataLoader(
                template.dataset, batch_sampler=batch_sampler, **_loader_kwargs(template, knobs)
            )
        elif mode == "iterable":
            self._loader = DataLoader(
                template.dataset,
                batch_size=knobs["batch_size"],
                drop_last=template.drop_last,
                **_loader_kwargs(template, knobs),
            )
        else:
            self._loader = template
        self._force_rebuild = False
        return knobs

    def _stale(self) -> bool:
        if self._force_rebuild:
            return True
        return tuple(self.knobs[k] for k in LOADER_KNOBS) != self._store.loader_knobs()

    def requeue(self, indices: list[int]) -> bool:
        """Hand delivered samples back to be delivered again first (an OOM rollback)."""
        stream = self._stream
        if self.mode != "exact" or stream is None:
            return False
        stream.redeliver.extend(indices)
        stream.consumed -= len(indices)
        self._force_rebuild = True
        self._store.touch_loaders()
        return True

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Any]:
        """Iterate one epoch, timing each fetch and switching loaders when the knobs change; each
        batch is placed (moved to the device) after its fetch is timed, before it is handed out."""
        batches = self._batches()
        return batches if self._place is None else map(self._place, batches)

    def _batches(self) -> Iterator[Any]:
        """One epoch's batches as they arrive (``__iter__`` places them)."""
        rebuilt = self._stale()
        if rebuilt:  # a change landed between epochs
            self.close()
            self.knobs = self._build()
            self.generation += 1
            self.last_rebuild = "loader rebuilt between epochs"
        if self._resume is not None:
            self.epoch, skip = self._resume
            self._resume = None
        else:
            self.epoch += 1
            skip = 0
        if self.mode == "exact":
            self._stream = _EpochStream(self._sampler, skip)
        elif skip:
            log.warning(
                "memtui: this loader cannot skip to sample %d of the epoch (%s)", skip, self.mode
            )
        iterator = iter(self._loader)
        if rebuilt:
            self._on_rebuilt()
        perf = time.perf_counter
        ledger, store = self._ledger, self._store
        ledger.start_clock()
        # The hot path, once per micro-batch: two clock reads, and the wait, the samples and
        # (exact mode) the delivered indices, moved from in-flight for an OOM re-queue, added to
        # the ledger's open step in place (no call but the bounded deque's append). Everything
        # else is a local.
        tally = ledger.open
        keep = tally.batches.append
        world = self.shard[1]
        sharded = world > 1
        generation = store.loader_generation
        while True:  # one pass per underlying loader: a knob change switches loaders mid-epoch
            stream = self._stream if self.mode == "exact" else None
            inflight = stream.inflight if stream is not None else None
            batch_size = self.knobs["batch_size"] or 1
            switched = False
            t0 = perf()
            for batch in iterator:
                tally.wait += perf() - t0
                tally.micro += 1
                delivered: list[int] | int
                if inflight:
                    delivered = inflight.popleft()
                    n = len(delivered)
                    stream.consumed += n  # type: ignore[union-attr]
                    tally.samples += -(-n // world) if sharded else n
                else:
                    delivered = batch_size
                    tally.samples += batch_size
                keep((self, delivered))
                yield batch
                if generation != store.loader_generation:  # a boundary may have changed knobs
                    generation = store.loader_generation
                    if self._stale():
                        iterator = self._switch(iterator)
                        switched = True
                        break
                t0 = perf()
            if not switched:
                return

    def _switch(self, iterator: Any) -> Any:
        """Shut the current loader down and continue the epoch with one built for the new knobs."""
        old = (self._loader, iterator)
        replayed = self._stream.requeue_inflight() if (self._stream and self.mode == "exact") else 0
        shutdown_workers(iterator, old[0])
        previous_mode = self.mode
        self.knobs = self._build()
        self.generation += 1
        self._ledger.mark(STEP_LOADER_REBUILT)
        if previous_mode == "exact" and self.mode == "exact":
            self.last_rebuild = f"loader rebuilt; the epoch continues exactly ({replayed} prefetched samples re-queued)"
        else:
            self._stream = None
            self.last_rebuild = "loader rebuilt; its iterator restarted (position not kept)"
        iterator = iter(self._loader)
        self._on_rebuilt()  # once the new workers exist: the sampler lists them now
        return iterator

    # ---------------------------------------------------------------- DataLoader look-alike

    def __len__(self) -> int:
        return len(self._loader)

    @property
    def epoch_stream(self) -> _EpochStream | None:
        """The current epoch's index stream (exact mode), which the batch sampler draws from."""
        return self._stream

    @property
    def sampler(self) -> Any:
        """The factory's sampler (call ``set_epoch`` on it as with a plain DataLoader)."""
        return self._sampler

    @property
    def batch_size(self) -> int | None:
        """The micro-batch size of the loader now iterated."""
        return self.knobs["batch_size"]

    @property
    def num_workers(self) -> int:
        """The worker count of the loader now iterated."""
        return self.knobs["num_workers"]

    @property
    def pin_memory(self) -> bool:
        """Whether the loader now iterated pins memory."""
        return self.knobs["pin_memory"]

    @property
    def prefetch_factor(self) -> int:
        """Batches each worker of the loader now iterated loads ahead (unused without workers)."""
        return int(self.knobs["prefetch_factor"])

    @property
    def dataloader(self) -> Any:
        """The torch DataLoader now iterated."""
        return self._loader

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    @property
    def resume_position(self) -> tuple[int, int] | None:
        """(epoch, samples consumed in it) that ``load_state_dict`` set for the next iteration
        (None: the next iteration starts an epoch of its own)."""
        return self._resume

    def state_dict(self) -> dict[str, int]:
        """Where the loop is in the data: the epoch and the samples consumed in it."""
        consumed = self._stream.consumed if self._stream is not None else 0
        return {"epoch": max(self.epoch, 0), "samples_in_epoch": consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Make the next iteration resume ``state``'s epoch after the samples already consumed."""
        self._resume = (int(state.get("epoch", 0)), int(state.get("samples_in_epoch", 0)))
        if self._sampler is not None and hasattr(self._sampler, "set_epoch"):
            self._sampler.set_epoch(self._resume[0])

    def close(self) -> None:
        """Shut down the loader's workers (persistent ones included)."""
        loader = self._loader
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            shutdown_workers(iterator, loader)


def _loader_kwargs(template: Any, knobs: dict[str, Any]) -> dict[str, Any]:
    """The DataLoader arguments of ``template``, with the tuned worker, pinning and prefetch knobs."""
    workers = int(knobs["num_workers"])
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "collate_fn": template.collate_fn,
        "pin_memory": bool(knobs["pin_memory"]),
        "timeout": template.timeout,
        "worker_init_fn": template.worker_init_fn,
        "multiprocessing_context": template.multiprocessing_context,
        "generator": template.generator,
        "persistent_workers": bool(template.persistent_workers and workers > 0),
        "pin_memory_device": template.pin_memory_device,
    }
    if workers > 0:
        kwargs["prefetch_factor"] = int(knobs["prefetch_factor"])
    if hasattr(template, "in_order"):
        kwargs["in_order"] = template.in_order
    return kwargs
