"""What the receiver reports to the app: plain dataclasses, no Textual and no sockets here.

The receiver (:mod:`memtui.runs.receiver`) makes a :class:`ReceivedBatch` of decoded wire messages,
connection changes and notices; the app folds it into the viewer's state
(:mod:`memtui.runs.state`). Both import these types from here, so the receiver does not depend on
the state and the state does not depend on the receiver. (The Textual message that tells the app
a batch is waiting is :class:`memtui.tui.messages.ReceiverUpdate`.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

from memtui.wire import Message

MANY_RANKS = 16
"""Above this many ranks the viewer paces itself: frames gathered for longer, the view redrawn
at 2 Hz and the summaries made once a second."""


class Status(enum.Enum):
    """The connection to the run, as the receiver sees it; the value is shown to the user."""

    CONNECTING = "connecting"
    LIVE = "live"
    QUIET = "quiet"
    ENDED = "ended"
    EXITED = "exited"
    """The run's process is gone (on this host) without ending the run: killed or crashed."""
    DISCONNECTED = "disconnected"


@dataclass(frozen=True)
class ConnectionEvent:
    """The receiver's connection changed."""

    status: Status
    detail: str = ""
    """Why, in words: ``no data for 3.0 s``, ``run ended at step 400``..."""
    label: str = ""
    """What the receiver is attached to: a run id, endpoint or recording."""


YOU, RUN, VIEWER = "you", "run", "viewer"
"""Who a notice is about, as the change log labels it: the operator's own request, the training
run (its process exited), or the viewer itself (which run it picked, its own trouble)."""


@dataclass(frozen=True)
class Notice:
    """A line for the operator: a request's outcome (queued, rejected, no answer) or trouble."""

    ok: bool
    """False for refusals and failures (shown in red)."""
    text: str
    time: float = 0.0
    """When it happened, on the source's clock (0: when the state folds it)."""
    who: str = YOU
    """Who acted: ``YOU`` (a request this viewer sent), ``RUN`` or ``VIEWER``."""
    queued: int = 0
    """The id of the change this viewer's request queued (0: none): the change log says ``by
    you`` when it lands, even where it landed before the viewer saw it pending."""


@dataclass(frozen=True)
class RunOffer:
    """Another live run the viewer could follow now that its own run is gone (``run`` "": no
    offer any more); only a key press follows it, never the receiver on its own."""

    run: str = ""
    pid: int = 0
    cwd: str = ""
    why: str = ""
    """Why this one, in words: ``same state dir``, ``same working directory`` or ``newest``."""


Event: TypeAlias = Message | ConnectionEvent | Notice | RunOffer
"""One thing the receiver reports, in the order it happened."""


@dataclass
class ReceivedBatch:
    """Everything the receiver got since its previous batch, in order."""

    events: list[Event]
    clock: float
    """The source's clock when the batch was made (the recording's time in a replay)."""
    bad_frames: int = 0
    """Frames the receiver could not decode, since it started."""
    last_bad_frame: str = ""
    bad_values: int = 0
    """Messages the receiver dropped for impossible values (a rank past the run's world size, an
    implausible control seq), since it started."""
    reconnects: int = 0
    """Times the receiver subscribed anew to telemetry that stopped while the run answered."""
