"""The static memory of training, by arithmetic: parameters, gradients, master copy, optimizer states.

Shared by ``memtui estimate`` (before the run) and the hook's live breakdown
(``memtui.hooks.memory``), so both count the same way. Pure Python: no torch import.

What is counted, and why (torch 2.x behaviour, checked by tests/test_estimate.py on real tensors):

- **parameters**: every parameter tensor, ``numel x itemsize`` of its dtype.
- **gradients**: one per trainable parameter, in the parameter's dtype (``param.grad`` always
  matches the parameter's dtype). Frozen parameters (``requires_grad=False``) have none.
- **master copy** (``master_weights=True``, the DeepSpeed / Megatron / apex-O2 recipe with
  16-bit parameters): an fp32 copy of every trainable parameter, 4 bytes each, and the optimizer
  states live on that copy, so they are fp32 too. torch's ``autocast`` (AMP) does not do this:
  under AMP the parameters themselves are fp32 and there is no extra copy.
- **optimizer states**, per state, per trainable parameter:

  - ``sgd``: none. ``sgd-momentum``: ``momentum_buffer``, a clone of the gradient (param dtype).
  - ``adam`` / ``adamw``: ``exp_avg`` and ``exp_avg_sq``, made by ``torch.zeros_like(param)``,
    so in the parameter's dtype (bf16 parameters get bf16 moments in plain torch; fp32 on a
    master copy), plus ``step``, one fp32 scalar per parameter tensor that lives on the host
    unless the optimizer is fused or capturable (counted only when ``step_on_device``).
  - ``adam8bit`` (bitsandbytes, block-wise): ``state1`` and ``state2`` as uint8 (1 byte per
    element each) plus ``absmax1`` and ``absmax2``, one fp32 per 256-element block each; tensors
    under 4,096 elements keep fp32 states (8 bytes per element). The two 256-entry quantisation
    maps are shared by all tensors (2 KiB) and not counted.

- **ZeRO** over ``world_size`` ranks: stage 1 shards the optimizer states and the master copy,
  stage 2 also the gradients, stage 3 also the parameters (each rank holds ``ceil(bytes / N)``;
  DeepSpeed's bucket padding and communication buffers are not counted).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
}
"""Bytes per element of the dtypes parameters come in (torch's names without ``torch.``)."""

DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp64": "float64",
    "double": "float64",
}

OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adam8bit")
"""The optimizer kinds ``memtui estimate`` takes."""

TORCH_OPTIMIZER_STATES: dict[str, tuple[str, ...]] = {
    "Adam": ("exp_avg", "exp_avg_sq"),
    "AdamW": ("exp_avg", "exp_avg_sq"),
    "NAdam": ("exp_avg", "exp_avg_sq"),
    "RAdam": ("exp_avg", "exp_avg_sq"),
    "Adamax": ("exp_avg", "exp_inf"),
    "Adagrad": ("sum",),
    "RMSprop": ("square_avg",),
}
"""Per-element states (in the parameter's dtype) of torch optimizers other than SGD."""

BNB_BLOCK = 256
"""bitsandbytes' block size for block-wise 8-bit optimizer states."""
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps fp32 states for tensors with fewer elements than this."""


def dtype_name(dtype: object) -> str:
    """A dtype's canonical name: ``torch.bfloat16``, ``"bf16"`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.").lower()
    return DTYPE_ALIASES.get(name, name)


