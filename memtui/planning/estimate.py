"""``memtui estimate``: the memory a training job will need, by part, before it runs.

Static parts come from ``memtui.core.memmath`` (the arithmetic the live breakdown uses too).
Activations are measured when the model can be built: a forward and backward at two small
micro-batches, counting the bytes autograd keeps for backward (deduplicated by storage,
parameters excluded), extrapolated per sample. Small models run for real on the CPU; large ones
on torch's meta device (shapes only, nothing allocated, the same saved tensors). Attention is
measured as the run will compute it (``--attention``): every ``scaled_dot_product_attention``
call is replaced by a stand-in that keeps what the chosen kernel keeps, so neither the CPU's
kernel nor the meta device's fp32 math fallback decides the number. Without a model, the
Korthikanti et al. formula on the nearest real model's shape. torch is imported only inside
functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.core import memmath
from memtui.core.stats import format_bytes

REAL_LIMIT_BYTES = 2 * 2**30
"""Models with parameters up to this size are measured on the CPU for real; larger on meta."""
MEASURE_BATCHES = (1, 2)
"""The micro-batches the activations are measured at (the line through them is extrapolated)."""
MIXED_PRECISION = ("none", "amp", "master")
DEFAULT_ATTENTION = "sdpa"
"""torch's and transformers' default: on a CUDA GPU, SDPA runs the flash or memory-efficient
kernel (16-bit and fp32 alike), which keeps q, k, v, the output and an fp32 log-sum-exp."""
ATTENTION_KEPT = {
    "sdpa": "q, k, v, output, fp32 log-sum-exp per query and the attention mask if one is "
    "passed (CUDA's flash / memory-efficient kernels)",
    "flash": "q, k, v, output and fp32 log-sum-exp per query (flash-attention; no mask)",
    "eager": "the s x s scores' softmax in the activation dtype (and the dropout mask), "
    "as attention written out keeps them",
}
"""What each attention kind keeps for backward, as the stand-ins keep it."""


class EstimateError(Exception):
    """A user error in the estimate's inputs, with the message to show."""


@dataclass
class Activations:
    """Activations as ``fixed + per_sample x batch`` bytes and how they were found."""

    fixed: int
    per_sample: float
    method: str
    """``measured``, ``formula`` or ``unknown`` (a bare parameter count without --seq-len)."""
    explanation: str
    measured: dict[int, int] = field(default_factory=dict)
    """Micro-batch to bytes autograd saved, where measured."""

    @property
    def known(self) -> bool:
        """Whether there is a number (a bare parameter count has none)."""
        return self.method != "unknown"

    def at(self, batch: int) -> int:
        """Bytes at micro-batch ``batch``."""
        return int(self.fixed + self.per_sample * batch)


# ----------------------------------------------------------------------------- models


