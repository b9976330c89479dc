"""The DataLoader wrapper: times the wait for each batch and rebuilds the loader when knobs change.

``tuner.loader(factory)`` calls ``factory`` (with the keyword arguments among ``batch_size``,
``num_workers``, ``pin_memory`` and ``prefetch_factor`` that it accepts) to get a ``torch.utils.data.DataLoader``,
then iterates a loader built from it with the tuner's current knob values. When a checkpoint
boundary changes one of those knobs, the next fetch shuts the old loader's workers down and
continues with a new loader. A factory parameter the config holds no value for gets torch's own
default (``num_workers=0``, ``pin_memory=False``, ``prefetch_factor=None``; ``batch_size`` has
none: the factory must give it one); a factory that raises at a rebuild leaves the loader as it
was, and the tuner is told (``on_failed``).

How the data position survives a rebuild depends on the loader (``position`` says which):

* ``exact`` (a map-style dataset batched by a plain ``BatchSampler``, the usual case): the
  wrapper owns the epoch's index stream. Indices the old loader had drawn but not yet delivered
  (prefetched by workers) are handed to the new loader first, then the same sampler iterator
  continues: no sample of the epoch is lost or repeated, whatever the sampler.
* ``restart`` (an ``IterableDataset``, a custom batch sampler, or a DataLoader subclass): the
  new loader starts a fresh iterator; the rebuild report says so.

Under several ranks (``shard``) each batch is this rank's slice of one global batch, so every
rank must draw the same order: a random sampler (one with a ``generator``: ``RandomSampler``,
``SubsetRandomSampler``, ``WeightedRandomSampler``) draws each epoch's order from a generator
seeded with the job's base seed (rank 0's, agreed through ``seed``) plus the epoch, as
``DistributedSampler`` does, never from a rank's global RNG; a single process keeps the
factory's sampler exactly as it is.

``state_dict()``/``load_state_dict()`` carry (epoch, samples consumed in the epoch) across a
restart; a resumed epoch skips that many indices of the sampler, which is exact when the
sampler's order is deterministic for the epoch (``DistributedSampler``, a seeded generator, or
any random sampler under several ranks).

The wrapper answers what a framework reads of a ``DataLoader`` as torch's own does
(``batch_sampler``, ``sampler``, ``len``, ``drop_last``, ``prefetch_factor`` None without
workers, ``set_epoch``): its batch sampler iterated outside the wrapper (a framework's
``DataLoader(dataset, batch_sampler=loader.batch_sampler)``) gives the next epoch's batches of
this rank, and the wrapper's epoch and position follow it.
"""

from __future__ import annotations

import base64
import functools
import inspect
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from memtui.core.knobs import DEFAULT_PREFETCH_FACTOR
from memtui.hooks.batches import batch_samples, missed_once
from memtui.hooks.errors import Report
from memtui.hooks.knobstore import LOADER_KNOBS, KnobStore
from memtui.hooks.ledger import StepLedger
from memtui.wire import STEP_LOADER_REBUILT

log = logging.getLogger("memtui")


def _said(exc: BaseException, where: str) -> None:
    """A failure of a loader made without the tuner's report, logged."""
    log.warning("memtui: %s: %s", where, exc)


TORCH_DEFAULTS: dict[str, Any] = {"num_workers": 0, "pin_memory": False, "prefetch_factor": None}
"""What torch's ``DataLoader`` takes for a loader knob it is not given (``batch_size`` is left
out: a default batch of 1 would change what the training learns from)."""

SEED_MASK = (1 << 64) - 1
"""A ``torch.Generator`` seed is an unsigned 64-bit integer."""


class FactoryError(TypeError):
    """The loader factory needs a value memtui cannot give it (said at ``tuner.loader``)."""


def own_seed(sampler: Any) -> int:
    """This process's base seed for a sampler's per-epoch order: its generator's initial seed, or
    torch's global one."""
    import torch

    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        return int(generator.initial_seed())
    return int(torch.initial_seed())


