"""The five knobs: names and aliases, parsing, validation, keep-effective-batch arithmetic and
the learning-rate rule for a change of the effective batch.

Pure functions, shared by the hook (which decides) and the clients (which check early).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from memtui.core.stats import shown
from memtui.wire import KnobDiff, Knobs, KnobValue

KNOBS: tuple[str, ...] = (
    "batch_size",
    "grad_accum",
    "num_workers",
    "pin_memory",
    "prefetch_factor",
)
"""The canonical knob names, in display order."""

CONFIG_ALIASES: dict[str, tuple[str, ...]] = {
    "batch_size": (
        "batch_size",
        "batch_size_per_gpu",
        "per_device_train_batch_size",
        "micro_batch_size",
    ),
    "grad_accum": ("gradient_accumulation_steps", "grad_accum", "accumulation_steps"),
    "num_workers": ("num_workers", "dataloader_num_workers"),
    "pin_memory": ("pin_memory", "dataloader_pin_memory"),
    "prefetch_factor": ("prefetch_factor", "dataloader_prefetch_factor"),
}
"""Names under which each knob is found in a user's config, in order of preference."""

CLI_ALIASES: dict[str, str] = {
    alias: knob for knob, aliases in CONFIG_ALIASES.items() for alias in aliases
} | {
    "bs": "batch_size",
    "accum": "grad_accum",
    "workers": "num_workers",
    "pin": "pin_memory",
    "prefetch": "prefetch_factor",
}
"""Names a client may use for a knob in ``memtui set``."""

MAX_BATCH_SIZE = 1 << 20
MAX_GRAD_ACCUM = 1 << 16
MAX_PREFETCH_FACTOR = 1 << 10
DEFAULT_PREFETCH_FACTOR = 2
"""torch's own ``prefetch_factor`` with workers (and the value a loader without workers has)."""
PREFETCH_NEEDS_WORKERS = (
    "prefetch_factor is only used with num_workers > 0 (torch refuses it without workers): "
    "set num_workers too"
)

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


class KnobError(ValueError):
    """A change that cannot be accepted; the message is the reason shown to the user."""


def max_workers(cpu_count: int | None = None) -> int:
    """The most loader workers memtui accepts: 4 per CPU, at least 64."""
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(64, 4 * cpus)


GROWING_KNOBS = ("batch_size", "num_workers", "pin_memory", "prefetch_factor")
"""Knobs whose increase takes more memory (and can cause an out-of-memory error): each worker
holds ``prefetch_factor`` batches in host memory."""


def grew(knob: str, diff: KnobDiff) -> bool:
    """Whether ``diff`` makes ``knob`` take more memory (a bigger batch, more workers, pinning)."""
    if knob not in GROWING_KNOBS:
        return False
    if isinstance(diff.new, bool) or isinstance(diff.old, bool):
        return bool(diff.new) and not diff.old
    return diff.old is None or int(diff.new) > int(diff.old)


def shrank(knob: str, diff: KnobDiff) -> bool:
    """Whether ``diff`` makes ``knob`` take less memory (the reverse of ``grew``)."""
    if knob not in GROWING_KNOBS or diff.old is None:
        return False
    return grew(knob, KnobDiff(diff.new, diff.old))


def canonical_name(name: str) -> str:
    """Map a knob name or alias to its canonical name, or raise KnobError with a suggestion."""
    key = name.strip().lower().replace("-", "_")
    if key in KNOBS:
        return key
    if key in CLI_ALIASES:
        return CLI_ALIASES[key]
    close = difflib.get_close_matches(key, [*KNOBS, *CLI_ALIASES], n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise KnobError(f"unknown knob {name!r}{hint}; knobs are {', '.join(KNOBS)}")


def parse_value(knob: str, raw: object) -> KnobValue:
    """Parse a raw value (a CLI string, or an int/bool off the wire) for ``knob``."""
    if knob == "pin_memory":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise KnobError(f"pin_memory must be true or false, got {shown(raw)}")
    if isinstance(raw, bool):
        raise KnobError(f"{knob} must be an integer, got {shown(raw)}")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str):
        try:
            value = int(raw.strip())
        except ValueError:
            raise KnobError(f"{knob} must be an integer, got {shown(raw)}")
    else:
        raise KnobError(f"{knob} must be an integer, got {shown(raw)}")
    check_range(knob, value)
    return value


