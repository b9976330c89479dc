"""Text that did not come from the code (a run, a file, the operator, the OS) shown as text.

Whatever a run sends, a file holds or the operator types is never parsed as markup (Rich's or
Textual's: ``[/]`` would raise, ``[@click=app.quit]`` would be an action) and never reaches the
terminal as a control character (an escape sequence in a host name would be obeyed by the
terminal). Widgets build ``rich.text.Text`` from such strings, never markup; every notification
goes through :func:`MemtuiApp.say` (``markup=False``); and ``memtui.runs.text.clean`` shows each control
character as a visible symbol of the same length (``␛`` for ESC, ``␀`` for NUL).
"""

from __future__ import annotations

from rich.text import Text

from memtui.runs.text import TABLE, UNSAFE, clean


def as_text(value: object, style: str = "", limit: int = 0) -> Text:
    """``value`` as a Text in ``style``: shown exactly as written, never as markup."""
    return Text(clean(value, limit), style)


def sanitize(text: Text) -> Text:
    """Make the control characters of a built Text visible, in place (its styles stay where
    they are: each character is replaced by one); returns it."""
    plain = text.plain
    if UNSAFE.search(plain):
        text.plain = plain.translate(TABLE)
    return text
