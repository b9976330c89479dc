"""Third-party training scripts run as their users run them (``make test-frameworks``)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is marked ``frameworks`` (the default suite leaves them out)."""
    for item in items:
        if "tests/clients/" in str(item.fspath):
            item.add_marker(pytest.mark.frameworks)
