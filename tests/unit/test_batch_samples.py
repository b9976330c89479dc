"""The samples of a training batch: the first dimension of the first tensor or array in it, for
every shape a framework hands a loop, counted the same wherever memtui counts them; a batch with
no tensor counts 0 and is reported once, never raised into training."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from memtui.hooks.batches import batch_samples, leading_dimension, timed_batches
from memtui.hooks.ledger import StepLedger

ROWS = 16
SEQ = 8


def rows(n: int = ROWS, width: int = SEQ) -> torch.Tensor:
    return torch.zeros(n, width, dtype=torch.long)


class Pair(NamedTuple):
    inputs: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass
class Example:
    """A user's own batch type: a name first, then tensors."""

    source: str
    inputs: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass(slots=True)
class Slotted:
    inputs: torch.Tensor


class Attributes:
    """A plain object holding its tensors as attributes."""

    def __init__(self) -> None:
        self.name = "batch"
        self.step = 3
        self.inputs = rows()


def batch_encoding() -> Any:
    """A tokenizer's batch as transformers returns it: a ``UserDict``, not a ``dict``."""
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding(
        {
            "input_ids": rows(),
            "token_type_ids": rows(),
            "attention_mask": rows(),
            "labels": torch.zeros(ROWS, dtype=torch.long),
        }
    )


def model_output() -> Any:
    """A Hugging Face ``ModelOutput`` (an ``OrderedDict`` and a dataclass), its first field unset."""
    outputs = pytest.importorskip("transformers.modeling_outputs")
    return outputs.CausalLMOutputWithPast(loss=None, logits=torch.zeros(ROWS, SEQ, 4))


SHAPES: dict[str, Callable[[], Any]] = {
    "tensor": rows,
    "numpy array": lambda: np.zeros((ROWS, SEQ)),
    "tuple of tensors": lambda: (rows(), torch.zeros(ROWS)),
    "list of tensors": lambda: [rows(), torch.zeros(ROWS)],
    "namedtuple": lambda: Pair(rows(), torch.zeros(ROWS)),
    "dict": lambda: {"inputs": rows(), "labels": torch.zeros(ROWS)},
    "dict with input_ids after a per-token tensor": lambda: {
        "position_bias": torch.zeros(SEQ, SEQ),
        "input_ids": rows(),
    },
    "UserDict": lambda: collections.UserDict({"inputs": rows()}),
    "OrderedDict": lambda: collections.OrderedDict(inputs=rows()),
    "transformers BatchEncoding": batch_encoding,
    "transformers ModelOutput": model_output,
    "dataclass": lambda: Example("train", rows(), torch.zeros(ROWS)),
    "slotted dataclass": lambda: Slotted(rows()),
    "object with tensor attributes": Attributes,
    "dict of a list of strings and a tensor": lambda: {"text": ["a"] * 3, "inputs": rows()},
    "tuple led by a dict": lambda: ({"input_ids": rows()}, torch.zeros(2)),
    "nested": lambda: [({"meta": {"ids": [rows()]}},)],
    "list of dicts": lambda: [{"inputs": rows()}, {"inputs": rows()}],
    "a scalar first": lambda: (torch.tensor(0.5), rows()),
}


@pytest.mark.parametrize("make", SHAPES.values(), ids=SHAPES.keys())
def test_the_samples_of_a_batch_are_the_first_dimension_of_its_first_tensor(
    make: Callable[[], Any],
) -> None:
    batch = make()
    assert batch_samples(batch) == ROWS
    assert leading_dimension(batch) == ROWS


def counted(batches: list[Any]) -> tuple[int, int, list[str]]:
    """(samples, micro-batches) a timed batch function adds to the open step for ``batches``,
    and what it reported."""
    ledger = StepLedger()
    reports: list[str] = []
    source = iter(batches)
    fetch = timed_batches(lambda: next(source), ledger, lambda exc, where: reports.append(str(exc)))
    for _ in batches:
        fetch()
    samples, micro = ledger.open_step()
    return samples, micro, reports


def test_a_tokenizers_batch_counts_its_rows_not_its_keys() -> None:
    """A ``BatchEncoding`` of 16 rows and 4 keys is 16 samples a micro-batch (it was 4)."""
    samples, micro, reports = counted([batch_encoding(), batch_encoding()])
    assert (samples, micro, reports) == (2 * ROWS, 2, [])


@pytest.mark.parametrize(
    "make",
    [SHAPES["namedtuple"], SHAPES["dataclass"], SHAPES["UserDict"], SHAPES["list of dicts"]],
    ids=["namedtuple", "dataclass", "UserDict", "list of dicts"],
)
def test_a_timed_batch_function_counts_every_shape_by_its_rows(make: Callable[[], Any]) -> None:
    samples, micro, reports = counted([make(), make(), make()])
    assert (samples, micro, reports) == (3 * ROWS, 3, [])


def test_a_batch_without_a_tensor_counts_zero_and_is_reported_once() -> None:
    samples, micro, reports = counted([["a", "b"], ["c"], {"text": "d"}])
    assert (samples, micro) == (0, 3)
    assert len(reports) == 1 and "builtins.list" in reports[0], reports


def test_an_empty_batch_counts_zero_and_is_not_reported() -> None:
    samples, micro, reports = counted([torch.zeros(0, SEQ), rows()])
    assert (samples, micro, reports) == (ROWS, 2, [])


class Hostile:
    """A batch that raises on every look inside it."""

    @property
    def shape(self) -> Any:
        raise RuntimeError("no shape")

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")


def test_a_batch_that_resists_being_looked_into_counts_zero_and_never_raises() -> None:
    cyclic: list[Any] = ["x"]
    cyclic.append(cyclic)
    deep: Any = rows()
    for _ in range(50):
        deep = [deep]
    for batch in (Hostile(), cyclic, deep, ["s"] * 100_000, None, 7, "text"):
        assert batch_samples(batch) == 0
    samples, _micro, reports = counted([Hostile(), cyclic])
    assert samples == 0 and len(reports) == 1, reports