def itemsize(dtype: object) -> int:
    """Bytes per element of ``dtype``; ValueError for an unknown dtype."""
    name = dtype_name(dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (try float32, bfloat16 or float16)")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor: its name, size, dtype and whether it is trained."""

    name: str
    numel: int
    dtype: str = "float32"
    trainable: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes the tensor holds."""
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer LoRA can wrap: its module name, input and output features, weight dtype."""

    name: str
    in_features: int
    out_features: int
    dtype: str = "float32"


@dataclass(frozen=True)
class StateBytes:
    """One optimizer state (``exp_avg``, ``momentum_buffer``, ...) summed over the parameters."""

    name: str
    bytes: int
    dtype: str
    note: str = ""


@dataclass(frozen=True)
class StaticEstimate:
    """Parameters, gradients, master copy and optimizer states in bytes (per rank under ZeRO)."""

    parameters: int
    gradients: int
    master: int
    states: tuple[StateBytes, ...]
    total_params: int
    trainable_params: int
    optimizer: str
    notes: tuple[str, ...] = ()
    by_dtype: dict[str, dict[str, int]] = field(default_factory=dict)
    """Part (parameters, gradients, master, optimizer) to dtype to bytes (before sharding)."""

    @property
    def optimizer_bytes(self) -> int:
        """All optimizer states together (the master copy not included)."""
        return sum(state.bytes for state in self.states)

    @property
    def total(self) -> int:
        """Every static part together."""
        return self.parameters + self.gradients + self.master + self.optimizer_bytes


def parse_count(text: str | int | float) -> int:
    """``"7B"``, ``"110M"``, ``"1.3e9"``, ``"350k"`` -> a parameter count."""
    if isinstance(text, int | float):
        return int(text)
    cleaned = text.strip().replace(",", "").replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    suffix = cleaned[-1:].lower()
    try:
        if suffix in scale:
            return round(float(cleaned[:-1]) * scale[suffix])
        return round(float(cleaned))
    except ValueError:
        raise ValueError(f"not a parameter count: {text!r} (try 7B, 110M or 1.3e9)") from None


def uniform_tensors(count: int, dtype: str, tensors: int = 1) -> list[TensorSpec]:
    """``count`` parameters of one dtype, all trained, split over ``tensors`` tensors."""
    per, rest = divmod(count, max(tensors, 1))
    return [
        TensorSpec(f"param{i}", per + (1 if i < rest else 0), dtype_name(dtype))
        for i in range(max(tensors, 1))
    ]


def frozen_by(name: str, patterns: Sequence[str]) -> bool:
    """Whether a parameter name matches a glob pattern (``encoder.*``) or a dotted prefix."""
    return any(
        fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern.rstrip(".") + ".")
        for pattern in patterns
    )


def freeze(tensors: Iterable[TensorSpec], patterns: Sequence[str]) -> list[TensorSpec]:
    """The tensors, with those whose name matches a pattern frozen."""
    return [replace(t, trainable=False) if frozen_by(t.name, patterns) else t for t in tensors]


def lora_targets(linears: Iterable[LinearSpec], modules: Sequence[str]) -> list[LinearSpec]:
    """The linear layers LoRA wraps: names equal to or ending in ``.<module>`` (as peft matches)."""
    return [
        linear
        for linear in linears
        if any(linear.name == m or linear.name.endswith("." + m) for m in modules)
    ]


def with_lora(
    tensors: Iterable[TensorSpec],
    targets: Iterable[LinearSpec],
    rank: int,
    dtype: str = "float32",
) -> list[TensorSpec]:
    """Every base tensor frozen, plus trainable ``lora_A`` (r x in) and ``lora_B`` (out x r) per target.

    peft makes the adapters fp32 by default (``autocast_adapter_dtype=True`` upcasts 16-bit
    adapter weights), hence the ``float32`` default.
    """
    frozen = [replace(t, trainable=False) for t in tensors]
    adapters = []
    for linear in targets:
        adapters.append(TensorSpec(f"{linear.name}.lora_A", rank * linear.in_features, dtype))
        adapters.append(TensorSpec(f"{linear.name}.lora_B", linear.out_features * rank, dtype))
    return frozen + adapters


def torch_optimizer_kind(class_name: str, momentum: bool = False) -> str | None:
    """The kind for a torch optimizer class (``SGD`` with momentum -> ``sgd-momentum``), or None."""
    if class_name == "SGD":
        return "sgd-momentum" if momentum else "sgd"
    if class_name in {"Adam", "AdamW"}:
        return class_name.lower()
    if class_name in {"Adam8bit", "AdamW8bit", "PagedAdamW8bit", "PagedAdam8bit"}:
        return "adam8bit"
    if class_name in TORCH_OPTIMIZER_STATES:
        return class_name
    return None


