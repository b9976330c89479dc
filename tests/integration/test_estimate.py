"""``memtui estimate`` and the shared static arithmetic, checked against real tensors on the CPU."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from memtui.core import memmath
from memtui.hooks.memory import static_memory
from memtui.planning import estimate
from tests.support.cli import memtui_cli

GB = 10**9


class MLP(torch.nn.Module):
    """A small MLP on feature vectors."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(torch.nn.Module):
    """One pre-norm transformer block with q/k/v/o projections (the names LoRA targets)."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.q_proj = torch.nn.Linear(width, width)
        self.k_proj = torch.nn.Linear(width, width)
        self.v_proj = torch.nn.Linear(width, width)
        self.o_proj = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        y = self.norm1(x)
        q, k, v = (
            proj(y).view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyGPT(torch.nn.Module):
    """A two-block decoder over a 128-token vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 32)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 128, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One real forward, backward and optimizer step on the CPU."""
    if isinstance(model, TinyGPT):
        tokens = torch.randint(0, 128, (4, 16))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    else:
        dtype = next(model.parameters()).dtype
        loss = model(torch.randn(8, 32, dtype=dtype)).float().square().mean()
    loss.backward()
    optimizer.step()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def real_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the real parameters, gradients and each optimizer state after a step."""
    parts = {
        "parameters": sum(nbytes(p) for p in model.parameters()),
        "gradients": sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None),
    }
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                parts[name] = parts.get(name, 0) + nbytes(value)
    return parts


def estimated_parts(static: memmath.StaticEstimate) -> dict[str, int]:
    parts = {"parameters": static.parameters, "gradients": static.gradients}
    parts.update({s.name: s.bytes for s in static.states if s.bytes})
    return parts


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
}


@pytest.mark.parametrize("optimizer_kind", list(OPTIMIZERS))
@pytest.mark.parametrize(
    ("model_class", "dtype"),
    [(MLP, torch.float32), (TinyGPT, torch.float32), (MLP, torch.bfloat16)],
)
def test_static_parts_match_real_tensors_exactly(
    model_class: type[torch.nn.Module], dtype: torch.dtype, optimizer_kind: str
) -> None:
    """After a real step, params, grads and every optimizer state equal the arithmetic's bytes."""
    torch.manual_seed(0)
    model = model_class().to(dtype)
    specs = estimate.tensor_specs(model)
    optimizer = OPTIMIZERS[optimizer_kind](model.parameters())
    train_step(model, optimizer)
    static = memmath.static_estimate(specs, optimizer_kind, step_on_device=True)
    assert estimated_parts(static) == real_parts(model, optimizer)
    if optimizer_kind in {"adam", "adamw"}:  # torch makes the moments with zeros_like(param)
        states = next(iter(optimizer.state.values()))
        assert states["exp_avg"].dtype == dtype == states["exp_avg_sq"].dtype
        assert {s.dtype for s in static.states if s.name.startswith("exp")} == {
            memmath.dtype_name(dtype)
        }


