"""Text that did not come from the code (a run, a file, the operator, the OS), made safe to show.

Whatever a run sends, a file holds or the operator types never reaches the terminal as a control
character (an escape sequence in a host name would be obeyed by the terminal): :func:`clean`
shows each control character as a visible symbol of the same length (``␛`` for ESC, ``␀`` for
NUL). Plain strings: the command line prints them, the viewer builds its text from them.
"""

from __future__ import annotations

from memtui.core.stats import CONTROL, CONTROL_TABLE

TABLE = CONTROL_TABLE
"""Every character not shown as itself, to the one character shown instead."""
UNSAFE = CONTROL

ELLIPSIS = "…"


def clean(value: object, limit: int = 0) -> str:
    """``value`` as text whose control characters are visible symbols (one for one), cut to
    ``limit`` characters with an ellipsis when ``limit`` is given."""
    text = value if isinstance(value, str) else str(value)
    if UNSAFE.search(text):
        text = text.translate(TABLE)
    if limit and len(text) > limit:
        text = text[: max(0, limit - 1)] + ELLIPSIS
    return text
