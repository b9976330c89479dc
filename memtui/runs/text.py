"""Text that did not come from the code (a run, a file, the operator, the OS), made safe to show.

Whatever a run sends, a file holds or the operator types never reaches the terminal as a control
character (an escape sequence in a host name would be obeyed by the terminal): :func:`clean`
shows each control character as a visible symbol of the same length (``␛`` for ESC, ``␀`` for
NUL). Plain strings: the command line prints them, the viewer builds its text from them.
"""

from __future__ import annotations

import re

_PICTURES = {code: 0x2400 + code for code in range(0x20) if code != 0x0A}
"""C0 control characters but the newline: their Unicode control pictures (``␛``, ``␀``)."""
_PICTURES[0x7F] = 0x2421  # DEL: ␡
_REPLACED = [*range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
"""C1 control characters (0x9B is a terminal's CSI) and the bidirectional overrides, embeddings
and isolates (they reorder what follows them on the line): the replacement character."""
TABLE = {**_PICTURES, **dict.fromkeys(_REPLACED, 0xFFFD)}
"""Every character not shown as itself, to the one character shown instead."""
UNSAFE = re.compile("[" + "".join(re.escape(chr(code)) for code in sorted(TABLE)) + "]")

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
