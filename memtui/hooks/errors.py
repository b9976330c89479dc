"""The hook's own failures: counted, logged (rate-limited) and published, never raised."""

from __future__ import annotations

import logging
from collections.abc import Callable

from memtui.core.stats import one_line

log = logging.getLogger("memtui")

Report = Callable[[BaseException, str], None]
"""How a part of the hook reports a failure: ``report(exc, where)``; it never raises."""


class ErrorLog:
    """Counts memtui's failures by place, keeps the last one, and logs the first few of each."""

    def __init__(self) -> None:
        self.count = 0
        """Failures reported since install."""
        self.last = ""
        """The last failure, in one line ("" while none)."""
        self._by_place: dict[str, int] = {}

    def report(self, exc: BaseException, where: str) -> None:
        """Count a failure inside memtui, log it (rate-limited); never raise."""
        try:
            self.count += 1
            text = one_line(exc)
            self.last = one_line(f"{where}: {type(exc).__name__}: {text}")
            seen = self._by_place.get(where, 0) + 1
            self._by_place[where] = seen
            if seen <= 3 or seen % 1000 == 0:
                log.warning(
                    "memtui: %s failed (%s: %s); training goes on", where, type(exc).__name__, text
                )
        except Exception:
            pass
