"""YAML read from files memtui does not control, safely: small, no aliases, errors in one line.

PyYAML's ``safe_load`` builds an alias bomb (a few hundred bytes of nested ``&a [*a, *a]``) as
shared references in microseconds, but anything that walks or formats the result (a message
that echoes a bad value) then takes minutes and gigabytes. The tuned config and the thresholds
file never need aliases, so a file that uses one is refused before it is built.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

MAX_BYTES = 1 << 20
"""A config file larger than this is refused unread (both of memtui's are a few hundred bytes)."""


class UnsafeYaml(yaml.YAMLError):
    """A YAML text memtui refuses: too large, or using aliases."""


class _NoAliasLoader(yaml.SafeLoader):
    """The safe loader, refusing every alias (``*name``)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        """Compose the next node, refusing an alias before anything is built from it."""
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise UnsafeYaml(f"YAML aliases are not accepted (line {event.start_mark.line + 1})")
        return super().compose_node(parent, index)


def load(text: str) -> Any:
    """The data in ``text``; raise ``yaml.YAMLError`` (one line) if it is not plain safe YAML."""
    if len(text) > MAX_BYTES:
        raise UnsafeYaml(f"{len(text)} characters, over the {MAX_BYTES >> 10} KiB accepted")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)
    except UnsafeYaml:
        raise
    except yaml.YAMLError as exc:
        raise yaml.YAMLError(" ".join(str(exc).split())[:300]) from None


def read(path: str | os.PathLike[str]) -> Any:
    """The data in the YAML file at ``path`` (at most ``MAX_BYTES`` of it is read); raise
    ``OSError``, ``UnicodeDecodeError`` or ``yaml.YAMLError`` (one line)."""
    with open(path, "rb") as handle:
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise UnsafeYaml(f"over the {MAX_BYTES >> 10} KiB accepted")
    return load(data.decode("utf-8"))
