"""What a restarted run starts from: the tuned YAML beside its checkpoint, the tuned config its own
checkpoint keeps (``checkpoint["memtui"] = tuner.state_dict()``), and which of the two wins.

The checkpoint's is the config its weights were trained with, so it wins over the YAML, except
where the YAML is newer knowledge of that same point: written by the same run at the checkpoint's
own step (a change applied at the boundary right after that save, which the save could not hold
yet), or the safe config an out-of-memory error wrote at or after that step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtui.core.knobs import KNOBS, format_value
from memtui.hooks.lr import LR_SECTION
from memtui.hooks.persist import ceiling_of, read_tuned_body, tuned_values
from memtui.wire import Ceiling, KnobValue

CHECKPOINT = "the checkpoint"
"""Where a checkpoint's tuned config was read, in the words memtui says it with."""


@dataclass(frozen=True)
class TunedState:
    """A tuned config as a restart reads it: from the tuned YAML or from a checkpoint's entry."""

    where: str
    """Where it was read: the tuned YAML's path, or ``CHECKPOINT``."""
    config: dict[str, KnobValue]
    """The knob values it sets (a YAML: every knob it keeps; a checkpoint: those memtui set)."""
    lr: dict[str, Any]
    """Its LR section (empty: the script's own LR)."""
    ceiling: Ceiling | None = None
    """What ran out of memory before it was written (None: nothing did)."""
    run: str = ""
    """The run that wrote it."""
    step: int | None = None
    """The step it was written at (None: not said)."""
    oom: bool = False
    """Whether it is the safe config an out-of-memory error wrote."""

    @property
    def factor(self) -> float:
        """The LR factor it keeps (1.0: the script's own LR)."""
        raw = self.lr.get("factor")
        return float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else 1.0

    def summary(self, config: Mapping[str, KnobValue] | None = None) -> str:
        """``step 40: batch_size 16, lr x2.0``: its step, knobs (``config``: those instead) and
        LR factor."""
        values = self.config if config is None else config
        parts = [f"{k} {format_value(v)}" for k, v in values.items()]
        if self.factor != 1.0:
            parts.append(f"lr x{round(self.factor, 4)}")
        said = ", ".join(parts) or "the script's own config"
        return f"step {self.step}: {said}" if self.step is not None else said


def from_yaml(path: Path) -> TunedState:
    """The tuned config of a tuned YAML; raise ``ownfiles.UnsafeFile`` if it is not the user's
    own or others can write it, ValueError if it is not a tuned config."""
    body = read_tuned_body(path)
    lr = body.get(LR_SECTION)
    step = body.get("step")
    return TunedState(
        where=str(path),
        config=tuned_values(body.get("config"), str(path)),
        lr=dict(lr) if isinstance(lr, Mapping) else {},
        ceiling=ceiling_of(body.get("ceiling")),
        run=str(body.get("run", "")),
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        oom="oom" in body,
    )


def from_entry(state: Mapping[str, Any]) -> TunedState | None:
    """The tuned config a checkpoint's ``tuner.state_dict()`` keeps (None: one saved before
    checkpoints kept it, with the step and the loaders only); raise ValueError if it is not one."""
    if "config" not in state:
        return None
    lr = state.get(LR_SECTION)
    if lr is not None and not isinstance(lr, Mapping):
        raise ValueError(f"{CHECKPOINT}'s memtui entry has an LR section that is not a mapping")
    step = state.get("step")
    return TunedState(
        where=CHECKPOINT,
        config=tuned_values(state["config"], f"{CHECKPOINT}'s memtui entry"),
        lr=dict(lr or {}),
        ceiling=ceiling_of(state.get("ceiling")),
        run=str(state.get("run", "")),
        step=int(step) if isinstance(step, int) and not isinstance(step, bool) else None,
    )


def yaml_wins(found: TunedState, entry: TunedState) -> str:
    """Why the tuned YAML is newer knowledge of the checkpoint's own point than its entry ("":
    it is not, and the checkpoint's wins)."""
    if found.step is None or entry.step is None:
        return ""
    if found.run and found.run == entry.run and found.step == entry.step:
        return "it was written at the checkpoint's step, after its save, by a change applied there"
    if found.oom and found.step >= entry.step:
        return "it is the safe config an out-of-memory error wrote after that checkpoint"
    return ""


def differ(found: TunedState, entry: TunedState, own: Mapping[str, KnobValue]) -> bool:
    """Whether the YAML and the checkpoint's entry set another config or LR factor (the entry's
    knobs over the script's ``own``)."""
    held = {**own, **entry.config}
    knobs = any(held.get(k, v) != v for k, v in found.config.items()) or any(
        found.config.get(k, v) != v for k, v in entry.config.items()
    )
    return knobs or not math.isclose(found.factor, entry.factor, rel_tol=1e-6)


@dataclass(frozen=True)
class Unfinished:
    """The last change an earlier run applied that the audit log and the tuned YAML do not agree
    on: the run stopped between the two (``interrupted``), or the tuned YAML was not written."""

    run: str
    """The run that applied it."""
    ids: list[int]
    """The changes' ids (none: a rollback)."""
    step: int
    changes: dict[str, tuple[Any, Any]]
    """Each knob's (old, new) value."""
    interrupted: bool
    """The audit log has its ``applying`` line and no ``applied`` line: the run stopped between."""
    saved: bool
    """The tuned YAML holds it (it was written at that step or after, by that run)."""

    @property
    def words(self) -> str:
        """``change #3 at step 40 (batch_size 8 -> 4)``."""
        which = f"change #{','.join(map(str, self.ids))}" if self.ids else "a rollback"
        diffs = ", ".join(
            f"{k} {format_value(old)} -> {format_value(new)}"
            for k, (old, new) in self.changes.items()
        )
        return f"{which} at step {self.step}" + (f" ({diffs})" if diffs else "")

    def requeue(self, run: str) -> str:
        """The command that queues it again on ``run`` ("" for none)."""
        words = " ".join(f"{k}={format_value(new)}" for k, (_old, new) in self.changes.items())
        return f"memtui set {run} {words}" if words else ""


def unfinished(
    events: list[dict[str, Any]], current_run: str, found: TunedState | None
) -> Unfinished | None:
    """The last change the last earlier run in the audit ``events`` applied, when the tuned YAML
    ``found`` (None: none was read) does not hold it or the run stopped before its ``applied``
    line; None when the two agree."""
    earlier = [e for e in events if e.get("run") != current_run]
    if not earlier:
        return None
    run = str(earlier[-1].get("run", ""))
    last = None
    for event in earlier:
        if event.get("run") == run and event.get("event") in ("applying", "applied"):
            last = event
    step = last.get("step") if last is not None else None
    if last is None or not isinstance(step, int) or isinstance(step, bool):
        return None
    interrupted = last.get("event") == "applying"
    saved = found is not None and found.run == run and found.step is not None and found.step >= step
    if saved and not interrupted:
        return None
    raw = last.get("changes")
    changes = {  # each knob's [old, new], as the audit log keeps a KnobDiff
        knob: (diff[0], diff[1])
        for knob, diff in (raw.items() if isinstance(raw, dict) else ())
        if knob in KNOBS and isinstance(diff, list) and len(diff) == 2
    }
    ids = [i for i in last.get("ids") or [] if isinstance(i, int) and not isinstance(i, bool)]
    return Unfinished(run, ids, step, changes, interrupted, saved)
