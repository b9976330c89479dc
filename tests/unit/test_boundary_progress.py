"""A rank that went past a checkpoint boundary is named within seconds; a slow one is waited for.

The decision over the ranks' posted progress (``memtui.hooks.progress``), and the boundary's
wait (``Coordinator``) over an in-memory store with the operations of the job's c10d store.
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from memtui.hooks.coordinate import Coordinator
from memtui.hooks.progress import (
    BACKWARD_SEEN_S,
    BackwardWatch,
    Progress,
    in_backward,
    went_past,
)
from memtui.wire import PendingChange
from tests.support.clock import patience


class MemoryStore:
    """The c10d store operations the coordinator uses, in memory (values are bytes, as c10d's)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.values[key]

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(key in self.values for key in keys)

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            current = self.values.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.values[key] = desired.encode()
                return desired.encode()
            return current if current is not None else expected.encode()

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.values.pop(key, None) is not None


def coordinator(store: MemoryStore, rank: int, timeout_s: float = 1800.0) -> Coordinator:
    """Rank ``rank`` of two over ``store``, looking at the store often (a test's pace)."""
    dist = SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: 2)
    made = Coordinator(dist, timeout_s=timeout_s, store=store)
    made.progress_every_s = 0.05
    return made


def post(store: MemoryStore, rank: int, progress: Progress) -> None:
    """Post ``rank``'s progress as its agent thread does."""
    coordinator(store, rank).post_progress(progress)


CHANGE = [
    PendingChange(
        id=1, changes={"batch_size": 8}, requested={"batch_size": 8}, queued_time=0.0, queued_step=3
    )
]

IN_BACKWARD = BACKWARD_SEEN_S + 0.5
"""Seen in a backward pass at the same position at two looks, a second apart."""

# ---------------------------------------------------------------------- the decision


def test_a_rank_at_a_later_step_went_past() -> None:
    why = went_past(1, Progress(12), step=10, micro=0)
    assert why.startswith("rank 1 went past step 10 without calling tuner.checkpoint()")
    assert "(it is at step 12)" in why and "outside any `if rank == 0:` block" in why


def test_a_rank_in_the_next_step_s_backward_pass_went_past() -> None:
    """nanoGPT's loop: the next batch was drawn (and counted) before the save, so the open step
    has no micro-batch at the boundary; a rank that skipped it drew two and waits in the
    gradient all-reduce of its backward pass."""
    why = went_past(1, Progress(10, micro=2, backward_s=IN_BACKWARD), step=10, micro=0)
    assert "(it is in the backward pass of step 11)" in why
    # a loop that draws the step's batch before the boundary: the skipping rank has no more
    assert went_past(1, Progress(10, micro=1, backward_s=IN_BACKWARD), step=10, micro=1)


def test_a_backward_pass_seen_once_is_no_proof() -> None:
    """It may be the step before the boundary finishing (or a step closing between two looks)."""
    assert went_past(1, Progress(10, micro=2, backward_s=0.0), step=10, micro=0) == ""
    assert went_past(1, Progress(10, micro=2, backward_s=0.2), step=10, micro=0) == ""


def test_a_rank_drawing_evaluation_batches_or_saving_is_only_slow() -> None:
    """An evaluation pass draws batches (a loader watched with no code counts it), and a save
    comes after it: more micro-batches than the waiting rank, but no backward pass."""
    assert went_past(0, Progress(10, micro=40), step=10, micro=0) == ""
    assert went_past(1, Progress(10, micro=0), step=10, micro=0) == ""


def test_a_rank_still_in_the_step_before_the_boundary_is_not_past() -> None:
    assert went_past(1, Progress(9, micro=2, backward_s=30.0), step=10, micro=0) == ""
    # fewer micro-batches than the waiting rank drew before its boundary: not past it
    assert went_past(1, Progress(10, micro=1, backward_s=30.0), step=10, micro=2) == ""


def test_the_watch_times_one_backward_pass_at_one_position() -> None:
    watch = BackwardWatch()
    assert watch.look(10, 1, False, now=100.0) == Progress(10, 1)
    assert watch.look(10, 2, True, now=101.0) == Progress(10, 2, 0.0)
    assert watch.look(10, 2, True, now=102.0) == Progress(10, 2, 1.0)
    assert watch.look(10, 3, True, now=103.0) == Progress(10, 3, 0.0), "a new micro-batch"
    assert watch.look(10, 3, False, now=104.0) == Progress(10, 3)
    assert watch.look(10, 3, True, now=105.0) == Progress(10, 3, 0.0), "a new backward pass"