def test_frozen_parameters_have_no_gradients_or_state() -> None:
    """A model with its embedding and first block frozen: exact, and smaller than full."""
    model = TinyGPT()
    for name, param in model.named_parameters():
        if name.startswith(("embed.", "blocks.0.")):
            param.requires_grad_(False)
    specs = estimate.tensor_specs(model)
    assert specs == memmath.freeze(estimate.tensor_specs(TinyGPT()), ["embed", "blocks.0.*"]), (
        "--freeze patterns select the same parameters"
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    train_step(model, optimizer)
    static = memmath.static_estimate(specs, "adamw", step_on_device=True)
    assert estimated_parts(static) == real_parts(model, optimizer)
    assert static.trainable_params < static.total_params


def test_lora_adapters_match_real_tensors() -> None:
    """LoRA r=4 on q_proj and v_proj: base frozen, only A and B get gradients and AdamW state."""
    model = TinyGPT()
    targets = memmath.lora_targets(estimate.linear_specs(model), ["q_proj", "v_proj"])
    specs = memmath.with_lora(estimate.tensor_specs(model), targets, rank=4)
    assert estimate.apply_lora(model, ["q_proj", "v_proj"], rank=4) == len(targets) == 4
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    with torch.no_grad():  # B starts at zero in LoRA; make A's gradient non-zero too
        for p in trainable:
            p.normal_()
    train_step(model, optimizer)
    static = memmath.static_estimate(specs, "adamw", step_on_device=True)
    assert estimated_parts(static) == real_parts(model, optimizer)
    assert static.trainable_params == 4 * (4 * (32 + 32)) == sum(p.numel() for p in trainable)


def test_live_breakdown_uses_the_same_arithmetic() -> None:
    """The hook's static memory: expected before the first step == measured after == estimate."""
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters())
    before = static_memory(model, optimizer, "cpu")
    train_step(model, optimizer)
    after = static_memory(model, optimizer, "cpu")
    static = memmath.static_estimate(estimate.tensor_specs(model), "adamw", step_on_device=True)
    assert before.optimizer_note.startswith("expected before the first step")
    assert after.optimizer_note == "measured"
    assert before.optimizer_bytes == after.optimizer_bytes == static.optimizer_bytes
    assert before.parameters_bytes == after.parameters_bytes == static.parameters
    assert before.gradients_bytes == after.gradients_bytes == static.gradients
    assert before.gradients_held_bytes is None and after.gradients_held_bytes is None


def test_a_boundary_counts_the_gradients_held_between_steps() -> None:
    """At a checkpoint boundary the hook counts the gradients that exist: all of them where the
    loop keeps them, none after ``zero_grad(set_to_none=True)``."""
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters())
    train_step(model, optimizer)
    kept = static_memory(model, optimizer, "cpu", between_steps=True)
    assert kept.gradients_held_bytes == kept.gradients_bytes > 0
    optimizer.zero_grad(set_to_none=True)
    freed = static_memory(model, optimizer, "cpu", between_steps=True)
    assert freed.gradients_held_bytes == 0


def test_a_7b_budget_and_where_the_hand_arithmetic_goes_wrong() -> None:
    """A 7B reward model's hand-made budget: 14 GB params and 14 GB grads are right; the moments
    are not.

    The budget said "fp32 AdamW (momentum and variance) 28 GB". Two fp32 moments for 7B
    parameters are 56 GB; 28 GB is what plain torch keeps for bf16 parameters (its moments are
    bf16, made by zeros_like). Fp32 moments come with an fp32 master copy: another 28 GB.
    """
    seven_b = memmath.uniform_tensors(7 * GB, "bfloat16")
    plain = memmath.static_estimate(seven_b, "adamw")
    assert plain.parameters == 14 * GB
    assert plain.gradients == 14 * GB
    assert {s.name: (s.bytes, s.dtype) for s in plain.states if s.bytes} == {
        "exp_avg": (14 * GB, "bfloat16"),
        "exp_avg_sq": (14 * GB, "bfloat16"),
    }
    assert [s.name for s in plain.states] == ["exp_avg", "exp_avg_sq", "step"]

    master = memmath.static_estimate(seven_b, "adamw", master_weights=True)
    assert master.parameters == 14 * GB and master.gradients == 14 * GB
    assert {s.name: (s.bytes, s.dtype) for s in master.states if s.bytes} == {
        "exp_avg": (28 * GB, "float32"),
        "exp_avg_sq": (28 * GB, "float32"),
    }
    assert master.optimizer_bytes == 56 * GB, "two fp32 moments: 56 GB, not 28"
    assert master.master == 28 * GB
    assert master.total == 112 * GB, "16 bytes per parameter (the ZeRO paper's 2 + 2 + 12)"
    hand_sum = 14 * GB + 28 * GB + 14 * GB
    assert master.total - hand_sum == 56 * GB, "the hand-made static sum misses 56 GB"

    eight_bit = memmath.static_estimate(seven_b, "adam8bit")
    assert 14 * GB <= eight_bit.optimizer_bytes < 14.25 * GB  # 2 B/param + 1/32 B absmax


