"""Unit tests: no process started, no socket to another process; the whole set runs in seconds."""