def _import_object(path: str) -> Any:
    """``pkg.mod:name`` or ``file.py:name`` -> the object."""
    if ":" not in path:
        raise EstimateError(f"--model wants module:name (e.g. mypkg.models:build), not {path!r}")
    module_name, _, attr = path.partition(":")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None:
                raise EstimateError(f"cannot load {module_name}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses look their module up while made
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EstimateError(f"cannot import {module_name}: {exc}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise EstimateError(f"{module_name} has no {attr}")
        target = getattr(target, part)
    return target


def build_model(path: str, device: str = "meta") -> Any:
    """The model a factory or class at ``path`` makes, built under ``torch.device(device)``."""
    import torch

    factory = _import_object(path)
    if not callable(factory):
        raise EstimateError(f"{path} is not a class or factory")
    with torch.device(device):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(f"{path} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def set_attention(model: Any, attention: str) -> bool:
    """Switch a transformers model to the attention implementation of ``attention``."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return False
    setter("eager" if attention == "eager" else "sdpa")
    return True


def build_hf_model(config_path: str, device: str = "meta") -> Any:
    """A Hugging Face model from a ``config.json`` on disk (no download), under ``device``."""
    try:
        import transformers
    except ImportError:
        raise EstimateError(
            "--hf-config needs the transformers package (pip install transformers); "
            "or pass --params N, or --model module:factory"
        ) from None
    import torch

    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise EstimateError(f"cannot read {path}: {exc}") from exc
    model_type = values.pop("model_type", None)
    if not model_type:
        raise EstimateError(f"{path} has no model_type")
    config = transformers.AutoConfig.for_model(model_type, **values)
    architectures = values.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device(device):
        if model_class is not None:
            return model_class(config)
        return transformers.AutoModel.from_config(config)


def tensor_specs(model: Any) -> list[memmath.TensorSpec]:
    """The model's parameters as the arithmetic sees them (shared tensors once)."""
    seen: set[int] = set()
    specs = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        specs.append(
            memmath.TensorSpec(
                name, int(param.numel()), memmath.dtype_name(param.dtype), param.requires_grad
            )
        )
    return specs


def linear_specs(model: Any) -> list[memmath.LinearSpec]:
    """Every ``nn.Linear`` in the model (what LoRA can wrap)."""
    import torch

    return [
        memmath.LinearSpec(
            name,
            module.in_features,
            module.out_features,
            memmath.dtype_name(module.weight.dtype),
        )
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def buffer_bytes(model: Any) -> int:
    """Bytes of the model's buffers (running statistics, rotary tables, masks)."""
    return sum(int(b.numel()) * int(b.element_size()) for b in model.buffers())


def apply_lora(model: Any, modules: Sequence[str], rank: int, dtype: Any = None) -> int:
    """Freeze the model and wrap the named linear layers with trainable rank-``rank`` adapters.

    A minimal LoRA (``y = W x + B A x``, A: r x in, B: out x r), enough for memory: the
    frozen base saves no input for its own weight's gradient, the adapters do.
    """
    import torch

    class LoRALinear(torch.nn.Module):
        """A frozen linear layer plus a trainable low-rank update."""

        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.base = base
            adapter_dtype = dtype or torch.float32
            device = base.weight.device
            self.lora_A = torch.nn.Parameter(
                torch.zeros(rank, base.in_features, dtype=adapter_dtype, device=device)
            )
            self.lora_B = torch.nn.Parameter(
                torch.zeros(base.out_features, rank, dtype=adapter_dtype, device=device)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            update = (x.to(self.lora_A.dtype) @ self.lora_A.t()) @ self.lora_B.t()
            return self.base(x) + update.to(x.dtype)

    for param in model.parameters():
        param.requires_grad_(False)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and any(name == m or name.endswith("." + m) for m in modules)
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module))
    return len(targets)


# ------------------------------------------------------------------------ activations


def _make_inputs(model: Any, batch: int, seq_len: int | None, device: Any) -> Any:
    """Inputs for one micro-batch: the model's ``example_inputs``, token ids, or features."""
    import torch

    if hasattr(model, "example_inputs"):
        return model.example_inputs(batch, seq_len)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        if not seq_len:
            raise EstimateError("token models need --seq-len")
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device=device)
        return {"input_ids": ids}
    first = next(
        (m for m in model.modules() if isinstance(m, torch.nn.Embedding | torch.nn.Linear)),
        None,
    )
    if isinstance(first, torch.nn.Embedding):
        if not seq_len:
            raise EstimateError("token models need --seq-len")
        return torch.zeros(batch, seq_len, dtype=torch.long, device=device)
    if isinstance(first, torch.nn.Linear):
        dtype = first.weight.dtype
        shape = (batch, seq_len, first.in_features) if seq_len else (batch, first.in_features)
        return torch.zeros(shape, dtype=dtype, device=device)
    raise EstimateError(
        "cannot guess the model's input: give the model an example_inputs(batch, seq_len) method"
    )


def output_tensor(output: Any) -> tuple[Any, bool]:
    """The tensor to backprop through, and whether it is logits.

    ``loss`` aside: ``logits``, else ``last_hidden_state`` (transformers' base classes such as
    ``BertModel`` and ``LlamaModel``), else the first floating tensor of a tuple, list or
    mapping (a ``ModelOutput`` is one).
    """
    import torch

    if isinstance(output, torch.Tensor):
        return output, True
    for name, logits in (("logits", True), ("last_hidden_state", False)):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value, logits
    values = output.values() if isinstance(output, dict) else output
    if isinstance(values, tuple | list) or isinstance(output, dict):
        for value in values:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value, False
    raise EstimateError(
        f"the model returned {type(output).__name__} with no floating tensor to backprop through"
    )


def _loss(output: Any, inputs: Any) -> Any:
    """A training loss: the output's ``loss``, else cross-entropy on logits, else a mean square."""
    import torch

    if getattr(output, "loss", None) is not None:
        return output.loss
    tensor, logits = output_tensor(output)
    tokens = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if (
        logits
        and isinstance(tokens, torch.Tensor)
        and not tokens.is_floating_point()
        and tensor.dim() == tokens.dim() + 1
    ):
        return torch.nn.functional.cross_entropy(
            tensor.float().flatten(0, -2), tokens.flatten(), reduction="mean"
        )
    return tensor.float().square().mean()


def attention_math(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """Attention written out in the inputs' dtype: scores, mask, softmax, dropout, values."""
    import torch

    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(
            query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device
        ).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p:  # as CUDA's fused kernel: a bool mask kept
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return torch.matmul(probs, value)


def _kernel_attention(keep_mask: bool) -> Any:
    """An autograd function that keeps what a fused attention kernel keeps for backward."""
    import torch

    class KernelAttention(torch.autograd.Function):
        """Forward by the written-out math (nothing recorded); keeps q, k, v, out and the lse."""

        @staticmethod
        def forward(
            ctx: Any,
            query: Any,
            key: Any,
            value: Any,
            attn_mask: Any,
            is_causal: bool,
            scale: float | None,
            enable_gqa: bool,
        ) -> Any:
            out = attention_math(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)
            # the kernels write the output as (batch, seq, heads, dim) and return a transposed view
            out = out.transpose(1, 2).contiguous().transpose(1, 2) if out.dim() == 4 else out
            lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
            kept = [query, key, value, out, lse]
            if keep_mask and isinstance(attn_mask, torch.Tensor):
                kept.append(attn_mask)
            ctx.save_for_backward(*kept)
            ctx.args = (attn_mask, is_causal, scale, enable_gqa)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            attn_mask, is_causal, scale, enable_gqa = ctx.args
            with torch.enable_grad():
                q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors[:3])
                inputs = [q, k, v]
                out = attention_math(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)
                grads = torch.autograd.grad(out, inputs, grad)
            return (*grads, None, None, None, None)

    return KernelAttention


def attention_as(attention: str, calls: list[int]) -> Any:
    """A torch function mode running attention as ``attention`` and dropout as CUDA does.

    Every ``scaled_dot_product_attention``: ``sdpa`` and ``flash`` keep what the fused kernels
    keep (q, k, v, output, fp32 log-sum-exp; ``sdpa`` also an explicit mask, as the
    memory-efficient kernel does); ``eager`` writes the attention out in the inputs' dtype.
    Each call appends 1 to ``calls``. Every training ``dropout`` runs as ``native_dropout``,
    CUDA's fused kernel, which keeps a bool mask (the CPU's and the meta device's dropout keep
    it in the input's dtype: twice the bytes at 16-bit).
    """
    import inspect

    import torch
    from torch.overrides import TorchFunctionMode

    sdpa = torch.nn.functional.scaled_dot_product_attention
    dropout = torch.nn.functional.dropout
    signature = inspect.signature(attention_math)
    kernel = None if attention == "eager" else _kernel_attention(attention == "sdpa")

    class AttentionAs(TorchFunctionMode):
        """Replaces SDPA and dropout; every other torch function runs as called."""

        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if func is dropout:
                return _cuda_dropout(func, *args, **kwargs)
            if func is not sdpa:
                return func(*args, **kwargs)
            calls.append(1)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if kernel is None:
                return attention_math(*bound.args)
            a = bound.arguments
            return kernel.apply(
                a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"],
                a["enable_gqa"],
            )  # fmt: skip

    return AttentionAs()


def _cuda_dropout(
    func: Any, input: Any, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Any:
    """Dropout as CUDA's fused kernel runs it (a bool mask kept), where it drops anything."""
    import torch

    if not training or not p or inplace or not input.is_floating_point():
        return func(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


def saved_bytes(
    model: Any,
    batch: int,
    seq_len: int | None,
    autocast: Any = None,
    attention: str | None = None,
    calls: list[int] | None = None,
) -> int:
    """Bytes autograd keeps for backward in one forward at ``batch`` (then runs the backward).

    With ``attention``, every ``scaled_dot_product_attention`` runs as that kind
    (``attention_as``); without, as torch runs it on the model's device.
    """
    import contextlib

    import torch

    device = next(model.parameters()).device
    # storages are told apart by _cdata (the StorageImpl's address): torch has no public
    # identity for a storage, and on the meta device every data_ptr() is 0
    param_storages = {p.untyped_storage()._cdata for p in model.parameters()}  # noqa: SLF001
    kept: dict[int, Any] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in param_storages:  # noqa: SLF001 (no public storage identity)
            kept.setdefault(storage._cdata, storage)  # noqa: SLF001 (no public storage identity)
        return tensor

    inputs = _make_inputs(model, batch, seq_len, device)
    context = torch.autocast(device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    mode = (
        attention_as(attention, calls if calls is not None else [])
        if attention
        else contextlib.nullcontext()
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context, mode:
        output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss = _loss(output, inputs)
    total = sum(int(s.nbytes()) for s in kept.values())
    if loss.requires_grad:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def measure_activations(
    model: Any,
    seq_len: int | None,
    autocast: Any = None,
    batches: Sequence[int] = MEASURE_BATCHES,
    attention: str = DEFAULT_ATTENTION,
) -> Activations:
    """Activations measured at two micro-batches, attention as ``attention``, per sample."""
    device = next(model.parameters()).device
    calls: list[int] = []
    measured = {b: saved_bytes(model, b, seq_len, autocast, attention, calls) for b in batches}
    first, second = batches[0], batches[-1]
    per_sample = (measured[second] - measured[first]) / (second - first)
    fixed = int(measured[first] - per_sample * first)
    where = "on the CPU" if device.type == "cpu" else "on the meta device (shapes only)"
    if calls:
        how = (
            f"{attention} attention ({len(calls) // len(batches)} scaled_dot_product_attention "
            f"calls per forward, each keeping {ATTENTION_KEPT[attention]})"
        )
    else:
        how = "no scaled_dot_product_attention call: attention measured as the model writes it"
    explanation = (
        f"measured {where}: bytes autograd keeps for backward at micro-batch "
        + ", ".join(f"{b} ({measured[b]:,} B)" for b in batches)
        + f", extrapolated per sample; {how}"
    )
    return Activations(max(fixed, 0), per_sample, "measured", explanation, measured=measured)


# --------------------------------------------------------------------------- estimate


@dataclass
class Options:
    """Everything ``memtui estimate`` was asked."""

    params: str | None = None
    model: str | None = None
    hf_config: str | None = None
    dtype: str | None = None
    mixed_precision: str = "none"
    optimizer: str = "adamw"
    freeze: tuple[str, ...] = ()
    lora_rank: int = 0
    lora_modules: tuple[str, ...] = ("q_proj", "v_proj")
    zero_stage: int = 0
    world_size: int = 1
    batch_size: int = 1
    seq_len: int | None = None
    gpu_memory: int | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    measure: bool = True
    attention: str = DEFAULT_ATTENTION
    grad_dtype: str | None = None
    zero_count: str = "deepspeed"
    thresholds: Thresholds = THRESHOLDS
    """The memory bands in force: the verdict's, from the user's config file (``memtui
    estimate`` reads it as the viewer and ``memtui status`` do)."""


@dataclass
class Estimate:
    """The answer: static parts, activations, overhead, total and the largest batch that fits."""

    options: Options
    static: memmath.StaticEstimate
    buffers: int
    activations: Activations
    param_dtype: str
    lora_layers: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def activation_bytes(self) -> int:
        """Activations at the asked micro-batch."""
        return self.activations.at(self.options.batch_size)

    @property
    def overhead(self) -> int:
        """CUDA context plus allocator slack."""
        return memmath.overhead_bytes(self.activation_bytes)

    @property
    def static_total(self) -> int:
        """Everything that does not depend on the micro-batch (overhead's context excluded)."""
        return self.static.total + self.buffers

    @property
    def total(self) -> int:
        """The predicted peak per GPU."""
        return self.static_total + self.activation_bytes + self.overhead

    def largest_batch(self) -> int | None:
        """The largest micro-batch under the edge band (None without a card or activations)."""
        if not self.options.gpu_memory or not self.activations.known:
            return None
        return memmath.largest_batch(
            self.static_total,
            self.activations.fixed,
            self.activations.per_sample,
            self.options.gpu_memory,
            self.options.thresholds.memory_edge_fraction,
        )


def _resolve_dtype(options: Options) -> tuple[str, bool, Any]:
    """(parameter dtype, master weights, autocast dtype for the measurement)."""
    precision = options.mixed_precision
    if precision not in MIXED_PRECISION:
        raise EstimateError(f"--mixed-precision is one of {', '.join(MIXED_PRECISION)}")
    dtype = memmath.dtype_name(options.dtype) if options.dtype else None
    if dtype is not None:
        try:
            memmath.itemsize(dtype)
        except ValueError as exc:
            raise EstimateError(str(exc)) from None
    if precision == "amp":
        if dtype not in (None, "float32"):
            raise EstimateError(
                "under AMP (torch.autocast) the parameters stay float32; drop --dtype, "
                "or use --mixed-precision master for 16-bit parameters with an fp32 master copy"
            )
        return "float32", False, "bfloat16"
    if precision == "master":
        dtype = dtype or "bfloat16"
        if memmath.itemsize(dtype) != 2:
            raise EstimateError("--mixed-precision master keeps 16-bit parameters: bf16 or fp16")
        return dtype, True, None
    return dtype or "float32", False, None


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _check_choices(options: Options) -> str | None:
    """The gradient dtype asked for (None: the parameters'); EstimateError on a bad choice."""
    if options.optimizer not in memmath.OPTIMIZERS:
        raise EstimateError(f"--optimizer is one of {', '.join(memmath.OPTIMIZERS)}")
    if options.attention not in memmath.ATTENTION_KINDS:
        raise EstimateError(f"--attention is one of {', '.join(memmath.ATTENTION_KINDS)}")
    if options.zero_count not in memmath.ZERO_COUNTS:
        raise EstimateError(f"--zero-count is one of {', '.join(memmath.ZERO_COUNTS)}")
    if options.batch_size < 1:
        raise EstimateError("--batch-size must be at least 1")
    if not options.grad_dtype:
        return None
    grad_dtype = memmath.dtype_name(options.grad_dtype)
    if grad_dtype not in ("float32", "bfloat16", "float16"):
        raise EstimateError("--grad-dtype is float32, bfloat16 or float16")
    return grad_dtype


def largest_layer(model: Any) -> int:
    """Parameters of the largest single module, as DeepSpeed's ``model_to_params`` counts it."""
    return max(
        (sum(int(p.numel()) for p in m.parameters(recurse=False)) for m in model.modules()),
        default=0,
    )


def _static(
    options: Options,
    specs: Sequence[memmath.TensorSpec],
    master: bool,
    grad_dtype: str | None,
    largest: int,
) -> memmath.StaticEstimate:
    """The static parts of ``specs`` under the options' optimizer, ZeRO and gradient dtype."""
    return memmath.static_estimate(
        specs,
        options.optimizer,
        master,
        options.zero_stage,
        options.world_size,
        grad_dtype=grad_dtype,
        zero_count=options.zero_count,
        largest_layer=largest,
    )


def estimate(options: Options) -> Estimate:
    """Build (or count) the model, apply freezing / LoRA / ZeRO, and measure or model activations."""
    sources = [s for s in (options.params, options.model, options.hf_config) if s]
    if len(sources) != 1:
        raise EstimateError("give exactly one of --params, --model or --hf-config")
    grad_dtype = _check_choices(options)
    param_dtype, master, autocast = _resolve_dtype(options)
    notes: list[str] = []
    if options.params:
        return _estimate_from_count(options, param_dtype, master, grad_dtype)

    def build(device: str) -> Any:
        if options.model:
            model = build_model(options.model, device)
        else:
            model = build_hf_model(str(options.hf_config), device)
        model = model.to(_torch_dtype(param_dtype))
        for name, param in model.named_parameters():
            if memmath.frozen_by(name, options.freeze):
                param.requires_grad_(False)
        return model

    meta_model = build("meta")
    specs = tensor_specs(meta_model)
    if options.freeze:
        frozen = sum(s.numel for s in specs if not s.trainable)
        if not frozen:
            raise EstimateError(f"--freeze {' '.join(options.freeze)} matches no parameter")
    lora_layers = 0
    if options.lora_rank:
        targets = memmath.lora_targets(linear_specs(meta_model), options.lora_modules)
        if not targets:
            raise EstimateError(
                f"--lora-modules {','.join(options.lora_modules)} matches no nn.Linear"
            )
        specs = memmath.with_lora(specs, targets, options.lora_rank)
        lora_layers = len(targets)
    static = _static(options, specs, master, grad_dtype, largest_layer(meta_model))
    buffers = buffer_bytes(meta_model)
    activations = None
    if options.measure:
        real = static.parameters + buffers <= REAL_LIMIT_BYTES
        try:
            model = build("cpu") if real else meta_model
            if set_attention(model, options.attention):
                notes.append(
                    "transformers model: attn_implementation="
                    + ("eager" if options.attention == "eager" else "sdpa")
                )
            if options.lora_rank:
                apply_lora(model, options.lora_modules, options.lora_rank)
            activations = measure_activations(
                model,
                options.seq_len,
                _torch_dtype(autocast) if autocast else None,
                attention=options.attention,
            )
            if autocast:
                notes.append("activations measured under CPU autocast (bf16)")
        except EstimateError:
            raise
        except Exception as exc:
            notes.append(f"could not run the model ({type(exc).__name__}: {exc}); formula used")
    if activations is None:
        activations = _formula(options, static.total_params, param_dtype, autocast or master)
    return Estimate(options, static, buffers, activations, param_dtype, lora_layers, notes)


def _formula(options: Options, params: int, dtype: str, half_activations: Any) -> Activations:
    if not options.seq_len:
        return Activations(
            0,
            0,
            "unknown",
            "unknown: give --seq-len (tokens per sample) for the formula, or --model / "
            "--hf-config to measure them",
        )
    activation_bytes = 2 if half_activations else memmath.itemsize(dtype)
    formula = memmath.formula_activations(
        params,
        options.seq_len,
        activation_bytes,
        options.attention,
        options.layers,
        options.hidden,
        options.heads,
    )
    explanation = (
        formula.explanation + "; approximate: frameworks add the logits over the vocabulary, "
        "SwiGLU and grouped-query attention change the 34 (measure with --model or --hf-config)"
    )
    return Activations(0, formula.per_sample, "formula", explanation)


def _estimate_from_count(
    options: Options, param_dtype: str, master: bool, grad_dtype: str | None
) -> Estimate:
    try:
        count = memmath.parse_count(str(options.params))
    except ValueError as exc:
        raise EstimateError(str(exc)) from None
    if options.freeze or options.lora_rank:
        raise EstimateError(
            "--freeze and --lora-rank need the model's layers: use --model or --hf-config"
        )
    specs = memmath.uniform_tensors(count, param_dtype)
    shape = memmath.nearest_shape(count)
    static = _static(options, specs, master, grad_dtype, shape.largest_layer)
    notes = []
    if options.zero_stage == 3 and options.zero_count == "deepspeed" and master:
        notes.append(
            f"largest layer: {shape.largest_layer:,} parameters, {shape.name}'s "
            f"(max of the embedding {shape.vocab} x {shape.hidden} and an FFN projection)"
        )
    activations = _formula(options, count, param_dtype, master or options.mixed_precision == "amp")
    return Estimate(options, static, 0, activations, param_dtype, 0, notes)


# ----------------------------------------------------------------------------- output


def _gb(size: float) -> str:
    return f"{size / 1e9:.2f} GB"


def rows(result: Estimate) -> list[tuple[str, int, str, str]]:
    """(part, bytes, dtype, what is counted) rows of the table, states indented under optimizer."""
    static = result.static
    out: list[tuple[str, int, str, str]] = []

    def dtypes(part: str) -> str:
        return "/".join(sorted(static.by_dtype.get(part, {}))) or "-"

    out.append(("parameters", static.parameters, dtypes("parameters"), "every parameter"))
    if result.buffers:
        out.append(("buffers", result.buffers, "-", "the model's buffers"))
    out.append(
        (
            "gradients",
            static.gradients,
            dtypes("gradients"),
            f"one per trained parameter ({static.trainable_params:,}), "
            + ("--grad-dtype" if result.options.grad_dtype else "the parameter's dtype")
            + (
                " (ZeRO-3: in the gathered layer)"
                if static.zero_buffers and not static.gradients
                else ""
            ),
        )
    )
    if static.master:
        out.append(("master copy", static.master, "float32", "fp32 copy of the trained params"))
    out.append(("optimizer", static.optimizer_bytes, "", static.optimizer))
    for state in static.states:
        out.append((f"  {state.name}", state.bytes, state.dtype, state.note))
    for buffer in static.zero_buffers:
        out.append((buffer.name, buffer.bytes, buffer.dtype, buffer.note))
    act = result.activations
    if act.known:
        act_note = (
            f"micro-batch {result.options.batch_size}: {act.method}, {result.options.attention} "
            f"attention, {act.per_sample / 2**20:,.1f} MiB per sample"
        )
    else:
        act_note = "unknown (not in the total): give --seq-len"
    out.append(("activations", result.activation_bytes, "", act_note))
    out.append(
        (
            "overhead",
            result.overhead,
            "",
            f"CUDA context {memmath.CUDA_CONTEXT_BYTES // 2**20} MiB + allocator slack "
            f"{memmath.ALLOCATOR_SLACK:.0%} of activations",
        )
    )
    out.append(
        (
            "total",
            result.total,
            "",
            "predicted peak per GPU"
            if act.known
            else "static parts and overhead, activations unknown",
        )
    )
    return out


def as_dict(result: Estimate) -> dict[str, Any]:
    """The ``memtui estimate --json`` object."""
    static = result.static
    act = result.activations
    data: dict[str, Any] = {
        "total_params": static.total_params,
        "trainable_params": static.trainable_params,
        "param_dtype": result.param_dtype,
        "mixed_precision": result.options.mixed_precision,
        "optimizer": static.optimizer,
        "zero_stage": result.options.zero_stage,
        "world_size": result.options.world_size,
        "batch_size": result.options.batch_size,
        "seq_len": result.options.seq_len,
        "lora_layers": result.lora_layers,
        "attention": result.options.attention,
        "grad_dtype": memmath.dtype_name(result.options.grad_dtype)
        if result.options.grad_dtype
        else None,
        "zero_count": result.options.zero_count if result.options.zero_stage else None,
        "parts": {
            "parameters": static.parameters,
            "buffers": result.buffers,
            "gradients": static.gradients,
            "master": static.master,
            "optimizer": static.optimizer_bytes,
            "zero_buffers": sum(b.bytes for b in static.zero_buffers),
            "activations": result.activation_bytes if act.known else None,
            "overhead": result.overhead,
        },
        "optimizer_states": [
            {"name": s.name, "bytes": s.bytes, "dtype": s.dtype, "note": s.note}
            for s in static.states
        ],
        "zero_buffers": [
            {"name": b.name, "bytes": b.bytes, "dtype": b.dtype, "note": b.note}
            for b in static.zero_buffers
        ],
        "by_dtype": static.by_dtype,
        "activations": {
            "method": act.method,
            "fixed_bytes": act.fixed,
            "per_sample_bytes": act.per_sample,
            "measured": {str(k): v for k, v in act.measured.items()},
            "explanation": act.explanation,
        },
        "overhead": {
            "cuda_context_bytes": memmath.CUDA_CONTEXT_BYTES,
            "allocator_slack": memmath.ALLOCATOR_SLACK,
        },
        "total_bytes": result.total,
        "total_includes_activations": act.known,
        "notes": list(static.notes) + result.notes,
    }
    if result.options.gpu_memory:
        data["gpu_memory_bytes"] = result.options.gpu_memory
        data["safe_band"] = result.options.thresholds.memory_edge_fraction
        data["danger_band"] = result.options.thresholds.memory_danger_fraction
        data["fraction_of_gpu"] = result.total / result.options.gpu_memory
        data["largest_batch"] = result.largest_batch()
    return data


def format_table(result: Estimate) -> str:
    """The human table."""
    static = result.static
    opts = result.options
    head = (
        f"{static.total_params:,} parameters ({static.trainable_params:,} trained), "
        f"{result.param_dtype}, {static.optimizer}"
    )
    if opts.mixed_precision != "none":
        head += f", mixed precision: {opts.mixed_precision}"
    if opts.zero_stage:
        head += f", ZeRO-{opts.zero_stage} x {opts.world_size}"
    if opts.grad_dtype:
        head += f", gradients {memmath.dtype_name(opts.grad_dtype)}"
    if result.lora_layers:
        head += f", LoRA r={opts.lora_rank} on {result.lora_layers} layers"
    lines = [head, f"{'PART':<16} {'SIZE':>10} {'GB':>10}  {'DTYPE':<17} COUNTED"]
    for name, size, dtype, what in rows(result):
        lines.append(f"{name:<16} {format_bytes(size):>10} {_gb(size):>10}  {dtype:<17} {what}")
    lines.append(f"activations: {result.activations.explanation}")
    for note in list(static.notes) + result.notes:
        lines.append(f"note: {note}")
    if opts.gpu_memory:
        share = result.total / opts.gpu_memory
        bands = opts.thresholds
        edge, danger = bands.memory_edge_fraction, bands.memory_danger_fraction
        band = "safe" if share < edge else "edge" if share < danger else "danger"
        largest = result.largest_batch()
        fit = (
            (str(largest) if largest else "none fits")
            if result.activations.known
            else "unknown without activations"
        )
        lines.append(
            f"on a {format_bytes(opts.gpu_memory)} card: {share:.0%} ({band}); largest "
            f"micro-batch under {edge:.0%}: {fit}"
        )
    return "\n".join(lines)
