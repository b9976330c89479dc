"""The exporter's bearer token: a secret of the user's, in a file only the user can read.

``memtui export`` over TCP answers only requests that carry it (``Authorization: Bearer``, which
Prometheus sends from ``authorization: credentials_file:``). The file is made on first use, 0600
(its directory 0700 where memtui makes it), with 32 random bytes; an existing one is used only
if it is the user's own regular file that no other account can read or write, since whoever
reads it reads every run's metrics.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from memtui.storage.ownfiles import UnsafeFile, open_read, open_write, private_dir
from memtui.storage.paths import export_token_file

MAX_TOKEN = 4096
"""Bytes of a token file read at most."""


class TokenError(RuntimeError):
    """The token file cannot be made or trusted (one line that says why)."""


def default_token_file() -> Path:
    """Where the token is kept unless ``--token-file`` says: ``~/.config/memtui/export-token``."""
    return export_token_file()


def load_token(path: Path) -> str:
    """The token in ``path``, made there first if there is none; TokenError if it cannot be."""
    try:
        if not path.exists() and not path.is_symlink():
            if path == default_token_file():
                private_dir(path.parent)
            fd = open_write(path)
            try:
                os.write(fd, secrets.token_urlsafe(32).encode() + b"\n")
            finally:
                os.close(fd)
        fd = open_read(path)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
            if mode & 0o077:
                raise TokenError(
                    f"{path} can be read by other accounts (mode {mode:04o}), and whoever reads it "
                    f"reads every run's metrics: refused (chmod 600 {path}, then make a new token)"
                )
            token = os.read(fd, MAX_TOKEN).decode(errors="replace").strip()
        finally:
            os.close(fd)
    except (UnsafeFile, OSError) as exc:
        raise TokenError(f"the token file {exc}" if isinstance(exc, UnsafeFile) else str(exc))
    if len(token) < 16 or any(c.isspace() for c in token):
        raise TokenError(f"{path} holds no usable token (16 characters or more, no spaces)")
    return token