def optimizer_states(
    trainable: Sequence[TensorSpec],
    optimizer: str,
    master_weights: bool = False,
    step_on_device: bool = False,
) -> list[StateBytes]:
    """Bytes of each optimizer state over the trainable tensors (unsharded)."""
    numel = sum(t.numel for t in trainable)
    states: list[StateBytes] = []

    def like_params(name: str) -> StateBytes:
        if master_weights:
            return StateBytes(name, numel * 4, "float32", "on the fp32 master copy")
        size = sum(t.nbytes for t in trainable)
        dtypes = sorted({dtype_name(t.dtype) for t in trainable}) or ["float32"]
        return StateBytes(name, size, "/".join(dtypes), "zeros_like(param): the param's dtype")

    if optimizer == "sgd":
        return []
    if optimizer == "sgd-momentum":
        return [like_params("momentum_buffer")]
    if optimizer in {"adam", "adamw"} or optimizer in TORCH_OPTIMIZER_STATES:
        names = TORCH_OPTIMIZER_STATES.get(optimizer, ("exp_avg", "exp_avg_sq"))
        states = [like_params(name) for name in names]
        if optimizer in {"adam", "adamw"}:
            count = len(trainable)
            note = "fp32 scalar per tensor" + ("" if step_on_device else ", on the host: 0 here")
            states.append(StateBytes("step", 4 * count if step_on_device else 0, "float32", note))
        return states
    if optimizer == "adam8bit":
        small = [t for t in trainable if t.numel < BNB_MIN_8BIT_SIZE]
        large = [t for t in trainable if t.numel >= BNB_MIN_8BIT_SIZE]
        large_numel = sum(t.numel for t in large)
        blocks = sum(math.ceil(t.numel / BNB_BLOCK) for t in large)
        small_numel = sum(t.numel for t in small)
        for i in (1, 2):
            states.append(StateBytes(f"state{i}", large_numel, "uint8", "8-bit, block-wise"))
            states.append(
                StateBytes(f"absmax{i}", 4 * blocks, "float32", f"one per {BNB_BLOCK} elements")
            )
        if small_numel:
            states.append(
                StateBytes(
                    "state1+state2 (small tensors)",
                    8 * small_numel,
                    "float32",
                    f"tensors under {BNB_MIN_8BIT_SIZE} elements stay 32-bit",
                )
            )
        return states
    raise ValueError(f"unknown optimizer {optimizer!r} (one of {', '.join(OPTIMIZERS)})")


