"""Agreement across ranks through the job's c10d store: no collective, so no rank can hang another.

Every exchange goes through the key-value store that ``init_process_group`` set up (the
launcher's TCPStore), under a prefix of memtui's own. memtui makes no collective call at all:
a collective made by some ranks and not others (one rank's memtui failed, or a collective that
needs a dependency one environment lacks, as ``all_gather_object`` needs numpy) blocks the
others until the job's timeout, while a store operation never waits for another rank.

At install (``join``) rank 0 posts its run id (a viewer may already follow it, when the
process group starts after install) and the other ranks read it, waiting for rank 0 at most two
minutes, or until a rank posts that it failed. Each rank posts its endpoints; rank 0 waits a
few seconds for the others' and picks up latecomers at its first boundary. A rank whose memtui fails at install or at a boundary posts the reason at once
(``fail``), so the others learn in milliseconds, not at a timeout, and changes switch off on
every rank, loudly.

Every rank also posts how far it got (``memtui.hooks.progress``: the steps it closed, the
micro-batches of the open step, whether it is in a backward pass), one key per rank overwritten,
from the agent thread about once a second and at each boundary; the agent thread also looks for
an abort posted at the boundary its rank has not reached (``learn_abort``), so that a rank that
went past one and may never call it knows that changes are off too.

A value every rank must share (the base seed of a loader's per-epoch order) is agreed the same
way (``agree``): rank 0 posts it, the others read it; a rank that gives up waiting posts a fixed
fallback with ``compare_set``, so whatever happens every rank takes the first value posted.

At the k-th checkpoint boundary of every rank, before anything is applied:

1. each rank posts its arrival (with its step);
2. rank 0 waits until every rank has arrived (polling; a warning names the missing ranks every
   ``warn_every_s``, at least three times before it gives up; a rank that posted a failure, or
   that never installed memtui and has not arrived after a short grace, ends the wait at
   once, and so does a missing rank whose progress says it went past the boundary: a later
   step, or the next step's backward pass, where a rank that skipped the boundary is blocked
   in the gradient all-reduce), checks that they are all at the same step, and posts the
   decision with ``compare_set``: ``go`` with rank 0's change set, or ``abort: <reason>``, so
   that a rank that gives up waiting (after ``timeout_s``, or once rank 0's own progress says
   it went past) and rank 0 cannot post different decisions;
3. on ``go`` every rank applies exactly that change set at that step;
4. on ``abort`` nothing is applied anywhere, every rank logs the reason loudly, and changes are
   switched off for the rest of the run (the boundaries are no longer aligned): queued changes
   are rejected with the reason. The user must call ``checkpoint()`` on every rank at the same
   step, as their own checkpointing already does.

The wait must also end before the *job's own* next collective times out: a rank that skipped
the boundary is already blocked in it (the gradient all-reduce) while rank 0 waits here. Its
progress names it within seconds; where progress says nothing (a rank blocked in another
collective, or one that posts none), a boundary gives up after at most half the default process
group's timeout (read from its backends: 10 minutes for NCCL and 30 for gloo unless
``init_process_group(timeout=...)`` says otherwise; 10 minutes assumed when torch does not
tell), whatever longer timeout was asked for.
The other half is left for rank 0 to reach the boundary (a save before ``checkpoint()``) and get
back to training.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import msgspec

from memtui.hooks.progress import PLACEMENT_FIX, Progress, went_past
from memtui.wire import PendingChange, RankInfo

log = logging.getLogger("memtui")

GO = "go"
GROUP_SHARE = 0.5
"""A boundary waits at most this share of the process group's timeout."""
ASSUMED_GROUP_TIMEOUT_S = 600.0
"""The group timeout assumed when torch does not tell it: NCCL's default, the shortest."""
WARNINGS = 3
"""A waiting rank names the missing ranks at least this many times before it gives up."""
JOIN_TIMEOUT_S = 120.0
"""How long a rank waits at install for rank 0's run id (a rank that failed ends it at once)."""
JOIN_WAIT_S = 5.0
"""How long rank 0 waits at install for the other ranks' endpoints (the rest join later)."""
ABSENT_GRACE_S = 10.0
"""How long rank 0 waits at a boundary for a rank that never posted its install entry."""
REASON_CHARS = 300
"""A failure reason posted for the other ranks is cut to this length."""
PROGRESS_EVERY_S = 0.5
"""How often a waiting rank reads the progress of the ranks it waits for."""

_ordinal = itertools.count(1)
"""The k-th coordinator of this process: every rank makes the same ones in the same order."""


class CoordinationError(RuntimeError):
    """The ranks cannot coordinate (no store, or a failure another rank posted)."""


