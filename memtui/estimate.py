"""``memtui estimate``: the memory a training job will need, by part, before it runs.

Static parts come from ``memtui.memmath`` (the arithmetic the live breakdown uses too).
Activations are measured when the model can be built: a forward and backward at two small
micro-batches, counting the bytes autograd keeps for backward (deduplicated by storage,
parameters excluded), extrapolated per sample. Small models run for real on the CPU; large ones
on torch's meta device (shapes only, nothing allocated, the same saved tensors). Without a
model, a documented formula gives a low-high range. torch is imported only inside functions.
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

from memtui import memmath
from memtui.advice.verdict import THRESHOLDS, Thresholds
from memtui.stats import format_bytes

REAL_LIMIT_BYTES = 2 * 2**30
"""Models with parameters up to this size are measured on the CPU for real; larger on meta."""
MEASURE_BATCHES = (1, 2)
"""The micro-batches the activations are measured at (the line through them is extrapolated)."""
MIXED_PRECISION = ("none", "amp", "master")


class EstimateError(Exception):
    """A user error in the estimate's inputs, with the message to show."""


@dataclass
class Activations:
    """Activations as ``fixed + per_sample x batch`` bytes, how they were found, and the range."""

    fixed: int
    per_sample: float
    method: str
    explanation: str
    per_sample_high: float | None = None
    measured: dict[int, int] = field(default_factory=dict)
    """Micro-batch to bytes autograd saved, where measured."""

    def at(self, batch: int, high: bool = False) -> int:
        """Bytes at micro-batch ``batch`` (the formula's high end with ``high``)."""
        per = self.per_sample_high if high and self.per_sample_high else self.per_sample
        return int(self.fixed + per * batch)


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


def _loss(output: Any, inputs: Any) -> Any:
    """A training loss from the output: its ``loss``, else cross-entropy on token ids, else MSE."""
    import torch

    if getattr(output, "loss", None) is not None:
        return output.loss
    if hasattr(output, "logits"):
        output = output.logits
    elif isinstance(output, tuple | list):
        output = output[0]
    tokens = inputs.get("input_ids") if isinstance(inputs, dict) else inputs
    if (
        isinstance(tokens, torch.Tensor)
        and not tokens.is_floating_point()
        and output.dim() == tokens.dim() + 1
    ):
        return torch.nn.functional.cross_entropy(
            output.float().flatten(0, -2), tokens.flatten(), reduction="mean"
        )
    return output.float().square().mean()


def saved_bytes(model: Any, batch: int, seq_len: int | None, autocast: Any = None) -> int:
    """Bytes autograd keeps for backward in one forward at ``batch`` (then runs the backward)."""
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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        output = model(**inputs) if isinstance(inputs, dict) else model(inputs)
        loss = _loss(output, inputs)
    total = sum(int(s.nbytes()) for s in kept.values())
    if loss.requires_grad:
        loss.backward()
    model.zero_grad(set_to_none=True)
    return total


