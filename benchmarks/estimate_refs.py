"""``memtui estimate`` against published references on the same inputs: prints the estimate guide's table.

Every row runs ``memtui estimate ... --json`` in this process and sets one of its numbers next
to a reference's, with the tolerance tests/unit/test_estimate_refs.py asserts. Run from the
repository root: ``python benchmarks/estimate_refs.py`` (markdown) or ``--json``.

The Korthikanti rows measure ``gpt3_6_7b`` below on the meta device: GPT-3 6.7B's shape
(L=32, h=4096, a=32) built of the layer the paper counts (LayerNorm, fused QKV, attention with
dropout, projection, dropout, LayerNorm, 4h GeLU MLP, dropout; p=0.1), fed hidden states.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


class PaperLayer(torch.nn.Module):
    """One transformer layer as Korthikanti et al. (2022), section 4.1, count its activations."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout, is_causal=True
        )
        out = self.proj(attn.transpose(1, 2).reshape(b, s, h))
        x = x + torch.nn.functional.dropout(out, self.dropout)
        mlp = self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return x + torch.nn.functional.dropout(mlp, self.dropout)


class PaperStack(torch.nn.Module):
    """``layers`` paper layers over hidden-state inputs (no embedding, no logits)."""

    def __init__(self, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.layers = torch.nn.ModuleList(PaperLayer(hidden, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def example_inputs(self, batch: int, seq_len: int | None) -> torch.Tensor:
        """Hidden states of ``batch`` samples of ``seq_len`` tokens (what memtui estimate feeds)."""
        weight = self.layers[0].qkv.weight
        shape = (batch, seq_len or 1, self.hidden)
        return torch.zeros(shape, dtype=weight.dtype, device=weight.device)


def gpt3_6_7b() -> PaperStack:
    """GPT-3 6.7B's layers (Brown et al. 2020, table 2.1): L=32, h=4096, a=32."""
    return PaperStack(32, 4096, 32)


def korthikanti(s: int, h: int, layers: int, a: int, eager: bool) -> int:
    """Korthikanti et al. eq. 2 (``s b h L (34 + 5 a s / h)``) or 3's 34 term, b=1, 16-bit."""
    return int(s * h * layers * (34 + (5 * a * s / h if eager else 0)))


GB = 10**9
LLAMA2_7B = 6_738_415_616
"""Llama-2-7B's parameters (its Hugging Face config: 32 x 4096, FFN 11008, vocabulary 32000)."""
LLAMA2_7B_LARGEST = 32000 * 4096
"""Its largest module: the embedding (32000 x 4096), as DeepSpeed's model_to_params finds it."""
BERT_BASE_CASED = 108_310_272
"""BertModel(bert-base-cased)'s parameters, what ``accelerate estimate-memory`` loads."""


@dataclass(frozen=True)
class Case:
    """One row: memtui's arguments, the number picked from its JSON, and the reference's."""

    reference: str
    how: str
    args: tuple[str, ...]
    pick: Callable[[dict[str, Any]], float]
    expected: float
    tolerance: float
    """Relative: |memtui - reference| <= tolerance x reference."""
    unit: str = "GB"


def _static(data: dict[str, Any]) -> float:
    parts = data["parts"]
    return float(sum(v for k, v in parts.items() if k not in {"activations", "overhead"}))


def _activations(data: dict[str, Any]) -> float:
    return float(data["parts"]["activations"])


PAPER = ("--params", "7.5B", "--dtype", "fp16", "--mixed-precision", "master", "--optimizer")
ZERO_PAPER = (*PAPER, "adam", "--world-size", "64", "--zero-count", "paper", "--zero-stage")
DEEPSPEED = ("--mixed-precision", "master", "--dtype", "fp16", "--optimizer", "adam")
KORTHIKANTI = ("--model", "benchmarks/estimate_refs.py:gpt3_6_7b", "--dtype", "bf16")
KORTHIKANTI_SHAPE = ("--seq-len", "2048", "--batch-size", "1")

CASES = (
    Case(
        "Transformer Math 101: mixed precision, AdamW, 16-bit gradients (2 + 2 + 12 B/param)",
        "7B x 16 bytes",
        ("--params", "7B", "--mixed-precision", "master"),
        _static,
        7e9 * 16,
        0.0,
    ),
    Case(
        "Transformer Math 101: the same, fp32 gradients (2 + 4 + 12 B/param)",
        "7B x 18 bytes",
        ("--params", "7B", "--mixed-precision", "master", "--grad-dtype", "fp32"),
        _static,
        7e9 * 18,
        0.0,
    ),
    *(
        Case(
            f"ZeRO paper, figure 1: 7.5B, 64 GPUs, K=12, stage {stage}",
            f"{value} GB as printed (one decimal)",
            (*ZERO_PAPER, str(stage)),
            _static,
            value * GB,
            0.05 / value,
        )
        for stage, value in ((0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9))
    ),
    *(
        Case(
            f"DeepSpeed estimate_zero{stage}_model_states_mem_needs: Llama-2-7B, 8 GPUs, "
            "no offload",
            how,
            (
                "--params",
                str(LLAMA2_7B),
                *DEEPSPEED,
                "--zero-stage",
                str(stage),
                "--world-size",
                "8",
            ),
            _static,
            value,
            1e-6,
        )
        for stage, how, value in (
            (2, "4 P + int(16 P / 8), P = 6,738,415,616", 4 * LLAMA2_7B + int(16 * LLAMA2_7B / 8)),
            (
                3,
                "4 L + int(18 P / 8), L = 131,072,000 (the embedding)",
                4 * LLAMA2_7B_LARGEST + int(18 * LLAMA2_7B / 8),
            ),
        )
    ),
    Case(
        "accelerate estimate-memory bert-base-cased, float32, 'Training using Adam'",
        "4 x the fp32 model size (1.61 GB in accelerate's table, GiB)",
        ("--params", str(BERT_BASE_CASED), "--optimizer", "adam"),
        _static,
        4 * 4 * BERT_BASE_CASED,
        0.0,
    ),
    *(
        Case(
            reference,
            how,
            (*KORTHIKANTI, *KORTHIKANTI_SHAPE, "--attention", attention),
            _activations,
            korthikanti(2048, 4096, 32, 32, eager=attention == "eager"),
            0.01,
        )
        for reference, how, attention in (
            (
                "Korthikanti et al. 2022, eq. 2: GPT-3 6.7B shape, s=2048, b=1, eager attention",
                "s h L (34 + 5 a s / h) at 16-bit",
                "eager",
            ),
            (
                "Korthikanti et al. 2022, 34 s h L (no s x s tensors): the same, flash attention",
                "34 s h L at 16-bit",
                "flash",
            ),
        )
    ),
)
"""The estimate guide's table, row by row."""


def run(case: Case) -> dict[str, Any]:
    """``memtui estimate <case.args> --json`` in this process, parsed."""
    from memtui.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["estimate", *case.args, "--json"], standalone_mode=False)
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def rows() -> list[dict[str, Any]]:
    """Each case with memtui's number and its difference from the reference."""
    found = []
    for case in CASES:
        value = case.pick(run(case))
        found.append(
            {
                "reference": case.reference,
                "how": case.how,
                "command": "memtui estimate " + " ".join(case.args),
                "reference_bytes": case.expected,
                "memtui_bytes": value,
                "difference": value / case.expected - 1,
                "tolerance": case.tolerance,
            }
        )
    return found


def markdown(found: list[dict[str, Any]]) -> str:
    """The estimate guide's table."""
    lines = [
        "| reference (how its number is obtained) | reference | memtui | difference | "
        "tolerance | `memtui estimate` arguments |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in found:
        args = row["command"].removeprefix("memtui estimate ")
        lines.append(
            f"| {row['reference']} ({row['how']}) | {row['reference_bytes'] / GB:,.3f} GB | "
            f"{row['memtui_bytes'] / GB:,.3f} GB | {row['difference']:+.2%} | "
            f"{row['tolerance']:.2%} | `{args}` |"
        )
    return "\n".join(lines)


def main() -> None:
    """Print the table (markdown, or JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    found = rows()
    print(json.dumps(found, indent=2) if parser.parse_args().json else markdown(found))


if __name__ == "__main__":
    main()
