"""litgpt's ``pretrain`` (Lightning Fabric, a token budget, a ``CycleIterator`` over litdata's
``StreamingDataLoader``) as its users run it, ``litgpt pretrain``, under ``memtui run``: a
one-layer model of width 16 from a config, three local text files tokenized by litdata, a
word-level tokenizer trained here, offline. Its ``fabric.save`` checkpoints are memtui's
checkpoints, and ``memtui status`` says why its loader takes no change in the middle of a pass.

litgpt pins ``huggingface-hub<1.4``, which the shared venv's transformers refuses: it runs in a
venv of its own (``make litgpt-venv``: ``.venv-litgpt``), whose installed ``litgpt/pretrain.py``
must be the file ``litgpt_pretrain/client.json`` pins (release v0.5.13); without that venv the
test is skipped with the command that builds it.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clients.harness import ClientRun, client_home, finished, start, status_json, steps_of
from tests.clients.upstream import Manifest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-litgpt" / "bin" / "python"
RUNNER = """import sys

if __name__ == "__main__":  # litdata's optimize spawns workers that import this module again
    from litgpt.__main__ import main

    sys.argv = ["litgpt", "pretrain", *sys.argv[1:]]
    main()
"""
"""``litgpt pretrain ARGS`` as its console script runs it (the witness runs a script file)."""
SAVE_EVERY, READ_AT = 4, 10
ARGS = [
    "tiny",
    *("--model_config.name", "tiny", "--model_config.block_size", "16"),
    *("--model_config.vocab_size", "19", "--model_config.padded_vocab_size", "32"),
    *("--model_config.n_layer", "1", "--model_config.n_head", "2"),
    *("--model_config.n_embd", "16", "--model_config.n_query_groups", "2"),
    *("--tokenizer_dir", "tok", "--data", "TextFiles", "--data.train_data_path", "data"),
    *("--data.num_workers", "0", "--train.micro_batch_size", "2"),
    *("--train.global_batch_size", "2", "--train.max_tokens", "768"),
    *("--train.save_interval", str(SAVE_EVERY), "--train.lr_warmup_steps", "1"),
    *("--eval.interval", "100", "--eval.max_iters", "2", "--out_dir", "out"),
    *("--precision", "32-true", "--devices", "1", "--logger_name", "csv"),
]
"""24 optimizer steps of 2 x 17 tokens, a ``fabric.save`` every 4 and a final one."""


def pinned_litgpt() -> Path:
    """The litgpt venv's python, its ``litgpt/pretrain.py`` the pinned one (else skip)."""
    if not PYTHON.exists():
        pytest.skip(
            f"litgpt's venv is not built: make litgpt-venv (it builds {PYTHON.parent.parent})"
        )
    manifest = Manifest.load("litgpt_pretrain")
    (pinned,) = manifest.files
    site = next((ROOT / ".venv-litgpt" / "lib").glob("python3*/site-packages"))
    installed = site / pinned.path
    digest = hashlib.sha256(installed.read_bytes()).hexdigest() if installed.exists() else ""
    if digest != pinned.sha256:
        pytest.skip(f"{installed} is not litgpt@{manifest.commit[:12]}'s: make litgpt-venv again")
    return PYTHON


def local_inputs(workdir: Path) -> None:
    """Three text files (the first is litgpt's validation split) and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "while",
        "dogs",
        "ran",
        "over",
        "hills",
        "and",
        "rivers",
        "under",
        "bright",
        "skies",
    ]
    pick = random.Random(0)
    (workdir / "data").mkdir()
    files = []
    for index in range(3):
        lines = (" ".join(pick.choice(words) for _ in range(12)) for _ in range(400))
        files.append(workdir / "data" / f"{index}.txt")
        files[-1].write_text("\n".join(lines))
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    special = ["<unk>", "<s>", "</s>"]
    tokenizer.train([str(f) for f in files], trainers.WordLevelTrainer(special_tokens=special))
    (workdir / "tok").mkdir()
    tokenizer.save(str(workdir / "tok" / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (workdir / "tok" / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pretrain() -> Iterator[tuple[ClientRun, dict[str, Any]]]:
    python = str(pinned_litgpt())
    pytest.importorskip("tokenizers")
    with client_home() as (base, env):
        workdir = base / "run"
        workdir.mkdir()
        local_inputs(workdir)
        script = workdir / "pretrain_run.py"
        script.write_text(RUNNER)
        memtui = [python, "-m", "memtui", "run", "--name", "litgpt", "--"]
        env = {**env, "PYTHONPATH": str(ROOT)}
        run = start(script, ARGS, env, [READ_AT], "litgpt", memtui, [python])
        try:
            run.wait_paused(READ_AT, timeout=400)
            runs = json.loads(run.memtui("ls", "--json").stdout)
            status = status_json(run, runs[0]["run"])
        finally:
            run.go(READ_AT)
        finished(run, timeout=400)
        yield run, status


def test_litgpt_fabric_saves_are_memtuis_checkpoints(
    pretrain: tuple[ClientRun, dict[str, Any]],
) -> None:
    """Read before step 10: the saves after steps 4 and 8, and the run trained to its end
    (24 steps, 7 checkpoints on disk)."""
    run, status = pretrain
    assert [c["step"] for c in status["checkpoints"]] == [SAVE_EVERY, 2 * SAVE_EVERY], status
    assert len(steps_of(run)) == 24
    assert len(list((run.workdir / "out").rglob("lit_model.pth"))) == 7


def test_litgpt_status_says_why_its_loader_takes_no_change_at_a_save(
    pretrain: tuple[ClientRun, dict[str, Any]],
) -> None:
    """litdata's ``StreamingDataLoader`` keeps its place in a pass inside its own iteration: its
    changes wait for the next pass, and status says which loader and why."""
    _run, status = pretrain
    assert "litdata.streaming.dataloader.StreamingDataLoader" in status["boundary"], status
    assert "a save takes no change" in status["boundary"]
    assert "pin_memory" in status["tunable"]
