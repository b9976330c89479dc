"""The rest of an epoch of the script's own DataLoader, delivered with other worker knobs.

Under ``memtui run`` the loop holds the iterator torch made with ``iter(loader)`` (or a
framework's generator that holds it: Accelerate's ``DataLoaderShard``, Fabric's
``_FabricDataLoader``, a ``CycleIterator``), and every batch comes through that iterator's
``__next__``, which the watch times. A change of ``num_workers``, ``pin_memory`` or
``prefetch_factor`` at a checkpoint in the middle of an epoch is taken there (``continue_epoch``):

1. the iterator's batch-sampler iterator (``_sampler_iter``: the epoch's remaining index batches,
   in the order the sampler drew them) is taken from it, and an empty one put in its place: it
   dispatches no more batches to its workers;
2. a new ``DataLoader`` over the same dataset, with the loader's own collate function, worker
   init, timeout and the new knobs, iterates those remaining index batches (``_Rest``); its
   workers' base seed comes from the old iterator's, so no generator of the script's is drawn
   from;
3. the old iterator's ``__next__`` delivers what its workers had already been given (each batch
   once, in order), then the new iterator's batches, to the end of the epoch
   (``Continuation``): every index batch of the epoch once, in the sampler's order.

Persistent workers are shut down once delivered; the loader's own attributes hold the new values,
so its next epoch starts its own iterator with them. Only a torch ``DataLoader`` (not a subclass,
whose iteration may be its own) over a map-style dataset that batches can be continued
(``why_not_continued``): an ``IterableDataset``'s position lives in its workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("memtui")

SAMPLER_ITER = "_sampler_iter"
"""The attribute of torch's DataLoader iterator that holds the epoch's index-batch iterator."""

Counter = Callable[[float, Any], None]
"""``count(wait_s, batch)``: a training batch delivered after ``wait_s`` seconds."""


def why_not_continued(loader: Any) -> str:
    """Why the epoch under way of ``loader`` cannot be continued with other knobs ("" if it can)."""
    from torch.utils.data import DataLoader, IterableDataset

    kind = f"{type(loader).__module__}.{type(loader).__qualname__}"
    if type(loader) is not DataLoader:
        return f"the training loader is a DataLoader subclass ({kind}), whose iteration is its own"
    if isinstance(loader.dataset, IterableDataset):
        return (
            "the training DataLoader reads an IterableDataset, whose position in the epoch lives "
            "in its workers"
        )
    if loader.batch_sampler is None:
        return "the training DataLoader does not batch (batch_size=None)"
    return ""


class _Rest:
    """The remaining index batches of an epoch, as a batch sampler of one iteration."""

    def __init__(self, batches: Iterator[Any], length: int) -> None:
        self.batches = batches
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        return self.batches

    def __len__(self) -> int:
        return self.length


def _remaining(loader: Any, iterator: Any) -> int:
    """The epoch's index batches the iterator has not dispatched yet (0 when unknown)."""
    try:
        sent = getattr(iterator, "_send_idx", None)
        done = getattr(iterator, "_num_yielded", 0) if sent is None else sent
        return max(0, len(loader.batch_sampler) - int(done))
    except Exception:
        return 0


def exhausted(loader: Any, iterator: Any) -> bool:
    """Whether ``iterator`` has delivered its epoch (or stopped): nothing is left to continue."""
    if getattr(iterator, "_shutdown", False) or getattr(iterator, "_sampler_iter", None) is None:
        return True
    try:
        return int(getattr(iterator, "_num_yielded", 0)) >= len(loader.batch_sampler)
    except Exception:
        return False


def _loader_with(loader: Any, rest: _Rest, base_seed: int) -> Any:
    """A DataLoader over ``loader``'s dataset for the index batches of ``rest``, with the knobs
    the loader holds now."""
    import torch
    from torch.utils.data import DataLoader

    workers = int(loader.num_workers)
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": bool(loader.pin_memory),
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        # drawn from the old iterator's base seed: the script's generators are left alone
        "generator": torch.Generator().manual_seed(int(base_seed) & ((1 << 63) - 1)),
        "pin_memory_device": loader.pin_memory_device,
    }
    if workers > 0:
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
        if loader.prefetch_factor is not None:
            kwargs["prefetch_factor"] = int(loader.prefetch_factor)
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return DataLoader(loader.dataset, batch_sampler=rest, **kwargs)


class Continuation:
    """What an iterator's ``__next__`` delivers once its epoch was continued: the batches its
    workers already had, then those of iterators made with the new knobs (the last one made is
    the one whose batches come last)."""

    def __init__(
        self,
        first: Any,
        loader: Any,
        own_next: Callable[[Any], Any],
        count: Counter | None,
    ) -> None:
        self.loader = loader
        self.own_next = own_next
        self.count = count
        """Counts the delivered batches as training micro-batches (None: not counted)."""
        self.draining: list[Any] = [first]
        """Iterators whose dispatched batches are still to deliver, oldest first."""
        self.current: Any = None
        self.then: Callable[[], Any] | None = None
        """Makes the iterator of the epoch's last batches, once ``current`` delivered its own
        (None: ``current``'s are the last)."""
        self.rest: Iterator[Any] | None = None
        self.seed = int(getattr(first, "_base_seed", 0))

    def switch(self) -> None:
        """Continue the epoch from now on with a new DataLoader built with the loader's knobs."""
        last = self.current if self.current is not None else self.draining[-1]
        if self.current is not None:
            self.draining.append(self.current)
        # torch's iterator draws its next index batch from ``_sampler_iter`` (no public way):
        # it dispatches nothing more, and the new loader goes on from where it stopped
        rest = getattr(last, SAMPLER_ITER)
        setattr(last, SAMPLER_ITER, iter(()))
        remaining = _remaining(self.loader, last)
        self.rest = rest
        fresh = _loader_with(self.loader, _Rest(rest, remaining), self.seed)
        from torch.utils.data import DataLoader

        own_iter = getattr(DataLoader.__iter__, "__wrapped__", DataLoader.__iter__)
        self.current = own_iter(fresh)

    def replace(self, iterator: Any, then: Callable[[], Any] | None = None) -> None:
        """Continue the epoch from now on with ``iterator``, whose place covers the batches the
        iterators before it were given (they are shut down, their batches not delivered), then
        with the iterator ``then`` makes, if any."""
        for old in (*self.draining, self.current):
            if old is not None and old is not iterator:
                self._retire(old)
        self.draining = []
        self.current, self.then = iterator, then

    def __call__(self) -> Any:
        """The next batch of the epoch (StopIteration at its end)."""
        draining = self.draining
        while draining:
            try:
                return self._deliver(draining[0])
            except StopIteration:
                self._retire(draining.pop(0))
        try:
            return self._deliver(self.current)
        except StopIteration:
            if self.then is None:
                raise
        then, self.then = self.then, None
        self.current = then()
        return self._deliver(self.current)

    def _deliver(self, iterator: Any) -> Any:
        count = self.count
        if count is None:
            return self.own_next(iterator)
        t0 = time.perf_counter()
        batch = self.own_next(iterator)
        count(time.perf_counter() - t0, batch)
        return batch

    def _retire(self, iterator: Any) -> None:
        """An iterator delivered all it had: its workers (persistent ones too) are shut down."""
        from memtui.hooks.loader import shutdown_workers

        try:
            shutdown_workers(iterator, self.loader)
        except Exception as exc:  # its workers end with the process
            log.debug("memtui: a drained loader iterator not shut down (%s)", exc)
