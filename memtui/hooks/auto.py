"""Watching a plain PyTorch loop with no code: steps from the optimizer, data wait from the loader.

``activate()`` runs at interpreter start (``memtui run``'s ``sitecustomize``). It imports
nothing heavy: it puts a finder first on ``sys.meta_path`` that finds nothing itself, and for a
module someone asked about with ``on_import`` wraps the loader the other finders return, so that
the callbacks run right after that module's code finished (once per process; a module already
imported gets them at once). The module's ``__loader__`` and ``__spec__.loader`` are the real
loader again before its code runs, so ``importlib.reload``, ``python -m``, pickling and
``inspect`` see what they would without memtui.

When ``torch`` is imported, two hooks watch the training:

* a global optimizer step post hook (``register_optimizer_step_post_hook``) closes one step per
  step of the **counted optimizer**: the first optimizer that steps in this process (a GAN's
  second optimizer, stepping in the same iteration, is not counted again); when it is garbage
  collected, the next optimizer that steps is counted. Its parameters, gradients and state are
  the run's exact memory parts (``Tuner.measure_optimizer``: read from the tensors as its first
  step ends and at every boundary, never on the per-step path);
* ``DataLoader.__iter__`` is wrapped (once an epoch: where the training loader's epoch starts);
  from the first iteration the DataLoader iterators' ``__next__`` is timed over torch's own for
  the iterators of the training DataLoader: each of its batches' wait is the micro-batch's data
  wait, ``batch_samples`` its samples (the first dimension of its first tensor).

The **training DataLoader** is the one whose iteration started last before the counted
optimizer's first step (a loop that evaluates before it trains starts its training loader
after). Only its batches are counted: an evaluation pass between steps (another DataLoader,
told apart by identity) adds neither samples nor data wait to the step it runs in, though its
time is in that step's time. Before the first step every DataLoader's batches count, and a
DataLoader that starts then drops what the one before it counted (the last to start is the
training loader). Its ``num_workers``, ``pin_memory`` and ``prefetch_factor`` become the run's knobs: a
change queued for them is applied when the loop next starts iterating that loader (the next
epoch, the same step on every rank): ``Tuner.epoch_boundary`` takes and agrees on the pending
changes there, and the new values are set on the DataLoader before it makes the epoch's iterator
(its persistent workers, if any, shut down first). A loop that makes a new DataLoader over the
same dataset each epoch gets the tuned values on the new one. The batch size and the
accumulation stay in the loop's code (the plain-loop guide's lines make them tunable); a loader
over an ``IterableDataset`` keeps its worker count (such a dataset splits its data between
workers itself, or repeats it); the run says why for each knob it cannot take.

The Tuner is created at the first optimizer step or DataLoader iteration (a launcher process that
does neither, torchrun's, registers nothing), with no knobs until that first step, named by
``MEMTUI_RUN_NAME`` and writing to ``MEMTUI_RUN_STATE_DIR`` when they are set. A DataLoader
worker never creates one (``torch.utils.data.get_worker_info()``). A Tuner started by other means
(``hooks.install`` in the script, a framework's adapter) calls ``adopt``: the watch stands down,
its hooks undone and its own Tuner, if it had made one, closed, so no step is counted twice.

Steps that arrive with no DataLoader batch (a loop drawing its batches some other way) carry
``micro_batches == 0``: their data wait was not measured, not zero.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

from memtui.hooks.environment import HookEnvironment

log = logging.getLogger("memtui")

ImportCallback = Callable[[ModuleType], None]

_lock = threading.RLock()
_callbacks: dict[str, list[ImportCallback]] = {}
"""The callbacks still waiting for their module, by module name."""
_fired: set[str] = set()
"""The modules whose callbacks have run (a reload runs none again)."""
_finder: _PostImportFinder | None = None


# --------------------------------------------------------------------------- post-import hooks


class _NotifyingLoader:
    """A module's own loader, whose ``exec_module`` then runs the module's import callbacks."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: Any) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        loader = self._loader
        # the module sees its real loader, as without memtui (resources, reload, inspect)
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = loader
        loader.exec_module(module)
        _imported(self._name, sys.modules.get(self._name, module))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder:
    """First on ``sys.meta_path``: finds nothing itself; for a watched module it asks the
    finders after it and wraps the loader of the spec they return."""

    def __init__(self) -> None:
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _callbacks or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
        except Exception:  # the import system finds it again and says what is wrong
            return None
        finally:
            self._finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _NotifyingLoader(loader, fullname)  # type: ignore[union-attr]
        return spec


