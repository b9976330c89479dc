"""Framework trainers hooked with no code: the first Trainer a script trains gets its adapter.

Under ``memtui run`` the process calls ``register(on_import)`` before the script's first line.
When ``transformers.trainer`` (Hugging Face) or ``lightning.pytorch.trainer.trainer`` /
``pytorch_lightning.trainer.trainer`` (Lightning) finishes importing, its ``Trainer.__init__`` is
wrapped (the class itself is left in place: subclasses, ``inspect.signature``, ``__wrapped__``
and pickling work as before). Each Trainer constructed then has its ``train`` (Hugging Face) or
``fit`` (Lightning) wrapped on the instance; the first call of the process's first Trainer to
train gets ``hooks.install(trainer)`` before the framework starts: the adapter of the explicit
line, with every knob, its checkpoint boundary and its state directory. A later Trainer of the
same process trains without memtui, and one ``memtui:`` line says so. A script that has its own
``hooks.install(trainer)`` line keeps it: that Trainer is left to it.

The resume story is the explicit line's (``hooks.install(trainer, resume=True)`` in a restarted
script): the call that starts training says whether the run resumes,
``trainer.train(resume_from_checkpoint=...)`` or ``trainer.fit(..., ckpt_path=...)``, and only
then does the tuned config in the state directory replace the script's settings.

``MEMTUI_RUN_NAME`` and ``MEMTUI_RUN_STATE_DIR`` name the run and its state directory; without
them the adapter's defaults hold (the script's name; ``output_dir`` or ``default_root_dir``).
Nothing here raises into the script: a failure is one ``memtui:`` line and the Trainer works as
without memtui. ``MEMTUI_DISABLE=1`` leaves the Trainers alone.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

from memtui.hooks.environment import HookEnvironment

log = logging.getLogger("memtui")

OnImport = Callable[[str, Callable[[Any], None]], None]
"""``on_import(module name, callback)``: ``callback(module)`` once that module has imported."""

TRAINER_MODULES = {
    "transformers.trainer": "transformers",
    "lightning.pytorch.trainer.trainer": "lightning",
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
}
"""The module that defines each framework's ``Trainer`` class, to its framework's name (a key of
``memtui.hooks.adapters.FRAMEWORKS``). The defining module, not the package: importing
``transformers`` alone (for a tokenizer) must not import its Trainer, nor torch."""

RESUME_ARGUMENT = {
    "transformers": ("train", "resume_from_checkpoint"),
    "lightning": ("fit", "ckpt_path"),
    "pytorch_lightning": ("fit", "ckpt_path"),
}
"""The Trainer method that starts training and its argument that says the run resumes."""

WRAPPED_MARK = "_memtui_installs_after_init"
"""Set on a wrapped ``__init__``, so a module imported twice (reloaded) is not wrapped twice."""


class _Installed:
    """What this process hooked: the first Trainer's tuner, and whether later ones were told."""

    pid: int | None = None
    trainer_type: str = ""
    tuner: Any = None
    said_second = False


_installed = _Installed()


def register(on_import: OnImport) -> None:
    """Wrap each framework's ``Trainer.__init__`` once its module has imported (nothing if not)."""
    if HookEnvironment.read().disable:
        return  # memtui turned off: the Trainers stay exactly the framework's
    for module_name, framework in TRAINER_MODULES.items():
        try:
            on_import(module_name, functools.partial(_wrap_trainer_module, framework=framework))
        except Exception as exc:
            log.warning(
                "memtui: cannot watch for %s (%s); it runs without memtui", module_name, exc
            )


def tuner_of(trainer: Any) -> Any:
    """The tuner this module installed for ``trainer``, or None (another or none was hooked)."""
    tuner = _installed.tuner
    if tuner is None or _installed.pid != os.getpid():
        return None
    return tuner if getattr(tuner.adapter, "trainer", None) is trainer else None


