"""Agreement across ranks: one run id and every rank's endpoints at install, one decision per boundary.

At install (every rank calls ``install`` at the same point, as it calls ``init_process_group``)
memtui makes a small gloo side group (so its own traffic never touches the device or the user's
collectives), broadcasts rank 0's run id and all-gathers where each rank publishes.

At the k-th checkpoint boundary of every rank, before anything is applied:

1. each rank posts its arrival (with its step) in the job's c10d store, under the run's prefix;
2. rank 0 waits until every rank has arrived (polling; a warning names the missing ranks every
   ``warn_every_s``, at least three times before it gives up), checks that they are all at the
   same step, and posts the decision
   ``go`` or ``abort: <reason>`` with ``compare_set``, so that a rank that gives up waiting
   (after ``timeout_s``) and rank 0 cannot post different decisions;
3. on ``go``, every rank is known to be at the boundary, so rank 0's change set is broadcast
   with ``torch.distributed.broadcast_object_list`` over the side group without any risk of a
   hang, and every rank applies exactly that set at that step;
4. on ``abort`` nothing is applied anywhere, every rank logs the reason loudly, and changes are
   switched off for the rest of the run (the boundaries are no longer aligned): queued changes
   are rejected with the reason. The user must call ``checkpoint()`` on every rank at the same
   step, as their own checkpointing already does.

A collective alone could not do this: a rank that never calls it leaves the others blocked
until the process-group timeout (30 minutes by default) and then kills the job.

The wait must also end before the *job's own* next collective times out: a rank that skipped
the boundary is already blocked in it (the gradient all-reduce) while rank 0 waits here. So a
boundary gives up after at most half the default process group's timeout (read from its
backends: 10 minutes for NCCL and 30 for gloo unless ``init_process_group(timeout=...)`` says
otherwise; 10 minutes assumed when torch does not tell), whatever longer timeout was asked for.
The other half is left for rank 0 to reach the boundary (a save before ``checkpoint()``) and get
back to training.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

log = logging.getLogger("memtui")

GO = "go"
GROUP_SHARE = 0.5
"""A boundary waits at most this share of the process group's timeout."""
ASSUMED_GROUP_TIMEOUT_S = 600.0
"""The group timeout assumed when torch does not tell it: NCCL's default, the shortest."""
WARNINGS = 3
"""A waiting rank names the missing ranks at least this many times before it gives up."""


def group_timeout_s(dist: Any) -> float | None:
    """The default process group's collective timeout in seconds (the shortest of its backends'),
    None when torch does not expose it."""
    try:
        group = dist.distributed_c10d._get_default_group()
        timeouts = [
            group._get_backend(device).options._timeout.total_seconds()
            for device in group._device_types
        ]
    except Exception:  # a private API: another torch may not have it
        return None
    return min(timeouts) if timeouts else None


