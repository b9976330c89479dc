"""Local stand-ins for what the client scripts would download: text, token files, a tokenizer
trained here, a tiny model config, and an accuracy metric (nothing is fetched from a hub)."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

WORDS = (
    "the", "a", "model", "learns", "to", "read", "write", "and", "count", "while", "data",
    "flows", "through", "small", "layers", "of", "numbers", "every", "step", "moves", "weights",
    "toward", "lower", "loss", "on", "text", "that", "repeats", "simple", "patterns", "so",
    "tiny", "network", "can", "fit", "it", "quickly", "one", "core",
)  # fmt: skip


def sentences(count: int, seed: int) -> list[str]:
    """``count`` lines of words from a small fixed vocabulary (deterministic for a seed)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) for _ in range(count)]


def write_text(path: Path, count: int, seed: int) -> Path:
    """A text file of ``count`` lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(sentences(count, seed)) + "\n")
    return path


def nanogpt_dataset(root: Path, name: str, vocab_size: int = 64) -> None:
    """``data/<name>/train.bin``, ``val.bin`` (uint16 tokens) and ``meta.pkl`` as nanoGPT's
    ``prepare.py`` scripts write them, under ``root``."""
    import numpy as np

    directory = root / "data" / name
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    pattern = rng.integers(vocab_size, size=97, dtype=np.uint16)  # repeats: something to learn
    for split, length in (("train", 20_000), ("val", 4_000)):
        tokens = np.resize(pattern, length) ^ (rng.random(length) < 0.1).astype(np.uint16)
        tokens.astype(np.uint16).tofile(directory / f"{split}.bin")
    with open(directory / "meta.pkl", "wb") as handle:
        pickle.dump({"vocab_size": vocab_size}, handle)


def wikitext2(root: Path, train_samples: int, block_size: int = 35) -> Path:
    """``data/wikitext-2.txt`` where Lightning's ``WikiText2`` demo looks for it (and then does not
    download it), sized so that its 4,000 held-out samples leave ``train_samples`` to train on."""
    path = root / "data" / "wikitext-2.txt"
    tokens_left = (train_samples + 4_000 + 1) * block_size  # the demo has len(tokens) // 35 - 1
    lines, seed = [], 0
    while tokens_left:
        for line in sentences(200, seed):
            words = line.split()[: tokens_left - 1]  # the demo adds <eos> to every line
            lines.append(" ".join(words))
            tokens_left -= len(words) + 1
            if tokens_left < 2:
                lines[-1] += " x" * tokens_left  # the last line fills the count exactly
                tokens_left = 0
                break
        seed += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def tokenizer(directory: Path, corpus: list[Path], vocab_size: int = 320) -> Path:
    """A byte-level BPE tokenizer trained on ``corpus``, saved for ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(path) for path in corpus], trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        model_max_length=64,
    )
    wrapped.save_pretrained(str(directory))
    return directory


def gpt2_config(directory: Path, vocab_size: int) -> Path:
    """A GPT-2 config of 2 layers and width 64, saved for ``AutoConfig``."""
    from transformers import GPT2Config

    GPT2Config(
        vocab_size=vocab_size,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(str(directory))
    return directory


ACCURACY = '''"""Accuracy: the share of predictions equal to their references."""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    """The share of predictions equal to their references."""

    def _info(self):
        return evaluate.MetricInfo(
            description="accuracy",
            citation="",
            inputs_description="predictions and references: lists of integers",
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
        )

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        return {"accuracy": sum(p == r for p, r in pairs) / max(1, len(pairs))}
'''


def causal_lm_inputs(workdir: Path) -> None:
    """What ``run_clm``-style scripts read, in their working directory: ``train.txt`` and
    ``val.txt``, a ``tokenizer`` trained on them and a 2-layer GPT-2 ``config`` of its vocabulary."""
    from transformers import AutoTokenizer

    train = write_text(workdir / "train.txt", 300, seed=1)
    val = write_text(workdir / "val.txt", 40, seed=2)
    trained = tokenizer(workdir / "tokenizer", [train, val])
    gpt2_config(workdir / "config", len(AutoTokenizer.from_pretrained(str(trained))))


def accuracy_metric(workdir: Path) -> Path:
    """``accuracy/accuracy.py`` in the script's working directory: ``evaluate.load("accuracy")``
    loads a local metric script of that name before it asks the hub."""
    path = workdir / "accuracy" / "accuracy.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ACCURACY)
    return path


def sentence_pairs(count: int, seed: int) -> list[dict[str, object]]:
    """``count`` MRPC-like rows (``sentence1``, ``sentence2``, ``label``, ``idx``), no two with
    the same pair of sentences, their lengths varied (batches of them pad to different lengths)."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    seen: set[tuple[str, str]] = set()
    while len(rows) < count:
        pair = tuple(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24))) for _ in range(2)
        )
        if pair in seen:
            continue
        seen.add((pair[0], pair[1]))
        rows.append(
            {
                "sentence1": pair[0],
                "sentence2": pair[1],
                "label": rng.randint(0, 1),
                "idx": len(rows),
            }
        )
    return rows


GLUE_README = """---
configs:
- config_name: mrpc
  data_files:
  - split: train
    path: mrpc/train.jsonl
  - split: validation
    path: mrpc/validation.jsonl
---
MRPC-like sentence pairs made locally for a test.
"""

GLUE = '''"""GLUE's MRPC metric: accuracy and the F1 of the positive class."""

import datasets
import evaluate


class Glue(evaluate.Metric):
    """Accuracy and F1 of predictions against references."""

    def _info(self):
        return evaluate.MetricInfo(
            description="glue",
            citation="",
            inputs_description="predictions and references: lists of integers",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references):
        pairs = list(zip(predictions, references))
        true_positives = sum(p == r == 1 for p, r in pairs)
        predicted, actual = sum(p == 1 for p, _ in pairs), sum(r == 1 for _, r in pairs)
        return {
            "accuracy": sum(p == r for p, r in pairs) / max(1, len(pairs)),
            "f1": 2 * true_positives / max(1, predicted + actual),
        }
'''


def mrpc_inputs(workdir: Path, train_rows: int, validation_rows: int) -> list[dict[str, object]]:
    """What Accelerate's ``complete_nlp_example.py`` loads, under the names it loads them by, in
    its working directory: ``nyu-mll/glue`` (a local dataset whose README's ``configs`` section
    names ``mrpc``), ``bert-base-cased`` (a cased WordPiece tokenizer trained here on the rows
    and a 2-layer BERT of width 32 for sequence classification, saved with ``save_pretrained``)
    and a ``glue`` metric; returns the training rows."""
    import json

    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    train = sentence_pairs(train_rows, seed=11)
    validation = sentence_pairs(validation_rows, seed=12)
    glue = workdir / "nyu-mll" / "glue"
    (glue / "mrpc").mkdir(parents=True, exist_ok=True)
    (glue / "README.md").write_text(GLUE_README)
    for split, rows in (("train", train), ("validation", validation)):
        lines = (json.dumps(row) for row in rows)
        (glue / "mrpc" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=False)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = [str(row[key]) for row in train + validation for key in ("sentence1", "sentence2")]
    wordpiece.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials)
    )
    model_dir = workdir / "bert-base-cased"
    tokenizer = BertTokenizer(
        vocab=wordpiece.get_vocab(), do_lower_case=False, model_max_length=128
    )
    tokenizer.save_pretrained(str(model_dir))
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=2,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(str(model_dir))
    metric = workdir / "glue" / "glue.py"
    metric.parent.mkdir(parents=True, exist_ok=True)
    metric.write_text(GLUE)
    return train
