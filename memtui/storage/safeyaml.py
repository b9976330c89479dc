"""YAML read from files memtui does not control, safely: small, no aliases, errors in one line.

PyYAML's ``safe_load`` builds an alias bomb (a few hundred bytes of nested ``&a [*a, *a]``) as
shared references in microseconds, but anything that walks or formats the result (a message
that echoes a bad value) then takes minutes and gigabytes. The tuned config and the thresholds
file never need aliases, so a file that uses one is refused before it is built. So is nesting
deeper than ``MAX_DEPTH`` (the composer recurses: a deep file raised RecursionError), a number
longer than ``MAX_NUMBER`` characters (``1:1:1...`` converts in quadratic time, big ones overflow)
and a path that is not a regular file (a FIFO blocked the reader). Every error is one
``yaml.YAMLError`` of one line. A file that steers a run (the tuned config) is read only if it is
the user's own and nobody else can write it (``read(path, private=True)``).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from memtui.storage import ownfiles

MAX_BYTES = 1 << 20
"""A config file larger than this is refused unread (both of memtui's are a few hundred bytes)."""
MAX_DEPTH = 32
"""Collections nested deeper than this are refused (memtui's files nest three deep)."""
MAX_NUMBER = 64
"""A number (an int or float scalar) longer than this many characters is refused."""


class UnsafeYaml(yaml.YAMLError):
    """A YAML text memtui refuses: too large, aliases, nested too deep or a number too long."""


class _NoAliasLoader(yaml.SafeLoader):
    """The safe loader, refusing every alias (``*name``), deep nesting and long numbers."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose the next node, refusing an alias or a deep one before anything is built."""
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise UnsafeYaml(f"YAML aliases are not accepted ({_line(event)})")
        if self._depth >= MAX_DEPTH:
            raise UnsafeYaml(f"nested over {MAX_DEPTH} deep ({_line(event)})")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_short_number(self, node: yaml.ScalarNode) -> Any:
        """An int or a float, refused over ``MAX_NUMBER`` characters."""
        if len(node.value) > MAX_NUMBER:
            raise UnsafeYaml(f"a number of {len(node.value)} characters ({_line(node)})")
        if node.tag.endswith(":int"):
            return self.construct_yaml_int(node)
        return self.construct_yaml_float(node)


def _line(where: Any) -> str:
    """Where an event or node starts, for a message."""
    mark = getattr(where, "start_mark", None)
    return f"line {mark.line + 1}" if mark is not None else "somewhere"


for _tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
    _NoAliasLoader.add_constructor(_tag, _NoAliasLoader.construct_short_number)


def load(text: str) -> Any:
    """The data in ``text``; raise ``yaml.YAMLError`` (one line) if it is not plain safe YAML."""
    if len(text) > MAX_BYTES:
        raise UnsafeYaml(f"{len(text)} characters, over the {MAX_BYTES >> 10} KiB accepted")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)
    except UnsafeYaml:
        raise
    except (yaml.YAMLError, ValueError, ArithmeticError, RecursionError) as exc:
        # a constructor's own error: a date that does not exist, a float that overflows
        raise yaml.YAMLError(" ".join(str(exc).split())[:300] or type(exc).__name__) from None


def read(path: str | os.PathLike[str], *, private: bool = False) -> Any:
    """The data in the YAML file at ``path`` (at most ``MAX_BYTES`` of it is read), with
    ``private`` only if it is the user's own and writable by nobody else
    (``ownfiles.open_read``); raise ``OSError``, ``UnicodeDecodeError`` or ``yaml.YAMLError``
    (one line)."""
    # a FIFO opens at once (O_NONBLOCK), and is refused
    fd = ownfiles.open_read(Path(path)) if private else os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise UnsafeYaml(f"over the {MAX_BYTES >> 10} KiB accepted")
    return load(data.decode("utf-8"))
