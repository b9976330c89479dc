"""Framework tests: real transformers / Lightning / accelerate on CPU (``make test-frameworks``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is marked ``frameworks`` (the default suite leaves them out)."""
    for item in items:
        if "tests/frameworks/" in str(item.fspath):
            item.add_marker(pytest.mark.frameworks)
