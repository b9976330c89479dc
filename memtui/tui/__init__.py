"""The Textual viewer (``memtui attach``); never imports torch."""
