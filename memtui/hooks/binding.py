"""Where each knob lives in the user's own config object, and reading and writing it there.

A config may be a dataclass, an ``argparse.Namespace``, a ``SimpleNamespace``, a dict, a module
(or its ``globals()``), or any object with attributes. Knobs are found under their common names
(see ``memtui.core.knobs.CONFIG_ALIASES``); an explicit mapping of knob to (dotted) path overrides
the search, e.g. ``{"batch_size": "train.micro_bs"}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any

from memtui.core.knobs import CONFIG_ALIASES, KNOBS, KnobError, canonical_name

_MISSING = object()

NAME_STEMS = {
    "batch_size": ("batch", "bs"),
    "grad_accum": ("accum",),
    "num_workers": ("worker",),
    "pin_memory": ("pin",),
    "prefetch_factor": ("prefetch",),
}
"""Parts of a config's name for each knob under a name memtui does not look for (a suggestion
only: memtui never binds a knob by a guess)."""


class BindingError(ValueError):
    """The config or the mapping cannot be used (a mapped path is missing, a frozen object)."""


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, _MISSING)
    return getattr(obj, name, _MISSING)


def _set(obj: Any, name: str, value: Any) -> None:
    if isinstance(obj, MutableMapping):
        obj[name] = value
    else:
        setattr(obj, name, value)


class ConfigBinding:
    """The paths of the knobs found in one config object."""

    def __init__(self, config: Any, mapping: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.paths: dict[str, str] = {}
        """Knob name to dotted path inside the config, for the knobs that were found."""
        if config is None:
            return
        params = getattr(config, "__dataclass_params__", None)
        if dataclasses.is_dataclass(config) and params is not None and params.frozen:
            raise BindingError(
                f"{type(config).__name__} is a frozen dataclass: memtui must be able to write "
                "the knobs into it (drop frozen=True, or pass a mutable config)"
            )
        for key, path in (mapping or {}).items():
            try:
                knob = canonical_name(key)
            except KnobError as exc:
                raise BindingError(str(exc))
            if self._resolve(path) is _MISSING:
                raise BindingError(f"knob mapping {key}={path!r}: the config has no {path!r}")
            self.paths[knob] = path
        for knob in KNOBS:
            if knob in self.paths:
                continue
            for alias in CONFIG_ALIASES[knob]:
                value = _get(config, alias)
                if value is not _MISSING and _looks_like(knob, value):
                    self.paths[knob] = alias
                    break

    def _resolve(self, path: str) -> Any:
        obj = self.config
        for part in path.split("."):
            obj = _get(obj, part)
            if obj is _MISSING:
                return _MISSING
        return obj

    def has(self, knob: str) -> bool:
        """True when the knob was found in the config."""
        return knob in self.paths

    def read(self, knob: str) -> Any:
        """The knob's current value in the config (None if not bound)."""
        if knob not in self.paths:
            return None
        value = self._resolve(self.paths[knob])
        return None if value is _MISSING else value

    def write(self, knob: str, value: Any) -> None:
        """Write the knob's value into the config."""
        path = self.paths[knob]
        *parents, leaf = path.split(".")
        obj = self.config
        for part in parents:
            obj = _get(obj, part)
        _set(obj, leaf, value)

    def names_like(self, knob: str) -> list[str]:
        """The config's own top-level names that look like ``knob`` by name and value (``workers``
        for ``num_workers``), for a message that suggests a ``knobs=`` mapping."""
        config = self.config
        if config is None:
            return []
        if isinstance(config, Mapping):
            names = [k for k in config if isinstance(k, str)]
        else:
            try:
                names = list(vars(config))
            except TypeError:
                names = dir(config)
        stems = NAME_STEMS.get(knob, ())
        return [
            name
            for name in names
            if not name.startswith("_")
            and any(stem in name.lower() for stem in stems)
            and _looks_like(knob, _get(config, name))
        ]

    def describe(self) -> str:
        """A line naming where each knob was found."""
        if not self.paths:
            return "no knobs found in the config"
        return ", ".join(f"{knob} <- {path}" for knob, path in self.paths.items())


def _looks_like(knob: str, value: Any) -> bool:
    if knob == "pin_memory":
        return isinstance(value, bool)
    return isinstance(value, int) and not isinstance(value, bool)
