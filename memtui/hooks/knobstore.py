"""The knob store: the one place the run's knob values live, and the only writer of the config.

It holds one frozen ``Knobs`` value, replaced whole when a change lands (the agent thread reads
it without a lock: a reference swap is atomic), the binding to the user's config object that it
writes through (all changed knobs or none), and a generation that loaders compare to notice a
change. Everyone else reads ``knobs``; nobody keeps a copy to sync by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memtui.core.knobs import (
    CONFIG_ALIASES,
    KNOBS,
    KnobError,
    as_dict,
    diff,
    format_diffs,
    format_value,
    knobs_with,
    new_values,
    parse_value,
)
from memtui.core.stats import shown
from memtui.hooks.binding import ConfigBinding
from memtui.hooks.errors import Report
from memtui.wire import KnobDiff, Knobs, KnobValue

log = logging.getLogger("memtui")

LOADER_KNOBS = ("batch_size", "num_workers", "pin_memory", "prefetch_factor")
"""The knobs a data loader is built with (a change rebuilds it)."""


def loader_values(loader: Any) -> dict[str, KnobValue]:
    """A torch DataLoader's own loader knobs, as it holds them (those it holds no usable value of
    left out: a custom batch sampler's batch size, the prefetch of a loader without workers)."""
    values: dict[str, KnobValue] = {}
    batch = getattr(loader, "batch_size", None)
    if batch is None:
        batch = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    read = {
        "batch_size": batch,
        "num_workers": getattr(loader, "num_workers", None),
        "pin_memory": getattr(loader, "pin_memory", None),
        "prefetch_factor": getattr(loader, "prefetch_factor", None),
    }
    for knob, value in read.items():
        parsed, _why = _parsed(knob, value) if value is not None else (None, "")
        if parsed is not None:
            values[knob] = parsed
    if values.get("num_workers") == 0:
        values.pop("prefetch_factor", None)  # nothing prefetches without workers
    return values


def _parsed(knob: str, value: Any) -> tuple[KnobValue | None, str]:
    """``value`` as a value of ``knob``, or None and why it is not one."""
    try:
        return parse_value(knob, value), ""
    except KnobError as exc:
        return None, str(exc)


def not_found(knob: str, like: list[str]) -> str:
    """Why ``knob`` is not tunable where the config given to ``hooks.install`` does not hold it,
    and how to make it tunable (``like``: the config's names that look like it)."""
    looked = ", ".join(CONFIG_ALIASES[knob])
    name = like[0] if like else "<its name in your config>"
    loader = "build the training loader with tuner.loader(factory), or " * (knob in LOADER_KNOBS)
    return (
        f"the config given to hooks.install holds no {knob} under the names memtui looks for "
        f"({looked}); to make it tunable, {loader}name yours: hooks.install(..., "
        f'knobs={{"{knob}": "{name}"}})'
    )


