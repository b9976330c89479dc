"""Counting a batch's samples, and timing a batch function: a loop without a DataLoader.

``batch_samples`` is the one count of a training batch's samples wherever memtui has the batch in
hand: a timed batch function, a DataLoader under ``memtui run``, the Hugging Face Trainer's
micro-batches, a Lightning loader memtui does not own, a loader of memtui's that cannot follow
its indices. It is the first dimension of the first tensor or array in the batch (rows, not
tokens). A loader of memtui's that follows its sampler counts the indices it delivered instead:
for a collated batch, the same number.

nanoGPT's ``train.py`` draws each micro-batch with ``get_batch('train')``, a function over its
data that reads ``batch_size`` from the module's globals. ``tuner.timed_batches(get_batch)``
returns a function that calls it with the same arguments and returns what it returns, and hands
the step ledger the call's time as the micro-batch's data wait and its samples
(``batch_samples``, or a ``samples`` callable), through ``StepLedger.on_batch`` as the DataLoader
wrapper does. Nothing is rebuilt: a ``batch_size`` change reaches the function through the
config it reads, and the count follows what it returns.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, ParamSpec, TypeVar

from memtui.hooks.errors import Report
from memtui.hooks.ledger import StepLedger

BatchT = TypeVar("BatchT")
Args = ParamSpec("Args")


INPUT_IDS = "input_ids"
"""The key a mapping's samples are read from first (a tokenizer's batch: ``BatchEncoding``)."""
SEARCH_ITEMS = 256
"""The most values a batch's search for its first tensor looks at (it never walks a large or
cyclic structure)."""
SEARCH_DEPTH = 8
"""The deepest nesting the search goes into."""
COUNTING = "counting a batch's samples"
"""Where an uncounted batch is reported."""


def batch_samples(batch: Any) -> int:
    """The samples in a training batch: the first dimension of the first tensor or array in it
    (a mapping's ``input_ids`` first); a sequence of plain rows first in a tuple or list where it
    holds none of those; else 0; never raises."""
    # the common cases first, once per micro-batch on the training thread: a tensor, a tuple or
    # list led by a tensor, a dict (``shape[0]``: torch's ``len()`` is 3-4 times slower)
    try:
        if isinstance(batch, (tuple, list)):
            return int(batch[0].shape[0])
        if isinstance(batch, dict):
            first = batch.get(INPUT_IDS)
            return int((next(iter(batch.values())) if first is None else first).shape[0])
        return int(batch.shape[0])
    except Exception:
        pass
    if isinstance(batch, Mapping):  # a tokenizer's ``BatchEncoding`` (a ``UserDict``)
        try:
            first = batch[INPUT_IDS] if INPUT_IDS in batch else next(iter(batch.values()))
            return int(first.shape[0])
        except Exception:
            pass
    found = leading_dimension(batch)
    if found is None:
        return _plain_rows(batch)
    return found


def _plain_rows(batch: Any) -> int:
    """The rows of a batch of plain numbers with no tensor (a tuple or list led by a list of
    rows, each a list of numbers): its first item's length; else 0."""
    try:
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        if not isinstance(first, (tuple, list)) or not first:
            return 0
        row = first[0]
        numbers = (int, float, bool)
        if isinstance(row, (tuple, list)) and all(isinstance(v, numbers) for v in row[:8]):
            return len(first)
    except Exception:
        pass
    return 0


def leading_dimension(batch: Any) -> int | None:
    """The first dimension of the first tensor or array found in ``batch``, depth first in
    order (None: none found); never raises.

    A tensor or array is anything with a ``shape`` of at least one dimension (a 0-d tensor is a
    scalar: passed over). The search goes into tuples, lists and namedtuples; any ``Mapping``
    (a dict, a ``UserDict`` such as transformers' ``BatchEncoding``, an ``OrderedDict`` such as
    its ``ModelOutput``), its ``input_ids`` first; dataclasses, by field; and other objects, by
    their attributes. At most ``SEARCH_ITEMS`` values, ``SEARCH_DEPTH`` deep.
    """
    try:
        pending: list[tuple[Any, int]] = [(batch, 0)]
        looked = 0
        while pending and looked < SEARCH_ITEMS:
            value, depth = pending.pop()
            looked += 1
            size = _first_dimension(value)
            if size is not None:
                return size
            if depth < SEARCH_DEPTH:
                inside = _inside(value)
                pending.extend((item, depth + 1) for item in reversed(inside))
    except Exception:  # an object that refuses to be looked into: nothing found
        return None
    return None


def _first_dimension(value: Any) -> int | None:
    """``value.shape[0]`` where ``value`` has a shape of one dimension or more."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return None
    try:
        shape = value.shape
        if len(shape) > 0:
            return int(shape[0])
    except Exception:
        return None
    return None


def _inside(value: Any) -> list[Any]:
    """The values ``value`` holds, in order, a mapping's ``input_ids`` first ([]: none)."""
    if isinstance(value, (str, bytes, bytearray, memoryview, type, ModuleType)):
        return []
    if isinstance(value, Mapping):
        return _mapping_values(value)
    if isinstance(value, (tuple, list)) or (
        isinstance(value, Sequence) and not isinstance(value, range)
    ):
        return list(itertools.islice(value, SEARCH_ITEMS))
    if dataclasses.is_dataclass(value):
        fields = dataclasses.fields(value)[:SEARCH_ITEMS]
        return _mapping_values({f.name: getattr(value, f.name, None) for f in fields})
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not callable(value):
        return _mapping_values(attributes)
    return []


def _mapping_values(mapping: Mapping[Any, Any]) -> list[Any]:
    """A mapping's values in order, its ``input_ids`` first (at most ``SEARCH_ITEMS``)."""
    values = list(itertools.islice(mapping.values(), SEARCH_ITEMS))
    if INPUT_IDS in mapping:
        values.insert(0, mapping[INPUT_IDS])
    return values


class UncountedBatch(Exception):
    """A training batch with no tensor or array in it: its samples count as 0."""

    def __init__(self, batch: Any) -> None:
        kind = type(batch)
        super().__init__(
            f"no tensor or array in a batch of {kind.__module__}.{kind.__qualname__}: its "
            "samples count as 0 (a batch function's samples= callable counts them your way)"
        )


def missed_once(report: Report) -> Callable[[Any], None]:
    """A check for a batch counted as 0 samples: the first one that holds no tensor is
    reported (once for the counting site; an empty batch is not reported)."""
    said = False

    def missed(batch: Any) -> None:
        nonlocal said
        if not said and leading_dimension(batch) is None:
            said = True
            report(UncountedBatch(batch), COUNTING)

    return missed


def _as_int(samples: Callable[[BatchT], int]) -> Callable[[BatchT], int]:
    """The user's count made an ``int`` (a float or a tensor must not reach the wire)."""

    def count(batch: BatchT) -> int:
        return int(samples(batch))

    return count


def timed_batches(
    fetch: Callable[Args, BatchT],
    ledger: StepLedger,
    report: Report,
    samples: Callable[[BatchT], int] | None = None,
) -> Callable[Args, BatchT]:
    """``fetch`` with each call timed as one micro-batch's data wait and its samples counted
    into ``ledger``'s open step (memtui's own failures are reported, never raised)."""
    perf = time.perf_counter
    on_batch = ledger.on_batch
    count = batch_samples if samples is None else _as_int(samples)
    missed = missed_once(report) if samples is None else None
    started = False

    @functools.wraps(fetch)
    def timed(*args: Args.args, **kwargs: Args.kwargs) -> BatchT:
        nonlocal started
        if not started:  # the first step's clock starts at its first batch, as with a loader
            started = True
            ledger.start_clock()
        # the hot path, once per micro-batch: two clock reads and one ledger call
        t0 = perf()
        batch = fetch(*args, **kwargs)
        t1 = perf()
        try:
            n = count(batch)
            if not n and missed is not None:
                missed(batch)
        except Exception as exc:
            report(exc, COUNTING)
            n = 0
        on_batch(t1 - t0, n)
        return batch

    return timed
