"""Placement: where this process sits in the job (rank, world size), the run id it publishes
under, and its coordination with the other ranks through the job's store.

One code path for a process group that exists at install and one that starts later (Lightning
starts it inside ``fit``): ``join`` takes the job's run id (rank 0's) and ``exchange`` posts this
rank's endpoints and reads the others'. The boundary asks ``coordinator`` to agree on changes;
a rank that cannot coordinate switches changes off for the run, says why (``error``) and tells
the others at once.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from memtui.hooks.coordinate import JOIN_WAIT_S, Coordinator
from memtui.hooks.errors import Report
from memtui.hooks.progress import Progress
from memtui.wire import RankInfo

log = logging.getLogger("memtui")


def job_group() -> Any:
    """``torch.distributed`` when this process is one rank of several, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    try:
        if (
            dist is not None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            return dist
    except Exception:
        return None
    return None


def rank_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torch.distributed or the launcher's environment."""
    dist = job_group()
    if dist is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", "0") or 0)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = int(os.environ.get("LOCAL_RANK", str(rank)) or 0)
    return rank, local, world


class Placement:
    """This rank's place in the job and its link to the other ranks."""

    def __init__(
        self,
        run_id: str,
        where: tuple[int, int, int] | None,
        report: Report,
        *,
        timeout_s: float,
        warn_every_s: float,
    ) -> None:
        self.rank, self.local_rank, self.world_size = where or rank_env()
        """``where``: (rank, local rank, world size) from an adapter whose framework knows them
        before the launcher's environment or ``torch.distributed`` says (Lightning)."""
        self.run_id = run_id
        """The run this rank publishes under: rank 0's once joined."""
        self.coordinator: Coordinator | None = None
        """The link to the other ranks, once both joined and exchanged (None: alone or off)."""
        self.ranks: list[RankInfo] = []
        """Where every rank of the run publishes (this one's alone until exchanged)."""
        self.error = ""
        """Why this rank could not coordinate ("" when it did, or runs alone)."""
        self._joined: Coordinator | None = None
        """Joined (the run id taken), endpoints not posted yet."""
        self._report = report
        self._timeout_s = timeout_s
        self._warn_every_s = warn_every_s
        self._progress_failed = False
        """Posting this rank's progress failed once: it is not tried again (the ranks waiting at
        a boundary then wait for it up to their bound, as for a rank that posts none)."""

    def leads(self) -> bool:
        """Whether this process is rank 0 (it may change when the job coordinates late)."""
        return self.rank == 0

    def current_run_id(self) -> str:
        """The run this rank publishes under now (rank 0's once joined)."""
        return self.run_id

    @property
    def coordinated(self) -> bool:
        """Whether changes are agreed with the other ranks (a job of several)."""
        return self.coordinator is not None

    def join(self) -> None:
        """Take the job's run id if a process group of several exists (nothing otherwise)."""
        if self.coordinator is not None or self._joined is not None:
            return
        dist = job_group()
        if dist is None:
            return
        coordinator: Coordinator | None = None
        try:
            coordinator = Coordinator(
                dist, timeout_s=self._timeout_s, warn_every_s=self._warn_every_s
            )
            run_id = coordinator.join(self.run_id)
        except Exception as exc:  # never apply uncoordinated: changes stay off, on every rank
            self.failed(coordinator, exc)
            return
        if coordinator.rank != self.rank:
            log.warning(
                "memtui: this process is rank %d, not %d as it seemed at install",
                coordinator.rank,
                self.rank,
            )
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self.run_id = run_id
        self._joined = coordinator

    def exchange(self, mine: RankInfo) -> None:
        """Post this rank's endpoints and read the others' (rank 0 waits a little for them)."""
        coordinator = self._joined
        self.ranks = [mine]
        if coordinator is None:
            return
        self._joined = None
        try:
            coordinator.post_endpoints(mine)
            self.ranks = coordinator.endpoints(JOIN_WAIT_S if coordinator.rank == 0 else 0.0)
            self.coordinator = coordinator
        except Exception as exc:
            self.failed(coordinator, exc)

    def refresh(self) -> bool:
        """Read the endpoints of ranks that joined late (rank 0, at a boundary); True if read."""
        coordinator = self.coordinator
        if coordinator is None or coordinator.complete:
            return False
        try:
            self.ranks = coordinator.endpoints()
        except Exception as exc:
            self._report(exc, "coordination")
            return False
        return True

    def post_progress(self, progress: Progress | None) -> str:
        """Post how far this rank got for the ranks waiting at a boundary (None: as posted
        last), and look for an abort posted at the boundary this rank has not reached: why
        changes are off, once ("" otherwise). A job of several, coordinated; a failure is
        reported once and posting stops, never raised."""
        coordinator = self.coordinator
        if coordinator is None or self._progress_failed:
            return ""
        try:
            if progress is not None:
                coordinator.post_progress(progress)
            return coordinator.learn_abort()
        except Exception as exc:
            self._progress_failed = True
            self._report(exc, "posting progress")
            return ""

    def failed(self, coordinator: Coordinator | None, exc: BaseException) -> None:
        """Switch changes off here, loudly, and tell the other ranks at once (they stop too)."""
        self._report(exc, "coordination")
        self.error = f"rank {self.rank} could not coordinate ({type(exc).__name__}: {exc})"[:300]
        self.coordinator = self._joined = None
        log.error("memtui: changes are OFF for this run: %s", self.error)
        if coordinator is not None:
            coordinator.fail(self.error)

    def endpoint(self, make: Callable[[], str]) -> str:
        """The endpoint ``make`` builds, or "" when the runtime directory is unusable."""
        try:
            return make()
        except Exception:
            return ""