def mistral_7b() -> tuple[list[memmath.TensorSpec], list[memmath.LinearSpec]]:
    """Mistral-7B's parameters and linear layers (32 layers, hidden 4096, 8 KV heads), bf16."""
    hidden, ffn, kv, vocab = 4096, 14336, 1024, 32000
    tensors = [memmath.TensorSpec("model.embed_tokens.weight", vocab * hidden, "bfloat16")]
    linears = []
    for layer in range(32):
        for name, (d_in, d_out) in {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (hidden, kv),
            "self_attn.v_proj": (hidden, kv),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (hidden, ffn),
            "mlp.up_proj": (hidden, ffn),
            "mlp.down_proj": (ffn, hidden),
        }.items():
            full = f"model.layers.{layer}.{name}"
            linears.append(memmath.LinearSpec(full, d_in, d_out, "bfloat16"))
            tensors.append(memmath.TensorSpec(f"{full}.weight", d_in * d_out, "bfloat16"))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors.append(memmath.TensorSpec(f"model.layers.{layer}.{norm}", hidden, "bfloat16"))
    tensors.append(memmath.TensorSpec("model.norm.weight", hidden, "bfloat16"))
    tensors.append(memmath.TensorSpec("lm_head.weight", vocab * hidden, "bfloat16"))
    return tensors, linears


def test_lora_on_a_7b_model_saves_about_40_gb() -> None:
    """LoRA r=16 on q_proj,v_proj of Mistral-7B: 6.8M fp32 adapters; ~43 GB less than full."""
    tensors, linears = mistral_7b()
    assert sum(t.numel for t in tensors) == 7_241_732_096
    full = memmath.static_estimate(tensors, "adamw")
    targets = memmath.lora_targets(linears, ["q_proj", "v_proj"])
    lora = memmath.static_estimate(memmath.with_lora(tensors, targets, 16), "adamw")
    assert lora.trainable_params == 6_815_744
    assert lora.gradients + lora.optimizer_bytes == 6_815_744 * 12  # fp32 grads + 2 moments
    assert 42 * GB < full.total - lora.total < 44 * GB


def test_zero_sharding_reproduces_the_zero_paper() -> None:
    """ZeRO paper, figure 1: 7.5B params, 64 GPUs, fp16 + fp32 Adam (K = 12)."""
    specs = memmath.uniform_tensors(7_500_000_000, "float16")
    per_gpu = {
        stage: memmath.static_estimate(specs, "adam", True, stage, 64).total / GB
        for stage in (0, 1, 2, 3)
    }
    assert per_gpu[0] == 120
    assert per_gpu[1] == pytest.approx(31.4, abs=0.05)
    assert per_gpu[2] == pytest.approx(16.6, abs=0.05)
    assert per_gpu[3] == pytest.approx(1.9, abs=0.05)


