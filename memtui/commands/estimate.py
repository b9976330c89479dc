"""`memtui estimate`: a model's memory before any run."""

from __future__ import annotations

from typing import Any

import click

from memtui.commands.common import fail, thresholds_in_force


@click.command("estimate")
@click.option("--params", default=None, help="A parameter count: 7B, 110M, 1.3e9.")
@click.option("--model", default=None, help="module:factory (or class) building the model.")
@click.option("--hf-config", default=None, help="A Hugging Face config.json on disk.")
@click.option("--dtype", default=None, help="Parameter dtype: float32, bfloat16, float16.")
@click.option(
    "--mixed-precision",
    type=click.Choice(["none", "amp", "master"]),
    default="none",
    show_default=True,
    help="amp: torch.autocast, fp32 params; master: 16-bit params + fp32 master copy.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "sgd-momentum", "adam", "adamw", "adam8bit"]),
    default="adamw",
    show_default=True,
    help="The optimizer whose state is counted.",
)
@click.option("--freeze", multiple=True, help="Freeze parameters matching a glob or prefix.")
@click.option("--lora-rank", default=0, show_default=True, help="LoRA rank r (0: no LoRA).")
@click.option(
    "--lora-modules",
    default="q_proj,v_proj",
    show_default=True,
    help="With --lora-rank: the modules that get adapters, comma-separated.",
)
@click.option(
    "--zero-stage",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="ZeRO stage: 1 shards the optimizer state over --world-size ranks, 2 the gradients "
    "too, 3 the parameters too.",
)
@click.option(
    "--world-size",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Ranks ZeRO shards over.",
)
@click.option("--batch-size", default=1, show_default=True, help="Micro-batch per GPU.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sample.")
@click.option("--gpu-memory", default=None, help="Card size for the fit, e.g. 24GiB.")
@click.option("--layers", type=int, default=None, help="Formula only: transformer layers.")
@click.option("--hidden", type=int, default=None, help="Formula only: hidden size.")
@click.option("--heads", type=int, default=None, help="Formula only: attention heads.")
@click.option("--no-measure", is_flag=True, help="Use the formula even when the model runs.")
@click.option(
    "--attention",
    type=click.Choice(["sdpa", "flash", "eager"]),
    default="sdpa",
    show_default=True,
    help="How the run computes attention: sdpa (torch's default; CUDA's flash or "
    "memory-efficient kernel), flash (flash-attention), eager (the scores kept).",
)
@click.option(
    "--grad-dtype",
    default=None,
    help="Gradient dtype, e.g. float32 for fp32 gradient accumulation (default: the params').",
)
@click.option(
    "--zero-count",
    type=click.Choice(["deepspeed", "paper"]),
    default="deepspeed",
    show_default=True,
    help="ZeRO per rank as DeepSpeed's estimator counts it, or as the ZeRO paper does.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def estimate_command(**kwargs: Any) -> None:
    """The memory a training job needs per GPU, by part, and the largest micro-batch that fits."""
    import json

    from memtui.core.stats import parse_bytes
    from memtui.planning.estimate import EstimateError, Options, as_dict, estimate, format_table

    as_json = kwargs.pop("as_json")
    gpu_memory = kwargs.pop("gpu_memory")
    try:
        card = parse_bytes(gpu_memory) if gpu_memory else None
    except ValueError as exc:
        fail(str(exc), 2)
        return
    options = Options(
        **{k: v for k, v in kwargs.items() if k not in {"freeze", "lora_modules", "no_measure"}},
        freeze=tuple(kwargs["freeze"]),
        lora_modules=tuple(m.strip() for m in kwargs["lora_modules"].split(",") if m.strip()),
        gpu_memory=card,
        measure=not kwargs["no_measure"],
        thresholds=thresholds_in_force(),
    )
    try:
        result = estimate(options)
    except EstimateError as exc:
        fail(str(exc), 2)
        return
    if as_json:
        click.echo(json.dumps(as_dict(result), indent=2))
    else:
        click.echo(format_table(result))
