"""litgpt's ``pretrain`` (Lightning Fabric, a token budget, a ``CycleIterator`` over litdata's
``StreamingDataLoader``) as its users run it, ``litgpt pretrain``, under ``memtui run``: a
one-layer model of width 16 from a config, three local text files tokenized by litdata (a pass of
24 steps), a word-level tokenizer trained here, offline. Its ``fabric.save`` checkpoints are
memtui's checkpoints, and a workers change queued before step 2 lands at the save after step 3,
in the middle of the pass: what the model trains on, read by the witness, is litdata's own order
of the pass, every sample once, then the next pass with the new workers.

litgpt pins ``huggingface-hub<1.4``, which the shared venv's transformers refuses: it runs in a
venv of its own (``make litgpt-venv``: ``.venv-litgpt``), whose installed ``litgpt/pretrain.py``
must be the file ``litgpt_pretrain/client.json`` pins (release v0.5.13); without that venv the
test is skipped with the command that builds it.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtui.hooks import auto
from tests.clients.harness import ClientRun, client_home, finished, start, status_json, steps_of
from tests.clients.upstream import Manifest
from tests.clients.witness import row_digest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-litgpt" / "bin" / "python"
RUNNER = """import sys

if __name__ == "__main__":  # litdata's optimize spawns workers that import this module again
    from litgpt.__main__ import main

    sys.argv = ["litgpt", "pretrain", *sys.argv[1:]]
    main()
"""
"""``litgpt pretrain ARGS`` as its console script runs it (the witness runs a script file)."""
SAVE_EVERY, QUEUE_AT, READ_AT, STEPS, PASS = 3, 2, 10, 32, 24
LINES = 34
"""Lines of 12 words a text file: 409 tokens, 24 samples of 17 tokens; two files train."""
EXPECTED = """import json, sys

from litdata.streaming import StreamingDataLoader, StreamingDataset, TokensLoader

# litgpt's TextFiles.train_dataloader, with the workers of each pass
first, then = int(sys.argv[2]), int(sys.argv[3])
passes = []
for workers, taken in ((first, 0), (then, 1)):
    dataset = StreamingDataset(sys.argv[1], item_loader=TokensLoader(block_size=17), shuffle=True)
    loader = StreamingDataLoader(dataset, batch_size=2, num_workers=workers, drop_last=True)
    for index in range(taken + 1):
        rows = [row[:16].tolist() for batch in loader for row in batch]
    passes.append(rows)
print(json.dumps(passes))
"""
"""The samples of litdata's first pass with ``first`` workers and its second with ``then``, as
litgpt's model takes them (16 of each sample's 17 tokens), in the order litdata delivers them."""
ARGS = [
    "tiny",
    *("--model_config.name", "tiny", "--model_config.block_size", "16"),
    *("--model_config.vocab_size", "19", "--model_config.padded_vocab_size", "32"),
    *("--model_config.n_layer", "1", "--model_config.n_head", "2"),
    *("--model_config.n_embd", "16", "--model_config.n_query_groups", "2"),
    *("--tokenizer_dir", "tok", "--data", "TextFiles", "--data.train_data_path", "data"),
    *("--data.num_workers", "0", "--train.micro_batch_size", "2"),
    *("--train.global_batch_size", "2", "--train.max_tokens", str(STEPS * 2 * 16)),
    *("--train.save_interval", str(SAVE_EVERY), "--train.lr_warmup_steps", "1"),
    *("--eval.interval", "100", "--eval.max_iters", "2", "--out_dir", "out"),
    *("--precision", "32-true", "--devices", "1", "--logger_name", "csv"),
]
"""32 optimizer steps of 2 x 17 tokens (16 inputs), a ``fabric.save`` every 3 and a final one."""


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
        lines = (" ".join(pick.choice(words) for _ in range(12)) for _ in range(LINES))
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
    """The run, held before step 2 while ``num_workers=2`` is queued; its status read before
    step 10."""
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
        run = start(script, ARGS, env, [QUEUE_AT, READ_AT], "litgpt", memtui, [python])
        try:
            run.wait_paused(QUEUE_AT, timeout=400)
            runs = json.loads(run.memtui("ls", "--json").stdout)
            queued = run.memtui("set", runs[0]["run"], "num_workers=2")
            assert queued.returncode == 0, queued.stdout + queued.stderr
            run.go(QUEUE_AT)
            run.wait_paused(READ_AT, timeout=400)
            status = status_json(run, runs[0]["run"])
        finally:
            run.go(QUEUE_AT)
            run.go(READ_AT)
        finished(run, timeout=400)
        expected = subprocess.run(
            [python, "-c", EXPECTED, str(workdir / "data" / "train"), "0", "2"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=workdir,
            env=env,
        )
        assert expected.returncode == 0, expected.stderr
        status["expected_passes"] = json.loads(expected.stdout.splitlines()[-1])
        yield run, status


def test_litgpt_fabric_saves_are_memtuis_checkpoints(
    pretrain: tuple[ClientRun, dict[str, Any]],
) -> None:
    """Read before step 10: the saves after steps 3, 6 and 9, and the run trained to its end
    (32 steps, 11 checkpoints on disk)."""
    run, status = pretrain
    assert [c["step"] for c in status["checkpoints"]] == [3, 6, 9], status
    assert len(steps_of(run)) == STEPS
    assert len(list((run.workdir / "out").rglob("lit_model.pth"))) == STEPS // SAVE_EVERY + 1


def test_litgpt_takes_a_workers_change_at_its_next_save_in_the_middle_of_the_pass(
    pretrain: tuple[ClientRun, dict[str, Any]],
) -> None:
    """litdata's ``StreamingDataLoader`` goes on from its place with two workers at the save
    after step 3: the model trains on litdata's own pass with no workers to its end (its last
    batch, which litdata's resumption onto two workers leaves out, from the training process),
    each sample once, then on litdata's next pass with two workers."""
    run, status = pretrain
    assert status["boundary"] == auto.WHEN_SAVED, status["boundary"]
    assert "num_workers" in status["tunable"], status
    (applied,) = status["applied"]
    assert applied["step"] == SAVE_EVERY and applied["changes"]["num_workers"] == {
        "old": 0,
        "new": 2,
    }
    first, second = status["expected_passes"]
    assert len(first) == 2 * PASS and len({row_digest(r) for r in first}) == 2 * PASS
    trained = [
        digest
        for record in run.records("forward")
        if record["training"] and "rows" in record
        for digest in record["rows"]
    ]
    expected = [row_digest(row) for row in first + second][: 2 * STEPS]
    assert trained == expected
    # the training process's children: one of litgpt's own, then the loader's two workers
    children = [step.workers for step in steps_of(run)]
    own = children[0]
    assert children[:SAVE_EVERY] == [own] * SAVE_EVERY, children
    assert children[SAVE_EVERY + 1 : PASS - 1] == [own + 2] * (PASS - SAVE_EVERY - 2), children
    assert children[PASS + 1 :] == [own + 2] * (STEPS - PASS - 1), children
