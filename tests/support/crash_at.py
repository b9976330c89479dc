"""The demo training, killed with SIGKILL at one point of its first applied change.

``CRASH_AT`` names the point: ``applying`` (the audit log's ``applying`` line written),
``before-rename`` (the tuned config's temp file written, not yet renamed over it),
``after-rename`` (the tuned config in place, the ``applied`` line not written) or ``applied``
(both written). ``CRASH_CHANGE`` is the change queued at install, as ``KEY=VALUE``. Run as
``python crash_at.py DEMO OPTIONS``: everything else is the real demo training and its hook.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from memtui import hooks
from memtui.demo import train
from memtui.hooks import persist
from memtui.hooks.persist import TUNED_FILE
from memtui.wire import SetRequest

POINT = os.environ["CRASH_AT"]
KNOB, _, VALUE = os.environ["CRASH_CHANGE"].partition("=")


def die() -> None:
    """``kill -9`` of this process, now."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


_install = hooks.install


def install(*args: Any, **kwargs: Any) -> hooks.Tuner:
    """The demo's install, then the change queued as an operator would."""
    tuner = _install(*args, **kwargs)
    assert tuner.control.queue(SetRequest(changes={KNOB: VALUE}, client="test")).ok
    return tuner


_append = persist.AuditLog.append


def append(self: persist.AuditLog, event: str, payload: Any, *, durable: bool = False) -> None:
    """The audit log's append, killed after the line of ``POINT``."""
    _append(self, event, payload, durable=durable)
    if event == POINT:
        die()


_replace = os.replace


def replace(src: Any, dst: Any, **kwargs: Any) -> None:
    """``os.replace``, killed before or after the rename of the tuned config."""
    tuned = os.fspath(dst).endswith(TUNED_FILE)
    if tuned and POINT == "before-rename":
        die()
    _replace(src, dst, **kwargs)
    if tuned and POINT == "after-rename":
        die()


hooks.install = install  # type: ignore[assignment]
persist.AuditLog.append = append  # type: ignore[method-assign]
os.replace = replace  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
