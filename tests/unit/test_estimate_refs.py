"""The estimate guide's reference table: every row is a case of benchmarks/estimate_refs.py, asserted
here."""

from __future__ import annotations

import re

import pytest

from benchmarks.estimate_refs import CASES, GB, Case, run
from tests.support.processes import ROOT

MEASURED = {i for i, case in enumerate(CASES) if "--model" in case.args}
"""The rows that measure a 32-layer model on the meta device (seconds each): -m slow."""


def _params(index: int, case: Case) -> object:
    marks = [pytest.mark.slow] if index in MEASURED else []
    return pytest.param(case, id=f"row{index}", marks=marks)


@pytest.mark.parametrize("case", [_params(i, c) for i, c in enumerate(CASES)])
def test_the_estimate_is_within_tolerance_of_each_reference(case: Case) -> None:
    """memtui's number within the row's tolerance of the reference's."""
    value = case.pick(run(case))
    assert abs(value - case.expected) <= case.tolerance * case.expected, (
        f"{case.reference}: memtui {value:,.0f} B, reference {case.expected:,.0f} B"
    )


def test_the_guide_table_is_the_cases() -> None:
    """Each row of the estimate guide's table has a case's arguments and reference value; its
    memtui column is within the case's tolerance (rounded to the table's 3 decimals)."""
    text = (ROOT / "docs" / "guides" / "estimate-and-gpus.md").read_text()
    rows = re.findall(
        r"^\| (.+?) \| ([\d,.]+) GB \| ([\d,.]+) GB \| [+-][\d.]+% \| [\d.]+% \| `(.+?)` \|$",
        text,
        re.M,
    )
    assert len(rows) == len(CASES)
    for (_, reference, memtui, args), case in zip(rows, CASES, strict=True):
        assert args == " ".join(case.args)
        assert float(reference.replace(",", "")) == round(case.expected / GB, 3)
        value = float(memtui.replace(",", "")) * GB
        assert abs(value - case.expected) <= case.tolerance * case.expected + 0.0005 * GB
