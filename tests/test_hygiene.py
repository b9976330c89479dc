"""Layers stay apart: the hook loads no UI library, the clients load no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def loaded_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_hooks_import_no_ui_and_no_torch() -> None:
    loaded = loaded_after("from memtui import hooks")
    assert not loaded & {"textual", "rich"}
    assert "torch" not in loaded, "torch is imported only by the user's script"


def test_hooks_with_torch_still_no_ui() -> None:
    loaded = loaded_after(
        "import torch\nfrom memtui import hooks\nhooks.install({'batch_size': 2}).close()"
    )
    assert not loaded & {"textual", "rich"}


@pytest.mark.parametrize(
    "module", ["memtui.cli", "memtui.client", "memtui.registry", "memtui.wire", "memtui.stats"]
)
def test_clients_import_no_torch(module: str) -> None:
    assert "torch" not in loaded_after(f"import {module}")


def test_hooks_import_no_framework() -> None:
    loaded = loaded_after("import memtui.hooks\nimport memtui.hooks.adapters")
    assert not loaded & {"transformers", "lightning", "pytorch_lightning", "accelerate"}


def test_plain_config_install_loads_no_framework() -> None:
    loaded = loaded_after(
        "import torch\nfrom memtui import hooks\nhooks.install({'batch_size': 2}).close()"
    )
    assert not loaded & {"transformers", "lightning", "pytorch_lightning", "accelerate"}
