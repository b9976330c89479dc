"""The run's summary, kept by the agent thread and written beside the tuned config.

The publisher folds every step and sample it drains into one ``advice.summary.SummaryBuilder``
(the agent thread, never the training thread); every ``SUMMARY_LOOK_S`` rank 0 takes the
verdict over its recent steps, and every ``SUMMARY_EVERY_S`` it writes ``memtui-summary.json``
in the state directory (an atomic replace of the user's own 0600 file: a run killed at any
moment leaves the last one whole), with every other rank's figures read from the job's store,
where each rank posts its own as often. When the run ends (its script returns, Ctrl-C, an
out-of-memory error it dies of) the agent writes it a last time with how it ended; a run killed
with ``kill -9`` keeps the last periodic one, at most ``SUMMARY_EVERY_S`` old.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import msgspec

from memtui.advice.oom import is_oom
from memtui.advice.summary import SummaryBuilder
from memtui.core.stats import one_line
from memtui.hooks.control import Control
from memtui.hooks.errors import Report
from memtui.hooks.persist import StateFiles, write_summary
from memtui.hooks.placement import Placement
from memtui.wire import HookCounters, RankFigures, RunInfo, RunSummary, Snapshot

SUMMARY_EVERY_S = 30.0
"""How often the summary is written (and each rank's figures posted) while the run lives."""


def how_it_ended(exc: BaseException | None = None) -> str:
    """How the run is ending, from the exception that ends it (``exc``, else the one being
    handled, else the one the interpreter is exiting on): ``ended`` without one."""
    found = exc or sys.exc_info()[1] or getattr(sys, "last_value", None)
    if found is None or isinstance(found, SystemExit):
        return "ended"
    if isinstance(found, KeyboardInterrupt):
        return "interrupted"
    if is_oom(found):
        return "out of memory"
    return one_line(f"failed: {type(found).__name__}: {found}", 200)


class RunSummaries:
    """One rank's summary: the builder the publisher feeds, the looks, the writes, the posts."""

    def __init__(
        self,
        files: StateFiles,
        placement: Placement,
        control: Control,
        report: Report,
        every_s: float = SUMMARY_EVERY_S,
    ) -> None:
        self.builder = SummaryBuilder(seed="memtui")
        self._files = files
        self._placement = placement
        self._control = control
        self._report = report
        self.every_s = every_s
        self._next = time.monotonic() + min(every_s, 5.0)
        """When the next write (or post) is due: a first one soon, so that a run killed in its
        first minute leaves one too."""
        self.written = 0
        """Summaries written so far."""
        self.ended = ""
        """How the run ended, once it did ("" while it runs)."""

    def due(self) -> bool:
        """Whether the summary is due to be written (or this rank's figures posted)."""
        return time.monotonic() >= self._next

    def look(self, snapshot: Callable[[], Snapshot], force: bool = False) -> None:
        """Take the verdict over the recent steps when a look is due or ``force`` (rank 0)."""
        now = time.time()
        if self._placement.rank != 0 or not (force or self.builder.look_due(now)):
            return
        self.builder.look(snapshot(), self._control.thresholds, now)

    def summary(
        self, info: RunInfo, counters: HookCounters | None, records_dropped: int
    ) -> RunSummary:
        """The summary as it stands, with the other ranks' figures posted so far."""
        now = time.time()
        own = self.figures(info, now)
        ranks = [own, *self._others()] if self._placement.world_size > 1 else [own]
        return self.builder.summary(
            info,
            self._control.state(),
            now,
            ended=self.ended,
            ranks=ranks,
            counters=counters,
            records_dropped=records_dropped,
        )

    def figures(self, info: RunInfo, now: float) -> RankFigures:
        """This rank's figures over the run."""
        ooms = len(self._control.ooms)
        return self.builder.figures(self._placement.rank, info.host, now, ooms)

    def _others(self) -> Sequence[RankFigures]:
        """The other ranks' figures as they last posted them (none without coordination)."""
        coordinator = self._placement.coordinator
        if coordinator is None:
            return []
        found: list[RankFigures] = []
        for rank in range(self._placement.world_size):
            if rank == self._placement.rank:
                continue
            try:
                raw = coordinator.figures_of(rank)
            except Exception as exc:
                self._report(exc, "reading the ranks' figures")
                return found
            if raw is None:
                continue
            try:
                found.append(msgspec.json.decode(raw, type=RankFigures))
            except msgspec.DecodeError:
                continue
        return found

    def save(
        self,
        info: Callable[[], RunInfo],
        counters: Callable[[], HookCounters],
        records_dropped: int,
        *,
        final: bool = False,
    ) -> None:
        """Write the summary (rank 0) or post this rank's figures (the others), when due or
        ``final``; what fails is reported, never raised."""
        if not final and not self.due():
            return
        self._next = time.monotonic() + self.every_s
        run = info()
        try:
            if self._placement.rank == 0:
                write_summary(
                    self._files.summary_path, self.summary(run, counters(), records_dropped)
                )
                self.written += 1
            elif self._placement.coordinator is not None:
                figures = self.figures(run, time.time())
                self._placement.coordinator.post_figures(msgspec.json.encode(figures))
        except Exception as exc:
            self._report(exc, "the run's summary")
