"""How memtui reads an on/off environment variable, the same on the hook's side and the viewer's."""

from __future__ import annotations

ON = ("1", "true", "yes")
"""A switch's values that turn it on (in any case; spaces around are ignored)."""
OFF = ("0", "false", "no")
"""A switch's values that turn it off."""


def switch(text: str | None) -> bool | None:
    """``text`` read as a switch: True or False, None where it is unset, empty or not a switch."""
    word = (text or "").strip().lower()
    if word in ON:
        return True
    if word in OFF:
        return False
    return None
