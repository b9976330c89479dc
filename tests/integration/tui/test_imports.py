"""Layers stay apart: the viewer imports neither torch nor the hook."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.processes import ROOT


@pytest.mark.parametrize(
    "module",
    [
        "memtui.tui",
        "memtui.tui.app",
        "memtui.transport.sources",
        "memtui.transport.recording",
        "memtui.advice.verdict",
    ],
)
def test_viewer_imports_no_torch_and_no_hook(module: str) -> None:
    code = f"import sys, json, {module}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "torch" not in loaded
    assert not any(m == "memtui.hooks" or m.startswith("memtui.hooks.") for m in loaded)


def test_advice_and_state_import_no_textual() -> None:
    code = (
        "import sys, json, memtui.advice.verdict, memtui.runs.state, memtui.runs.events, "
        "memtui.runs.receiver, memtui.transport.sources\nprint(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "textual" not in loaded
