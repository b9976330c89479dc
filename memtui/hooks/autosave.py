"""Under ``memtui run``: the script's saves of its training state, seen as they happen.

A plain loop watched with no code has no ``tuner.checkpoint()`` line, but it saves its training
state: ``torch.save`` of a dict that holds the counted optimizer's ``state_dict()`` or the
model's (nanoGPT's ``ckpt.pt``), Accelerate's ``accelerator.save_state`` or Lightning Fabric's
``fabric.save`` (litgpt's checkpoints). Each is seen right after it returned and handed to the
watch (``memtui.hooks.auto``), which makes it a checkpoint boundary where every rank saves.

* ``torch.save`` is wrapped once, when torch has imported. A save of anything else costs one
  flag test and one ``isinstance``; a dict is recognised by identity: the optimizer's
  ``state_dict()`` shares its per-parameter state dicts with the optimizer, and a model's
  ``state_dict()`` holds tensors over the storage of the optimizer's parameters
  (``holds_training_state``), at the dict's top level or one level down.
* ``Accelerator.save_state`` and ``Fabric.save`` are wrapped on their classes when their modules
  have imported; both must be called on every rank, so each is a boundary of every rank. The
  ``torch.save`` calls they make themselves are theirs (not boundaries of their own).

A wrapper adds no frame to a traceback: an exception raised by the save leaves it with the
wrapper's own frame taken out of its traceback, so a failing save prints what it prints without
memtui. The wrappers are put back when the watch stands down (a Tuner of the script's own, or a
Trainer's adapter, then drives the process).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("memtui")

MARK = "_memtui_save"
"""Set on a wrapper of memtui's: a function wrapped once is not wrapped again."""

TORCH_SAVE = "torch.save"
SAVE_STATE = "accelerator.save_state"
FABRIC_SAVE = "fabric.save"

SaveCallback = Callable[[str, float], None]
"""``saved(kind, seconds)``: the script saved its training state (``kind`` one of the above)."""

FRAMEWORK_SAVES = {
    "accelerate.accelerator": ("Accelerator", "save_state", SAVE_STATE),
    "lightning.fabric.fabric": ("Fabric", "save", FABRIC_SAVE),
    "lightning_fabric.fabric": ("Fabric", "save", FABRIC_SAVE),
}
"""The module that defines a framework's save of every rank: (its class, the method, the kind)."""


class _Saves:
    """What the save wrappers share: whether they report, the callback, the saves under way."""

    def __init__(self) -> None:
        self.armed = False
        """Whether saves are reported (the watch counts an optimizer and has not stood down)."""
        self.inside = 0
        """Framework saves under way on this thread: the ``torch.save`` calls they make are
        theirs."""
        self.saved: SaveCallback = _ignore
        self.optimizer: Callable[[], Any] = _nothing
        """The counted optimizer (a weak reference), whose state recognises a training save."""
        self.restore: list[Callable[[], None]] = []
        self.off = False
        """The watch stood down: a framework imported later is left as it is."""


def _ignore(_kind: str, _seconds: float) -> None:
    return None


def _nothing() -> None:
    return None


saves = _Saves()


def arm(optimizer: Callable[[], Any], saved: SaveCallback) -> None:
    """Report the script's training saves to ``saved`` from now on; ``optimizer`` gives the
    counted optimizer (None once it is gone)."""
    saves.optimizer, saves.saved, saves.armed = optimizer, saved, True


def disarm() -> None:
    """Report nothing more and put the wrapped functions back."""
    saves.armed, saves.off = False, True
    saves.saved, saves.optimizer = _ignore, _nothing
    for restore in saves.restore:
        restore()
    saves.restore.clear()


def _without_own_frame(exc: BaseException) -> None:
    """Take the wrapper's frame (the first) out of ``exc``'s traceback before it is raised on:
    the save's caller sees the traceback it would without memtui."""
    tb = exc.__traceback__
    if tb is not None:
        exc.__traceback__ = tb.tb_next