def check_range(knob: str, value: int) -> None:
    """Raise KnobError if an integer knob's value is out of its range."""
    if knob == "batch_size" and not 1 <= value <= MAX_BATCH_SIZE:
        raise KnobError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}, got {value}")
    if knob == "grad_accum" and not 1 <= value <= MAX_GRAD_ACCUM:
        raise KnobError(f"grad_accum must be between 1 and {MAX_GRAD_ACCUM}, got {value}")
    if knob == "prefetch_factor" and not 1 <= value <= MAX_PREFETCH_FACTOR:
        raise KnobError(
            f"prefetch_factor must be between 1 and {MAX_PREFETCH_FACTOR} (batches each worker "
            f"loads ahead), got {value}"
        )
    if knob == "num_workers":
        limit = max_workers()
        if value < 0:
            raise KnobError(f"num_workers must be 0 or more, got {value}")
        if value > limit:
            raise KnobError(
                f"num_workers={value} is absurdly high for a host with {os.cpu_count()} CPUs "
                f"(limit {limit})"
            )


def parse_changes(raw: Mapping[str, object]) -> dict[str, KnobValue]:
    """Parse a mapping of names (aliases allowed) to raw values into canonical knob values."""
    if not raw:
        raise KnobError("no change given: pass KEY=VALUE, e.g. batch_size=24")
    parsed: dict[str, KnobValue] = {}
    for name, value in raw.items():
        knob = canonical_name(str(name))
        if knob in parsed:
            raise KnobError(f"{knob} given twice")
        parsed[knob] = parse_value(knob, value)
    return parsed


def names_knob(word: str) -> bool:
    """Whether ``word`` is a knob's name or alias (``batch_size``, ``workers``), not a run."""
    return word.strip().lower().replace("-", "_") in (*KNOBS, *CLI_ALIASES)


