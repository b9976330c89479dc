"""``hooks.install(trainer)`` tells the framework from the object's classes, or says it can't."""

from __future__ import annotations

import argparse

import pytest
import torch

from memtui import hooks
from memtui.hooks.adapters import framework_of


def test_framework_is_told_from_the_class() -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    pytorch_lightning = pytest.importorskip("pytorch_lightning")
    accelerate = pytest.importorskip("accelerate")
    assert framework_of(lightning.Trainer()) == "lightning"
    assert framework_of(pytorch_lightning.Trainer(logger=False)) == "pytorch_lightning"
    assert framework_of(accelerate.Accelerator(cpu=True)) == "accelerate"
    assert framework_of(argparse.Namespace(batch_size=2)) is None
    assert framework_of({"batch_size": 2}) is None


def test_subclass_of_hf_trainer_is_hf() -> None:
    transformers = pytest.importorskip("transformers")

    class MyTrainer(transformers.Trainer):  # type: ignore[misc]
        pass

    trainer = MyTrainer.__new__(MyTrainer)
    assert framework_of(trainer) == "transformers"


def test_objects_that_are_not_trainers_get_a_clear_error() -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    with pytest.raises(hooks.UnsupportedTrainer, match="pass the Lightning Trainer"):
        hooks.install(lightning.LightningModule())
    with pytest.raises(hooks.UnsupportedTrainer, match="not a config or a trainer"):
        hooks.install(torch.nn.Linear(2, 2))