def group_timeout_s(dist: Any) -> float | None:
    """The default process group's collective timeout in seconds (the shortest of its backends'),
    None when torch does not expose it."""
    try:
        # torch exposes the group's timeout only through private members (checked per release)
        group = dist.distributed_c10d._get_default_group()  # noqa: SLF001
        timeouts = [
            group._get_backend(device).options._timeout.total_seconds()  # noqa: SLF001
            for device in group._device_types  # noqa: SLF001
        ]
    except Exception:  # a private API: another torch may not have it
        return None
    return min(timeouts) if timeouts else None


def job_store(ordinal: int) -> Any:
    """The job's c10d store under memtui's prefix for the ``ordinal``-th coordinator."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import _get_default_store

    return PrefixStore(f"memtui/c{ordinal}/", _get_default_store())


class Coordinator:
    """memtui's side channel between the ranks of one job: the c10d store, never a collective."""

    def __init__(
        self,
        dist: Any,
        *,
        timeout_s: float = 1800.0,
        warn_every_s: float = 60.0,
        store: Any = None,
    ) -> None:
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
        self.store: Any = store if store is not None else job_store(next(_ordinal))
        self.boundaries = 0
        """Boundaries this rank has reached (the k of the protocol)."""
        self.broken = ""
        """Why changes are off for the rest of the run (empty while they are on)."""
        self.poll_s = 0.02
        """How often a waiting rank looks at the store (a check is one round trip)."""
        self.progress_every_s = PROGRESS_EVERY_S
        """How often a waiting rank reads the progress of the ranks it waits for."""
        self._endpoints: dict[int, RankInfo] = {}
        """Every rank's endpoints read from the store so far."""

    # ------------------------------------------------------------------ install

    def join(self, run_id: str) -> str:
        """The job's run id: rank 0's (a viewer may already follow it); the other ranks read it,
        waiting for rank 0 at most ``JOIN_TIMEOUT_S`` (raise CoordinationError after that, or at
        once when a rank posts that it failed)."""
        if self.rank == 0:
            self.store.set("run_id", run_id)
            return run_id
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not self.store.check(["run_id"]):
            failed = self.failures()
            if failed:
                raise CoordinationError(failed)
            if time.monotonic() >= deadline:
                raise CoordinationError(
                    f"rank 0 did not install memtui within {JOIN_TIMEOUT_S:g} s"
                )
            time.sleep(self.poll_s)
        return _text(self.store.get("run_id"))

    def post_endpoints(self, mine: RankInfo) -> None:
        """Publish where this rank publishes and answers (also: this rank has installed)."""
        self._endpoints[self.rank] = mine
        self.store.set(f"rank/{self.rank}", msgspec.json.encode(mine))

    def endpoints(self, wait_s: float = 0.0) -> list[RankInfo]:
        """Every rank's endpoints, waiting up to ``wait_s`` for them (a rank not there yet is
        listed with no endpoints, and read again at the next call)."""
        deadline = time.monotonic() + wait_s
        while True:
            for r in range(self.world_size):
                if r not in self._endpoints and self.store.check([f"rank/{r}"]):
                    self._endpoints[r] = msgspec.json.decode(
                        self.store.get(f"rank/{r}"), type=RankInfo
                    )
            if len(self._endpoints) == self.world_size or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        return [
            self._endpoints.get(r) or RankInfo(rank=r, pub="", control="")
            for r in range(self.world_size)
        ]

    @property
    def complete(self) -> bool:
        """Whether every rank's endpoints have been read."""
        return len(self._endpoints) == self.world_size

    def post_progress(self, progress: Progress) -> None:
        """Post how far this rank got (one key, overwritten), for the ranks waiting at a boundary."""
        self.store.set(f"progress/{self.rank}", msgspec.json.encode(progress))

    def progress_of(self, rank: int) -> Progress | None:
        """How far ``rank`` got, as it last posted (None: nothing posted, or nothing readable)."""
        key = f"progress/{rank}"
        if not self.store.check([key]):  # a get would wait for the key
            return None
        try:
            return msgspec.json.decode(self.store.get(key), type=Progress)
        except msgspec.DecodeError:
            return None

    def post_figures(self, figures: bytes) -> None:
        """Post this rank's figures over the run (one key, overwritten), for rank 0's summary."""
        self.store.set(f"figures/{self.rank}", figures)

    def figures_of(self, rank: int) -> bytes | None:
        """``rank``'s figures as it last posted them (None: nothing posted yet)."""
        key = f"figures/{rank}"
        if not self.store.check([key]):  # a get would wait for the key
            return None
        return bytes(self.store.get(key))

    def learn_abort(self) -> str:
        """Why changes are off, once an abort is posted for the boundary this rank has not
        reached (it went past it: it may never call it); "" while none is, or when this rank
        knew already."""
        if self.broken:
            return ""
        k = self.boundaries + 1
        key = f"b{k}/decision"
        if not self.store.check([key]):  # a get would wait for the key
            return ""
        decision = _text(self.store.get(key))
        if not decision.startswith("abort: ") or self.broken:
            return ""
        self.broken = decision.removeprefix("abort: ")
        log.error(
            "memtui: changes are OFF for this run (rank %d, checkpoint #%d, which it did not "
            "reach): %s.",
            self.rank,
            k,
            self.broken,
        )
        return self.broken

    def fail(self, reason: str) -> None:
        """Tell the other ranks at once that memtui failed here (best effort; never raises)."""
        self.broken = self.broken or reason
        post_failure(self.store, self.rank, reason)

    def agree(self, key: str, proposal: str, fallback: str) -> tuple[str, str]:
        """One value of ``key`` for every rank: rank 0's ``proposal``; a rank that gives up
        waiting for it (a rank posted a failure, or rank 0 posted nothing within
        ``JOIN_TIMEOUT_S``) posts ``fallback`` instead, and the first value posted is every
        rank's. Returns (the value, why it is the fallback: "" when it is rank 0's)."""
        store, key = self.store, f"agree/{key}"
        why = self.failures()
        if self.rank == 0:
            value = _text(store.compare_set(key, "", fallback if why else proposal))
            return value, why if value == fallback else ""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not why and not store.check([key]):
            if time.monotonic() >= deadline:
                why = f"rank 0 posted none within {JOIN_TIMEOUT_S:g} s"
                break
            time.sleep(self.poll_s)
            why = self.failures()
        if not why:
            return _text(store.get(key)), ""
        value = _text(store.compare_set(key, "", fallback))
        return value, why if value == fallback else ""

    # ------------------------------------------------------------------ boundary

    def boundary(self, step: int, pending: list[PendingChange], micro: int = 0) -> tuple[Any, str]:
        """Agree on this boundary, reached after ``step`` steps and ``micro`` micro-batches of the
        next: (rank 0's pending changes, "") or (None, reason to abort)."""
        if self.broken:
            return None, self.broken
        self.boundaries += 1
        k = self.boundaries
        try:
            decision = self._decide(k, Progress(step, micro), pending)
            if decision == GO or decision.startswith(GO + " "):
                payload = decision[len(GO) :].strip() or "[]"
                return msgspec.json.decode(payload, type=list[PendingChange]), ""
            self.broken = decision.removeprefix("abort: ")
        except Exception as exc:  # say so to the others at once: they must not wait for us
            reason = f"rank {self.rank} failed at checkpoint #{k} ({type(exc).__name__}: {exc})"
            self.fail(reason)
        fix = (
            ""
            if PLACEMENT_FIX in self.broken
            else " Call tuner.checkpoint() on every rank at the same step."
        )
        log.error(
            "memtui: changes are OFF for this run (rank %d, checkpoint #%d at step %d): %s.%s",
            self.rank,
            k,
            step,
            self.broken,
            fix,
        )
        return None, self.broken

    def _decide(self, k: int, arrived: Progress, pending: list[PendingChange]) -> str:
        store = self.store
        step = arrived.step
        self.post_progress(arrived)
        store.set(f"b{k}/r{self.rank}", str(step))
        decision_key = f"b{k}/decision"
        if self.rank == 0:
            keys = [f"b{k}/r{r}" for r in range(self.world_size)]
            missing, why = self._wait(keys, arrived, k)
            if why:
                verdict = f"abort: {why}"
            elif missing:
                verdict = (
                    f"abort: rank(s) {', '.join(map(str, missing))} did not reach checkpoint #{k} "
                    f"(rank 0 at step {step}) within {self._within()}"
                )
            else:
                steps = {r: int(_text(store.get(key))) for r, key in enumerate(keys)}
                if len(set(steps.values())) > 1:
                    shown = ", ".join(f"rank {r} at step {s}" for r, s in steps.items())
                    verdict = f"abort: checkpoint #{k} was called at different steps ({shown})"
                else:
                    encoded = msgspec.json.encode(pending).decode()
                    verdict = f"{GO} {encoded}"
            final = _text(store.compare_set(decision_key, "", verdict))
            if final.startswith(GO) and k > 1:
                for r in range(self.world_size):  # everyone has passed boundary k-1: tidy it
                    store.delete_key(f"b{k - 1}/r{r}")
                store.delete_key(f"b{k - 1}/decision")
            return final
        missing, why = self._wait([decision_key], arrived, k)
        if missing or why:
            give_up = why or (
                f"rank {self.rank} waited {self._within()} at checkpoint #{k} (step {step}) "
                "for rank 0"
            )
            return _text(store.compare_set(decision_key, "", f"abort: {give_up}"))
        return _text(store.get(decision_key))

    def _within(self) -> str:
        """The wait, and why it is no longer (``12 s``, ``300 s, half the job's 600 s timeout``)."""
        if not self.limited:
            return f"{self.timeout_s:g} s"
        group = self.group_timeout_s
        basis = f"the job's {group:g} s" if group else f"an assumed {ASSUMED_GROUP_TIMEOUT_S:g} s"
        return f"{self.timeout_s:g} s, half {basis} collective timeout"

    def failures(self) -> str:
        """What the ranks that failed posted ("" while none has)."""
        if int(self.store.add("failed", 0)) == 0:
            return ""
        reasons = [
            _text(self.store.get(f"fail/{r}"))
            for r in range(self.world_size)
            if self.store.check([f"fail/{r}"])
        ]
        return "; ".join(reasons) or "another rank's memtui failed"

    def _absent(self, ranks: list[int]) -> list[int]:
        """Which of ``ranks`` never posted their install entry (memtui is not installed there)."""
        return [r for r in ranks if not self.store.check([f"rank/{r}"])]

    def _wait(self, keys: list[str], arrived: Progress, k: int) -> tuple[list[int], str]:
        """Poll until every key exists: ([], "") or the ranks still missing at the timeout, or a
        reason to stop waiting at once (a rank posted a failure, never installed memtui, or
        went past the boundary)."""
        step = arrived.step
        start = time.monotonic()
        next_warning = start + self.warn_every_s
        next_progress = start
        grace_checked = False
        seen: dict[int, Progress] = {}
        while True:
            missing = [key for key in keys if not self.store.check([key])]
            if not missing:
                return [], ""
            failed = self.failures()
            if failed:
                return [], failed
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + self.progress_every_s
                # rank 0 waits for the ranks missing; the others for rank 0's decision, and
                # rank 0 may be the one that went past
                waited = [_rank_of(key) for key in missing] if self.rank == 0 else [0]
                past = self._gone_past(k, arrived, waited, seen)
                if past:
                    return [], past
            if self.rank == 0 and not grace_checked and now - start >= ABSENT_GRACE_S:
                grace_checked = True
                absent = self._absent([_rank_of(key) for key in missing])
                if absent:
                    who = ", ".join(map(str, absent))
                    return [], (
                        f"rank(s) {who} never installed memtui (hooks.install must run on every "
                        f"rank) and did not reach checkpoint #{k} within {ABSENT_GRACE_S:g} s"
                    )
            if now - start >= self.timeout_s:
                return [_rank_of(key) for key in missing], ""
            if now >= next_warning:
                next_warning = now + self.warn_every_s
                who = ", ".join(str(_rank_of(key)) for key in missing)
                log.warning(
                    "memtui: rank %d has waited %.0f s at checkpoint #%d (step %d) for "
                    "rank(s) %s%s; is tuner.checkpoint() called on every rank? Changes are "
                    "switched off after %s.",
                    self.rank,
                    now - start,
                    k,
                    step,
                    who,
                    _positions(seen),
                    self._within(),
                )
            time.sleep(self.poll_s)

    def _gone_past(
        self, k: int, arrived: Progress, ranks: list[int], seen: dict[int, Progress]
    ) -> str:
        """Why one of ``ranks`` that has not arrived at boundary ``k`` went past it ("" while
        each may still arrive); ``seen`` keeps what each last posted."""
        for rank in ranks:
            if rank == self.rank or self.store.check([f"b{k}/r{rank}"]):
                continue
            progress = self.progress_of(rank)
            if progress is None:
                continue
            seen[rank] = progress
            why = went_past(rank, progress, arrived.step, arrived.micro)
            if why:
                return why
        return ""


def post_failure(store: Any, rank: int, reason: str) -> None:
    """Post that memtui failed on ``rank`` (the others stop waiting for it); never raises."""
    try:
        store.set(f"fail/{rank}", reason[:REASON_CHARS])
        store.add("failed", 1)
    except Exception as exc:
        log.warning("memtui: could not tell the other ranks that rank %d failed (%s)", rank, exc)


def _positions(seen: dict[int, Progress]) -> str:
    """Where the ranks waited for were last seen (`` (rank 1 last seen at step 10, 2
    micro-batches into the next)``), "" when none posted."""
    if not seen:
        return ""
    words = [
        f"rank {rank} last seen at step {p.step}, {p.micro} "
        f"micro-batch{'es' if p.micro != 1 else ''} into the next"
        for rank, p in sorted(seen.items())
    ]
    return f" ({'; '.join(words)})"


def _rank_of(key: str) -> int:
    tail = key.rsplit("/", 1)[-1]
    return int(tail[1:]) if tail.startswith("r") and tail[1:].isdigit() else 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