def parse_assignments(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Split CLI ``KEY=VALUE`` words into a mapping; raise KnobError on a malformed one."""
    raw: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if names_knob(key) and not value.strip():
            knob = canonical_name(key)
            example = "true" if knob == "pin_memory" else "N"
            raise KnobError(f"{key.strip()} needs a value: {key.strip()}={example}")
        if not sep or not key.strip() or not value.strip():
            raise KnobError(f"expected KEY=VALUE, got {item!r}")
        raw[key.strip()] = value.strip()
    return raw


def effective_batch(batch_size: int, grad_accum: int, world_size: int = 1) -> int:
    """Samples per optimizer step across the job: micro-batch x accumulation x ranks."""
    return batch_size * grad_accum * world_size


def unused_knobs(config: Mapping[str, object]) -> dict[str, str]:
    """The knobs whose value the run's loader does not use now, with why in a few words:
    ``prefetch_factor`` without loader workers (torch uses it only with ``num_workers > 0``; the
    value kept is the one workers would use)."""
    if config.get("num_workers") == 0 and config.get("prefetch_factor") is not None:
        return {"prefetch_factor": "no loader workers"}
    return {}


MEASURED_KNOBS = ("batch_size", "grad_accum")
"""The knobs whose value the steps measure where the run holds none memtui can read: the
samples of a micro-batch, the micro-batches of a step."""


@dataclass(frozen=True)
class KnownConfig:
    """Every knob's value as far as memtui knows it (None: unknown), and where it came from: the
    knobs it can change, those the run holds that it cannot (read by the hook), or what the steps
    measured; the one source of the figures every view of a run shows."""

    values: dict[str, KnobValue | None]
    """Every knob, in display order."""
    tunable: tuple[str, ...] = ()
    measured: tuple[str, ...] = ()
    """The knobs whose value was measured from the steps, not read."""
    world_size: int = 1

    def value(self, knob: str) -> KnobValue | None:
        """One knob's value (None: not known)."""
        return self.values.get(knob)

    @property
    def unused(self) -> dict[str, str]:
        """The knobs the loader does not use now, with why (``unused_knobs``): their value is
        the one it takes once they apply."""
        return unused_knobs(self.values)

    def effective_batch(self, changes: Mapping[str, KnobValue] | None = None) -> int | None:
        """Micro-batch x accumulation x ranks, with ``changes`` (None: either is not known)."""
        values = {**self.values, **(changes or {})}
        batch, accum = values.get("batch_size"), values.get("grad_accum")
        if not isinstance(batch, int) or isinstance(batch, bool):
            return None
        if not isinstance(accum, int) or isinstance(accum, bool):
            return None
        return effective_batch(batch, accum, self.world_size)

    def as_knobs(self) -> Knobs:
        """The values as a ``Knobs`` (the unknown ones unset)."""
        return knobs_with(Knobs(), {k: v for k, v in self.values.items() if v is not None})


class StepShape(Protocol):
    """What the steps measured of the loop's micro-batch (``core.stats.StepStats``)."""

    @property
    def micro_batch(self) -> int | None: ...

    @property
    def micro_batches(self) -> int | None: ...


def known_config(
    config: Knobs,
    tunable: Iterable[str],
    held: Mapping[str, KnobValue] | None = None,
    steps: StepShape | None = None,
    world_size: int = 1,
) -> KnownConfig:
    """The run's knobs as far as memtui knows them: ``config`` (its tunable knobs' values), else
    ``held`` (the values the hook read of knobs it cannot change), else, for the micro-batch and
    the accumulation, what ``steps`` measured."""
    values: dict[str, KnobValue | None] = {}
    measured: list[str] = []
    for knob in KNOBS:
        value = getattr(config, knob)
        if value is None and held:
            value = held.get(knob)
        if value is None and steps is not None and knob in MEASURED_KNOBS:
            value = steps.micro_batch if knob == "batch_size" else steps.micro_batches
            if value is not None:
                measured.append(knob)
        values[knob] = value
    return KnownConfig(values, tuple(k for k in KNOBS if k in tunable), tuple(measured), world_size)


@dataclass(frozen=True)
class Resolved:
    """A change with keep-effective-batch arithmetic done, and a note for the user."""

    changes: dict[str, KnobValue]
    note: str = ""


def resolve(
    changes: Mapping[str, KnobValue],
    current: Knobs,
    tunable: list[str] | tuple[str, ...],
    *,
    keep_effective_batch: bool = False,
    world_size: int = 1,
    why_not: Mapping[str, str] | None = None,
    held: Mapping[str, KnobValue] | None = None,
) -> Resolved:
    """Check a parsed change against the run (``current``: its config with the pending changes
    merged; ``held``: the values of the knobs it has but memtui cannot change) and apply
    keep-effective-batch; raise KnobError. Knobs already at their value are left out (said in
    the note); a change that changes nothing is refused."""
    for knob in changes:
        if knob not in tunable:
            why = (why_not or {}).get(knob) or (
                "the run found no value of it; to make it tunable, keep it in the config given "
                "to hooks.install, or name it there with knobs="
            )
            raise KnobError(f"{knob} is not tunable in this run ({why})")
    resolved = dict(changes)
    note = ""
    if keep_effective_batch:
        if "batch_size" not in changes:
            raise KnobError("keep-effective-batch needs a batch_size change")
        if "grad_accum" in changes:
            raise KnobError("keep-effective-batch computes grad_accum: do not give both")
        if current.batch_size is None or current.grad_accum is None:
            raise KnobError("keep-effective-batch needs both batch_size and grad_accum tunable")
        new_batch = int(changes["batch_size"])
        target = current.batch_size * current.grad_accum
        accum, exact = accumulation_for(target, new_batch)
        resolved["grad_accum"] = accum
        old_eff = effective_batch(current.batch_size, current.grad_accum, world_size)
        new_eff = effective_batch(new_batch, accum, world_size)
        if exact:
            note = f"effective batch kept at {new_eff} ({new_batch} x {accum}"
            note += f" x {world_size} ranks)" if world_size > 1 else ")"
        else:
            note = (
                f"{new_batch} does not divide {target}: grad_accum {accum} gives effective "
                f"batch {new_eff} (was {old_eff})"
            )
    if "prefetch_factor" in resolved:
        # refused only where the run has no workers: a worker count memtui has not read is
        # unknown, not 0 (the loader, told, keeps its prefetch where it has none)
        workers = resolved.get("num_workers", current.num_workers)
        if workers is None:
            workers = (held or {}).get("num_workers")
        if workers == 0:
            raise KnobError(PREFETCH_NEEDS_WORKERS)
    same = {k: v for k, v in resolved.items() if getattr(current, k) == v}
    if same:
        already = ", ".join(f"{k} is already {format_value(v)}" for k, v in same.items())
        if len(same) == len(resolved):
            raise KnobError(f"{already} (pending changes included): nothing to change")
        resolved = {k: v for k, v in resolved.items() if k not in same}
        note = f"{note}; {already}" if note else already
    return Resolved(resolved, note)


def accumulation_for(target_samples: int, batch_size: int) -> tuple[int, bool]:
    """The accumulation that brings ``batch_size`` closest to ``target_samples``, and if exact."""
    if target_samples % batch_size == 0:
        return target_samples // batch_size, True
    low = max(1, target_samples // batch_size)
    high = low + 1
    best = min((low, high), key=lambda a: (abs(a * batch_size - target_samples), a))
    return best, False


def format_value(value: object) -> str:
    """Show a knob value the way a user types it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "-" if value is None else str(value)


def format_changes(changes: Mapping[str, object]) -> str:
    """Show a change set as ``key=value`` words."""
    return " ".join(f"{k}={format_value(v)}" for k, v in changes.items())


def knobs_with(base: Knobs, changes: Mapping[str, KnobValue | None]) -> Knobs:
    """A copy of ``base`` with ``changes`` applied (names that are not knobs are left out: a
    run's pending changes arrive from outside)."""
    known = {k: v for k, v in changes.items() if k in KNOBS}
    return Knobs(**{**as_dict(base, keep_none=True), **known})  # type: ignore[arg-type]


def as_dict(knobs: Knobs, *, keep_none: bool = False) -> dict[str, KnobValue | None]:
    """The knobs as ``{name: value}`` in display order (the unset ones only with ``keep_none``)."""
    values = {k: getattr(knobs, k) for k in KNOBS}
    return values if keep_none else {k: v for k, v in values.items() if v is not None}


def merge(changes: Iterable[Mapping[str, KnobValue]]) -> dict[str, KnobValue]:
    """Change sets merged in order: a later value of a knob wins."""
    merged: dict[str, KnobValue] = {}
    for change in changes:
        merged.update(change)
    return merged


def diff(current: Knobs, target: Mapping[str, KnobValue | None]) -> dict[str, KnobDiff]:
    """What setting ``target`` changes in ``current``: ``{knob: KnobDiff(old, new)}``."""
    return {
        k: KnobDiff(getattr(current, k), v)
        for k, v in target.items()
        if v is not None and getattr(current, k) != v
    }


def new_values(diffs: Mapping[str, KnobDiff]) -> dict[str, KnobValue]:
    """The values a change set: ``{knob: new}`` of its diffs."""
    return {k: d.new for k, d in diffs.items()}


class OldNew(Protocol):
    """A knob's value before and after a change (the wire's ``KnobDiff``, or a report's view)."""

    @property
    def old(self) -> KnobValue | None: ...

    @property
    def new(self) -> KnobValue: ...


def format_diffs(diffs: Mapping[str, OldNew], arrow: str = "->") -> str:
    """Show changes as ``knob old -> new`` parts, comma separated (``default`` for a knob the run
    had not set)."""
    return ", ".join(
        f"{k} {'default' if d.old is None else format_value(d.old)} {arrow} {format_value(d.new)}"
        for k, d in diffs.items()
    )


LR_RULES: tuple[str, ...] = ("linear", "sqrt", "none")
"""How the learning rate follows a change of the effective batch: in proportion to it, to its
square root, or not at all."""


def next_lr_scale(rule: str) -> str:
    """The viewer's next choice of LR rule after ``rule`` ('' is the run's own, first)."""
    choices = ("", *LR_RULES)
    return choices[(choices.index(rule) + 1) % len(choices)] if rule in choices else ""


def lr_rule(raw: str) -> str:
    """A learning-rate rule's canonical name; raise KnobError if ``raw`` names none."""
    rule = raw.strip().lower()
    if rule not in LR_RULES:
        raise KnobError(f"unknown lr rule {raw!r}; rules are {', '.join(LR_RULES)}")
    return rule


def samples_per_rank_step(knobs: Knobs) -> int | None:
    """Samples one rank feeds an optimizer step (micro-batch x accumulation; None: no batch)."""
    if knobs.batch_size is None:
        return None
    return knobs.batch_size * (knobs.grad_accum or 1)


def lr_factor(old: Knobs, new: Knobs, rule: str) -> float | None:
    """What the LR is multiplied by when the config goes from ``old`` to ``new`` under ``rule``
    (the ranks cancel out); None when the effective batch stays or the rule is ``none``."""
    before, after = samples_per_rank_step(old), samples_per_rank_step(new)
    if before is None or after is None or before == after or rule == "none":
        return None
    ratio = after / before
    return ratio if rule == "linear" else ratio**0.5


def format_lr(factor: float, rule: str) -> str:
    """``lr x2.0 (linear)``: the audit log's and the change log's words for an LR change."""
    return f"lr x{round(factor, 4)} ({rule})"


def lr_words(
    old: Knobs,
    new: Knobs,
    rule: str,
    *,
    optimizer_known: bool,
    world_size: int = 1,
    why: str = "",
) -> str:
    """What a change from ``old`` to ``new`` does to the LR under ``rule``, in words: ``lr x2.0
    (linear)``, a warning that it does not follow the effective batch (``why``, where the
    caller knows), or "" if that stays."""
    before, after = samples_per_rank_step(old), samples_per_rank_step(new)
    if before is None or after is None or before == after:
        return ""
    factor = lr_factor(old, new, rule)
    if factor is not None and optimizer_known and not why:
        return format_lr(factor, rule)
    if not why:
        why = "no optimizer known to memtui" if factor is not None else "rule none"
    return (
        f"warning: effective batch {before * world_size} -> {after * world_size}, the LR does "
        f"not follow ({why})"
    )