def test_in_backward_sees_a_thread_inside_a_real_backward_pass() -> None:
    entered, release = threading.Event(), threading.Event()

    class Blocking(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            entered.set()
            release.wait(patience(10))
            return grad * 2

    def train() -> None:
        x = torch.ones(3, requires_grad=True)
        Blocking.apply(x).sum().backward()

    thread = threading.Thread(target=train)
    idle = threading.Thread(target=release.wait, args=(10,))
    idle.start()
    try:
        assert not in_backward(idle.ident or 0), "a thread elsewhere is not"
        thread.start()
        assert entered.wait(patience(10))
        assert in_backward(thread.ident or 0)
    finally:
        release.set()
        thread.join(patience(10))
        idle.join(patience(10))
    assert not in_backward(threading.get_ident())


# ---------------------------------------------------------------------- the boundary's wait


def test_rank_0_gives_up_at_once_on_a_rank_that_went_past() -> None:
    store = MemoryStore()
    post(store, 1, Progress(10, micro=2, backward_s=IN_BACKWARD))
    started = time.monotonic()
    agreed, abort = coordinator(store, 0).boundary(10, CHANGE, micro=0)
    assert time.monotonic() - started < patience(5), "not the 1800 s bound"
    assert agreed is None
    assert abort.startswith("rank 1 went past step 10 without calling tuner.checkpoint()")
    assert store.get("b1/decision").decode() == f"abort: {abort}", "posted for every rank"


def test_rank_0_waits_for_a_slow_rank_that_stays_at_the_step() -> None:
    store = MemoryStore()
    post(store, 1, Progress(10, micro=0))  # saving: no further progress
    rank1 = coordinator(store, 1)
    arrived: list[tuple[object, str]] = []

    def slow_save() -> None:
        time.sleep(0.6)
        arrived.append(rank1.boundary(10, [], micro=0))

    late = threading.Thread(target=slow_save)
    late.start()
    agreed, abort = coordinator(store, 0).boundary(10, CHANGE, micro=0)
    late.join(patience(10))
    assert abort == "" and agreed == CHANGE
    assert arrived == [(CHANGE, "")], "the same change set on both ranks"


def test_a_rank_that_drew_evaluation_batches_is_waited_for_up_to_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    post(store, 1, Progress(10, micro=6))
    waiting = coordinator(store, 0, timeout_s=0.6)
    waiting.warn_every_s = 0.2
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="memtui"):
        _agreed, abort = waiting.boundary(10, CHANGE, micro=0)
    assert time.monotonic() - started >= 0.6, "waited for the whole bound"
    assert abort.startswith("rank(s) 1 did not reach checkpoint #1 (rank 0 at step 10)"), abort
    assert "for rank(s) 1 (rank 1 last seen at step 10, 6 micro-batches into the next)" in (
        caplog.text
    ), "the warning says where the missing rank was last seen"


def test_a_rank_that_posted_nothing_is_waited_for_up_to_the_bound() -> None:
    store = MemoryStore()
    _agreed, abort = coordinator(store, 0, timeout_s=0.3).boundary(10, CHANGE)
    assert abort.startswith("rank(s) 1 did not reach checkpoint #1"), abort


def test_another_rank_gives_up_at_once_when_rank_0_went_past() -> None:
    store = MemoryStore()
    post(store, 0, Progress(11, micro=1))
    agreed, abort = coordinator(store, 1).boundary(10, [], micro=0)
    assert agreed is None
    assert abort.startswith("rank 0 went past step 10 without calling tuner.checkpoint()")
    assert "(it is at step 11)" in abort
    assert store.get("b1/decision").decode() == f"abort: {abort}"


def test_a_rank_that_arrived_is_never_judged_on_an_older_post() -> None:
    """Its agent's last post, from before it arrived, says it was in a backward pass."""
    store = MemoryStore()
    rank1 = coordinator(store, 1)
    rank1.post_progress(Progress(10, micro=0, backward_s=IN_BACKWARD))
    store.set("b1/r1", "10")  # its arrival, as rank 1's boundary posts it
    assert coordinator(store, 0).boundary(10, CHANGE) == (CHANGE, "")


def test_a_rank_that_went_past_learns_of_the_abort_without_reaching_the_boundary() -> None:
    store = MemoryStore()
    post(store, 1, Progress(10, micro=2, backward_s=IN_BACKWARD))
    _agreed, abort = coordinator(store, 0).boundary(10, CHANGE)
    past = coordinator(store, 1)
    assert past.learn_abort() == abort, "its agent thread reads the decision"
    assert past.broken == abort and past.learn_abort() == "", "once"
    assert past.boundary(20, []) == (None, abort), "its own boundary, if it ever calls one"


def test_no_abort_is_learnt_from_a_boundary_still_open() -> None:
    store = MemoryStore()
    assert coordinator(store, 1).learn_abort() == ""