def test_adam8bit_states_follow_bitsandbytes() -> None:
    """Block-wise 8-bit: 1 B per element per state + fp32 absmax per 256; small tensors fp32."""
    specs = [memmath.TensorSpec("big", 10_000), memmath.TensorSpec("small", 100)]
    states = {s.name: s.bytes for s in memmath.static_estimate(specs, "adam8bit").states}
    blocks = -(-10_000 // 256)
    assert states == {
        "state1": 10_000,
        "state2": 10_000,
        "absmax1": 4 * blocks,
        "absmax2": 4 * blocks,
        "state1+state2 (small tensors)": 8 * 100,
    }


MEASURE_TOLERANCE = 0.02
"""Extrapolated activations at micro-batch 4 within 2% of the measured ones."""


@pytest.mark.parametrize("model_class", [TinyGPT, MLP])
def test_measured_activations_extrapolate_to_a_third_batch(
    model_class: type[torch.nn.Module],
) -> None:
    """The line through micro-batches 1 and 2 predicts micro-batch 4 (measured for real)."""
    model = model_class()
    seq_len = 16 if model_class is TinyGPT else None
    line = estimate.measure_activations(model, seq_len)
    measured = estimate.saved_bytes(model, 4, seq_len)
    assert line.per_sample > 0
    assert abs(line.at(4) - measured) <= MEASURE_TOLERANCE * measured
    assert all(p.grad is None for p in model.parameters()), "the measurement leaves no grads"


def test_largest_batch_is_the_edge_of_the_band() -> None:
    """The largest micro-batch fits under 85%; one more does not."""
    card = 24 * 2**30
    static, fixed, per = 9 * 2**30, 100 * 2**20, 350 * 2**20
    batch = memmath.largest_batch(static, fixed, per, card, 0.85)
    assert memmath.total_bytes(static, fixed, per, batch) <= 0.85 * card
    assert memmath.total_bytes(static, fixed, per, batch + 1) > 0.85 * card
    assert memmath.largest_batch(30 * 2**30, fixed, per, card, 0.85) == 0


def test_cli_estimate_uses_the_bands_of_the_config_file(tmp_path: Path) -> None:
    """``memtui estimate`` reads the verdict's bands from the config file, as the viewer does."""
    config = tmp_path / "config.yaml"
    config.write_text("verdict:\n  memory_edge_fraction: 0.5\n  memory_danger_fraction: 0.6\n")
    args = ("estimate", "--params", "500M", "--seq-len", "512", "--gpu-memory", "24GB")
    plain = memtui_cli(
        *args, "--json", env={**os.environ, "MEMTUI_CONFIG": str(tmp_path / "none.yaml")}
    )
    tight = memtui_cli(*args, "--json", env={**os.environ, "MEMTUI_CONFIG": str(config)})
    assert plain.returncode == 0 and tight.returncode == 0, plain.stderr + tight.stderr
    default, from_file = json.loads(plain.stdout), json.loads(tight.stdout)
    assert (default["safe_band"], default["danger_band"]) == (0.85, 0.9)
    assert (from_file["safe_band"], from_file["danger_band"]) == (0.5, 0.6)
    assert 0 < from_file["largest_batch"] < default["largest_batch"]
    table = memtui_cli(*args, env={**os.environ, "MEMTUI_CONFIG": str(config)})
    assert "largest micro-batch under 50%" in table.stdout, table.stdout


def test_cli_estimate_params_json() -> None:
    """``memtui estimate --params 7B`` as JSON: the parts, the per-state list and the fit."""
    result = memtui_cli(
        "estimate", "--params", "7B", "--mixed-precision", "master", "--seq-len", "512",
        "--batch-size", "2", "--gpu-memory", "80GB", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["param_dtype"] == "bfloat16"
    assert data["parts"]["master"] == 28 * GB
    assert [s["name"] for s in data["optimizer_states"]] == ["exp_avg", "exp_avg_sq", "step"]
    assert data["activations"]["method"] == "formula"
    assert data["largest_batch"] == 0, "112 GB of static state does not fit an 80 GB card"


def test_cli_estimate_model_table() -> None:
    """``--model`` builds a real model, measures activations and prints the table."""
    result = memtui_cli(
        "estimate", "--model", "tests.integration.test_estimate:TinyGPT", "--seq-len", "16",
        "--batch-size", "8", "--optimizer", "sgd-momentum", "--gpu-memory", "8GiB",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "momentum_buffer" in result.stdout
    assert "measured on the CPU" in result.stdout
    assert "largest micro-batch under 85%" in result.stdout


def test_cli_estimate_errors_are_plain() -> None:
    """Bad inputs exit 2 with one line on stderr."""
    both = memtui_cli("estimate", "--params", "7B", "--model", "x:y")
    assert both.returncode == 2 and "exactly one" in both.stderr
    amp = memtui_cli("estimate", "--params", "1B", "--dtype", "bf16", "--mixed-precision", "amp")
    assert amp.returncode == 2 and "stay float32" in amp.stderr
    lora = memtui_cli("estimate", "--params", "1B", "--lora-rank", "8", "--seq-len", "8")
    assert lora.returncode == 2 and "need the model's layers" in lora.stderr


TINY_MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}


def test_hf_config_without_transformers_says_so(tmp_path: Any) -> None:
    """Where transformers is not installed, --hf-config fails with the reason (exit 2)."""
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MISTRAL))
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from memtui.cli import main\n"
        f"main(['estimate', '--hf-config', {str(config)!r}, '--seq-len', '8'])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert "needs the transformers package" in result.stderr


