"""Layers stay apart (the hook loads no UI library, the clients load no torch), and the
repository speaks of the product, never of how it was made."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import grimp
import pytest

from tests.support.processes import ROOT

VIEWER = ("memtui.tui", "memtui.transport.sources", "memtui.transport.client")
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
    assert "memtui.transport.recording" in loaded, (
        "the hook writes recordings with the format module"
    )


def test_recording_format_loads_no_transport() -> None:
    loaded = modules_after("import memtui.transport.recording")
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
    "module",
    [
        "memtui.cli",
        "memtui.transport.client",
        "memtui.storage.registry",
        "memtui.wire",
        "memtui.core.stats",
    ],
)
def test_clients_import_no_torch(module: str) -> None:
    assert "torch" not in loaded_after(f"import {module}")


def test_cli_import_loads_no_transport_and_no_parsers() -> None:
    """``memtui --version`` starts like ``nvidia-smi``: each command imports what it uses."""
    loaded = loaded_after("import memtui.cli")
    assert not loaded & {
        "zmq",
        "psutil",
        "yaml",
        "textual",
        "rich",
        "msgspec",
        "matplotlib",
        "numpy",
    }, loaded


def test_status_loads_no_psutil_and_without_a_config_file_no_yaml() -> None:
    """What ``memtui status`` imports: the registry reads start times from /proc, and the
    verdict's thresholds need the YAML parser only when there is a config file."""
    loaded = loaded_after(
        "import os\nos.environ['MEMTUI_CONFIG'] = '/nonexistent/memtui.yaml'\n"
        "import memtui.runs.report, memtui.transport.client, memtui.storage.registry\n"
        "from memtui.storage.userconfig import load_thresholds\nload_thresholds()"
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


# ------------------------------------------------------------------- words of the making

HISTORY = {
    "a numbered work stop": re.compile(
        r"\bstops? \d+\b(?! ?(?:s|ms|steps?|seconds?|workers?|ranks?|times)\b)", re.I
    ),
    "an issue by number": re.compile(r"\bissues? #?\d+", re.I),
    "the issue itself": re.compile(r"\bthe issue's\b", re.I),
    "a seed document by number": re.compile(r"(?<![a-z.-])seeds?'?[ _-]?0\d\d(?!\d)", re.I),
    "the seed documents": re.compile(r"\bthe seeds\b(?!\s+(?:of|for|from)\b)|\btest_seeds\b", re.I),
    "the machine it was made on": re.compile(
        r"\bthis VM\b|\bthe CI machine\b|\bthis session's\b|\bsession's VM\b", re.I
    ),
    "a run named by letter": re.compile(r"(?<![\w-])runs? (?![IN]\b)[A-O]\d?(?:-[A-O]\d?)?\b"),
    "a benchmark run by letter": re.compile(r"\badvice_truth[ ]runs?\b"),
    "the design it set out from": re.compile(r"\bthe[ ]starting[ ]design\b", re.I),
    "a numbered knob": re.compile(r"(?<![a-z])knob_?\d(?!\d)", re.I),
}
"""Words that name the repository's own making (numbered work stops, issue numbers, the seed
documents by number, benchmark runs by letter, the machine a figure was taken on) instead of
what the product does and why (words that are something else stay out by the patterns' own
bounds: ``torch.manual_seed(0)``, ``--seed 3``, "the workers stop 2 s later", ``--max-runs N``,
"the run I started", "a CPU run a memory limit")."""

HISTORY_IN_NAMES = re.compile(r"(?<![a-z])(?:seeds?(?![a-z])|(?:issue|stop|knob)_?\d)", re.I)
"""The same in a file's name (a test file named after a seed document or a numbered knob)."""


def repository_files() -> list[str]:
    """Every file git tracks or would add (untracked but not ignored), as it is on disk."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the repository's files are listed by git: no git checkout here")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted({name for name in listed.split("\0") if name and (ROOT / name).is_file()})


def history_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the words) for each line of ``text`` that names the making."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            if match := pattern.search(line):
                found.append((number, what, match.group(0)))
    return found


def test_the_patterns_catch_the_making_and_leave_product_words_alone() -> None:
    """Each pattern catches what it is for, and words that are something else pass."""
    caught = [
        "up to stop " + "28",
        "Issue " + "15: decreases",
        "see issues #" + "13",
        "the " + "issue's bar",
        "seed " + "004's options table",
        "SEED_" + "004 = ",
        "test_readme_seed_" + "004_command",
        "the seed-" + "003 situation",
        "the seed" + "s' 003 -> 004",
        "as the " + "seeds resume",
        "(`test_" + "seeds`, `test_ddp`)",
        "on this " + "VM a thread",
        "since the CI " + "machine has no GPU",
        "This session" + "'s VM",
        "advice_" + "truth run" + " J",
        "runs " + "A-E2",
        "in run " + "D (load 4)",
        "departs from the starting " + "design",
        "tests/test_knob" + "5_live.py",
    ]
    assert [text for text in caught if not history_in(text)] == []
    product = [
        "torch.manual_seed(0)",
        "random.seed(1337)",
        "memtui demo --seed 003",
        "the workers stop 2 s later",
        "a loop that runs a number of epochs",
        "on a CPU run a memory limit",
        "[--max-runs N]",
        "the run I started",
        "the seeds of its loader workers",
        "every GPU on this host",
        "a tmux session's panes",
    ]
    assert [text for text in product if history_in(text)] == []
    assert HISTORY_IN_NAMES.search("tests/test_" + "seeds.py")
    assert not HISTORY_IN_NAMES.search("tests/integration/test_sampler.py")


def test_no_file_names_how_the_project_was_made() -> None:
    """No file git tracks (code, tests, benchmarks, README, docs, CHANGELOG) names numbered work
    stops, issues, the seed documents by number, benchmark runs by letter or the machine a figure
    was taken on: a comment says what the code guards and why, in product terms."""
    found = []
    for name in repository_files():
        if HISTORY_IN_NAMES.search(name):
            found.append(f"{name}: the file's name")
        data = (ROOT / name).read_bytes()
        if b"\0" in data:  # recordings and other binary files
            continue
        text = data.decode("utf-8", "replace")
        found += [f"{name}:{no}: {what}: {words!r}" for no, what, words in history_in(text)]
    assert not found, "\n".join(found)
