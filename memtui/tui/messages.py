"""Textual messages the receiver posts to the app."""

from __future__ import annotations

from textual.message import Message


class ReceiverUpdate(Message):
    """The receiver put a batch in the app's inbox; the handler drains every batch waiting.

    Posted once per batch from the receiver's thread (``post_message`` is thread-safe). The data
    travels in the inbox, not in the message, so a newer update may replace an older one still
    queued (``can_replace``): when the app falls behind, many updates cost one drain.
    """

    def can_replace(self, message: Message) -> bool:
        """An update still queued is superseded by a newer one (the inbox keeps the data)."""
        return isinstance(message, ReceiverUpdate)
