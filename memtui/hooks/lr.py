"""The learning rate's owner: the optimizers and LR schedulers memtui knows, the run's rule for
a change of the effective batch, and the factor the optimizers' LR carries over the script's own.

The factor is a function of where the run is, not of the path it took: it is ``linear`` or
``sqrt`` of the effective batch over an anchor (the effective batch at which a known factor was
right: the script's own LR at the batch it started with, or the one a ``none`` change kept).
A boundary multiplies every known optimizer param group's ``lr`` and ``initial_lr``, every known
scheduler's ``base_lrs`` and the config fields the script's own schedule reads (``lr_fields``)
by what takes the factor there; an out-of-memory rollback restores the factor before it.

What memtui reports is what the optimizer uses: while the factor is not 1, a step pre-hook on
each known optimizer reads the LR the step is about to use and compares it with what the LR
schedulers of that optimizer set (``get_last_lr()``), or with the LR of the step before where
the optimizer has none. An LR no scheduler explains (memtui first looks for torch schedulers of
that optimizer it was not given, and follows them) is the script's own schedule: memtui
withdraws its factor, says so, and refuses LR rules from then on (unless the script's schedule
reads ``lr_fields``, which memtui scales).

The tuned config keeps the factor, its anchor, the optimizers' scaled start LRs and the factors
the run's LR carried. While the run has a factor (a resumed one too), each optimizer is
reconciled when memtui is given it, right after every ``load_state_dict`` of it (a script's,
accelerate's ``load_state``, a Trainer's resume: before a step reads what was loaded) and again
before its next step: start LRs that already carry the factor (a checkpoint saved after the
change) are left, ones that carry an earlier factor of the run or none (a checkpoint saved at
the change's own boundary, a fresh optimizer) are multiplied up to it, and every scheduler of
that optimizer (a restored one, one memtui was not given) computes from those start LRs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any, TypeGuard

from memtui.core.knobs import Knobs, format_lr, lr_rule, samples_per_rank_step
from memtui.wire import LrState

LR_SECTION = "lr"
"""The tuned config's section that keeps the LR factor."""

HISTORY = 16
"""Factors kept for out-of-memory rollbacks (each undoes the latest change)."""