def seeded_order(sampler: Any, seed: int) -> Iterator[int]:
    """One epoch of ``sampler`` drawn from a generator seeded with ``seed``; the sampler's own
    generator is back in place once the epoch's order is drawn (at its first index)."""
    import torch

    own = sampler.generator
    sampler.generator = torch.Generator().manual_seed(seed & SEED_MASK)
    try:
        iterator = iter(sampler)
        first = next(iterator, None)  # torch's random samplers draw the order here
    finally:
        sampler.generator = own
    return iter(()) if first is None else itertools.chain((first,), iterator)


def shard_batches(
    source: Iterator[int], size: int, rank: int, world: int, drop_last: bool
) -> Iterator[tuple[list[int], list[int]]]:
    """(global batch, this rank's slice) for each global batch of ``size`` x ``world`` indices;
    a short last batch is padded by repeating its indices, as ``DistributedSampler`` does, so
    that every rank gets as many."""
    whole = size * world
    while True:
        batch = list(itertools.islice(source, whole))
        if not batch or (drop_last and len(batch) < whole):
            return
        short = (-len(batch)) % world
        padded = batch + list(itertools.islice(itertools.cycle(batch), short))
        share = len(padded) // world
        yield batch, padded[rank * share : (rank + 1) * share]


def generator_states(generators: list[Any]) -> list[str]:
    """Each torch generator's state, as text a checkpoint keeps (JSON and ``weights_only``)."""
    return [base64.b64encode(bytes(g.get_state().tolist())).decode("ascii") for g in generators]


def set_generator_states(generators: list[Any], states: list[str]) -> None:
    """Put back the states ``generator_states`` gave (as many as there are generators)."""
    import torch

    for generator, state in zip(generators, states, strict=True):
        raw = base64.b64decode(state.encode("ascii"), validate=True)
        generator.set_state(torch.tensor(list(raw), dtype=torch.uint8))


class _EpochStream:
    """One epoch's indices: the sampler's iterator, plus drawn-but-undelivered ones to replay."""

    def __init__(self, order: Callable[[], Iterator[int]], skip: int = 0) -> None:
        self.order = order
        """Starts the epoch's order (the sampler's iterator, seeded under several ranks)."""
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
            self.iterator = self.order()
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
    """Batches the owner's current epoch stream, recording each batch it hands out; iterated
    outside the owner (a framework's own DataLoader over it), the owner's next epoch."""

    def __init__(self, owner: TunedLoader, sampler: Any, batch_size: int, drop_last: bool) -> None:
        self.owner = owner
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        owner = self.owner
        stream = owner.take_claim()
        if stream is None:  # not the owner's own loader: a framework's, built on this sampler
            yield from owner.batches_outside(self.batch_size, self.drop_last)
            return
        source = stream.source()
        inflight = stream.inflight
        size = self.batch_size
        rank, world = owner.shard
        if world > 1:  # one global batch of size x world, this rank's slice of it
            for batch, mine in shard_batches(source, size, rank, world, self.drop_last):
                inflight.append(batch)
                yield mine
            return
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


def _rank_sampler_class() -> type:
    """``_RankSampler``, a ``torch.utils.data.Sampler`` (made at first use: torch is imported
    only by a script that uses it)."""
    from torch.utils.data import Sampler

    class _RankSampler(Sampler[int]):
        """This rank's indices of the loader's epoch, as its batches deliver them (a loader of
        several ranks): what a ``DistributedSampler`` gives its rank."""

        def __init__(self, owner: TunedLoader) -> None:
            self.owner = owner

        def __iter__(self) -> Iterator[int]:
            owner = self.owner
            for _, mine in owner.rank_batches(owner.current_epoch()):
                yield from mine

        def __len__(self) -> int:
            return self.owner.rank_samples()

        def set_epoch(self, epoch: int) -> None:
            """The epoch the loader iterates next (``TunedLoader.set_epoch``)."""
            self.owner.set_epoch(epoch)

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_") or name == "owner":
                raise AttributeError(name)
            return getattr(self.owner.factory_sampler, name)

    return _RankSampler