def _wrap_trainer_module(module: Any, framework: str) -> None:
    """Make the module's ``Trainer.__init__`` ready each Trainer for memtui after it returns."""
    try:
        cls = module.Trainer
        init = cls.__init__
        if getattr(init, WRAPPED_MARK, False):
            return

        @functools.wraps(init)
        def init_then_watch(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            _install_at_start(self, framework)

        setattr(init_then_watch, WRAPPED_MARK, True)
        cls.__init__ = init_then_watch
    except Exception as exc:
        log.warning("memtui: cannot hook %s's Trainer (%s); it runs without memtui", framework, exc)


def _install_at_start(trainer: Any, framework: str) -> None:
    """Make the Trainer's ``train`` / ``fit`` (on the instance) install memtui when first called.

    Installed there rather than in ``__init__``: the call says whether the run resumes from a
    checkpoint (the tuned config is loaded only then, as ``resume=True`` does), and a script's
    own ``hooks.install(trainer)`` line, which runs between the two, keeps the Trainer to itself.
    """
    try:
        method_name, argument = RESUME_ARGUMENT[framework]
        start = getattr(trainer, method_name)
        signature = inspect.signature(start)

        @functools.wraps(start)
        def install_then_start(*args: Any, **kwargs: Any) -> Any:
            if vars(trainer).get(method_name) is not install_then_start:
                return start(*args, **kwargs)  # the script's own line wrapped it: memtui's already
            delattr(trainer, method_name)  # the Trainer's own method again, for the adapter
            if not _has_memtui(trainer):
                _install_once(trainer, framework, _resumes(signature, argument, args, kwargs))
            return getattr(trainer, method_name)(*args, **kwargs)

        setattr(trainer, method_name, install_then_start)
    except Exception as exc:
        kind = f"{type(trainer).__module__}.{type(trainer).__qualname__}"
        log.warning("memtui: cannot hook %s (%s); it runs without memtui", kind, exc)


def _resumes(signature: inspect.Signature, argument: str, args: Any, kwargs: Any) -> bool:
    """Whether this ``train`` / ``fit`` call resumes from a checkpoint (a path, or True)."""
    try:
        value = signature.bind_partial(*args, **kwargs).arguments.get(argument)
    except TypeError:
        return False  # the framework's own call raises the same error
    return value not in (None, False, "")


def _has_memtui(trainer: Any) -> bool:
    """Whether the script's own ``hooks.install(trainer)`` line already hooked this Trainer."""
    handler = getattr(trainer, "callback_handler", None)  # Hugging Face
    callbacks = getattr(handler, "callbacks", None) or getattr(trainer, "callbacks", None) or []
    return any(type(callback).__module__.startswith("memtui.") for callback in callbacks)


def _install_once(trainer: Any, framework: str, resume: bool) -> None:
    """``hooks.install(trainer)`` for the process's first Trainer to train; never raises."""
    kind = f"{type(trainer).__module__}.{type(trainer).__qualname__}"
    try:
        if _installed.pid == os.getpid():
            if not _installed.said_second:
                _installed.said_second = True
                what = _installed.tuner.run_id if _installed.tuner is not None else "none"
                log.warning(
                    "memtui: another Trainer (%s) in this process trains without memtui: memtui "
                    "hooks the first one that trains (%s, run %s)",
                    kind,
                    _installed.trainer_type,
                    what,
                )
            return
        # claimed before installing: a failure is said once, not retried at every Trainer
        _installed.pid, _installed.trainer_type = os.getpid(), kind
        _installed.tuner, _installed.said_second = None, False
        from memtui import hooks

        environment = HookEnvironment.read()
        tuner = hooks.install(
            trainer,
            name=environment.run_name,
            state_dir=environment.run_state_dir,
            resume=resume,
        )
        _installed.tuner = tuner
    except Exception as exc:
        log.warning("memtui: cannot hook %s (%s); it trains without memtui", kind, exc)
        return
    # the adapter's Tuner, started, has made the no-code watch stand down (``Tuner.start``)