def cli_in_process(*args: str) -> Any:
    """``memtui <args>`` in this process (no torch import per call): exit code, stdout, stderr."""
    from click.testing import CliRunner

    from memtui.cli import main

    result = CliRunner().invoke(main, list(args))
    return type(
        "Result",
        (),
        {"returncode": result.exit_code, "stdout": result.stdout, "stderr": result.stderr},
    )


@pytest.mark.parametrize(
    ("attention", "dtype"),
    [
        ("sdpa", torch.float32),
        ("flash", torch.float32),
        ("eager", torch.float32),
        ("sdpa", torch.bfloat16),
    ],
)
def test_meta_and_cpu_measure_the_same(attention: str, dtype: torch.dtype) -> None:
    """TinyGPT measured on the CPU and on the meta device with the same attention kind agree.

    Exactly in fp32. In bf16 the CPU's LayerNorm keeps its mean and rstd in bf16 where the
    meta device (and CUDA) keep fp32: 16 bytes per token per LayerNorm, under 1% here.
    """
    cpu = TinyGPT().to(dtype)
    with torch.device("meta"):
        meta = TinyGPT().to(dtype)
    on_cpu = estimate.measure_activations(cpu, 64, attention=attention)
    on_meta = estimate.measure_activations(meta, 64, attention=attention)
    assert "on the meta device" in on_meta.explanation and "on the CPU" in on_cpu.explanation
    assert f"{attention} attention (2 scaled_dot_product_attention calls" in on_meta.explanation
    if dtype == torch.float32:
        assert on_cpu.measured == on_meta.measured
    else:
        assert on_meta.per_sample == pytest.approx(on_cpu.per_sample, rel=0.01)
        assert on_meta.per_sample - on_cpu.per_sample == 5 * 2 * 64 * 2  # 5 norms, 2 stats


def test_sdpa_stand_in_keeps_what_torch_keeps() -> None:
    """On the CPU torch's own SDPA kernel keeps q, k, v, out and the lse: the stand-in the same."""
    model = TinyGPT()
    assert estimate.saved_bytes(model, 2, 64) == estimate.saved_bytes(model, 2, 64, None, "sdpa")


def test_meta_bf16_no_longer_counts_fp32_scores() -> None:
    """The meta device's SDPA falls back to math in fp32 (s x s scores at 4 bytes): not counted."""
    with torch.device("meta"):
        model = TinyGPT().to(torch.bfloat16)
    fallback = estimate.saved_bytes(model, 2, 64)
    flash = estimate.saved_bytes(model, 2, 64, None, "flash")
    eager = estimate.saved_bytes(model, 2, 64, None, "eager")
    assert flash < eager < fallback
    # per block the bf16 eager softmax keeps b a s^2 x 2 bytes; the fallback's fp32 ones more
    assert eager - flash >= 2 * (2 * 4 * 64 * 64 * 2)


def test_korthikanti_per_layer_fast() -> None:
    """One layer of GPT-3 6.7B's shape at s=2048 (two layers less one, on meta): within 1%.

    The difference leaves out what is kept once per model (the loss's fp32 copy of the output).
    The estimate guide's rows measure all 32 layers (tests/unit/test_estimate_refs.py, -m slow).
    """
    from benchmarks.estimate_refs import PaperStack, korthikanti

    with torch.device("meta"):
        models = [PaperStack(layers, 4096, 32).to(torch.bfloat16) for layers in (1, 2)]
    for attention, eager in (("eager", True), ("flash", False), ("sdpa", False)):
        one, two = (estimate.measure_activations(m, 2048, attention=attention) for m in models)
        layer = two.at(1) - one.at(1)
        assert layer == pytest.approx(korthikanti(2048, 4096, 1, 32, eager), rel=0.01)