def _imported(name: str, module: ModuleType) -> None:
    """Run ``name``'s callbacks once (never into the import: a failure is logged)."""
    with _lock:
        if name in _fired:
            return
        _fired.add(name)
        callbacks = _callbacks.pop(name, [])
    for callback in callbacks:
        _run(callback, module)


def _run(callback: ImportCallback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:
        log.warning(
            "memtui: a hook on importing %s failed (%s: %s); the program goes on without it",
            getattr(module, "__name__", "?"),
            type(exc).__name__,
            exc,
        )


def _ready(name: str) -> ModuleType | None:
    """The module ``name`` if its code has finished running (None: not imported, or under way)."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    return None if getattr(spec, "_initializing", False) else module


def on_import(name: str, callback: ImportCallback) -> None:
    """Call ``callback(module)`` once, right after the module ``name`` finished importing (at
    once when it already has)."""
    with _lock:
        module = _ready(name)
        if module is None:
            _callbacks.setdefault(name, []).append(callback)
            _install_finder()
            return
        _fired.add(name)
    _run(callback, module)


def _install_finder() -> None:
    global _finder
    if _finder is None or _finder not in sys.meta_path:
        _finder = _finder or _PostImportFinder()
        sys.meta_path.insert(0, _finder)


# --------------------------------------------------------------------------- activation


def activate() -> None:
    """Watch this process's training when it imports torch, and let frameworks be found on
    import (``memtui.hooks.autoframe``); never raises, imports nothing heavy."""
    try:
        if HookEnvironment.read().disable:
            return
        with _lock:
            if _watch.activated:
                return
            _watch.activated = True
        on_import("torch", _on_torch)
        try:
            autoframe = importlib.import_module("memtui.hooks.autoframe")
            autosave = importlib.import_module("memtui.hooks.autosave")
        except ImportError:
            return
        autoframe.register(on_import)
        autosave.register(on_import)
    except Exception as exc:  # never into the program's start
        log.warning("memtui: not watching (%s: %s)", type(exc).__name__, exc)


def _nothing() -> None:
    return None


class _Watch:
    """This process's watch: its Tuner, its hooks on torch, and whether it stood down."""

    def __init__(self) -> None:
        self.activated = False
        self.tuner: Any = None
        self.creating = False
        self.stood_down = False
        self.step_handle: Any = None
        self.disarm_steps: Callable[[], None] | None = None
        self.in_step_hook = False
        self.restore_loader: list[Callable[[], None]] = []
        self.timing = False
        """Whether the DataLoader iterators' ``__next__`` is timed (it is wrapped once)."""
        self.found = False
        """Whether the counted optimizer has made its first step (the training loader is known)."""
        self.early: list[Callable[[], Any]] = []
        """The iterators counted before that step (weak references): a DataLoader that starts
        after them stops their count."""
        self.last_started: Callable[[], Any] = _nothing
        """The DataLoader whose iteration started last (a weak reference; None: none yet)."""
        self.train: Callable[[], Any] = _nothing
        """The training DataLoader, found at the first counted step (a weak reference)."""
        self.train_dataset: Callable[[], Any] = _nothing
        """Its dataset: a new DataLoader over it is the training loader of a later epoch."""
        self.live: tuple[Callable[[], Any], Callable[[], Any]] = (_nothing, _nothing)
        """(the loader, its iterator) of the counted iterator made last (weak references): the
        epoch a save continues with other knobs."""
        self.own_next: Callable[[Any], Any] | None = None
        """torch's own ``__next__`` of the DataLoader iterators (the timed one calls it)."""
        self.count: Callable[[float, Any], None] | None = None
        """Counts one training batch (its wait and samples) in the open step."""
        self.continued: weakref.WeakSet[Any] = weakref.WeakSet()
        """The epochs continued with other knobs that may still deliver batches."""
        self.saved_step = -1
        """The step of the last save taken as a boundary (one a step)."""
        self.first_save: int | None = None
        """The step of this rank's first ``torch.save`` of its training state (several ranks)."""
        self.every_rank: bool | None = None
        """Whether every rank saves its training state with ``torch.save`` (None: not known)."""
        self.reseed: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        """Loaders whose persistent iterator memtui shut down, with that iterator's base seed:
        their next iterator draws its own from it (``_iterator_seeded``)."""
        self.why_not_mid: str | None = None
        """Why the training loader's epoch cannot be continued with other knobs ("" it can;
        None: not looked at yet)."""


_watch = _Watch()


def _on_torch(_torch: ModuleType) -> None:
    """Install the step hook and the DataLoader wrapper (torch has finished importing)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import dataloader

    with _lock:
        if _watch.stood_down or _watch.step_handle is not None:
            return
        hook, disarm = _step_hook()
        _watch.disarm_steps = disarm
        _watch.step_handle = register_optimizer_step_post_hook(hook)
        loader_class = dataloader.DataLoader
        own_iter = loader_class.__iter__

        def iterate(loader: Any) -> Any:
            counted = _loader_starts(loader)
            seed = _watch.reseed.pop(loader, None) if _watch.reseed else None
            if seed is None:
                iterator = own_iter(loader)
            else:
                iterator = _iterator_seeded(own_iter, loader, seed)
            _mark(iterator, counted)
            if counted:
                _watch.live = (_weak(loader), _weak(iterator))
            return iterator

        iterate.__wrapped__ = own_iter  # type: ignore[attr-defined]
        loader_class.__iter__ = iterate
        _watch.restore_loader.append(lambda: _put_back(loader_class, "__iter__", iterate, own_iter))
        from memtui.hooks import autosave

        autosave.wrap_torch_save(_torch)


def _put_back(owner: type, name: str, ours: Any, theirs: Any) -> None:
    """Restore ``owner.name`` unless someone replaced ours since (then theirs calls ours)."""
    if owner.__dict__.get(name) is ours:
        setattr(owner, name, theirs)


def _step_hook() -> tuple[Callable[[Any, Any, Any], None], Callable[[], None]]:
    """The global optimizer step post hook, and the function that makes it a no-op."""
    counted = -1  # ``id`` of the counted optimizer; -1: none yet; -2: not counting
    counted_ref: Any = None  # a weak reference to it: its callback fires while this holds it
    close: Callable[[], None] = _nothing

    def forget(_ref: Any) -> None:  # the counted optimizer was collected: the next is counted
        nonlocal counted
        if counted != -2:
            counted = -1

    def disarm() -> None:
        nonlocal counted, counted_ref, close
        counted, counted_ref, close = -2, None, _nothing

    def hook(optimizer: Any, _args: Any, _kwargs: Any) -> None:
        nonlocal counted, counted_ref, close
        # the hot path, once per optimizer step: one ``id``, one comparison, one call
        if id(optimizer) == counted:
            close()
            return
        if counted != -1:  # another optimizer, or not counting
            return
        _watch.in_step_hook = True
        try:
            tuner = _watch_tuner()
            if tuner is None or counted != -1:
                return
            try:
                counted_ref = weakref.ref(optimizer, forget)
            except TypeError:  # an optimizer without weak references stays the counted one
                counted_ref = None
            counted = id(optimizer)
            # its tensors are the memory parts, read as its first step ends
            tuner.measure_optimizer(optimizer)
            tuner.step()  # the first step (it measures the memory held between steps)
            close = tuner.step  # now the ledger's own ``close_step``
            _first_counted_step(tuner, optimizer)
        except Exception as exc:
            _give_up(exc)
        finally:
            _watch.in_step_hook = False

    return hook, disarm


def _loader_starts(loader: Any) -> bool:
    """A DataLoader starts an iteration: whether its batches are counted (the training loader's,
    or any before the counted optimizer's first step); at the training loader's, apply the
    pending changes and its knobs (never raises into the loop)."""
    if _watch.stood_down:
        return False
    if not _watch.timing:
        _time_loaders()
    tuner = _watch.tuner
    if tuner is None:
        return False
    try:
        previous = _watch.last_started()
        _watch.last_started = _weak(loader)
        if not _watch.found:
            _before_first_step(tuner, loader, previous)
            return True
        training = _is_training_loader(loader)
    except Exception as exc:
        tuner.report(exc, "the training DataLoader's epoch start")
        return False
    if training:
        try:
            applied = tuner.epoch_boundary()
            changed = _set_knobs(loader, tuner.store.knobs) or applied is not None
            if changed or _starts_workers(loader):  # the host sample lists them anew
                tuner.loader_changed()
        except Exception as exc:
            tuner.report(exc, "the training DataLoader's epoch start")
    return training


def _before_first_step(tuner: Any, loader: Any, previous: Any) -> None:
    """A DataLoader starts before the counted optimizer's first step: it may be the training
    loader; what another loader counted before it was not training (the training loader is the
    last to start), so that count is dropped and the first step's clock starts here."""
    ledger = tuner.ledger
    if previous is not loader:
        for counted in _watch.early:
            iterator = counted()
            if iterator is not None:
                setattr(iterator, COUNTED, False)
        _watch.early.clear()
        if ledger.open.micro:
            ledger.reset_open_step()
    ledger.start_clock()


COUNTED = "_memtui_counted"
"""The attribute of a DataLoader iterator that says whether its batches are counted (set on each
iterator made while the watch times them; ``False`` on the iterator class for the others, kept
after the watch stands down: a wrapper of someone else's may still call the timed ``__next__``)."""


def _mark(iterator: Any, counted: bool) -> None:
    """Say on a new DataLoader iterator whether its batches are counted (never raises)."""
    if not _watch.timing:
        return
    try:
        setattr(iterator, COUNTED, counted)
        if counted and not _watch.found:
            # the live ones only: a loop that makes an iterator a batch keeps this list short
            _watch.early = [ref for ref in _watch.early if ref() is not None]
            _watch.early.append(_weak(iterator))
    except Exception as exc:  # an iterator that takes no attribute: its batches are not counted
        log.debug("memtui: a DataLoader iterator not counted (%s)", exc)


def _starts_workers(loader: Any) -> bool:
    """Whether ``loader``'s iteration starts worker processes of its own (workers that are not
    persistent end with each epoch, and the next one starts new ones)."""
    if not getattr(loader, "num_workers", 0):
        return False
    persistent = getattr(loader, "persistent_workers", False)
    return not (persistent and getattr(loader, "_iterator", None) is not None)


def _weak(value: Any) -> Callable[[], Any]:
    """A weak reference to ``value`` (one that always answers None where it takes none)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return _nothing


def _is_training_loader(loader: Any) -> bool:
    """Whether ``loader`` is the training DataLoader (or a new one over its dataset, after the
    training loader of an earlier epoch was collected)."""
    train = _watch.train()
    if train is loader:
        return True
    dataset = _watch.train_dataset()
    if train is None and dataset is not None and getattr(loader, "dataset", None) is dataset:
        _watch.train = _weak(loader)
        return True
    return False


BATCH_IN_CODE = (
    "memtui run cannot change a plain loop's batch size or accumulation: the loop's own code sets "
    "them; to make them tunable, add the plain-loop guide's lines"
)
NO_LOADER = (
    "memtui run saw no DataLoader feeding this loop's optimizer steps (the loop draws its batches "
    "itself); to make them tunable, feed the loop from a torch DataLoader, or add the "
    "plain-loop guide's lines (tuner.loader(factory), or tuner.timed_batches for a get_batch "
    "loop)"
)
ITERABLE = (
    "the training DataLoader reads an IterableDataset, which splits its data between workers "
    "itself (or repeats it in each): memtui cannot tell which, so it keeps the script's workers; "
    "to make them tunable, build that loader with tuner.loader(factory) (the plain-loop guide's "
    "lines): your dataset then splits its data as it does for any number of workers"
)
WHEN = "the training DataLoader's next epoch"
WHEN_SAVED = (
    "the script's next save of its training state (torch.save of its model's or optimizer's "
    "state_dict, accelerator.save_state, fabric.save) or the training DataLoader's next epoch, "
    "whichever comes first"
)
ONE_RANK_SAVES = (
    "the training DataLoader's next epoch: the script saves its training state with torch.save "
    "on rank {ranks} only, and a save that not every rank makes cannot be a boundary of the job"
)
TAKEN = "the training DataLoader takes them as its next epoch starts"
CONTINUED = (
    "the training DataLoader goes on with them in the middle of its epoch, from the batches its "
    "workers had not been given yet (no sample lost or repeated)"
)


def _first_counted_step(tuner: Any, optimizer: Any) -> None:
    """After the counted optimizer's first step: its LR is followed, the training loader found,
    and a Tuner made before the process group was up (a loader iterated before
    ``init_process_group``) joins the other ranks."""
    _watch.found = True
    _watch.early.clear()  # the training loader's iterator stays counted, the others were stopped
    try:
        tuner.lr.watch_optimizer(optimizer)
        _find_training_loader(tuner)
        from memtui.hooks import autosave

        autosave.arm(_weak(optimizer), _saved)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            tuner.coordinate()
    except Exception as exc:  # the watch goes on without knobs
        tuner.report(exc, "finding the training DataLoader")


def _find_training_loader(tuner: Any) -> None:
    """At the counted optimizer's first step: the loader whose iteration started last feeds the
    steps; its worker knobs become the run's (the reasons said for the knobs it cannot take)."""
    from memtui.hooks.knobstore import loader_values

    store = tuner.store
    loader = _watch.last_started()
    # the loop's own micro-batch is the loader's (shown, not tunable); the accumulation is
    # measured from the steps
    held = loader_values(loader) if loader is not None else {}
    store.refuse("batch_size", BATCH_IN_CODE, held.get("batch_size"))
    store.refuse("grad_accum", BATCH_IN_CODE)
    if loader is None:
        for knob in ("num_workers", "pin_memory", "prefetch_factor"):
            store.refuse(knob, NO_LOADER)
        return
    from torch.utils.data import IterableDataset

    from memtui.core.knobs import DEFAULT_PREFETCH_FACTOR
    from memtui.hooks import midepoch, streaming

    _watch.train, _watch.train_dataset = _weak(loader), _weak(loader.dataset)
    found: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "prefetch_factor": loader.prefetch_factor or DEFAULT_PREFETCH_FACTOR,
    }
    # litdata's StreamingDataset splits its chunks between any number of workers itself
    if isinstance(loader.dataset, IterableDataset) and not streaming.splits_itself(loader):
        del found["num_workers"]
        store.refuse("num_workers", ITERABLE, held.get("num_workers"))
        if not loader.num_workers:
            del found["prefetch_factor"]  # no workers: nothing prefetches
            store.refuse("prefetch_factor", ITERABLE)
    store.adopt(found)
    tuner.follows_loader = True
    judge = streaming if streaming.is_streaming(loader) else midepoch
    why = _watch.why_not_mid = judge.why_not_continued(loader)
    tuner.control.boundary = WHEN_SAVED if not why else f"{WHEN} ({why}: a save takes no change)"
    tuner.boundary.loader_words = TAKEN


def _wanted(loader: Any, knobs: Any) -> dict[str, Any]:
    """The worker knobs of the run that ``loader`` does not hold yet."""
    wanted = {
        name: value
        for name, value in (
            ("num_workers", knobs.num_workers),
            ("pin_memory", knobs.pin_memory),
            ("prefetch_factor", knobs.prefetch_factor),
        )
        if value is not None
    }
    workers = wanted.get("num_workers", loader.num_workers)
    if not workers:
        wanted.pop("prefetch_factor", None)  # unused without workers: the loader keeps its own
    now = {name: getattr(loader, name, None) for name in wanted}
    return {} if now == wanted else wanted


def _set_knobs(loader: Any, knobs: Any) -> bool:
    """Give ``loader`` the run's worker knobs before it makes its iterator; whether it changed."""
    wanted = _wanted(loader, knobs)
    if not wanted:
        return False
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:  # persistent workers were started with the old values
        from memtui.hooks.loader import shutdown_workers

        _keep_seed(loader, iterator)
        shutdown_workers(iterator, loader)
    from memtui.hooks import streaming

    if streaming.is_streaming(loader):
        streaming.set_knobs(loader, wanted)
        return True
    for name, value in wanted.items():
        setattr(loader, name, value)
    return True


def _keep_seed(loader: Any, iterator: Any) -> None:
    """A loader's persistent iterator is replaced: its next iterator draws its workers' base seed
    from this one's, not from the script's generator, which a reused persistent iterator never
    draws from again (the order of the script's next epochs stays the one it has without
    memtui)."""
    seed = getattr(iterator, "_base_seed", None)
    if isinstance(seed, int):
        _watch.reseed[loader] = seed


def _iterator_seeded(own_iter: Callable[[Any], Any], loader: Any, seed: int) -> Any:
    """``own_iter(loader)`` (torch's ``__iter__``), the iterator's base seed drawn from a
    generator of memtui's seeded with ``seed``."""
    import torch

    own = loader.generator
    loader.generator = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    try:
        return own_iter(loader)
    finally:
        loader.generator = own


def _time_loaders() -> None:
    """At the first DataLoader iteration: time every DataLoader iterator's batches from now."""
    if _watch.timing:  # a wrapper of someone else's kept ours in the chain
        return
    try:
        tuner = _watch_tuner()
        if tuner is None:
            return
        from torch.utils.data import dataloader

        with _lock:
            if _watch.stood_down or _watch.timing:
                return
            _watch.timing = True
            iterator_class = dataloader._BaseDataLoaderIter  # noqa: SLF001
            own_next = iterator_class.__next__
            timed = _counted_next(own_next, tuner)
            setattr(iterator_class, COUNTED, False)
            iterator_class.__next__ = timed
            _watch.own_next = own_next

            def restore() -> None:
                # an epoch continued with other knobs is delivered through the timed
                # ``__next__`` (its first iterator dispatches nothing more): it stays
                if not _watch.continued:
                    _put_back(iterator_class, "__next__", timed, own_next)

            _watch.restore_loader.append(restore)
    except Exception as exc:
        _give_up(exc)


def _counted_next(own_next: Callable[[Any], Any], tuner: Any) -> Callable[[Any], Any]:
    """A DataLoader iterator's ``__next__`` that times the batches of a counted iterator as
    the open step's micro-batches: the wait for each and its samples (``batch_samples``)."""
    from memtui.hooks.batches import batch_samples, missed_once

    perf = time.perf_counter
    on_batch = tuner.ledger.on_batch
    missed = missed_once(tuner.report)

    @functools.wraps(own_next)
    def next_batch(iterator: Any) -> Any:
        # the hot path, once per batch: one attribute read and one comparison for a batch
        # counted, then two clock reads, the count and one ledger call; one more comparison
        # for a batch not counted
        counted = iterator._memtui_counted  # noqa: SLF001  (``COUNTED``: set by the watch)
        if counted is True:
            t0 = perf()
            batch = own_next(iterator)
            t1 = perf()
            samples = batch_samples(batch)
            if not samples:
                missed(batch)
            on_batch(t1 - t0, samples)
            return batch
        if not counted:
            return own_next(iterator)
        return counted()  # the epoch continued with other knobs (``midepoch.Continuation``)

    def count(wait_s: float, batch: Any) -> None:
        samples = batch_samples(batch)
        if not samples:
            missed(batch)
        on_batch(wait_s, samples)

    _watch.count = count
    return next_batch


def _saved(kind: str, seconds: float) -> None:
    """The script saved its training state (``autosave``): a checkpoint boundary where every
    rank makes that save, listed as the explicit lines' checkpoints are; loader knobs changed
    there continue the training loader's epoch. Never raises into the script's save."""
    tuner = _watch.tuner
    if tuner is None or _watch.stood_down or not _watch.found:
        return
    try:
        ledger = tuner.ledger
        if threading.get_ident() != ledger.training_thread or ledger.step == _watch.saved_step:
            return  # a save of another thread (it is no place of the loop), or again this step
        _watch.saved_step = ledger.step
        from memtui.hooks.autosave import TORCH_SAVE

        if kind == TORCH_SAVE and tuner.placement.world_size > 1 and not _every_rank_saves(tuner):
            return
        loader = _watch.train()
        if loader is not None and _watch.why_not_mid:  # its epoch keeps its knobs: listed only
            tuner.checkpoint(apply=False)
            return
        tuner.boundary.loader_words = CONTINUED
        try:
            applied = tuner.checkpoint()
        finally:
            tuner.boundary.loader_words = TAKEN
        if applied is not None and loader is not None:
            _continue_epoch(tuner, loader)
    except Exception as exc:
        tuner.report(exc, f"the script's {kind}")


def _every_rank_saves(tuner: Any) -> bool:
    """Whether every rank saves its training state with ``torch.save`` (several ranks): each
    posts the step of its first such save; from its second save on, a rank takes its saves as
    boundaries when every rank posted the same step (they did before this save: a step's
    collectives lie between), and rank 0 says where changes apply when not."""
    if _watch.every_rank is not None:
        return _watch.every_rank
    placement = tuner.placement
    coordinator = placement.coordinator
    if coordinator is None:
        return False
    store, step = coordinator.store, tuner.ledger.step
    if _watch.first_save is None:
        _watch.first_save = step
        store.set(f"saves/r{placement.rank}", str(step))
        return False  # the first save: whether the others save too is known at the next
    keys = [f"saves/r{r}" for r in range(placement.world_size)]
    saving = [r for r, key in enumerate(keys) if store.check([key])]
    first = str(_watch.first_save)
    every = len(saving) == len(keys) and all(_text(store.get(k)) == first for k in keys)
    _watch.every_rank = every
    if not every:
        ranks = ", ".join(map(str, saving)) or str(placement.rank)
        tuner.control.boundary = ONE_RANK_SAVES.format(ranks=ranks)
        tuner.control.touch()
    return every


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _continue_epoch(tuner: Any, loader: Any) -> None:
    """Give the training loader the knobs a save applied: the rest of the epoch under way comes
    from a loader with them (``midepoch``), the next epoch from the loader's own attributes."""
    from memtui.hooks.midepoch import Continuation, exhausted

    knobs = tuner.store.knobs
    owner, iterator = _watch.live[0](), _watch.live[1]()
    from memtui.hooks import streaming

    if streaming.is_streaming(loader):
        _continue_pass(tuner, loader, owner, iterator)
        return
    if owner is not loader or iterator is None or exhausted(loader, iterator):
        if _set_knobs(loader, knobs):  # the next epoch starts with them
            tuner.loader_changed()
        return
    if getattr(loader, "_iterator", None) is iterator:
        _keep_seed(loader, iterator)
        # persistent: the continuation shuts it down once delivered (torch has no public reset)
        loader._iterator = None  # noqa: SLF001
    if not _set_knobs(loader, knobs) or _watch.own_next is None:
        return
    counted = getattr(iterator, COUNTED, False)
    continuation = counted if isinstance(counted, Continuation) else None
    if continuation is None:
        continuation = Continuation(iterator, loader, _watch.own_next, _watch.count)
    continuation.switch()
    setattr(iterator, COUNTED, continuation)
    _watch.continued.add(continuation)
    tuner.loader_changed()


def _continue_pass(tuner: Any, loader: Any, owner: Any, iterator: Any) -> None:
    """Give litdata's ``StreamingDataLoader`` the knobs a save applied: the rest of the pass
    under way from its own resumption with them (``streaming``), the next pass from its own
    attributes."""
    from memtui.hooks import streaming
    from memtui.hooks.midepoch import Continuation

    counted = getattr(iterator, COUNTED, False) if iterator is not None else False
    continuation = counted if isinstance(counted, Continuation) else None
    current = iterator if continuation is None else continuation.current
    if owner is not loader or current is None or streaming.ended(current):
        if _set_knobs(loader, tuner.store.knobs):  # between passes: the next one takes them
            tuner.loader_changed()
        return
    wanted = _wanted(loader, tuner.store.knobs)
    if not wanted or _watch.own_next is None:
        return
    fresh, then = streaming.continue_with(loader, current, wanted, _own_iter)
    if continuation is None:
        continuation = Continuation(iterator, loader, _watch.own_next, _watch.count)
    continuation.replace(fresh, then)
    setattr(iterator, COUNTED, continuation)
    _watch.continued.add(continuation)
    tuner.loader_changed()


def _own_iter(loader: Any) -> Any:
    """torch's own ``DataLoader.__iter__`` of ``loader`` (an iterator of this pass, not a new
    epoch of the training loader)."""
    from torch.utils.data import DataLoader

    return getattr(DataLoader.__iter__, "__wrapped__", DataLoader.__iter__)(loader)


def _watch_tuner() -> Any:
    """The watch's Tuner, created on first use (None: stood down, or a loader worker)."""
    if _watch.tuner is not None or _watch.stood_down:
        return _watch.tuner
    from torch.utils.data import get_worker_info

    # a DataLoader worker (forked or spawned) is part of its rank's run, never a run of its
    # own; the process name is no guide: ``torch.multiprocessing.spawn`` starts real ranks
    if get_worker_info() is not None:
        return None
    with _lock:
        if _watch.tuner is not None or _watch.stood_down:
            return _watch.tuner
        from memtui import hooks

        _watch.creating = True
        try:
            environment = HookEnvironment.read()
            tuner = hooks.install(
                {}, name=environment.run_name, state_dir=environment.run_state_dir
            )
        finally:
            _watch.creating = False
        if _watch.stood_down:  # a Tuner of the script's own started meanwhile
            tuner.close()
            return None
        _watch.tuner = tuner
        return tuner


def _give_up(exc: BaseException) -> None:
    """memtui failed while watching: stand down, the training goes on untouched."""
    log.warning("memtui: not watching this training (%s: %s)", type(exc).__name__, exc)
    _stand_down()


def _stand_down() -> None:
    with _lock:
        _watch.stood_down = True
        try:
            from memtui.hooks import autosave

            autosave.disarm()
        except Exception as exc:  # the saves are reported to nobody: the flag is down
            log.debug("memtui: the save wrappers not put back (%s)", exc)
        for continuation in list(_watch.continued):
            continuation.count = None  # its batches are no longer counted
        if _watch.disarm_steps is not None:
            _watch.disarm_steps()
        # removing the hook while torch runs the hooks would change the dict it iterates: a
        # stand-down from inside the hook only disarms it (two comparisons a step)
        if _watch.step_handle is not None and not _watch.in_step_hook:
            _watch.step_handle.remove()
            _watch.step_handle = None
        for restore in _watch.restore_loader:
            restore()
        _watch.restore_loader.clear()


def adopt(tuner: Any) -> None:
    """A Tuner started by the script or a framework's adapter drives this process: the watch
    stands down (its hooks undone, its own Tuner closed), so no step is counted twice."""
    try:
        if _watch.creating or tuner is _watch.tuner:
            return
        if not _watch.activated and _watch.step_handle is None:
            return
        _stand_down()
        own, _watch.tuner = _watch.tuner, None
        if own is not None:
            own.close()
    except Exception as exc:
        log.warning("memtui: could not stand the watch down (%s: %s)", type(exc).__name__, exc)