Lost = Callable[[str, float], None]
"""Told ``(why, undo)`` when the script is found to set its own LR (memtui's factor withdrawn)."""


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside an accelerate or HF wrapper (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if hasattr(inner, "param_groups") else optimizer


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    """An optimizer's param groups."""
    groups = getattr(_unwrapped(optimizer), "param_groups", None)
    return list(groups) if isinstance(groups, list) else []


def _close(a: float, b: float) -> bool:
    """Whether two LRs are the same value (up to float rounding of a few multiplications)."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-15)


def _number(value: Any) -> TypeGuard[float]:
    """A plain LR value memtui can read without touching a device (not a tensor, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rule_factor(rule: str, ratio: float) -> float:
    """What a rule makes of a ratio of effective batches (``none``: 1)."""
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return ratio**0.5
    return 1.0


class LearningRate:
    """The optimizers and schedulers whose LR follows the effective batch, and by how much."""

    def __init__(
        self,
        rule: str = "none",
        *,
        fields: Sequence[str] = (),
        config: Any = None,
        report: Callable[[BaseException, str], None] | None = None,
        on_lost: Lost | None = None,
    ) -> None:
        self.rule = lr_rule(rule)
        """The run's rule for a change that names none (``hooks.install(..., lr_scale=...)``)."""
        self.fields = tuple(fields)
        """The config's fields the script's own LR schedule reads (``lr_fields``)."""
        self._config = config
        self._report = report or (lambda exc, where: None)
        self._optimizers: list[Any] = []
        self._schedulers: list[Any] = []
        self.factor = 1.0
        """What the optimizers' LR carries over the script's own (1.0: untouched)."""
        self.anchor: tuple[int, float] | None = None
        """(samples per rank step, the factor right there) that the rules compute from."""
        self.last_rule = ""
        """The rule of the last change that moved the LR ('' none since the anchor)."""
        self.owner = ""
        """Why memtui knows the script sets the optimizer's LR itself ('' it does not, so far)."""
        self.on_lost = on_lost
        """Told when the script sets the optimizer's LR itself: why, and the factor to undo."""
        self._history: list[tuple[float, tuple[int, float] | None, str]] = []
        self._starts: list[list[float]] | None = None
        """Each optimizer's start LRs carrying the factor (the tuned config's, in a resumed run)."""
        self._carried: list[float] = []
        """The factors other than 1 the LR carried since the script's own, oldest first (a
        checkpoint of the run carries one of them, or none)."""
        self._unchecked: set[int] = set()
        """Optimizers (by position) still to reconcile with the resumed factor at their step."""
        self._seen: dict[int, list[float]] = {}
        """Each optimizer's LRs at its last step (or as memtui last wrote them)."""
        self._hooks: dict[int, Any] = {}
        self._load_hooks: list[Any] = []
        """The handles of the known optimizers' ``load_state_dict`` post-hooks."""

    # ------------------------------------------------------------------ what memtui knows

    def watch_optimizer(self, optimizer: Any) -> None:
        """Make an optimizer's LR follow the effective batch (once; a resumed factor applies)."""
        optimizer = _unwrapped(optimizer)
        if optimizer is None or any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        index = len(self._optimizers) - 1
        self._follow_loads(index, optimizer)
        if self._reconciles():
            self._reconcile(index)
            self._unchecked.add(index)  # a checkpoint may still be loaded into it
        self._arm()

    def watch_scheduler(self, scheduler: Any) -> None:
        """Make an LR scheduler's ``base_lrs`` follow the effective batch (and its optimizer's)."""
        if scheduler is None or any(s is scheduler for s in self._schedulers):
            return
        self._schedulers.append(scheduler)
        self.watch_optimizer(getattr(_inner(scheduler), "optimizer", None))
        if self._reconciles():  # its optimizer's starts carry the factor now
            _rebase(scheduler)

    def known(self) -> bool:
        """Whether an optimizer is known: a change of the effective batch can move its LR."""
        return bool(self._optimizers) or bool(self.fields)

    def state(self) -> LrState:
        """The factor, its anchor and rule, and whether the script owns its schedule."""
        batch, factor = self.anchor or (None, 1.0)
        return LrState(
            factor=self.factor,
            anchor_batch=batch,
            anchor_factor=factor,
            rule=self.last_rule,
            fields=list(self.fields),
            script_schedule=self.owner,
        )

    def resolve(self, requested: str) -> str:
        """The rule a change follows: the one it names, else the run's (raise KnobError)."""
        return lr_rule(requested) if requested else self.rule

    # ------------------------------------------------------------------ a change's factor

    def decide(self, old: Knobs, new: Knobs, rule: str) -> float | None:
        """What every LR is multiplied by when the config goes from ``old`` to ``new`` under
        ``rule``: the rule's factor from the anchor over the factor held now (None: it stays)."""
        before, after = samples_per_rank_step(old), samples_per_rank_step(new)
        if before is None or after is None or before == after or rule == "none" or self.owner:
            return None
        batch, factor = self.anchor or (before, self.factor)
        multiplier = factor * rule_factor(rule, after / batch) / self.factor
        return None if _close(multiplier, 1.0) else multiplier

    def words(self, old: Knobs, new: Knobs, rule: str, world_size: int = 1) -> str:
        """What a change does to the LR, in words: ``lr x2.0 (linear)``, or a warning that the
        LR does not follow (and why), or "" when the effective batch stays."""
        before, after = samples_per_rank_step(old), samples_per_rank_step(new)
        if before is None or after is None or before == after:
            return ""
        if rule != "none" and self.known() and not self.owner:
            multiplier = self.decide(old, new, rule) or 1.0
            return self._said(multiplier, rule, before, after)
        why = (
            self.owner
            if self.owner and rule != "none"
            else "rule none"
            if rule == "none"
            else "no optimizer known to memtui"
        )
        return (
            f"warning: effective batch {before * world_size} -> {after * world_size}, the LR does "
            f"not follow ({why})"
        )

    def _said(self, multiplier: float, rule: str, before: int, after: int) -> str:
        """The LR words of a change: its factor, the total over the script's own where that
        differs, and a warning when its rule is not the one the factor came from."""
        text = format_lr(multiplier, rule)
        batch, factor = self.anchor or (before, self.factor)
        total = factor * rule_factor(rule, after / batch)
        if not _close(total, multiplier):
            text += f"; the LR is then x{round(total, 4)} the script's own"
        if self.last_rule and self.last_rule != rule:
            text += (
                f"; warning: the factor follows {rule} from effective batch {batch} per rank, "
                f"the change before followed {self.last_rule}"
            )
        return text

    def note(self, multiplier: float, rule: str, old: Knobs, new: Knobs) -> str:
        """The applied change's LR words (before ``changed`` records it)."""
        before, after = samples_per_rank_step(old) or 1, samples_per_rank_step(new) or 1
        return self._said(multiplier, rule, before, after)

    def changed(self, multiplier: float | None, rule: str, old: Knobs, new: Knobs) -> None:
        """A boundary changed the config from ``old`` to ``new``: multiply every known LR by
        ``multiplier`` (None: the LR stays, and the anchor moves to the new effective batch)."""
        before, after = samples_per_rank_step(old), samples_per_rank_step(new)
        if before is None or after is None or before == after:
            return
        self._history = [*self._history[-HISTORY + 1 :], (self.factor, self.anchor, self.last_rule)]
        if multiplier is None:  # the LR stays: it is the one for the new effective batch
            self.anchor, self.last_rule = (after, self.factor), ""
            return
        self.anchor = self.anchor or (before, self.factor)
        self.last_rule = rule
        self._scale(multiplier)

    def revert(self, multiplier: float | None) -> None:
        """Undo the latest change (an out-of-memory rollback): its factor and anchor."""
        if self._history:
            self.factor, self.anchor, self.last_rule = self._history.pop()
        elif multiplier is not None:  # a change from before a restart: its factor is counted
            self.factor /= multiplier
        if multiplier is not None:
            self._multiply(1.0 / multiplier)
        self._note(self.factor)
        self._arm()

    def _scale(self, multiplier: float) -> None:
        """Multiply every known LR by ``multiplier`` and count it in the factor."""
        for optimizer in list(self._optimizers):
            self._adopt(optimizer)
        self._multiply(multiplier)
        self.factor *= multiplier
        self._note(self.factor)
        self._arm()

    def _multiply(self, multiplier: float) -> None:
        """Multiply every known LR (and the ``lr_fields``) by ``multiplier``."""
        for optimizer in self._optimizers:
            _scale_groups(optimizer, multiplier)
        for scheduler in self._schedulers:
            _scale_base(scheduler, multiplier)
        self._scale_fields(multiplier)
        self._seen = {i: _lrs(o) for i, o in enumerate(self._optimizers)}
        self._starts = [_starts(o) for o in self._optimizers]

    def _note(self, factor: float) -> None:
        """Count ``factor`` among those the run's LR carried (the latest last)."""
        if factor != 1.0:
            others = [f for f in self._carried if not _close(f, factor)]
            self._carried = [*others[-HISTORY + 1 :], factor]

    def _reconciles(self) -> bool:
        """Whether LRs loaded or made now may lack the factor held (or carry another)."""
        return not self.fields and not self.owner and (self.factor != 1.0 or bool(self._carried))

    def _scale_fields(self, multiplier: float) -> None:
        """Multiply the config fields the script's own schedule reads."""
        for name in self.fields:
            value = _get(self._config, name)
            if _number(value):
                _set(self._config, name, value * multiplier)

    def replace(self, optimizer: Any, scheduler: Any, unsaved: float) -> None:
        """Follow an optimizer and scheduler loaded from a checkpoint instead of the ones known
        (a Trainer resuming in-process): ``unsaved`` is the factor applied since that checkpoint
        was saved, which its state lacks unless memtui reconciled it as it was loaded (an
        optimizer memtui knew, loaded again)."""
        self._disarm()
        self._forget_loads()
        self._optimizers, self._schedulers = [], []
        self._unchecked, self._seen = set(), {}
        self._note(self.factor / unsaved)  # what the checkpoint carries
        self.watch_optimizer(optimizer)
        self.watch_scheduler(scheduler)
        self._arm()

    # ------------------------------------------------------------------ the tuned config

    def persisted(self) -> dict[str, Any]:
        """The tuned config's LR section (empty while the LR is the script's own)."""
        section: dict[str, Any] = {}
        if self.factor != 1.0:
            section["factor"] = self.factor
            if self.anchor is not None:
                section["anchor"] = {"batch": self.anchor[0], "factor": self.anchor[1]}
            if self.last_rule:
                section["rule"] = self.last_rule
            starts = [_starts(o) for o in self._optimizers]
            if starts and all(starts) and not self.fields:
                section["starts"] = starts
                section["carried"] = list(self._carried)
            if self.fields:
                section["fields"] = list(self.fields)
        if self.owner:
            section["script_schedule"] = self.owner
        return {LR_SECTION: section} if section else {}

    def resume(self, section: Any) -> float:
        """Start from a tuned config's LR section: the optimizers and schedulers made known from
        now on are reconciled with its factor; return it (1.0: none)."""
        if not isinstance(section, Mapping):
            return 1.0
        owner = section.get("script_schedule")
        if isinstance(owner, str) and owner and not self.fields:
            self.owner = owner[:500]
        raw = section.get("factor")
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < 1e6:
            return 1.0
        self.factor = float(raw)
        anchor = section.get("anchor")
        if isinstance(anchor, Mapping):
            batch, factor = anchor.get("batch"), anchor.get("factor")
            if isinstance(batch, int) and batch > 0 and _number(factor) and 0 < factor < 1e6:
                self.anchor = (batch, float(factor))
        rule = section.get("rule")
        self.last_rule = rule if rule in ("linear", "sqrt") else ""
        starts = section.get("starts")
        if isinstance(starts, list) and all(
            isinstance(s, list) and all(_number(v) for v in s) for s in starts
        ):
            self._starts = [[float(v) for v in s] for s in starts]
        carried = section.get("carried")
        if isinstance(carried, list):
            self._carried = [float(f) for f in carried if _number(f) and 0 < f < 1e6][-HISTORY:]
        self._note(self.factor)
        self._scale_fields(self.factor)  # the script's own values, from its config
        for index in range(len(self._optimizers)):
            self._reconcile(index)
            self._unchecked.add(index)
        self._arm()
        return self.factor

    def restore(self, section: Any) -> float:
        """Start from a checkpoint's LR section in place of the factor held now (a tuned YAML's,
        resumed at install): the LRs that still carry memtui's scaling for it (an optimizer whose
        start LRs are the ones memtui gave it, the ``lr_fields``) give it back, then ``resume``
        reconciles every optimizer with the checkpoint's; return its factor (1.0: none)."""
        held = self.factor
        if held != 1.0:
            for index, optimizer in enumerate(self._optimizers):
                given = self._starts[index] if self._starts and index < len(self._starts) else []
                now = _starts(optimizer)
                if self.fields or not given or len(given) != len(now):
                    continue
                if all(_close(a, b) for a, b in zip(now, given, strict=True)):
                    _scale_groups(optimizer, 1.0 / held)
                    for scheduler in self._schedulers:
                        if _optimizer_of(scheduler) is optimizer:
                            _rebase(scheduler)
            self._scale_fields(1.0 / held)
        self.factor, self.anchor, self.last_rule = 1.0, None, ""
        self._history, self._carried, self._starts, self._unchecked = [], [], None, set()
        self._seen = {i: _lrs(o) for i, o in enumerate(self._optimizers)}
        factor = self.resume(section)
        self._arm()  # a section without a factor leaves the LR the script's own: nothing to read
        return factor

    def _reconcile(self, index: int, *, look: bool = True) -> None:
        """Make optimizer ``index`` carry the factor once, and every LR scheduler of it (a
        restored one, and where ``look`` one memtui was not given, too) compute from its start
        LRs."""
        if self.fields:
            return  # the script's schedule sets its LR from the scaled fields
        optimizer = self._optimizers[index]
        multiplier = self._owed(index, optimizer)
        if multiplier != 1.0:
            _scale_groups(optimizer, multiplier)
        if look:
            self._adopt(optimizer)
        for scheduler in self._schedulers:
            if _optimizer_of(scheduler) is optimizer:
                _rebase(scheduler)
        if self._starts is None:
            self._starts = []
        while len(self._starts) <= index:
            self._starts.append([])
        self._starts[index] = _starts(optimizer)
        self._seen[index] = _lrs(optimizer)

    def _owed(self, index: int, optimizer: Any) -> float:
        """What optimizer ``index``'s LRs lack of the factor: 1 where its start LRs are the ones
        kept (a checkpoint saved after the change), the factor over the one they carry where
        they are the kept ones at an earlier factor of the run or at none (a checkpoint saved
        before a change, a fresh optimizer), else the whole factor (the script's LR changed)."""
        now = _starts(optimizer)
        kept = self._starts[index] if self._starts and index < len(self._starts) else None
        if not now:
            return 1.0
        if not kept or len(kept) != len(now):
            return self.factor
        for carried in (self.factor, 1.0, *self._carried):
            if all(_close(a * self.factor / carried, b) for a, b in zip(now, kept, strict=True)):
                return self.factor / carried
        if self.factor == 1.0:
            return 1.0  # nothing of memtui's to apply
        self._report(
            ValueError(
                f"the optimizer's start LRs {now} are neither the tuned config's {kept} nor those "
                f"at a factor the run had: the script's LR changed; memtui applies its factor "
                f"x{round(self.factor, 4)} to it"
            ),
            "resuming the LR factor",
        )
        return self.factor

    def _adopt(self, optimizer: Any, *, beside: bool = False) -> list[Any]:
        """Follow the torch LR schedulers of ``optimizer`` that memtui was not given, where it
        knows none of it (``beside``: those beside the ones it knows too); return them (a search
        of the heap: at a change, a restore, an LR no known scheduler set)."""
        if not beside and any(_optimizer_of(s) is optimizer for s in self._schedulers):
            return []
        found = _unknown_schedulers(optimizer, self._schedulers)
        for scheduler in found:
            self.watch_scheduler(scheduler)
        return found

    def _follow_loads(self, index: int, optimizer: Any) -> None:
        """Reconcile optimizer ``index`` right after each ``load_state_dict`` of it, before any
        step uses what it loaded (and its schedulers, which may be loaded after it, at its next
        step)."""
        register = getattr(optimizer, "register_load_state_dict_post_hook", None)
        if not callable(register):
            return

        def loaded(_optimizer: Any) -> None:
            try:
                if self._reconciles():  # the schedulers memtui was not given: at the step
                    self._reconcile(index, look=False)
                    self._unchecked.add(index)
            except Exception as exc:  # never into training
                self._report(exc, "reconciling a loaded optimizer with the LR factor")

        try:
            self._load_hooks.append(register(loaded))
        except Exception as exc:
            self._report(exc, "following the optimizer's loaded state")

    def _forget_loads(self) -> None:
        """Stop following the known optimizers' ``load_state_dict``."""
        for handle in self._load_hooks:
            try:
                handle.remove()
            except Exception as exc:
                self._report(exc, "following the optimizer's loaded state")
        self._load_hooks = []

    # ------------------------------------------------------------------ what the optimizer uses

    def _arm(self) -> None:
        """Read the LR before each optimizer step while memtui's factor is not 1."""
        if self.factor == 1.0 or self.owner:
            self._disarm()
            return
        for index, optimizer in enumerate(self._optimizers):
            if index in self._hooks:
                continue
            register = getattr(optimizer, "register_step_pre_hook", None)
            if not callable(register):
                continue
            try:
                self._hooks[index] = register(self._checker(index))
            except Exception as exc:
                self._report(exc, "reading the LR at each step")

    def _disarm(self) -> None:
        """Stop reading the LR at each step."""
        for handle in self._hooks.values():
            try:
                handle.remove()
            except Exception as exc:
                self._report(exc, "reading the LR at each step")
        self._hooks = {}

    def _checker(self, index: int) -> Callable[..., None]:
        """The step pre-hook of optimizer ``index``: reconcile once, then check the LR held."""

        def check(optimizer: Any, args: Any, kwargs: Any) -> None:
            try:
                if index in self._unchecked:
                    self._unchecked.discard(index)
                    self._reconcile(index)
                self._check(index, optimizer)
            except Exception as exc:  # never into training
                self._report(exc, "reading the LR at a step")

        return check

    def _check(self, index: int, optimizer: Any) -> None:
        """Compare the LR this step uses with what the schedulers of its optimizer set, or with
        the step before's where it has none (the first param group's: a script that sets its LR
        sets every group's); a scheduler memtui was not given is looked for before the factor is
        withdrawn."""
        if self.factor == 1.0 or self.owner or self.fields:
            return
        groups = optimizer.param_groups
        now = groups[0].get("lr") if groups else None
        if not _number(now):
            return
        seen = self._seen.get(index)
        self._seen[index] = [now]
        expected = None  # what the first of its schedulers set (each step: no list made)
        for scheduler in self._schedulers:
            if _optimizer_of(scheduler) is optimizer:
                last = getattr(_inner(scheduler), "_last_lr", None)
                if isinstance(last, list) and last and _number(last[0]):
                    if _close(last[0], now):
                        return
                    expected = last[0] if expected is None else expected
        if expected is None:  # no scheduler of it: the LR holds from step to step
            if not seen or _close(seen[0], now):
                return
            expected = seen[0]
        if any(_close(lr, now) for lr in _set_by(self._adopt(optimizer, beside=True))):
            return  # a scheduler memtui was not given set it: memtui follows it from now on
        self._lose(expected, now)

    def _lose(self, expected: float, used: float) -> None:
        """The script set the optimizer's LR itself: withdraw memtui's factor and say so."""
        factor = self.factor
        why = (
            f"the script sets the optimizer's LR itself: a step used {used:.6g} where memtui "
            f"had {expected:.6g}"
            + (
                " (an LR scheduler memtui does not know, or the loop's own schedule; give the "
                "scheduler to tuner.watch_scheduler, or name the config fields the schedule reads "
                "in hooks.install(..., lr_fields=...))"
            )
        )
        for optimizer in self._optimizers:  # the 'lr' is the script's now; the starts follow it
            for group in _groups(optimizer):
                if _number(group.get("initial_lr")):
                    group["initial_lr"] = group["initial_lr"] / factor
        for scheduler in self._schedulers:
            target = _inner(scheduler)
            base = getattr(target, "base_lrs", None)
            if isinstance(base, list):
                target.base_lrs = [b / factor for b in base]
        self._history, self._carried, self._starts = [], [], None
        self.factor, self.anchor, self.last_rule, self.owner = 1.0, None, "", why
        self._disarm()
        if self.on_lost is not None:
            self.on_lost(why, 1.0 / factor)


def _unknown_schedulers(optimizer: Any, known: list[Any]) -> list[Any]:
    """The torch LR schedulers of ``optimizer`` that memtui was not given (torch marks an
    optimizer whose step a scheduler wraps; the scheduler is found among its referrers)."""
    if not hasattr(getattr(optimizer, "step", None), "_wrapped_by_lr_sched"):
        return []
    import gc

    from torch.optim import lr_scheduler

    kinds = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)
    given = [_inner(s) for s in known]
    referrers = gc.get_referrers(optimizer)
    holders = [r for r in referrers if not isinstance(r, dict)]
    attributes = [r for r in referrers if isinstance(r, dict)]  # an object's ``__dict__``
    if attributes:  # one more pass over the heap for all of them
        holders += gc.get_referrers(*attributes)
    found: list[Any] = []
    for holder in holders:
        owned = _unwrapped(getattr(holder, "optimizer", None)) is optimizer
        new = all(h is not holder for h in (*found, *given))
        if isinstance(holder, kinds) and owned and new:
            found.append(holder)
    return found


def _set_by(schedulers: list[Any]) -> list[float]:
    """The first param group's LR each scheduler set at its last step (``get_last_lr()``)."""
    lrs = [getattr(s, "_last_lr", None) for s in schedulers]
    return [float(last[0]) for last in lrs if isinstance(last, list) and last and _number(last[0])]


def _lrs(optimizer: Any) -> list[float]:
    """The LR of each param group (empty when one is not a plain number)."""
    values = [group.get("lr") for group in _groups(optimizer)]
    numbers = [float(v) for v in values if _number(v)]
    return numbers if len(numbers) == len(values) else []


def _starts(optimizer: Any) -> list[float]:
    """Each param group's start LR (a scheduler's ``initial_lr``, else its ``lr``)."""
    values = [group.get("initial_lr", group.get("lr")) for group in _groups(optimizer)]
    numbers = [float(v) for v in values if _number(v)]
    return numbers if len(numbers) == len(values) else []


def _get(config: Any, name: str) -> Any:
    """A config field's value (None when the config has no such field)."""
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _set(config: Any, name: str, value: Any) -> None:
    """Write a config field."""
    if isinstance(config, MutableMapping):
        config[name] = value
    else:
        setattr(config, name, value)


def _scale_groups(optimizer: Any, factor: float) -> None:
    """Multiply each param group's ``lr`` and ``initial_lr`` (a scheduler's start) by ``factor``."""
    for group in _groups(optimizer):
        for key in ("lr", "initial_lr"):
            if _number(group.get(key)):
                group[key] = group[key] * factor


def _inner(scheduler: Any) -> Any:
    """The torch scheduler inside an accelerate wrapper (or the scheduler itself)."""
    inner = getattr(scheduler, "scheduler", None)
    return inner if inner is not None else scheduler


def _optimizer_of(scheduler: Any) -> Any:
    """The torch optimizer a scheduler steps (inside any accelerate or HF wrapper)."""
    return _unwrapped(getattr(_inner(scheduler), "optimizer", None))


def _scale_base(scheduler: Any, factor: float) -> None:
    """Multiply a scheduler's ``base_lrs`` (what it computes each step from) and the last LRs it
    reports (``get_last_lr``, which a Trainer logs) by ``factor``."""
    target = _inner(scheduler)
    base = getattr(target, "base_lrs", None)
    if isinstance(base, list):
        target.base_lrs = [b * factor for b in base]
    _set_last(target, [lr * factor for lr in getattr(target, "_last_lr", None) or []])


def _set_last(scheduler: Any, lrs: list[float]) -> None:
    """Make a torch scheduler's ``get_last_lr()`` say ``lrs`` (when it has as many)."""
    last = getattr(scheduler, "_last_lr", None)
    if isinstance(last, list) and lrs and len(lrs) == len(last):
        # torch keeps the reported LRs here; no public setter
        scheduler._last_lr = lrs  # noqa: SLF001


def _rebase(scheduler: Any) -> None:
    """Set a scheduler's ``base_lrs`` from its optimizer's ``initial_lr``s, as torch does when
    it builds one (whether it was built before or after the optimizer was scaled)."""
    target = _inner(scheduler)
    base = getattr(target, "base_lrs", None)
    starts = [g.get("initial_lr") for g in _groups(getattr(target, "optimizer", None))]
    if isinstance(base, list) and len(starts) == len(base) and None not in starts:
        target.base_lrs = list(starts)
    _set_last(target, [g["lr"] for g in _groups(getattr(target, "optimizer", None))])
