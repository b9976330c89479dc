"""Framework adapters: ``hooks.install(trainer)`` for Hugging Face, Lightning and Accelerate.

The framework is told from the object's class names (its MRO's modules), so nothing from a
framework is imported unless the user's object comes from it.
"""

from __future__ import annotations

from typing import Any

FRAMEWORKS = {
    "transformers": ("transformers", "Trainer"),
    "lightning": ("lightning.pytorch", "Trainer"),
    "pytorch_lightning": ("pytorch_lightning", "Trainer"),
    "accelerate": ("accelerate", "Accelerator"),
}
"""Framework name to (top-level module prefix, class name somewhere in the object's MRO)."""

_NOT_A_TRAINER = {
    "lightning.pytorch": "a LightningModule or other Lightning object: pass the Lightning Trainer",
    "pytorch_lightning": "a LightningModule or other Lightning object: pass the Lightning Trainer",
    "lightning.fabric": "Lightning Fabric: use the plain-loop integration with your config",
    "transformers": "a transformers object that is not a Trainer: pass the Trainer",
    "accelerate": "an accelerate object that is not the Accelerator: pass the Accelerator",
    "torch": "a torch object (a model, optimizer or loader), not a config or a trainer",
}


class UnsupportedTrainer(TypeError):
    """``install`` was given an object it cannot tell how to hook."""


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def framework_of(obj: Any) -> str | None:
    """The framework ``obj`` is a trainer of (a key of ``FRAMEWORKS``), or None for a plain config.

    Raises ``UnsupportedTrainer`` for objects from these frameworks (or torch) that are not their
    trainer, so a wrong object fails at install with what to pass instead.
    """
    if obj is None or isinstance(obj, (dict, type)):
        return None
    classes = type(obj).__mro__
    for name, (prefix, class_name) in FRAMEWORKS.items():
        for cls in classes:
            if cls.__name__ == class_name and _in(cls.__module__, prefix):
                return name
    module = type(obj).__module__
    for prefix, why in _NOT_A_TRAINER.items():
        if _in(module, prefix) and not type(obj).__name__.endswith("Arguments"):
            raise UnsupportedTrainer(
                f"memtui.hooks.install got {type(obj).__module__}.{type(obj).__name__}: {why}"
            )
    return None
