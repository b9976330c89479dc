"""Where an Accelerate script's accumulation lives decides whether memtui may change it: the
accelerator's count drives ``accelerator.accumulate()``, and a script that steps its optimizer on
a count of its own would never train the value memtui wrote."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from memtui import hooks
from memtui.hooks.adapters.accelerate import OWN_COUNT

accelerate = pytest.importorskip("accelerate")


@pytest.fixture
def parts(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any]]:
    """An accelerator on the CPU, a model and its optimizer, prepared; memtui publishes nothing."""
    monkeypatch.setenv("MEMTUI_DISABLE", "1")
    monkeypatch.chdir(tmp_path)
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    yield accelerator, model, optimizer


def one_step(accelerator: Any, model: Any, optimizer: Any, *, accumulate: bool) -> None:
    """One micro-batch and an optimizer step, inside ``accumulate()`` or on the script's count."""
    x = torch.randn(2, 4)
    if accumulate:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            optimizer.step()
            optimizer.zero_grad()
    else:
        accelerator.backward(model(x).sum())
        optimizer.step()
        optimizer.zero_grad()


def test_a_script_counting_its_own_accumulation_gets_grad_accum_refused_with_how_to_fix(
    parts: tuple[Any, Any, Any],
) -> None:
    """A config without ``gradient_accumulation_steps`` and no ``accumulate()``: not tunable,
    with the two ways to make it tunable."""
    accelerator, model, optimizer = parts
    tuner = hooks.install(accelerator, config=argparse.Namespace(lr=0.1), optimizer=optimizer)
    try:
        one_step(accelerator, model, optimizer, accumulate=False)
        assert "grad_accum" not in tuner.tunable()
        assert tuner.store.untunable_reasons()["grad_accum"] == OWN_COUNT
        assert "accelerator.accumulate(model)" in OWN_COUNT
    finally:
        tuner.close()


def test_no_config_and_no_accumulate_withdraws_grad_accum_at_the_first_step(
    parts: tuple[Any, Any, Any],
) -> None:
    """With no config memtui holds the accelerator's count, tunable until the first optimizer
    step shows the script does not use ``accumulate()``."""
    accelerator, model, optimizer = parts
    tuner = hooks.install(accelerator, optimizer=optimizer)
    try:
        assert "grad_accum" in tuner.tunable()
        one_step(accelerator, model, optimizer, accumulate=False)
        assert "grad_accum" not in tuner.tunable()
        assert tuner.store.untunable_reasons()["grad_accum"] == OWN_COUNT
    finally:
        tuner.close()


@pytest.mark.parametrize("config", [None, argparse.Namespace(lr=0.1)], ids=["none", "without"])
def test_a_script_using_accumulate_has_grad_accum_tunable(
    parts: tuple[Any, Any, Any], config: Any
) -> None:
    """``accumulate()`` entered: the accelerator's count is the run's accumulation, tunable
    whether or not the config holds one, and the accelerator keeps its own method."""
    accelerator, model, optimizer = parts
    tuner = hooks.install(accelerator, config=config, optimizer=optimizer)
    try:
        one_step(accelerator, model, optimizer, accumulate=True)
        assert "grad_accum" in tuner.tunable()
        assert tuner.knobs().grad_accum == 2
        assert "accumulate" not in vars(accelerator)  # the wrapper gave the method back
    finally:
        tuner.close()