def _factory_parameters(factory: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """(the loader knobs ``factory`` takes by keyword, those of them it has no default for)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return set(LOADER_KNOBS), set()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    knobs = [p for p in params if p.name in LOADER_KNOBS and p.kind in keyword]
    required = {p.name for p in knobs if p.default is inspect.Parameter.empty}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return set(LOADER_KNOBS), required
    return {p.name for p in knobs}, required


def shutdown_workers(iterator: Any, loader: Any) -> None:
    """Stop a DataLoader iterator's worker processes now (they are joined, not leaked)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    if loader is not None and getattr(loader, "_iterator", None) is iterator:
        # DataLoader's persistent iterator; no public reset
        loader._iterator = None  # noqa: SLF001


@dataclass
class _Built:
    """A loader built from the factory's latest DataLoader, not yet in use."""

    template: Any
    """The factory's DataLoader (never iterated: it only describes the loader)."""
    loader: Any
    """The DataLoader to iterate."""
    knobs: dict[str, Any]
    mode: str
    defaulted: dict[str, Any]
    """The factory's parameters the config gave no value for, and torch's defaults given them."""


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
        seed: Callable[[int, int], int] | None = None,
        on_failed: Callable[[BaseException, dict[str, Any]], None] | None = None,
        ended_epoch_is_next: bool = False,
        report: Report | None = None,
    ) -> None:
        self._ledger = ledger
        self._store = store
        self._on_rebuilt = on_rebuilt
        """Told after a rebuild (the sampler looks for the new workers)."""
        self._agree_seed = seed
        """Given this rank's base seed for the per-epoch order and the count of agreements so
        far, returns the job's (rank 0's); None: this process's own (a single process)."""
        self._on_failed = on_failed
        """Told when the factory raised at a rebuild, with the knobs the loader kept."""
        self.ended_epoch_is_next = ended_epoch_is_next
        """A position at the end of an epoch (``load_state_dict``, ``skip_batches``) resumes at
        the next epoch's start: a script that counts its own epochs from its steps (Accelerate's
        examples) starts the next one there, not the empty rest of the old one."""
        self._missed = missed_once(report or _said)
        """Reports the first batch counted as 0 samples that holds no tensor (a loader that
        cannot follow its indices counts each batch's rows)."""
        self._factory = factory
        self.shard = shard
        """(rank, world size): with world > 1 each batch is this rank's slice of a global batch
        (the position is kept in global samples, the same on every rank)."""
        self._place = place
        """Applied to each batch before it is handed out (moving it to the device)."""
        self._accepts, self._requires = _factory_parameters(factory)
        self._stream: _EpochStream | None = None
        self._claim: _EpochStream | None = None
        """The stream the owner's own loader is about to draw from (taken by its batch sampler's
        iteration; a batch sampler iterated with no claim is a framework's, outside)."""
        self._loader: Any = None
        """The DataLoader currently iterated (built by the wrapper from the factory's)."""
        self._template: Any = None
        """The factory's latest DataLoader (never iterated: it only describes the loader)."""
        self._sampler: Any = None
        self._base_seed: int | None = None
        """The job's base seed of the per-epoch order (agreed at the first epoch of several
        ranks)."""
        self._saved_seed: int | None = None
        """The base seed of the run a restart resumes (``load_state_dict``): what this rank
        proposes at the next agreement, instead of its own."""
        self._agreements = 0
        self._said_unseeded = False
        self._epoch_rng: list[str] | None = None
        """A single process's: the states of the generators its order draws from (the sampler's,
        the loader's) at the start of the epoch under way, what a resumed epoch starts from."""
        self._resume_rng: list[str] | None = None
        """Those states as the checkpoint a restart resumes kept them (``load_state_dict``)."""
        self._rank_sampler: Any = None
        """What ``sampler`` gives under several ranks (made at first use)."""
        self.mode = "exact"
        """How the data position survives a rebuild: ``exact`` or ``restart``."""
        self.epoch = -1
        """The epoch being (or last) iterated, counted by this wrapper from 0."""
        self._resume: tuple[int, int] | None = None
        self._held: int | None = None
        """Samples of the resumed epoch a restored checkpoint consumed, waiting for the script's
        ``skip_first_batches`` (``load_state_dict(..., held=True)``)."""
        self._next_epoch: int | None = None
        """The epoch ``set_epoch`` named for the next iteration."""
        self._iterating = False
        self._force_rebuild = False
        self._refused: int | None = None
        """The knob store's loader generation the factory raised at: not tried again until the
        knobs change again (a rollback, another change)."""
        self.generation = 0
        """Counts loader rebuilds."""
        self.last_rebuild = ""
        """What the last rebuild did, in words."""
        built = self._make(initial=True)
        self.defaulted = built.defaulted
        """The factory's parameters the config holds no value for, with the torch defaults they
        were given (``tuner.loader`` says so)."""
        self.knobs: dict[str, Any] = self._adopt(built)
        """The values the loader now iterated was built with (the factory's, where it does not
        take a knob)."""

    # ---------------------------------------------------------------- building

    def _factory_kwargs(self, knobs: dict[str, Any]) -> dict[str, Any]:
        given = {k: v for k, v in knobs.items() if k in self._accepts and v is not None}
        if not knobs.get("num_workers"):  # torch refuses a prefetch factor without workers
            given.pop("prefetch_factor", None)
        return given

    def _make(self, initial: bool = False) -> _Built:
        """Build a loader from the factory with the tuner's current knobs (nothing in use
        changes: ``_adopt`` puts it in place)."""
        from torch.utils.data import BatchSampler, DataLoader, IterableDataset

        wanted = dict(zip(LOADER_KNOBS, self._store.loader_knobs(), strict=True))
        # the config's own values memtui cannot take go to the factory as they are: the user's
        # code (or torch) says what is wrong with them, not a missing argument in memtui
        given = {**self._store.untunable, **self._factory_kwargs(wanted)}
        kwargs = {k: v for k, v in given.items() if k in self._accepts}
        defaulted: dict[str, Any] = {}
        for name in sorted(self._requires - set(kwargs)):
            if name not in TORCH_DEFAULTS:
                own = [*self._store.binding.names_like(name), "<its name in your config>"][0]
                raise FactoryError(
                    f"memtui: the loader factory needs {name}, and your config holds none under "
                    f'a name memtui knows: name it with hooks.install(..., knobs={{"{name}": '
                    f'"{own}"}}), or give the factory\'s {name} a default'
                )
            kwargs[name] = TORCH_DEFAULTS[name]
            if wanted[name] is None:  # not a prefetch factor left out for want of workers
                defaulted[name] = TORCH_DEFAULTS[name]
        template = self._factory(**kwargs)
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
        if mode == "exact":
            batch_sampler = _TrackedBatchSampler(
                self, template.sampler, int(knobs["batch_size"]), template.drop_last
            )
            loader = DataLoader(
                template.dataset, batch_sampler=batch_sampler, **_loader_kwargs(template, knobs)
            )
        elif mode == "iterable":
            loader = DataLoader(
                template.dataset,
                batch_size=knobs["batch_size"],
                drop_last=template.drop_last,
                **_loader_kwargs(template, knobs),
            )
        else:
            loader = template
        return _Built(template, loader, knobs, "exact" if mode == "exact" else "restart", defaulted)

    def _adopt(self, built: _Built) -> dict[str, Any]:
        """Put a built loader in use; return its knobs."""
        template = built.template
        self._template = template
        self.mode = built.mode
        if self._sampler is not None and template.sampler is not None:
            epoch = getattr(self._sampler, "epoch", None)
            if epoch is not None and hasattr(template.sampler, "set_epoch"):
                template.sampler.set_epoch(epoch)
        self._sampler = template.sampler
        self._loader = built.loader
        self._force_rebuild = False
        return built.knobs

    def _as_is(self) -> _Built:
        """A new loader like the one in use (its template and knobs), without the factory."""
        from torch.utils.data import DataLoader

        template, knobs = self._template, dict(self.knobs)
        sampler = _TrackedBatchSampler(
            self, template.sampler, int(knobs["batch_size"]), template.drop_last
        )
        loader = DataLoader(
            template.dataset, batch_sampler=sampler, **_loader_kwargs(template, knobs)
        )
        return _Built(template, loader, knobs, "exact", {})

    def _try_make(self) -> _Built | None:
        """A loader built for the current knobs, or None when the factory raised: the loader in
        use stays, the tuner is told, and these knobs are not tried again."""
        try:
            built = self._make()
        except Exception as exc:
            self._refused = self._store.loader_generation
            self._force_rebuild = False
            kept = dict(self.knobs)
            if self._on_failed is None:
                log.warning(
                    "memtui: the loader factory raised %s: %s; the loader keeps %s",
                    type(exc).__name__,
                    exc,
                    kept,
                )
            else:
                try:
                    self._on_failed(exc, kept)
                except Exception as told:  # never into training
                    log.warning("memtui: could not report a failed loader rebuild (%s)", told)
            return None
        self._refused = None
        return built

    def _stale(self) -> bool:
        if self._force_rebuild:
            return True
        store = self._store
        if store.loader_generation == self._refused:
            return False
        return tuple(self.knobs[k] for k in LOADER_KNOBS) != store.loader_knobs()

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

    # ---------------------------------------------------------------- the epoch's order

    def epoch_order(self, epoch: int) -> Iterator[int]:
        """The global order of ``epoch``: the sampler's own, or, under several ranks, a random
        sampler's drawn from the job's base seed plus the epoch (the same on every rank)."""
        sampler = self._sampler
        if self.shard[1] <= 1 or not hasattr(sampler, "generator"):
            return iter(sampler)
        if self._base_seed is None:
            mine = own_seed(sampler) if self._saved_seed is None else self._saved_seed
            self._base_seed = self._job_seed(mine)
        try:
            return seeded_order(sampler, self._base_seed + epoch)
        except AttributeError as exc:  # a sampler whose generator cannot be set
            if not self._said_unseeded:
                self._said_unseeded = True
                log.warning(
                    "memtui: cannot seed the order of %s (%s): each rank draws its own, and the "
                    "ranks' slices of a global batch may repeat or miss samples; give its "
                    "generator a settable attribute, or use a DistributedSampler",
                    type(sampler).__name__,
                    exc,
                )
            return iter(sampler)

    def _generators(self) -> list[Any]:
        """The torch generators a single process's epoch order draws from, each once: the
        sampler's (the order) and the loader's (its workers' base seed, drawn at each epoch's
        start); none under several ranks, whose order is seeded by the epoch."""
        import torch

        if self.shard[1] > 1 or self.mode != "exact":
            return []
        found: list[Any] = []
        for owner in (self._sampler, self._template):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and all(g is not generator for g in found):
                found.append(generator)
        return found

    def _start_generators(self) -> None:
        """At an epoch's start: put back the generators' states a resumed epoch started from,
        then keep them (what the epoch's order and base seed are drawn from)."""
        restore, self._resume_rng = self._resume_rng, None
        try:
            generators = self._generators()
            if restore is not None and len(restore) == len(generators):
                set_generator_states(generators, restore)
            self._epoch_rng = generator_states(generators) if generators else None
        except Exception as exc:  # the epoch goes on in the order the generators give
            self._epoch_rng = None
            log.warning(
                "memtui: could not keep the loader's generator state (%s: %s); a restart "
                "resumes this epoch in the order its own generator then gives",
                type(exc).__name__,
                exc,
            )

    def _job_seed(self, mine: int) -> int:
        """The job's base seed, from this rank's (0 where the agreement itself failed: every rank
        that fails takes the same)."""
        if self._agree_seed is None:
            return mine
        self._agreements += 1
        try:
            return int(self._agree_seed(mine, self._agreements))
        except Exception as exc:  # never into training
            log.warning(
                "memtui: could not agree the loader's seed with the other ranks (%s: %s); this "
                "rank shuffles with seed 0 + the epoch",
                type(exc).__name__,
                exc,
            )
            return 0

    def _take_position(self, say_held: bool = True) -> tuple[int, int]:
        """(epoch, samples to skip) of the iteration starting now (``say_held``: say that held
        samples are left to the script's own skip)."""
        if self._held is not None and self._resume is not None and say_held:
            log.warning(
                "memtui: the checkpoint's place is sample %d of epoch %d, and the script resumes "
                "without skip_first_batches: the loader starts epoch %d from its first sample "
                "(a script that skips its first batches itself goes on from there)",
                self._held,
                self._resume[0],
                self._resume[0],
            )
        self._held = None
        if self._resume is not None:
            position = self._resume
        elif self._next_epoch is not None:
            position = (self._next_epoch, 0)
        else:
            position = (self.epoch + 1, 0)
        self._resume = self._next_epoch = None
        return position

    def current_epoch(self) -> int:
        """The epoch being iterated, or the one the next iteration starts."""
        if self._iterating:
            return self.epoch
        if self._resume is not None:
            return self._resume[0]
        return self._next_epoch if self._next_epoch is not None else self.epoch + 1

    def take_claim(self) -> _EpochStream | None:
        """The stream the owner's own loader draws from (None: a framework's loader is iterating
        the batch sampler outside the owner)."""
        claim, self._claim = self._claim, None
        return claim

    def rank_batches(self, epoch: int) -> Iterator[tuple[list[int], list[int]]]:
        """(global batch, this rank's slice) of each batch of ``epoch``, at the batch size now."""
        rank, world = self.shard
        size = int(self.knobs["batch_size"])
        return shard_batches(self.epoch_order(epoch), size, rank, world, self.drop_last)

    def batches_outside(self, size: int, drop_last: bool) -> Iterator[list[int]]:
        """The next epoch's batches of this rank for a loader that is not the owner's (a
        framework's ``DataLoader(dataset, batch_sampler=loader.batch_sampler)``): the wrapper's
        epoch moves on and its position counts the samples as they are drawn."""
        epoch, skip = self._take_position(say_held=False)  # the framework's loader skips
        self.epoch = epoch
        stream = _EpochStream(functools.partial(self.epoch_order, epoch), skip)
        self._stream = stream
        rank, world = self.shard
        for batch, mine in shard_batches(stream.source(), size, rank, world, drop_last):
            stream.consumed += len(batch)
            yield mine

    def rank_samples(self) -> int:
        """This rank's samples in an epoch (its batches' sizes summed)."""
        total, world = self.epoch_samples, self.shard[1]
        size = int(self.knobs["batch_size"]) * world
        whole, rest = divmod(total, size)
        if self.drop_last or not rest:
            return whole * size // world
        return whole * size // world + math.ceil(rest / world)

    def epoch_end(self) -> int:
        """The samples an epoch delivers in all, at the loader's batch size (its last short
        global batch left out when it drops the last)."""
        total = self.epoch_samples
        if not self.drop_last:
            return total
        size = int(self.knobs["batch_size"]) * self.shard[1]
        return total // size * size

    def _position(self, epoch: int, consumed: int) -> tuple[int, int]:
        """(epoch, consumed), or the next epoch's start for the end of an epoch when
        ``ended_epoch_is_next``."""
        if self.ended_epoch_is_next and self.mode == "exact" and consumed >= self.epoch_end():
            return epoch + 1, 0
        return epoch, consumed

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
            built = self._try_make()
            rebuilt = built is not None
            if built is not None:
                self.close()
                self.knobs = self._adopt(built)
                self.generation += 1
                self.last_rebuild = "loader rebuilt between epochs"
        self.epoch, skip = self._take_position()
        if self.mode == "exact":
            self._stream = _EpochStream(functools.partial(self.epoch_order, self.epoch), skip)
            self._claim = self._stream
        elif skip:
            log.warning(
                "memtui: this loader cannot skip to sample %d of the epoch (%s)", skip, self.mode
            )
        self._iterating = True
        try:
            self._start_generators()
            iterator = iter(self._loader)
            if rebuilt:
                self._on_rebuilt()
            perf = time.perf_counter
            ledger, store = self._ledger, self._store
            ledger.start_clock()
            # The hot path, once per micro-batch: two clock reads, and the wait, the samples and
            # (exact mode) the delivered indices, moved from in-flight for an OOM re-queue, added
            # to the ledger's open step in place (no call but the bounded deque's append).
            # Everything else is a local.
            tally = ledger.open
            keep = tally.batches.append
            world = self.shard[1]
            sharded = world > 1
            generation = store.loader_generation
            missed = self._missed
            while True:  # one pass per underlying loader: a knob change switches loaders
                stream = self._stream if self.mode == "exact" else None
                inflight = stream.inflight if stream is not None else None
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
                    else:  # no indices to follow: the batch's own rows
                        delivered = batch_samples(batch)
                        if not delivered:
                            missed(batch)
                        tally.samples += delivered
                    keep((self, delivered))
                    yield batch
                    if generation != store.loader_generation:  # a boundary changed knobs?
                        generation = store.loader_generation
                        if self._stale():
                            switched_to = self._switch(iterator)
                            if switched_to is not None:
                                iterator = switched_to
                                switched = True
                                break
                    t0 = perf()
                if not switched:
                    return
        finally:
            self._iterating = False
            self._claim = None

    def _switch(self, iterator: Any) -> Any:
        """Shut the current loader down and continue the epoch with one built for the new knobs
        (None: the factory raised, and the loader in use goes on)."""
        stream = self._stream if self.mode == "exact" else None
        requeued = bool(stream is not None and stream.redeliver)
        built = self._try_make()
        if built is None and requeued:  # the handed-back samples still go first
            built = self._as_is()
        if built is None:
            return None
        old = (self._loader, iterator)
        replayed = self._stream.requeue_inflight() if (self._stream and self.mode == "exact") else 0
        shutdown_workers(iterator, old[0])
        previous_mode = self.mode
        self.knobs = self._adopt(built)
        self.generation += 1
        self._ledger.mark(STEP_LOADER_REBUILT)
        if previous_mode == "exact" and self.mode == "exact":
            self.last_rebuild = f"loader rebuilt; the epoch continues exactly ({replayed} prefetched samples re-queued)"
            self._claim = self._stream
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
        """The sampler, as a ``DataLoader``'s: the factory's own in a single process; under
        several ranks this rank's indices of the epoch in the loader's order (as a
        ``DistributedSampler``'s), its ``set_epoch`` the loader's."""
        if self.shard[1] > 1 and self.mode == "exact":
            if self._rank_sampler is None:
                self._rank_sampler = _rank_sampler_class()(self)
            return self._rank_sampler
        return self._sampler

    @property
    def factory_sampler(self) -> Any:
        """The sampler of the factory's DataLoader (the global order, every rank's samples)."""
        return self._sampler

    @property
    def epoch_samples(self) -> int:
        """The samples of one epoch over every rank (the factory sampler's length)."""
        return len(self._sampler)

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler of the loader now iterated; iterated outside this wrapper (by a
        framework's own DataLoader) it gives the next epoch's batches of this rank."""
        return self._loader.batch_sampler

    @property
    def drop_last(self) -> bool:
        """Whether an epoch's last short batch is dropped (the factory's)."""
        return bool(self._template.drop_last)

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
    def prefetch_factor(self) -> int | None:
        """Batches each worker of the loader now iterated loads ahead (None without workers, as
        torch's DataLoader says)."""
        if not self.knobs["num_workers"]:
            return None
        return int(self.knobs["prefetch_factor"])

    @property
    def dataloader(self) -> Any:
        """The torch DataLoader now iterated."""
        return self._loader

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._loader, name)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (and tell the factory's sampler, as a
        ``DistributedSampler``'s ``set_epoch``)."""
        epoch = int(epoch)
        if hasattr(self._sampler, "set_epoch"):
            self._sampler.set_epoch(epoch)
        if self._resume is not None and self._resume[0] != epoch:
            log.warning(
                "memtui: the script set epoch %d; the loader's resumed position, sample %d of "
                "epoch %d, is left: epoch %d starts from its first sample",
                epoch,
                self._resume[1],
                self._resume[0],
                epoch,
            )
            self._resume = self._held = None
        self._next_epoch = epoch

    def skip_batches(self, batches: int) -> str:
        """Make the next iteration skip the first ``batches`` batches of its epoch (``batches`` x
        the batch size x the ranks global samples), as a framework's ``skip_first_batches``; a
        position ``load_state_dict`` set wins: returns the line that says they disagree ("" when
        they agree)."""
        samples = int(batches) * int(self.knobs["batch_size"] or 1) * self.shard[1]
        if self._held is not None and self._resume is not None:  # the checkpoint's place, now
            self._resume, self._held = (self._resume[0], self._held), None
        if self._resume is not None:
            epoch, consumed = self._resume
            if consumed == samples:
                return ""
            return (
                f"memtui: the script skips {batches} batches ({samples} samples) of the epoch; "
                f"the saved position memtui restored is sample {consumed} of epoch {epoch}: the "
                "loader resumes there"
            )
        epoch = self._next_epoch if self._next_epoch is not None else self.epoch + 1
        self._next_epoch = None
        self._resume = self._position(epoch, samples)
        return ""

    @property
    def resume_position(self) -> tuple[int, int] | None:
        """(epoch, samples consumed in it) that ``load_state_dict`` set for the next iteration
        (None: the next iteration starts an epoch of its own)."""
        return self._resume

    def state_dict(self) -> dict[str, Any]:
        """Where the loop is in the data: the epoch and the samples consumed in it, and what its
        order is drawn from (under several ranks the base seed of the per-epoch order; in a
        single process the states of the generators at the epoch's start)."""
        rng: list[str] | None
        if self._resume is not None and not self._iterating:  # restored, not iterated yet
            consumed = self._resume[1] if self._held is None else self._held
            state: dict[str, Any] = {"epoch": self._resume[0], "samples_in_epoch": consumed}
            rng = self._resume_rng
        else:
            consumed = self._stream.consumed if self._stream is not None else 0
            state = {"epoch": max(self.epoch, 0), "samples_in_epoch": consumed}
            rng = self._epoch_rng
            if self._position(state["epoch"], consumed)[0] != state["epoch"] or self.epoch < 0:
                rng = self._generator_states_now()  # the next epoch starts from them as they are
        seed = self._base_seed if self._base_seed is not None else self._saved_seed
        if seed is not None:
            state["seed"] = seed
        if rng:
            state["generators"] = list(rng)
        return state

    def _generator_states_now(self) -> list[str] | None:
        """The generators' states now (None: none, or they cannot be read)."""
        try:
            generators = self._generators()
            return generator_states(generators) if generators else None
        except Exception:
            return None

    def load_state_dict(self, state: Mapping[str, Any], *, held: bool = False) -> None:
        """Make the next iteration resume ``state``'s epoch after the samples already consumed.

        ``held``: the samples wait for ``skip_batches`` (a framework's ``skip_first_batches``,
        which the script calls to resume inside the epoch); an iteration that starts without it
        starts the epoch from its first sample, for a script that skips batches itself.
        """
        epoch = int(state.get("epoch", 0))
        self._resume = self._position(epoch, int(state.get("samples_in_epoch", 0)))
        self._held = None
        if held and self._resume[1]:
            self._resume, self._held = (self._resume[0], 0), self._resume[1]
        self._next_epoch = None
        if state.get("seed") is not None:  # the order of the run it resumes, agreed again
            self._saved_seed, self._base_seed = int(state["seed"]), None
        kept = state.get("generators")
        self._resume_rng = None  # else the resumed epoch's own order, as the generators gave it
        if isinstance(kept, list) and all(isinstance(g, str) for g in kept):
            self._resume_rng = [str(g) for g in kept]
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