def measure_activations(
    model: Any, seq_len: int | None, autocast: Any = None, batches: Sequence[int] = MEASURE_BATCHES
) -> Activations:
    """Activations measured at two micro-batches and extrapolated per sample."""
    device = next(model.parameters()).device
    measured = {b: saved_bytes(model, b, seq_len, autocast) for b in batches}
    first, second = batches[0], batches[-1]
    per_sample = (measured[second] - measured[first]) / (second - first)
    fixed = int(measured[first] - per_sample * first)
    where = "on the CPU" if device.type == "cpu" else "on the meta device (shapes only)"
    explanation = (
        f"measured {where}: bytes autograd keeps for backward at micro-batch "
        + ", ".join(f"{b} ({measured[b]:,} B)" for b in batches)
        + ", extrapolated per sample (CPU and meta attention keep the s x s scores, CUDA's "
        "flash attention does not: an upper bound for attention models)"
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

    def largest_batch(self, high: bool = False) -> int | None:
        """The largest micro-batch under the edge band of ``--gpu-memory`` (None without a card
        size)."""
        if not self.options.gpu_memory:
            return None
        per = self.activations.per_sample
        if high and self.activations.per_sample_high:
            per = self.activations.per_sample_high
        return memmath.largest_batch(
            self.static_total,
            self.activations.fixed,
            per,
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


def estimate(options: Options) -> Estimate:
    """Build (or count) the model, apply freezing / LoRA / ZeRO, and measure or model activations."""
    sources = [s for s in (options.params, options.model, options.hf_config) if s]
    if len(sources) != 1:
        raise EstimateError("give exactly one of --params, --model or --hf-config")
    if options.optimizer not in memmath.OPTIMIZERS:
        raise EstimateError(f"--optimizer is one of {', '.join(memmath.OPTIMIZERS)}")
    if options.batch_size < 1:
        raise EstimateError("--batch-size must be at least 1")
    param_dtype, master, autocast = _resolve_dtype(options)
    notes: list[str] = []
    if options.params:
        return _estimate_from_count(options, param_dtype, master, notes)

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
    static = memmath.static_estimate(
        specs, options.optimizer, master, options.zero_stage, options.world_size
    )
    buffers = buffer_bytes(meta_model)
    activations = None
    if options.measure:
        real = static.parameters + buffers <= REAL_LIMIT_BYTES
        try:
            model = build("cpu") if real else meta_model
            if options.lora_rank:
                apply_lora(model, options.lora_modules, options.lora_rank)
            activations = measure_activations(
                model, options.seq_len, _torch_dtype(autocast) if autocast else None
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
        raise EstimateError("activations by formula need --seq-len (tokens per sample)")
    activation_bytes = 2 if half_activations else memmath.itemsize(dtype)
    formula = memmath.formula_activations(
        params, options.seq_len, activation_bytes, options.layers, options.hidden, options.heads
    )
    explanation = (
        formula.explanation
        + "; uncertain: the range is the two attention kinds, frameworks add logits and "
        "dropout masks (+-30% beyond the range)"
    )
    return Activations(
        0,
        formula.per_sample_low,
        "formula",
        explanation,
        per_sample_high=formula.per_sample_high,
    )


def _estimate_from_count(
    options: Options, param_dtype: str, master: bool, notes: list[str]
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
    static = memmath.static_estimate(
        specs, options.optimizer, master, options.zero_stage, options.world_size
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
            f"one per trained parameter ({static.trainable_params:,}), the parameter's dtype",
        )
    )
    if static.master:
        out.append(("master copy", static.master, "float32", "fp32 copy of the trained params"))
    out.append(("optimizer", static.optimizer_bytes, "", static.optimizer))
    for state in static.states:
        out.append((f"  {state.name}", state.bytes, state.dtype, state.note))
    act = result.activations
    act_note = (
        f"micro-batch {result.options.batch_size}: {act.method}, "
        f"{act.per_sample / 2**20:,.1f} MiB per sample"
    )
    if act.per_sample_high:
        high = result.activations.at(result.options.batch_size, True)
        act_note += f" (up to {format_bytes(high)}, {_gb(high)})"
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
    out.append(("total", result.total, "", "predicted peak per GPU"))
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
        "parts": {
            "parameters": static.parameters,
            "buffers": result.buffers,
            "gradients": static.gradients,
            "master": static.master,
            "optimizer": static.optimizer_bytes,
            "activations": result.activation_bytes,
            "overhead": result.overhead,
        },
        "optimizer_states": [
            {"name": s.name, "bytes": s.bytes, "dtype": s.dtype, "note": s.note}
            for s in static.states
        ],
        "by_dtype": static.by_dtype,
        "activations": {
            "method": act.method,
            "fixed_bytes": act.fixed,
            "per_sample_bytes": act.per_sample,
            "per_sample_high_bytes": act.per_sample_high,
            "measured": {str(k): v for k, v in act.measured.items()},
            "explanation": act.explanation,
        },
        "overhead": {
            "cuda_context_bytes": memmath.CUDA_CONTEXT_BYTES,
            "allocator_slack": memmath.ALLOCATOR_SLACK,
        },
        "total_bytes": result.total,
        "notes": list(static.notes) + result.notes,
    }
    if result.options.gpu_memory:
        data["gpu_memory_bytes"] = result.options.gpu_memory
        data["safe_band"] = result.options.thresholds.memory_edge_fraction
        data["danger_band"] = result.options.thresholds.memory_danger_fraction
        data["fraction_of_gpu"] = result.total / result.options.gpu_memory
        data["largest_batch"] = result.largest_batch()
        if act.per_sample_high:
            data["largest_batch_high"] = result.largest_batch(high=True)
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
        lines.append(
            f"on a {format_bytes(opts.gpu_memory)} card: {share:.0%} ({band}); largest "
            f"micro-batch under {edge:.0%}: "
            + (str(largest) if largest else "none fits")
            + (
                f" ({result.largest_batch(high=True) or 'none'} at the formula's high end)"
                if result.activations.per_sample_high
                else ""
            )
        )
    return "\n".join(lines)
