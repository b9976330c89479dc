"""Layers stay apart: the hook loads no UI library, the clients load no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import grimp
import pytest

from tests.conftest import ROOT

VIEWER = ("memtui.tui", "memtui.sources", "memtui.client")
"""The viewer's code, its transport and its control client: never loaded by a training process."""


def modules_after(statement: str) -> set[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def loaded_after(statement: str) -> set[str]:
    return {m.split(".")[0] for m in modules_after(statement)}


def viewer_modules(loaded: set[str]) -> set[str]:
    return {m for m in loaded if any(m == v or m.startswith(v + ".") for v in VIEWER)}


def test_hooks_import_no_ui_and_no_torch() -> None:
    loaded = loaded_after("from memtui import hooks")
    assert not loaded & {"textual", "rich"}
    assert "torch" not in loaded, "torch is imported only by the user's script"


def test_hooks_with_torch_still_no_ui() -> None:
    loaded = modules_after(
        "import torch\nfrom memtui import hooks\nhooks.install({'batch_size': 2}).close()"
    )
    assert not {m.split(".")[0] for m in loaded} & {"textual", "rich"}
    assert not viewer_modules(loaded), "the hook loads none of the viewer's client code"
    assert "memtui.recording" in loaded, "the hook writes recordings with the format module"


def test_recording_format_loads_no_transport() -> None:
    loaded = modules_after("import memtui.recording")
    assert "zmq" not in {m.split(".")[0] for m in loaded}
    assert not viewer_modules(loaded)


def test_no_import_cycles() -> None:
    """No module of memtui reaches itself through its imports, deferred ones included."""
    # import-linter's acyclic_siblings contract (make lint) checks the siblings of every package;
    # this also catches a package's __init__ and one of its own modules importing each other
    graph = grimp.build_graph("memtui", cache_dir=None)
    cycles = [
        (module, *back)
        for module in sorted(graph.modules)
        for imported in sorted(graph.find_modules_directly_imported_by(module))
        if (back := graph.find_shortest_chain(importer=imported, imported=module))
    ]
    assert not cycles, "\n".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize(
    "module", ["memtui.cli", "memtui.client", "memtui.registry", "memtui.wire", "memtui.stats"]
)
def test_clients_import_no_torch(module: str) -> None:
    assert "torch" not in loaded_after(f"import {module}")


def test_cli_import_loads_no_transport_and_no_parsers() -> None:
    """``memtui --version`` starts like ``nvidia-smi``: each command imports what it uses."""
    loaded = loaded_after("import memtui.cli")
    assert not loaded & {"zmq", "psutil", "yaml", "textual", "rich", "msgspec"}, loaded


def test_status_loads_no_psutil_and_without_a_config_file_no_yaml() -> None:
    """What ``memtui status`` imports: the registry reads start times from /proc, and the
    verdict's thresholds need the YAML parser only when there is a config file."""
    loaded = loaded_after(
        "import os\nos.environ['MEMTUI_CONFIG'] = '/nonexistent/memtui.yaml'\n"
        "import memtui.report, memtui.client, memtui.registry\n"
        "from memtui.advice.verdict import load_thresholds\nload_thresholds()"
    )
    assert "zmq" in loaded and not loaded & {"yaml", "psutil"}, loaded


def test_hooks_import_no_framework() -> None:
    loaded = loaded_after("import memtui.hooks\nimport memtui.hooks.adapters")
    assert not loaded & {"transformers", "lightning", "pytorch_lightning", "accelerate"}


def test_plain_config_install_loads_no_framework() -> None:
    loaded = loaded_after(
        "import torch\nfrom memtui import hooks\nhooks.install({'batch_size': 2}).close()"
    )
    assert not loaded & {"transformers", "lightning", "pytorch_lightning", "accelerate"}