def _shard(size: int, ranks: int) -> int:
    return -(-size // ranks) if ranks > 1 else size


def static_estimate(
    tensors: Sequence[TensorSpec],
    optimizer: str,
    master_weights: bool = False,
    zero_stage: int = 0,
    world_size: int = 1,
    step_on_device: bool = False,
) -> StaticEstimate:
    """Parameters, gradients, master copy and optimizer states of one rank."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {zero_stage}")
    if world_size < 1:
        raise ValueError("world size must be at least 1")
    trainable = [t for t in tensors if t.trainable]
    by_dtype: dict[str, dict[str, int]] = {}

    def add(part: str, dtype: str, size: int) -> None:
        if size:
            sizes = by_dtype.setdefault(part, {})
            sizes[dtype] = sizes.get(dtype, 0) + size

    for t in tensors:
        add("parameters", dtype_name(t.dtype), t.nbytes)
    for t in trainable:
        add("gradients", dtype_name(t.dtype), t.nbytes)
    parameters = sum(t.nbytes for t in tensors)
    gradients = sum(t.nbytes for t in trainable)
    master = 4 * sum(t.numel for t in trainable) if master_weights else 0
    add("master", "float32", master)
    states = optimizer_states(trainable, optimizer, master_weights, step_on_device)
    for state in states:
        if "/" in state.dtype:  # like mixed-dtype params: each tensor's own dtype
            for t in trainable:
                add("optimizer", dtype_name(t.dtype), t.nbytes)
        else:
            add("optimizer", state.dtype, state.bytes)
    notes = []
    ranks = world_size if zero_stage else 1
    if zero_stage:
        notes.append(
            f"ZeRO-{zero_stage} over {world_size} ranks: "
            + {
                1: "optimizer states and master copy sharded",
                2: "optimizer states, master copy and gradients sharded",
                3: "optimizer states, master copy, gradients and parameters sharded",
            }[zero_stage]
        )
    if master_weights:
        notes.append("16-bit parameters with an fp32 master copy: optimizer states are fp32")
    return StaticEstimate(
        parameters=_shard(parameters, ranks) if zero_stage >= 3 else parameters,
        gradients=_shard(gradients, ranks) if zero_stage >= 2 else gradients,
        master=_shard(master, ranks),
        states=tuple(replace(s, bytes=_shard(s.bytes, ranks)) for s in states),
        total_params=sum(t.numel for t in tensors),
        trainable_params=sum(t.numel for t in trainable),
        optimizer=optimizer,
        notes=tuple(notes),
        by_dtype=by_dtype,
    )


# ------------------------------------------------------------------------- overhead and fit

CUDA_CONTEXT_BYTES = 512 * 2**20
"""The CUDA context and kernels loaded by torch: 300-600 MiB on recent drivers with lazy
module loading (more with cuDNN/NCCL initialised); 512 MiB is charged."""
ALLOCATOR_SLACK = 0.10
"""The caching allocator's rounding and fragmentation, charged as 10% of the activations (the
part whose block sizes change from step to step)."""
"""Under 85% of the card is safe (seed 004's bands: 85-90% edge, over 90% danger)."""


def overhead_bytes(activation_bytes: int) -> int:
    """CUDA context plus allocator slack for a step with ``activation_bytes`` of activations."""
    return CUDA_CONTEXT_BYTES + int(ALLOCATOR_SLACK * activation_bytes)


def total_bytes(static_total: int, fixed_activations: int, per_sample: float, batch: int) -> int:
    """The peak for micro-batch ``batch``: static parts, activations and overhead."""
    activations = int(fixed_activations + per_sample * batch)
    return static_total + activations + overhead_bytes(activations)


def largest_batch(
    static_total: int,
    fixed_activations: int,
    per_sample: float,
    capacity: int,
    band: float,
) -> int:
    """The largest micro-batch whose peak stays under ``band`` of ``capacity`` (0: none fits)."""
    budget = band * capacity
    if per_sample <= 0:
        return 0
    if total_bytes(static_total, fixed_activations, per_sample, 1) > budget:
        return 0
    headroom = budget - static_total - CUDA_CONTEXT_BYTES
    batch = int((headroom / (1 + ALLOCATOR_SLACK) - fixed_activations) / per_sample)
    while batch > 1 and total_bytes(static_total, fixed_activations, per_sample, batch) > budget:
        batch -= 1
    while total_bytes(static_total, fixed_activations, per_sample, batch + 1) <= budget:
        batch += 1
    return max(batch, 1)


# ------------------------------------------------------------------- activations by formula


def transformer_shape(params: int) -> tuple[int, int]:
    """(layers, hidden) of a standard decoder with ``params`` parameters (~12 L h^2, h = 128 L)."""
    layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    hidden = max(64, int(math.sqrt(params / (12 * layers))))
    return layers, hidden


@dataclass(frozen=True)
class FormulaActivations:
    """Activations from the Korthikanti et al. (2022) formula, as a low-high range per sample."""

    per_sample_low: int
    per_sample_high: int
    layers: int
    hidden: int
    heads: int
    explanation: str


def formula_activations(
    params: int,
    seq_len: int,
    activation_bytes: int = 2,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
) -> FormulaActivations:
    """Per-sample activations of a transformer: ``s h L (34 + 5 a s / h)`` bytes at 16-bit.

    Low: fused/flash attention (no ``a s^2`` score matrices kept, the 34 term only). High:
    eager attention (scores and softmax kept). Scaled by ``activation_bytes / 2`` for fp32
    activations. Not modelled: the logits over a large vocabulary (``s V`` per sample, often
    the single largest tensor), gradient checkpointing, tensor/sequence parallelism.
    """
    guessed_layers, guessed_hidden = transformer_shape(params)
    layers = layers or guessed_layers
    hidden = hidden or guessed_hidden
    heads = heads or max(1, hidden // 128)
    scale = activation_bytes / 2
    low = seq_len * hidden * layers * 34 * scale
    high = seq_len * hidden * layers * (34 + 5 * heads * seq_len / hidden) * scale
    explanation = (
        f"formula s*h*L*(34 + 5*a*s/h) bytes (Korthikanti et al. 2022) with L={layers}, "
        f"h={hidden}, a={heads}, s={seq_len}; low = flash attention, high = eager attention"
    )
    return FormulaActivations(int(low), int(high), layers, hidden, heads, explanation)