class ManyOutputs(torch.nn.Module):
    """A model returning a dict of tensors, like a ModelOutput without logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = MLP()

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"count": 3, "hidden": self.net(x)}


def test_output_without_logits_is_measured() -> None:
    """The first floating tensor of a mapping or tuple is backpropagated through."""
    line = estimate.measure_activations(ManyOutputs(), None)
    assert line.per_sample > 0
    with pytest.raises(estimate.EstimateError, match="no floating tensor"):
        estimate.output_tensor({"count": 3})


def test_params_alone_gives_the_static_part() -> None:
    """``--params 7B`` alone: exit 0, the static parts, activations unknown (not a refusal)."""
    result = cli_in_process("estimate", "--params", "7B", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["activations"]["method"] == "unknown"
    assert data["parts"]["activations"] is None
    assert data["total_includes_activations"] is False
    static = 7 * GB * 16  # fp32 params, grads and two moments
    assert data["total_bytes"] == static + memmath.CUDA_CONTEXT_BYTES
    table = cli_in_process("estimate", "--params", "7B", "--gpu-memory", "80GB")
    assert table.returncode == 0, table.stderr
    assert "unknown (not in the total): give --seq-len" in table.stdout
    assert "largest micro-batch under 85%: unknown without activations" in table.stdout


def test_params_take_the_shape_of_the_nearest_real_model() -> None:
    """A bare count gets a real family's shape, named: 7B is Llama-2-7B, 175B GPT-3 175B."""
    assert memmath.nearest_shape(7 * GB).name == "Llama-2-7B"
    assert memmath.nearest_shape(175 * GB).name == "GPT-3 175B"
    assert memmath.nearest_shape(1_300_000_000).name == "GPT-3 XL"
    assert memmath.nearest_shape(70 * GB).name == "Llama-2-70B"
    formula = memmath.formula_activations(7 * GB, 2048, attention="eager")
    assert (formula.layers, formula.hidden, formula.heads) == (32, 4096, 32)
    assert "Llama-2-7B (6,738,415,616 parameters)" in formula.explanation
    assert formula.per_sample == 2048 * 4096 * 32 * (34 + 5 * 32 * 2048 / 4096)
    flash = memmath.formula_activations(7 * GB, 2048, attention="flash")
    assert flash.per_sample == 34 * 2048 * 4096 * 32


def test_grad_dtype_fp32_accumulation() -> None:
    """``--grad-dtype fp32`` with bf16 params and a master copy: 18 bytes per parameter."""
    specs = memmath.uniform_tensors(7 * GB, "bfloat16")
    static = memmath.static_estimate(specs, "adamw", master_weights=True, grad_dtype="float32")
    assert static.gradients == 28 * GB
    assert static.by_dtype["gradients"] == {"float32": 28 * GB}
    assert static.total == 7 * GB * 18
    assert "gradients kept in float32 (--grad-dtype)" in static.notes
    result = cli_in_process(
        "estimate", "--params", "7B", "--mixed-precision", "master", "--grad-dtype", "fp32",
        "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["grad_dtype"] == "float32" and data["parts"]["gradients"] == 28 * GB
    bad = cli_in_process("estimate", "--params", "7B", "--grad-dtype", "int8")
    assert bad.returncode == 2 and "--grad-dtype is float32" in bad.stderr


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_counts_name_what_they_count(stage: int) -> None:
    """Both ZeRO counts say what is sharded, kept whole and left out; DeepSpeed's is larger."""
    specs = memmath.uniform_tensors(7 * GB, "bfloat16")
    paper = memmath.static_estimate(specs, "adam", True, stage, 8, zero_count="paper")
    deepspeed = memmath.static_estimate(
        specs, "adam", True, stage, 8, zero_count="deepspeed", largest_layer=131_072_000
    )
    assert deepspeed.total > paper.total
    assert any("reduce / all-gather buckets" in n for n in paper.notes)
    assert any("--zero-count deepspeed counts them" in n for n in paper.notes)
    note = next(n for n in deepspeed.notes if n.startswith(f"ZeRO-{stage}"))
    assert "DeepSpeed's estimate_zero" in note and "left out" in note
    names = [b.name for b in deepspeed.zero_buffers]
    assert names == (["fp32 grads", "gathered layer"] if stage == 3 else names[:1])
    assert names[0] == "fp32 grads"
    plain = memmath.static_estimate(
        memmath.uniform_tensors(GB, "float32"), "adam", False, stage, 8, zero_count="deepspeed"
    )
    assert not plain.zero_buffers, "fp32 params without a master copy: the paper's count"
    assert any("counted as the ZeRO paper does" in n for n in plain.notes)
