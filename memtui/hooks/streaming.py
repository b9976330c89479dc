"""litdata's ``StreamingDataLoader`` (litgpt's ``pretrain``): its pass goes on with other worker
knobs, through litdata's own resumption.

A ``StreamingDataset`` is an ``IterableDataset`` that splits its chunks between the loader's
workers itself, so its worker count is a knob like a map-style loader's. Its place in a pass is
not an index batch memtui can hand on: it is the loader's ``state_dict()`` (the samples the loop
was given), which litdata resumes from with ``load_state_dict``. A change at a save in the middle
of a pass (``continue_with``):

1. the loader's ``state_dict()`` is taken with the old knobs (the samples its iterator delivered:
   the batches its workers had prefetched are not in it, and come again);
2. the old iterator's workers are shut down, the loader given the new knobs, and the state loaded
   back: with the same worker count litdata replays each worker's place; with another, its
   elastic resume restripes the rest of the pass's sample stream onto the new workers, in the
   order the old workers would have delivered it (the state is marked elastic, so that a
   checkpoint saved later in the pass resumes the same way);
3. a new iterator of the loader's own delivers the rest of the pass through the old one's
   ``__next__`` (``midepoch.Continuation``).

With ``drop_last`` (litgpt's setting; every run on several ranks), litdata's elastic resume keeps
only a whole number of batches for each new worker; the few batches of the pass it would leave
out (fewer than one per worker) come after the others from the training process itself
(``tail_batches``), so every sample of the pass is trained once.

Only a ``StreamingDataLoader`` over a ``StreamingDataset`` is continued: litdata's combined and
parallel datasets resume only with the worker count they were saved with.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import cycle
from typing import Any

LOADER = ("litdata.streaming.dataloader", "StreamingDataLoader")
DATASET = ("litdata.streaming.dataset", "StreamingDataset")

WORKER_CYCLE = "_worker_idx"
WORKER_CYCLE_ITER = "_worker_idx_iter"
PREFETCH = "_prefetch_factor"
"""The loader's attributes that follow its worker count and prefetch (no public setter)."""


def _is(value: Any, kind: tuple[str, str]) -> bool:
    cls = type(value)
    return (cls.__module__, cls.__qualname__) == kind


def is_streaming(loader: Any) -> bool:
    """Whether ``loader`` is litdata's ``StreamingDataLoader`` (litdata is not imported)."""
    return _is(loader, LOADER)


def splits_itself(loader: Any) -> bool:
    """Whether ``loader`` is a ``StreamingDataLoader`` over a ``StreamingDataset``, which splits
    its chunks between any number of workers itself."""
    return is_streaming(loader) and _is(loader.dataset, DATASET)


def why_not_continued(loader: Any) -> str:
    """Why a ``StreamingDataLoader``'s pass under way cannot go on with other knobs ("" if it
    can)."""
    if splits_itself(loader):
        return ""
    dataset = type(loader.dataset)
    return (
        f"the training loader is litdata's StreamingDataLoader over a "
        f"{dataset.__module__}.{dataset.__qualname__}, which litdata resumes only with the "
        "workers it was saved with"
    )


def ended(iterator: Any) -> bool:
    """Whether a loader iterator delivered its pass (its workers shut down, or its dataset
    ended in the training process)."""
    if getattr(iterator, "_shutdown", False):
        return True
    return bool(getattr(getattr(iterator, "_dataset_fetcher", None), "ended", False))


def _give(loader: Any, wanted: dict[str, Any]) -> None:
    """Set ``wanted`` on the loader and what litdata keeps beside them."""
    for name, value in wanted.items():
        setattr(loader, name, value)
    setattr(loader, PREFETCH, loader.prefetch_factor if loader.num_workers else None)
    loader.dataset.set_num_workers(loader.num_workers)


def set_knobs(loader: Any, wanted: dict[str, Any]) -> None:
    """Give the loader ``wanted`` as its pass starts (or between passes): a pass resumed from
    a checkpoint goes on from its place with them, a fresh one deals its batches to the new
    workers from the first."""
    if loader.restore:
        _regrid(loader, wanted)
        return
    _give(loader, wanted)
    workers = cycle(range(max(1, int(loader.num_workers))))
    setattr(loader, WORKER_CYCLE, workers)
    setattr(loader, WORKER_CYCLE_ITER, iter(workers))


def _regrid(loader: Any, wanted: dict[str, Any]) -> None:
    """Load the loader's place back into it with ``wanted``: the rest of its pass with them."""
    state = loader.state_dict()
    before = max(1, int(loader.num_workers))
    _give(loader, wanted)
    if max(1, int(loader.num_workers)) != before:
        # litdata marks its elastic resume in the workers' copy of the state only: marked
        # here, a checkpoint saved later in the pass resumes elastically too
        state["dataset"]["resume_mode"] = "elastic"
    setattr(loader, WORKER_CYCLE, None)  # made again for the new worker count
    loader.load_state_dict(state)


def tail_batches(loader: Any, workers: int) -> int:
    """The batches of the pass under way a restripe onto ``workers`` workers would leave out
    (``drop_last``: litdata's elastic resume keeps a whole number of batches a worker)."""
    dataset = loader.dataset
    if not dataset.drop_last or workers <= 1:
        return 0
    batch = max(1, int(loader.batch_size))
    world = max(1, int(dataset.distributed_env.world_size))
    per_rank = int(dataset.get_len(loader.num_workers, batch))
    taken = int(loader.state_dict()["dataset"]["sample_in_epoch"])
    return ((per_rank * world - taken) % (world * workers * batch)) // (world * batch)


def continue_with(
    loader: Any, old: Any, wanted: dict[str, Any], own_iter: Callable[[Any], Any]
) -> tuple[Any, Callable[[], Any] | None]:
    """The rest of the pass ``old`` delivers, from a new iterator of the loader with ``wanted``,
    and what makes the iterator of its last batches (None: the new one delivers them all)."""
    from memtui.hooks.loader import shutdown_workers

    tail = tail_batches(loader, max(1, int(wanted.get("num_workers", loader.num_workers))))
    shutdown_workers(old, loader)
    _regrid(loader, wanted)
    fresh = own_iter(loader)
    if not tail:
        return fresh, None

    def last_batches() -> Any:
        """The pass's last batches, read in the training process (a worker count of 0 until
        the next pass starts with the knobs again)."""
        _regrid(loader, {"num_workers": 0})
        return own_iter(loader)

    return fresh, last_batches
