"""The hook: ``from memtui import hooks; tuner = hooks.install(config)`` in the training script.

Importing this package loads neither Textual nor Rich, and torch only when the training
script already uses it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memtui.hooks.adapters import UnsupportedTrainer
    from memtui.hooks.binding import BindingError
    from memtui.hooks.loader import TunedLoader
    from memtui.hooks.sampler import peak_rss
    from memtui.hooks.settings import Options
    from memtui.hooks.tracker import TrackerEvent, event_text, event_values
    from memtui.hooks.tuner import Applied, Tuner

_LAZY = {
    "Applied": "memtui.hooks.tuner",
    "BindingError": "memtui.hooks.binding",
    "Options": "memtui.hooks.settings",
    "TrackerEvent": "memtui.hooks.tracker",
    "TunedLoader": "memtui.hooks.loader",
    "Tuner": "memtui.hooks.tuner",
    "UnsupportedTrainer": "memtui.hooks.adapters",
    "event_text": "memtui.hooks.tracker",
    "event_values": "memtui.hooks.tracker",
    "peak_rss": "memtui.hooks.sampler",
}
"""Where each public name lives: loaded at first use, so that a process that only imports
``memtui.hooks.auto`` at start-up (every Python process under ``memtui run``) does not pay for
the tuner, ZeroMQ, YAML and psutil before it trains."""


def __getattr__(name: str) -> Any:
    """A public name of the hook, imported from its module at first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Applied",
    "BindingError",
    "Options",
    "TrackerEvent",
    "TunedLoader",
    "Tuner",
    "UnsupportedTrainer",
    "event_text",
    "event_values",
    "install",
    "peak_rss",
]


def install(
    trainer: Any = None,
    *,
    config: Any = None,
    knobs: Mapping[str, str] | None = None,
    model: Any = None,
    optimizer: Any = None,
    state_dir: str | os.PathLike[str] | None = None,
    tuned_path: str | os.PathLike[str] | None = None,
    resume: bool | str | os.PathLike[str] = False,
    name: str | None = None,
    auto_step: bool = False,
    options: Options | None = None,
    record: str | os.PathLike[str] | None = None,
    autotune: bool = False,
    lr_scale: str = "none",
    lr_fields: Sequence[str] = (),
) -> Tuner:
    """Install memtui in this training process and return its Tuner.

    ``trainer`` is a ``transformers.Trainer``, a Lightning ``Trainer``, an
    ``accelerate.Accelerator`` (see ``memtui.hooks.adapters``), or, in a plain PyTorch loop, the
    object that holds the knobs: your config (a dataclass, ``argparse.Namespace``,
    ``SimpleNamespace``, dict, or module / ``globals()``).
    ``knobs`` maps knob names to (dotted) paths in it when the common names do not apply.
    ``state_dir`` is where the audit log and the tuned config are written (use your checkpoint
    directory); ``resume=True`` starts from the tuned config found there (or pass a path).
    ``auto_step=True`` with ``optimizer`` counts steps from the optimizer's post-step hook.
    ``record`` also writes the published stream to this file (``memtui replay`` shows it); the
    same as ``options=Options(record=...)`` or ``MEMTUI_RECORD``, and it wins over both.
    ``autotune=True`` starts the autopilot: it tunes the knobs by itself, one change per
    checkpoint, until nothing left is predicted to help (``Options.autotune`` likewise).
    Every option is resolved once, here (``memtui.hooks.settings``): an argument of this call
    over a field of ``options`` over its ``MEMTUI_*`` variable over the default.
    ``lr_scale`` is the run's rule for the LR when a change moves the effective batch and names
    no rule of its own: ``linear``, ``sqrt`` or ``none`` (see "Changing the effective batch").
    ``lr_fields`` names the config fields a loop's own LR schedule reads every step (nanoGPT's
    ``("learning_rate", "min_lr")``): memtui multiplies them with the optimizer's LR.
    """
    from memtui.hooks.adapters import framework_of
    from memtui.hooks.settings import HookSettings
    from memtui.hooks.tuner import Tuner, live_tuners

    settings = HookSettings.resolve(options, record=record, autotune=autotune)
    common: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "state_dir": state_dir,
        "tuned_path": tuned_path,
        "resume": resume,
        "name": name,
        "options": settings,
        "lr_scale": lr_scale,
    }
    framework = framework_of(trainer)
    if framework in ("transformers", "lightning", "pytorch_lightning", "accelerate"):
        before = set(live_tuners())
        try:
            return _install_adapter(framework, trainer, knobs, config, lr_fields, common)
        except BaseException:
            # an adapter that failed after its Tuner started leaves no run registered that
            # nothing drives: the Tuner is closed (it leaves the registry) and the error raised
            for started in set(live_tuners()) - before:
                started.close()
            raise
    target = config if config is not None else trainer
    return Tuner(
        target,
        knobs=knobs,
        model=model,
        optimizer=optimizer,
        state_dir=state_dir,
        tuned_path=tuned_path,
        resume=resume,
        name=name,
        auto_step=auto_step,
        options=settings,
        lr_scale=lr_scale,
        lr_fields=lr_fields,
    ).start()


def _install_adapter(
    framework: str,
    trainer: Any,
    knobs: Mapping[str, str] | None,
    config: Any,
    lr_fields: Sequence[str],
    common: dict[str, Any],
) -> Tuner:
    """The framework adapter's ``install`` for ``trainer``."""
    if framework == "transformers":
        from memtui.hooks.adapters import hf

        return hf.install(trainer, **common)
    if framework == "accelerate":
        from memtui.hooks.adapters import accelerate

        return accelerate.install(
            trainer, knobs=knobs, config=config, lr_fields=lr_fields, **common
        )
    from memtui.hooks.adapters import lightning

    return lightning.install(trainer, **common)
