"""Timing a batch function: the data wait and the samples of a loop without a DataLoader.

nanoGPT's ``train.py`` draws each micro-batch with ``get_batch('train')``, a function over its
data that reads ``batch_size`` from the module's globals. ``tuner.timed_batches(get_batch)``
returns a function that calls it with the same arguments and returns what it returns, and hands
the step ledger the call's time as the micro-batch's data wait and its samples (the first
dimension of the first tensor returned, or a ``samples`` callable), through
``StepLedger.on_batch`` as the DataLoader wrapper does. Nothing is rebuilt: a ``batch_size`` change reaches the function
through the config it reads, and the count follows what it returns.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from memtui.hooks.errors import Report
from memtui.hooks.ledger import StepLedger

BatchT = TypeVar("BatchT")
Args = ParamSpec("Args")


def first_len(batch: Any) -> int:
    """The samples in a batch: the first dimension of its first item (of a tuple or list; a
    dict's first value), else of the batch itself."""
    if isinstance(batch, (tuple, list)):
        first = batch[0]
    elif isinstance(batch, dict):
        first = next(iter(batch.values()))
    else:
        first = batch
    try:  # a tensor's or an array's ``shape[0]``: torch's ``len()`` is 3-4 times slower
        return int(first.shape[0])
    except AttributeError:
        return len(first)


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
    count = first_len if samples is None else _as_int(samples)
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
        except Exception as exc:
            report(exc, "counting a batch's samples")
            n = 0
        on_batch(t1 - t0, n)
        return batch

    return timed
