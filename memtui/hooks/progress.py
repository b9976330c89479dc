"""How far a rank got, as the ranks waiting at a checkpoint boundary read it.

A rank waiting at a boundary cannot tell from its arrival key alone whether a rank that has not
arrived is slow (a long save) or went past the boundary without calling ``tuner.checkpoint()``
(the call inside a block that runs on rank 0 only): the second is meanwhile blocked in the next
step's collective and never arrives. So every rank posts its position in the job's store, from
the agent thread about once a second (the training thread posts nothing per step): the optimizer
steps it closed, the micro-batches of the open step it drew, and for how long its training thread
has been in one backward pass at that position.

A waiting rank at step S that had drawn M micro-batches of its open step when it arrived calls a
rank that has not arrived *past* the boundary when it closed a step after S, or when it closed S
and has been in a backward pass with at least M micro-batches of the next step drawn for half a
second: a rank that skipped the boundary is blocked there in DDP's gradient all-reduce (and
FSDP's reduce-scatter). The micro-batch count alone would not do. It moves on a rank that is
only slow: an evaluation pass draws batches (every DataLoader of a loop watched with no code
counts, an evaluation loader included, and so does a batch function that evaluation calls too),
on the master rank alone where it evaluates before its save. And it says little on a rank that
went past: nanoGPT fetches the next step's first batch before its save (counted in the step
before), so the skipping rank is blocked one or two micro-batches further, and a loop that
draws its step's batch before the boundary leaves it blocked with the waiting rank's count. No
save or evaluation runs a backward pass; a backward pass seen once may be a rank finishing the
step before the boundary, so it must be seen at the same position twice. A rank that is past
without a backward pass (blocked in a forward's collective) is not named: the boundary waits
for it as for a slow one, up to its bound.
"""

from __future__ import annotations

import sys
from types import CodeType

import msgspec

BACKWARD_SEEN_S = 0.5
"""A rank is called past only once its training thread has been seen in a backward pass at the
same position for this long (two looks of the agent thread, a second apart)."""


class Progress(msgspec.Struct, frozen=True):
    """One rank's position in training, as it posts it for the others."""

    step: int
    """Optimizer steps closed."""
    micro: int = 0
    """Micro-batches of the open step drawn so far."""
    backward_s: float = 0.0
    """Seconds the training thread has been seen in a backward pass at this position (0: not
    in one)."""


def went_past(rank: int, seen: Progress, step: int, micro: int) -> str:
    """Why ``rank``, last seen at ``seen``, went past the boundary that a rank waits at after
    ``step`` steps and ``micro`` micro-batches of the next ("" while it may still arrive)."""
    if seen.step > step:
        where = f"it is at step {seen.step}"
    elif seen.step == step and seen.micro >= micro and seen.backward_s >= BACKWARD_SEEN_S:
        where = f"it is in the backward pass of step {step + 1}"
    else:
        return ""
    return (
        f"rank {rank} went past step {step} without calling tuner.checkpoint() ({where}): "
        f"{PLACEMENT_FIX}"
    )


PLACEMENT_FIX = (
    "call it on every rank at the same step, outside any `if rank == 0:` block "
    "(nanoGPT's `if master_process:`)"
)
"""What to do about a boundary that some rank does not reach."""


class BackwardWatch:
    """The agent thread's looks at the training thread: where it is, and since when it has been
    in a backward pass at that position."""

    def __init__(self) -> None:
        self._since: tuple[int, int, float] | None = None
        """(step, micro-batches, when) of the first look that found it in a backward pass there."""

    def look(self, step: int, micro: int, in_backward: bool, now: float) -> Progress:
        """The position to post after one look at the training thread at ``now``."""
        if not in_backward:
            self._since = None
            return Progress(step, micro)
        since = self._since
        if since is None or since[:2] != (step, micro):
            self._since = since = (step, micro, now)
        return Progress(step, micro, round(now - since[2], 3))


def in_backward(thread_id: int) -> bool:
    """Whether the thread ``thread_id`` is inside a backward pass now (``Tensor.backward``,
    ``torch.autograd.backward`` or ``torch.autograd.grad`` on its stack)."""
    codes = _backward_codes()
    if not codes:
        return False
    # CPython's documented view of every thread's stack (what faulthandler and debuggers read)
    frame = sys._current_frames().get(thread_id)  # noqa: SLF001
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _backward_codes() -> frozenset[CodeType]:
    """The code of torch's public entry points into a backward pass (none before torch is
    imported)."""
    torch = sys.modules.get("torch")
    autograd = getattr(torch, "autograd", None)
    if torch is None or autograd is None:
        return frozenset()
    entries = (
        getattr(getattr(torch, "Tensor", None), "backward", None),
        getattr(autograd, "backward", None),
        getattr(autograd, "grad", None),
    )
    return frozenset(
        code for entry in entries if isinstance(code := getattr(entry, "__code__", None), CodeType)
    )