def wrap_torch_save(torch: Any) -> None:
    """Wrap ``torch.save`` (and ``torch.serialization.save``) once: a training save is reported
    after it returned."""
    serialization = torch.serialization
    own = serialization.save
    if saves.off or getattr(own, MARK, False):
        return

    @functools.wraps(own)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if not saves.armed or saves.inside:  # the hot case: nothing to look at
            try:
                return own(obj, f, *args, **kwargs)
            except BaseException as exc:
                _without_own_frame(exc)
                raise
        start = time.perf_counter()
        try:
            result = own(obj, f, *args, **kwargs)
        except BaseException as exc:
            _without_own_frame(exc)
            raise
        try:
            if isinstance(obj, dict) and holds_training_state(obj, saves.optimizer()):
                saves.saved(TORCH_SAVE, time.perf_counter() - start)
        except Exception as error:  # never into the script's save
            log.debug("memtui: a save not looked at (%s)", error)
        return result

    setattr(save, MARK, True)
    holders = [m for m in (torch, serialization) if getattr(m, "save", None) is own]
    for holder in holders:
        holder.save = save

    def restore() -> None:
        for holder in holders:
            _put_back(holder, "save", save, own)

    saves.restore.append(restore)


def wrap_framework_save(cls: Any, method: str, kind: str) -> None:
    """Wrap a framework's save of every rank (``cls.method``): reported after it returned; the
    ``torch.save`` calls it makes inside are its own."""
    own = cls.__dict__.get(method)
    if own is None or saves.off or getattr(own, MARK, False):
        return

    @functools.wraps(own)
    def framework_save(*args: Any, **kwargs: Any) -> Any:
        if not saves.armed:
            try:
                return own(*args, **kwargs)
            except BaseException as exc:
                _without_own_frame(exc)
                raise
        start = time.perf_counter()
        saves.inside += 1
        try:
            result = own(*args, **kwargs)
        except BaseException as exc:
            _without_own_frame(exc)
            raise
        finally:
            saves.inside -= 1
        if not saves.inside:
            saves.saved(kind, time.perf_counter() - start)
        return result

    setattr(framework_save, MARK, True)
    setattr(cls, method, framework_save)
    saves.restore.append(lambda: _put_back(cls, method, framework_save, own))


def _put_back(owner: Any, name: str, ours: Any, theirs: Any) -> None:
    """Restore ``owner.name`` unless someone replaced ours since."""
    holder = vars(owner) if isinstance(owner, type) else owner.__dict__
    if holder.get(name) is ours:
        setattr(owner, name, theirs)


def register(on_import: Callable[[str, Callable[[Any], None]], None]) -> None:
    """Wrap the frameworks' saves of every rank once their modules have imported."""
    for module_name, (class_name, method, kind) in FRAMEWORK_SAVES.items():

        def wrap(
            module: Any, class_name: str = class_name, method: str = method, kind: str = kind
        ) -> None:
            wrap_framework_save(getattr(module, class_name), method, kind)

        on_import(module_name, wrap)


def holds_training_state(obj: dict[Any, Any], optimizer: Any) -> bool:
    """Whether a dict given to ``torch.save`` is (or holds, one level down) ``optimizer``'s
    ``state_dict()`` or the ``state_dict()`` of a model it optimizes."""
    if optimizer is None:
        return False
    state = getattr(optimizer, "state", None)
    first_state = next(iter(state.values()), None) if isinstance(state, dict) else None
    pointers: set[int] | None = None
    for value in (obj, *obj.values()):
        if not isinstance(value, dict):
            continue
        packed = value.get("state")
        # the optimizer's state_dict() packs the optimizer's own per-parameter dicts
        if (
            first_state is not None
            and isinstance(packed, dict)
            and "param_groups" in value
            and any(entry is first_state for entry in packed.values())
        ):
            return True
        if pointers is None:
            pointers = _parameter_storages(optimizer)
        if pointers and _shares_storage(value, pointers):
            return True
    return False


def _parameter_storages(optimizer: Any) -> set[int]:
    """The storage addresses of ``optimizer``'s parameters."""
    found: set[int] = set()
    for group in getattr(optimizer, "param_groups", ()):
        for param in group.get("params", ()):
            try:
                found.add(param.untyped_storage().data_ptr())
            except Exception:
                continue
    found.discard(0)
    return found


def _shares_storage(mapping: dict[Any, Any], pointers: set[int]) -> bool:
    """Whether a tensor of ``mapping`` (a model's ``state_dict()``) is over a parameter's
    storage."""
    for value in mapping.values():
        storage = getattr(value, "untyped_storage", None)
        if storage is None:
            continue
        try:
            if storage().data_ptr() in pointers:
                return True
        except Exception:
            continue
    return False


def _after_fork_in_child() -> None:
    """A forked child (a loader worker) saves nothing of the loop's: its saves are no boundary."""
    saves.armed = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