class KnobStore:
    """The current knob values, the tunable set, and the config object they are written into."""

    def __init__(self, config: Any, names: Mapping[str, str] | None, report: Report) -> None:
        self.binding = ConfigBinding(config, names)
        self._report = report
        read = {k: self.binding.read(k) for k in KNOBS if self.binding.has(k)}
        parsed = {k: _parsed(k, v) for k, v in read.items()}
        self._knobs = knobs_with(Knobs(), {k: v for k, (v, _) in parsed.items()})
        self.own: dict[str, KnobValue] = {k: v for k, (v, _) in parsed.items() if v is not None}
        """The script's own values: its config's at install, and a loader's for a knob the config
        does not hold (what a checkpoint's tuned config is told apart from)."""
        self.untunable: dict[str, Any] = {k: read[k] for k, (v, _) in parsed.items() if v is None}
        """The config's own values memtui cannot take (``num_workers=-1``): left to the user's
        code as they are (torch says what is wrong with them), and not tunable."""
        self.why_not: dict[str, str] = {
            knob: f"{knob}={shown(value)} in your config is not a value memtui can use "
            f"({parsed[knob][1]}); to make it tunable, give it one"
            for knob, value in self.untunable.items()
        }
        """Why each knob this run cannot change is not tunable, and how to make it tunable, in
        the user's words, by knob: written by whoever knows (the store, an adapter, the no-code
        watch), shown by the viewer and ``memtui status`` and said when a change of it is
        refused. A knob the config does not hold starts with ``not_found``'s reason; it is shown
        only while the knob has no value (a loader built by ``tuner.loader`` gives it one)."""
        for knob in KNOBS:
            if not self.binding.has(knob):
                self.why_not[knob] = not_found(knob, self.binding.names_like(knob))
        for knob, value in self.untunable.items():
            log.warning(
                "memtui: %s=%s in your config is not a value memtui can use (%s); it is passed to "
                "your code as it is and %s is not tunable in this run",
                knob,
                shown(value),
                parsed[knob][1],
                knob,
            )
        self.read_values: dict[str, KnobValue] = {}
        """The values of knobs the run has but memtui cannot change, as read where the run holds
        them (its training loader's own workers and batch size): shown, never written."""
        self.version = 0
        """Bumped at every change of the values, the tunable set, what was read or why a knob is
        not tunable: the control state a viewer holds is stale once it moves."""
        self.loader_generation = 0
        """Bumped whenever loaders must look again (a loader knob changed, samples re-queued):
        read by each loader once per batch, so a plain attribute (a property is a call); only
        ``touch_loaders`` writes it."""
        self.memory_since_step = 0
        """The step at which the current micro-batch and loader began (the memory model's window:
        samples taken at another worker count would count the workers' memory as noise)."""

    # ------------------------------------------------------------ reading

    @property
    def knobs(self) -> Knobs:
        """The knob values now (one frozen value: safe to keep and to read from any thread)."""
        return self._knobs

    def current(self) -> Knobs:
        """The knob values now, as a call (for the parts that read them from another thread)."""
        return self._knobs

    def untunable_reasons(self) -> dict[str, str]:
        """Why each knob this run has no value of is not tunable (a copy)."""
        return dict(self.why_not)

    def untunable_values(self) -> dict[str, KnobValue]:
        """The values read of the knobs this run cannot change (a copy)."""
        knobs = self._knobs
        return {k: v for k, v in self.read_values.items() if getattr(knobs, k) is None}

    def value(self, knob: str) -> KnobValue | None:
        """One knob's value now (None: not tunable in this run)."""
        value: KnobValue | None = getattr(self._knobs, knob)
        return value

    def tunable(self) -> list[str]:
        """The knobs this run can change."""
        knobs = self._knobs
        return [k for k in KNOBS if getattr(knobs, k) is not None]

    def refuse(self, knob: str, why: str, value: KnobValue | None = None) -> None:
        """Say why ``knob`` is not tunable in this run (for a knob the run has no value of memtui
        can change), with the run's own ``value`` of it where it was read (None: not known)."""
        self.why_not[knob] = why
        if value is not None:
            self.read_values[knob] = value
        self.version += 1

    def withdraw(self, knob: str, why: str) -> None:
        """Make ``knob`` not tunable from now on, and say why (a change of it is then refused at
        the boundary with that reason)."""
        self._knobs = knobs_with(self._knobs, {knob: None})
        self.why_not[knob] = why
        self.version += 1

    def loader_knobs(self) -> tuple[Any, ...]:
        """The values a loader is built with, in ``LOADER_KNOBS`` order."""
        knobs = self._knobs
        return tuple(getattr(knobs, k) for k in LOADER_KNOBS)

    # ------------------------------------------------------------ writing (training thread)

    def adopt(self, found: Mapping[str, Any]) -> None:
        """Take the values a loader was built with for the knobs the config does not expose."""
        missing = {k: v for k, v in found.items() if self.value(k) is None and v is not None}
        if missing:
            self._knobs = knobs_with(self._knobs, missing)
            self.own.update(missing)
            self.version += 1

    def touch_loaders(self) -> None:
        """Make every loader look at its knobs again at its next batch."""
        self.loader_generation += 1

    def check(self, changes: Mapping[str, KnobValue]) -> None:
        """Raise KnobError if a change names a knob this run cannot change or a value out of range."""
        for knob, value in changes.items():
            if self.value(knob) is None:
                why = self.why_not.get(knob)
                raise KnobError(f"{knob} is not tunable in this run" + (f": {why}" if why else ""))
            parse_value(knob, value)

    def apply(self, changes: Mapping[str, KnobValue | None], step: int) -> dict[str, KnobDiff]:
        """Write ``changes`` into the config (all or none) and the store; return what changed.

        Raise KnobError (with the config left as it was) if the config refuses a value.
        """
        diffs = diff(self._knobs, changes)
        written: list[str] = []
        failing = ""
        try:
            for failing, change in diffs.items():
                if self.binding.has(failing):
                    self.binding.write(failing, change.new)
                    written.append(failing)
        except Exception as exc:
            for knob in written:
                self.binding.write(knob, diffs[knob].old)
            self._report(exc, "apply")
            raise KnobError(f"could not write {failing} into the config: {exc}") from exc
        self._knobs = knobs_with(self._knobs, new_values(diffs))
        if diffs:
            self.version += 1
        if any(k in LOADER_KNOBS for k in diffs):
            self.memory_since_step = step
            self.loader_generation += 1
        return diffs

    def resume(
        self, values: Mapping[str, KnobValue], source: str | Path, *, say: bool = True
    ) -> dict[str, KnobDiff]:
        """Start from a tuned config's values (read from ``source``); return what they changed
        (``say``: name them in the log)."""
        wanted = {
            k: v for k, v in values.items() if k != "grad_accum" or self.binding.has("grad_accum")
        }
        for knob, value in wanted.items():
            if self.binding.has(knob):
                self.binding.write(knob, value)
        resumed = diff(self._knobs, wanted)
        self._knobs = knobs_with(self._knobs, wanted)
        if resumed:
            self.version += 1
        if any(k in LOADER_KNOBS for k in resumed):  # a loader already built follows them
            self.loader_generation += 1
        # a knob no config holds (a framework's loader knobs) has no value to name yet: the
        # loader that ``tuner.loader(factory)`` builds later takes the tuned one
        known = {k: d for k, d in resumed.items() if d.old is not None}
        later = [f"{k} {format_value(d.new)}" for k, d in resumed.items() if d.old is None]
        said = [format_diffs(known)] if known else []
        if later:
            said.append(
                f"the training loader is built with {', '.join(later)} (instead of its own values)"
            )
        if said and say:
            log.warning("memtui: resumed the tuned config from %s: %s", source, "; ".join(said))
        return resumed

    def tuned_values(self) -> dict[str, KnobValue]:
        """The knob values memtui set (those that are not the script's own), and those of the
        knobs only a loader holds (a restart cannot read the script's own from its config)."""
        own, binding = self.own, self.binding
        return {
            k: v
            for k, v in as_dict(self._knobs).items()
            if v is not None and (own.get(k) != v or not binding.has(k))
        }

    def as_dict(self) -> dict[str, KnobValue | None]:
        """The set knobs as ``{name: value}``."""
        return as_dict(self._knobs)
