"""A torch ``DataLoader`` memtui did not build, rebuilt from its own arguments with other knobs.

A framework's or a script's own loader (Lightning's ``train_dataloader()``, a loader passed to
``trainer.fit``) is not memtui's: ``rebuild_factory(loader)`` gives the loader factory
``tuner.loader(factory)`` takes, which builds the same loader again with another ``batch_size``,
``num_workers``, ``pin_memory`` or ``prefetch_factor``. Everything else is the loader's own, read
from the loader as it is now (Lightning re-instantiates a loader from its attributes the same
way): the dataset, the very sampler object (its order, its generator, a ``DistributedSampler``'s
rank and epoch), ``drop_last``, ``collate_fn``, ``worker_init_fn``, the loader's ``generator``,
``timeout``, ``multiprocessing_context``, ``persistent_workers``, ``pin_memory_device`` and
``in_order``.

``why_not_rebuilt(loader)`` says why a loader cannot be rebuilt faithfully ("" when it can): not a
``DataLoader``, a subclass (its own arguments and behaviour are unknown), an ``IterableDataset``
(its position cannot be kept), automatic batching off, a custom batch sampler (its batch size is
its own), a sampler without a length, or an argument of ``DataLoader`` this module does not
carry over set to other than its default.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from memtui.core.knobs import DEFAULT_PREFETCH_FACTOR

CARRIED = frozenset(
    {
        "self",
        "dataset",
        "batch_size",
        "shuffle",
        "sampler",
        "batch_sampler",
        "num_workers",
        "collate_fn",
        "pin_memory",
        "drop_last",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    }
)
"""The ``DataLoader.__init__`` arguments a rebuild carries over or replaces (``shuffle`` is the
sampler's own: the sampler object is kept)."""


OWN_LOADER = "or give the training a loader of memtui's own, tuner.loader(factory)"
"""The other way to make the loader knobs tunable, whatever the loader's own is."""


def why_not_rebuilt(loader: Any) -> str:
    """Why ``loader`` cannot be rebuilt from its own arguments with other knobs, and how to make
    them tunable ("" if it can)."""
    why = _why_not_rebuilt(loader)
    return f"{why[0]}; to make them tunable, {why[1]}, {OWN_LOADER}" if why else ""


def _why_not_rebuilt(loader: Any) -> tuple[str, str] | None:
    """Why ``loader`` cannot be rebuilt, and what of it to change (None: it can be)."""
    from torch.utils.data import BatchSampler, DataLoader, IterableDataset

    kind = f"{type(loader).__module__}.{type(loader).__qualname__}"
    if not isinstance(loader, DataLoader):
        why = f"the training data comes from a {kind}, not a torch DataLoader"
        return why, "train from a torch DataLoader"
    if type(loader) is not DataLoader:
        why = (
            f"the training loader is a DataLoader subclass ({kind}), whose arguments memtui "
            "does not know"
        )
        return why, "train from a torch DataLoader itself"
    if isinstance(loader.dataset, IterableDataset):
        why = "the training DataLoader reads an IterableDataset, whose position a rebuild loses"
        return why, "read a map-style Dataset"
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:
        why = "the training DataLoader does not batch (batch_size=None)"
        return why, "let the DataLoader batch (batch_size=N)"
    if type(batch_sampler) is not BatchSampler:
        name = f"{type(batch_sampler).__module__}.{type(batch_sampler).__qualname__}"
        why = (
            f"the training DataLoader batches with its own batch sampler ({name}), whose batch "
            "size memtui cannot change"
        )
        return why, "give the DataLoader batch_size= and a sampler instead"
    try:
        len(batch_sampler.sampler)
    except (TypeError, NotImplementedError):
        why = "the training DataLoader's sampler has no length (memtui counts an epoch's batches)"
        return why, "give the sampler a __len__"
    for name, parameter in inspect.signature(DataLoader.__init__).parameters.items():
        if name in CARRIED or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if _differs(getattr(loader, name, parameter.default), parameter.default):
            why = (
                f"the training DataLoader sets {name}, which memtui does not carry over to a new "
                "loader"
            )
            return why, f"leave {name} at its default"
    return None


def _differs(value: Any, default: Any) -> bool:
    """Whether an argument's value is not its default (one that cannot be compared differs)."""
    if value is default:
        return False
    try:
        return bool(value != default)
    except Exception:
        return True


def rebuild_factory(loader: Any) -> Callable[..., Any]:
    """A loader factory for ``tuner.loader``: ``loader`` built again with the knobs it is given
    (its own values by default)."""
    from torch.utils.data import DataLoader

    batch_sampler = loader.batch_sampler
    dataset, sampler, drop_last = loader.dataset, batch_sampler.sampler, batch_sampler.drop_last
    own: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):  # torch 2.6 and later
        own["in_order"] = loader.in_order

    def rebuilt(
        batch_size: int = int(batch_sampler.batch_size),
        num_workers: int = int(loader.num_workers),
        pin_memory: bool = bool(loader.pin_memory),
        prefetch_factor: int = int(loader.prefetch_factor or DEFAULT_PREFETCH_FACTOR),
    ) -> Any:
        workers = int(num_workers)
        kwargs = dict(own)
        if workers > 0:
            kwargs["prefetch_factor"] = int(prefetch_factor)
        else:  # torch refuses these without worker processes
            kwargs["multiprocessing_context"] = None
            kwargs["persistent_workers"] = False
        return DataLoader(
            dataset,
            batch_size=int(batch_size),
            sampler=sampler,
            drop_last=drop_last,
            num_workers=workers,
            pin_memory=bool(pin_memory),
            **kwargs,
        )

    return rebuilt