class Coordinator:
    """memtui's side channel between the ranks of one job."""

    def __init__(self, dist: Any, *, timeout_s: float = 1800.0, warn_every_s: float = 60.0) -> None:
        self.dist = dist
        self.rank = int(dist.get_rank())
        self.world_size = int(dist.get_world_size())
        self.group_timeout_s = group_timeout_s(dist)
        """The job's process-group timeout (None: torch does not say)."""
        limit = GROUP_SHARE * (self.group_timeout_s or ASSUMED_GROUP_TIMEOUT_S)
        self.timeout_s = min(timeout_s, limit)
        """How long a boundary waits: as asked, but at most half the group's timeout."""
        self.limited = timeout_s > limit
        """The timeout asked for was cut to fit the group's."""
        self.warn_every_s = min(warn_every_s, self.timeout_s / WARNINGS)
        self.group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=max(self.timeout_s, 60.0))
        )
        self.store: Any = None
        self.boundaries = 0
        """Boundaries this rank has reached (the k of the protocol)."""
        self.broken = ""
        """Why changes are off for the rest of the run (empty while they are on)."""
        self.poll_s = 0.02

    # ------------------------------------------------------------------ install

    def agree(self, proposal: Any) -> Any:
        """Rank 0's ``proposal`` on every rank (a broadcast on the side group)."""
        box = [proposal if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, item: Any) -> list[Any]:
        """Every rank's ``item``, in rank order."""
        out: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(out, item, group=self.group)
        return out

    def attach_store(self, run_id: str) -> None:
        """Use the job's c10d store, under this run's prefix, for the boundary protocol."""
        try:
            from torch.distributed import PrefixStore
            from torch.distributed.distributed_c10d import _get_default_store

            self.store = PrefixStore(f"memtui/{run_id}/", _get_default_store())
        except Exception as exc:  # no store: boundaries fall back to the broadcast alone
            log.warning("memtui: no c10d store (%s); boundary checks are off", exc)
            self.store = None

    # ------------------------------------------------------------------ boundary

    def boundary(self, step: int, pending: Any) -> tuple[Any, str]:
        """Agree on this boundary: (rank 0's pending changes, "") or (None, reason to abort)."""
        if self.broken:
            return None, self.broken
        self.boundaries += 1
        k = self.boundaries
        if self.store is not None:
            decision = self._decide(k, step)
            if decision != GO:
                self.broken = decision.removeprefix("abort: ")
                log.error(
                    "memtui: changes are OFF for this run (rank %d, checkpoint #%d at step %d): %s. "
                    "Call tuner.checkpoint() on every rank at the same step.",
                    self.rank,
                    k,
                    step,
                    self.broken,
                )
                return None, self.broken
        box = [pending if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0], ""

    def _decide(self, k: int, step: int) -> str:
        store = self.store
        store.set(f"b{k}/r{self.rank}", str(step))
        decision_key = f"b{k}/decision"
        if self.rank == 0:
            keys = [f"b{k}/r{r}" for r in range(self.world_size)]
            missing = self._wait(keys, step, k)
            if missing:
                verdict = (
                    f"abort: rank(s) {', '.join(map(str, missing))} did not reach checkpoint #{k} "
                    f"(rank 0 at step {step}) within {self._within()}"
                )
            else:
                steps = {r: int(store.get(key)) for r, key in enumerate(keys)}
                if len(set(steps.values())) > 1:
                    shown = ", ".join(f"rank {r} at step {s}" for r, s in steps.items())
                    verdict = f"abort: checkpoint #{k} was called at different steps ({shown})"
                else:
                    verdict = GO
            final = _text(store.compare_set(decision_key, "", verdict))
            if final == GO and k > 1:
                for r in range(self.world_size):  # everyone has passed boundary k-1: tidy it
                    store.delete_key(f"b{k - 1}/r{r}")
                store.delete_key(f"b{k - 1}/decision")
            return final
        if self._wait([decision_key], step, k):
            give_up = (
                f"abort: rank {self.rank} waited {self._within()} at checkpoint #{k} "
                f"(step {step}) for rank 0"
            )
            return _text(store.compare_set(decision_key, "", give_up))
        return _text(store.get(decision_key))

    def _within(self) -> str:
        """The wait, and why it is no longer (``12 s``, ``300 s, half the job's 600 s timeout``)."""
        if not self.limited:
            return f"{self.timeout_s:g} s"
        group = self.group_timeout_s
        basis = f"the job's {group:g} s" if group else f"an assumed {ASSUMED_GROUP_TIMEOUT_S:g} s"
        return f"{self.timeout_s:g} s, half {basis} collective timeout"

    def _wait(self, keys: list[str], step: int, k: int) -> list[int]:
        """Poll until every key exists; return the ranks still missing at the timeout."""
        start = time.monotonic()
        next_warning = start + self.warn_every_s
        while True:
            missing = [key for key in keys if not self.store.check([key])]
            if not missing:
                return []
            now = time.monotonic()
            if now - start >= self.timeout_s:
                return [_rank_of(key) for key in missing]
            if now >= next_warning:
                next_warning = now + self.warn_every_s
                who = ", ".join(str(_rank_of(key)) for key in missing)
                log.warning(
                    "memtui: rank %d has waited %.0f s at checkpoint #%d (step %d) for rank(s) %s; "
                    "is tuner.checkpoint() called on every rank? Changes are switched off after "
                    "%s.",
                    self.rank,
                    now - start,
                    k,
                    step,
                    who,
                    self._within(),
                )
            time.sleep(self.poll_s)


def _rank_of(key: str) -> int:
    tail = key.rsplit("/", 1)[-1]
    return int(tail[1:]) if tail.startswith("r") and tail[1:].isdigit() else 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
