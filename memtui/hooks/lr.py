"""The learning rate's owner: the optimizers and LR schedulers memtui knows, the run's rule for
a change of the effective batch, and the factor applied since the script's own LR.

A boundary that changes the effective batch (micro-batch x accumulation x ranks) multiplies
every known optimizer param group's ``lr`` and ``initial_lr`` and every known scheduler's
``base_lrs`` by the factor rank 0 decided (``scale``); an out-of-memory rollback divides by it
again. The product of those factors is written with the tuned config (``persisted``), and a
resumed run multiplies the optimizers and schedulers it is given by it (``resume``), so a
restart keeps the LR that went with the tuned batch.
"""

from __future__ import annotations

from typing import Any

from memtui.knobs import lr_rule

LR_SECTION = "lr"
"""The tuned config's section that keeps the LR factor."""


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside an accelerate or HF wrapper (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if hasattr(inner, "param_groups") else optimizer


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    """An optimizer's param groups."""
    groups = getattr(_unwrapped(optimizer), "param_groups", None)
    return list(groups) if isinstance(groups, list) else []


class LearningRate:
    """The optimizers and schedulers whose LR follows the effective batch, and by how much."""

    def __init__(self, rule: str = "none") -> None:
        self.rule = lr_rule(rule)
        """The run's rule for a change that names none (``hooks.install(..., lr_scale=...)``)."""
        self._optimizers: list[Any] = []
        self._schedulers: list[Any] = []
        self.factor = 1.0
        """The product of the factors applied since the script's own LR (1.0: untouched)."""
        self._owed = 1.0
        """The resumed factor, applied to each optimizer and scheduler as it is made known."""

    def watch_optimizer(self, optimizer: Any) -> None:
        """Make an optimizer's LR follow the effective batch (once; a resumed factor applies)."""
        optimizer = _unwrapped(optimizer)
        if optimizer is None or any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        if self._owed != 1.0:
            _scale_groups(optimizer, self._owed)

    def watch_scheduler(self, scheduler: Any) -> None:
        """Make an LR scheduler's ``base_lrs`` follow the effective batch (and its optimizer's)."""
        if scheduler is None or any(s is scheduler for s in self._schedulers):
            return
        self._schedulers.append(scheduler)
        self.watch_optimizer(getattr(_inner(scheduler), "optimizer", None))
        if self._owed != 1.0:  # its optimizer's initial LRs carry the resumed factor now
            _rebase(scheduler)

    def known(self) -> bool:
        """Whether an optimizer is known: a change of the effective batch can move its LR."""
        return bool(self._optimizers)

    def resolve(self, requested: str) -> str:
        """The rule a change follows: the one it names, else the run's (raise KnobError)."""
        return lr_rule(requested) if requested else self.rule

    def scale(self, factor: float) -> None:
        """Multiply every known LR by ``factor`` (param groups, initial LRs, schedulers' bases)."""
        self._multiply(factor)
        self.factor *= factor

    def _multiply(self, factor: float) -> None:
        """Multiply every known LR by ``factor`` without counting it (it was counted before)."""
        for optimizer in self._optimizers:
            _scale_groups(optimizer, factor)
        for scheduler in self._schedulers:
            _scale_base(scheduler, factor)

    def replace(self, optimizer: Any, scheduler: Any, unsaved: float) -> None:
        """Follow an optimizer and scheduler loaded from a checkpoint instead of the ones known
        (a Trainer resuming in-process): ``unsaved`` is the factor applied since that checkpoint
        was saved, which its state lacks."""
        self._optimizers, self._schedulers = [], []
        self._owed = 1.0  # the checkpoint's state carries the resumed factor already
        self.watch_optimizer(optimizer)
        self.watch_scheduler(scheduler)
        if unsaved != 1.0:
            self._multiply(unsaved)

    def persisted(self) -> dict[str, Any]:
        """The tuned config's LR section (empty while the LR is the script's own)."""
        if self.factor == 1.0:
            return {}
        return {LR_SECTION: {"factor": self.factor}}

    def resume(self, section: Any) -> float:
        """Start from a tuned config's LR section: the optimizers and schedulers made known from
        now on are multiplied by its factor; return it (1.0: none)."""
        raw = section.get("factor") if isinstance(section, dict) else None
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not 0 < raw < 1e6:
            return 1.0
        self._owed = self.factor = float(raw)
        for optimizer in self._optimizers:
            _scale_groups(optimizer, self._owed)
        for scheduler in self._schedulers:
            _rebase(scheduler)
        return self.factor


def _scale_groups(optimizer: Any, factor: float) -> None:
    """Multiply each param group's ``lr`` and ``initial_lr`` (a scheduler's start) by ``factor``."""
    for group in _groups(optimizer):
        for key in ("lr", "initial_lr"):
            if isinstance(group.get(key), (int, float)):
                group[key] = group[key] * factor


def _inner(scheduler: Any) -> Any:
    """The torch scheduler inside an accelerate wrapper (or the scheduler itself)."""
    inner = getattr(scheduler, "scheduler", None)
    return inner if inner is not None else scheduler


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
