"""The unit tests start no process: starting one here fails the test that did."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from typing import Any, NoReturn

import pytest


def _refused(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise AssertionError(
        "a unit test started a process: it belongs in the integration tests (tests/integration/)"
    )


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Subprocesses, forks and multiprocessing starts raise for the length of each unit test."""
    monkeypatch.setattr(subprocess.Popen, "__init__", _refused)
    monkeypatch.setattr(os, "fork", _refused)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused)
    yield
