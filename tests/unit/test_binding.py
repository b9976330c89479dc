"""Finding the knobs in the user's own config object, whatever its kind."""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from memtui.hooks.binding import BindingError, ConfigBinding


@dataclass
class TrainConfig:
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 4
    dataloader_num_workers: int = 2
    dataloader_pin_memory: bool = True
    learning_rate: float = 1e-4


@dataclass(frozen=True)
class Frozen:
    batch_size: int = 8


def _check_roundtrip(config: object) -> ConfigBinding:
    binding = ConfigBinding(config)
    assert binding.read("batch_size") == 8
    binding.write("batch_size", 24)
    assert binding.read("batch_size") == 24
    return binding


def test_dataclass_with_hf_names() -> None:
    config = TrainConfig()
    binding = _check_roundtrip(config)
    assert binding.paths == {
        "batch_size": "per_device_train_batch_size",
        "grad_accum": "gradient_accumulation_steps",
        "num_workers": "dataloader_num_workers",
        "pin_memory": "dataloader_pin_memory",
    }
    assert config.per_device_train_batch_size == 24


def test_argparse_and_simple_namespaces_are_bound_and_written_through() -> None:
    _check_roundtrip(argparse.Namespace(batch_size=8, grad_accum=2))
    _check_roundtrip(SimpleNamespace(batch_size=8, num_workers=0))


def test_a_dict_config_is_bound_and_written_through() -> None:
    config = {"batch_size": 8, "accumulation_steps": 2, "pin_memory": False}
    binding = _check_roundtrip(config)
    assert config["batch_size"] == 24
    assert binding.paths["grad_accum"] == "accumulation_steps"


def test_module_globals_nanogpt_style() -> None:
    """nanoGPT keeps batch_size and gradient_accumulation_steps as module globals."""
    module = types.ModuleType("train_nanogpt")
    exec("batch_size = 8\ngradient_accumulation_steps = 40\n", module.__dict__)
    sys.modules["train_nanogpt"] = module
    try:
        _check_roundtrip(module)
        binding = ConfigBinding(module.__dict__)  # globals() of the script
        binding.write("grad_accum", 5)
        assert module.gradient_accumulation_steps == 5
    finally:
        del sys.modules["train_nanogpt"]


def test_explicit_mapping_with_dotted_path_overrides() -> None:
    config = {"train": SimpleNamespace(micro_bs=8), "batch_size": 1000}
    binding = ConfigBinding(config, {"batch_size": "train.micro_bs"})
    assert binding.read("batch_size") == 8
    binding.write("batch_size", 12)
    assert config["train"].micro_bs == 12 and config["batch_size"] == 1000


def test_a_missing_path_an_unknown_knob_or_a_frozen_config_is_refused_with_the_reason() -> None:
    with pytest.raises(BindingError, match=r"has no 'train\.nope'"):
        ConfigBinding({"train": {}}, {"batch_size": "train.nope"})
    with pytest.raises(BindingError, match="unknown knob"):
        ConfigBinding({"x": 1}, {"learning_rate": "x"})
    with pytest.raises(BindingError, match="frozen dataclass"):
        ConfigBinding(Frozen())


def test_wrong_types_are_not_bound() -> None:
    """A `batch_size` that is not an int (say a string) is not a knob memtui can tune."""
    binding = ConfigBinding({"batch_size": "auto", "pin_memory": 1})
    assert not binding.has("batch_size") and not binding.has("pin_memory")
