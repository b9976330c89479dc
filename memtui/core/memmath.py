"""The static memory of training, by arithmetic: parameters, gradients, master copy, optimizer states.

Shared by ``memtui estimate`` (before the run) and the hook's live breakdown
(``memtui.hooks.memory``), so both count the same way. Pure Python: no torch import.

What is counted, and why (torch 2.x behaviour, checked by tests/test_estimate.py on real tensors):

- **parameters**: every parameter tensor, ``numel x itemsize`` of its dtype.
- **gradients**: one per trainable parameter, in the parameter's dtype (``param.grad`` always
  matches the parameter's dtype) unless ``grad_dtype`` says otherwise (fp32 gradient
  accumulation: Megatron's ``main_grad``, DeepSpeed's ``grad_accum_dtype``). Frozen parameters
  (``requires_grad=False``) have none.
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

- **ZeRO** over ``world_size`` ranks, counted one of two ways (``zero_count``):

  - ``paper`` (Rajbhandari et al. 2020): stage 1 shards the optimizer states and the master
    copy, stage 2 also the gradients, stage 3 also the parameters (each rank holds
    ``ceil(bytes / N)``).
  - ``deepspeed``: as DeepSpeed's ``estimate_zero2_model_states_mem_needs`` and
    ``estimate_zero3_model_states_mem_needs`` count it (no offload), for 16-bit parameters with
    an fp32 master copy: ZeRO-1/2 ``4 P + 16 P / N`` (16-bit parameters and gradients whole;
    master copy, two Adam moments and an fp32 gradient partition sharded), ZeRO-3
    ``4 L + 18 P / N`` (L: the largest layer's parameters, gathered with its gradients; the
    16-bit parameter shard, master copy, moments and fp32 gradient partition sharded).

  Neither counts DeepSpeed's reduce / all-gather buckets or ZeRO-3's prefetch buffers.
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
    zero_buffers: tuple[StateBytes, ...] = ()
    """DeepSpeed's own ZeRO buffers (fp32 gradient partition, gathered layer), where counted."""

    @property
    def optimizer_bytes(self) -> int:
        """All optimizer states together (the master copy not included)."""
        return sum(state.bytes for state in self.states)

    @property
    def total(self) -> int:
        """Every static part together."""
        zero = sum(buffer.bytes for buffer in self.zero_buffers)
        return self.parameters + self.gradients + self.master + self.optimizer_bytes + zero


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


ZERO_COUNTS = ("deepspeed", "paper")
"""How ZeRO's per-rank memory is counted: as DeepSpeed's estimator does, or as the paper does."""

ZERO_LEFT_OUT = "left out: DeepSpeed's reduce / all-gather buckets and ZeRO-3 prefetch buffers"


def _zero_note(stage: int, world_size: int, count: str) -> str:
    """What a ZeRO stage shards and keeps, and what is left out, in one line."""
    if count == "deepspeed":
        formula = "4 L + 18 P / N" if stage == 3 else "4 P + 16 P / N"
        estimator = f"estimate_zero{3 if stage == 3 else 2}_model_states_mem_needs"
        kept = (
            "the largest layer's 16-bit parameters and gradients gathered (4 L); the 16-bit "
            "parameter shard, fp32 master copy, Adam moments and fp32 gradient partition sharded"
            if stage == 3
            else "16-bit parameters and gradients whole (4 P); fp32 master copy, Adam moments "
            "and an fp32 gradient partition sharded (16 P / N)"
        )
        first = (
            "DeepSpeed documents no ZeRO-1 estimator: counted as ZeRO-2's; " if stage == 1 else ""
        )
        return (
            f"ZeRO-{stage} over {world_size} ranks as DeepSpeed's {estimator} counts it "
            f"(no offload, {formula}): {first}{kept}; {ZERO_LEFT_OUT}"
        )
    sharded = {
        1: "optimizer states and master copy sharded",
        2: "optimizer states, master copy and gradients sharded",
        3: "optimizer states, master copy, gradients and parameters sharded",
    }[stage]
    return (
        f"ZeRO-{stage} over {world_size} ranks as the ZeRO paper counts it: {sharded}; "
        f"{ZERO_LEFT_OUT}, and DeepSpeed's fp32 gradient partition "
        + ("and gathered largest layer" if stage == 3 else "and whole 16-bit gradients")
        + " (--zero-count deepspeed counts them)"
    )


def static_estimate(
    tensors: Sequence[TensorSpec],
    optimizer: str,
    master_weights: bool = False,
    zero_stage: int = 0,
    world_size: int = 1,
    step_on_device: bool = False,
    grad_dtype: str | None = None,
    zero_count: str = "paper",
    largest_layer: int = 0,
) -> StaticEstimate:
    """Parameters, gradients, master copy and optimizer states of one rank."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {zero_stage}")
    if world_size < 1:
        raise ValueError("world size must be at least 1")
    if zero_count not in ZERO_COUNTS:
        raise ValueError(f"ZeRO count is one of {', '.join(ZERO_COUNTS)}, not {zero_count!r}")
    trainable = [t for t in tensors if t.trainable]
    by_dtype: dict[str, dict[str, int]] = {}

    def add(part: str, dtype: str, size: int) -> None:
        if size:
            sizes = by_dtype.setdefault(part, {})
            sizes[dtype] = sizes.get(dtype, 0) + size

    def grad_bytes(t: TensorSpec) -> int:
        return t.numel * itemsize(grad_dtype) if grad_dtype else t.nbytes

    for t in tensors:
        add("parameters", dtype_name(t.dtype), t.nbytes)
    for t in trainable:
        add("gradients", dtype_name(grad_dtype or t.dtype), grad_bytes(t))
    parameters = sum(t.nbytes for t in tensors)
    gradients = sum(grad_bytes(t) for t in trainable)
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
    deepspeed = zero_stage > 0 and zero_count == "deepspeed"
    if deepspeed and not master_weights:
        deepspeed = False
        notes.append(
            "DeepSpeed's ZeRO estimator assumes 16-bit parameters with an fp32 master copy "
            "(--mixed-precision master): counted as the ZeRO paper does"
        )
    if zero_stage:
        notes.append(_zero_note(zero_stage, world_size, "deepspeed" if deepspeed else "paper"))
    if master_weights:
        notes.append("16-bit parameters with an fp32 master copy: optimizer states are fp32")
    if grad_dtype:
        notes.append(f"gradients kept in {dtype_name(grad_dtype)} (--grad-dtype)")
    zero_buffers: tuple[StateBytes, ...] = ()
    if deepspeed:
        numel = sum(t.numel for t in trainable)
        partition = StateBytes(
            "fp32 grads",
            _shard(4 * numel, ranks),
            "float32",
            "DeepSpeed's fp32 gradients of this rank's partition",
        )
        if zero_stage == 3:
            width = max((itemsize(t.dtype) for t in tensors), default=2)
            gathered = StateBytes(
                "gathered layer",
                2 * width * largest_layer,
                "/".join(sorted({dtype_name(t.dtype) for t in tensors})) or "-",
                f"largest layer's parameters + gradients ({largest_layer:,} parameters)",
            )
            zero_buffers = (partition, gathered)
        else:
            zero_buffers = (partition,)
    shard_params = zero_stage >= 3
    shard_grads = zero_stage >= 2 and not deepspeed
    return StaticEstimate(
        parameters=_shard(parameters, ranks) if shard_params else parameters,
        gradients=0
        if deepspeed and zero_stage == 3
        else (_shard(gradients, ranks) if shard_grads else gradients),
        master=_shard(master, ranks),
        states=tuple(replace(s, bytes=_shard(s.bytes, ranks)) for s in states),
        total_params=sum(t.numel for t in tensors),
        trainable_params=sum(t.numel for t in trainable),
        optimizer=optimizer,
        notes=tuple(notes),
        by_dtype=by_dtype,
        zero_buffers=zero_buffers,
    )


# ------------------------------------------------------------------------- overhead and fit

CUDA_CONTEXT_BYTES = 512 * 2**20
"""The CUDA context and kernels loaded by torch: 300-600 MiB on recent drivers with lazy
module loading (more with cuDNN/NCCL initialised); 512 MiB is charged."""
ALLOCATOR_SLACK = 0.10
"""The caching allocator's rounding and fragmentation, charged as 10% of the activations (the
part whose block sizes change from step to step)."""


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


@dataclass(frozen=True)
class ModelShape:
    """A real model family's published shape: layers, hidden size, heads, FFN width, vocabulary."""

    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int

    @property
    def largest_layer(self) -> int:
        """Parameters of the largest single module (the embedding or an FFN projection)."""
        return max(self.vocab * self.hidden, self.ffn * self.hidden)


MODEL_SHAPES = (
    # GPT-3 (Brown et al. 2020, table 2.1): FFN 4h, vocabulary 50257; nominal parameter counts
    ModelShape("GPT-3 Small", 125_000_000, 12, 768, 12, 3072, 50257),
    ModelShape("GPT-3 Medium", 350_000_000, 24, 1024, 16, 4096, 50257),
    ModelShape("GPT-3 Large", 760_000_000, 24, 1536, 16, 6144, 50257),
    ModelShape("GPT-3 XL", 1_300_000_000, 24, 2048, 24, 8192, 50257),
    ModelShape("GPT-3 2.7B", 2_700_000_000, 32, 2560, 32, 10240, 50257),
    ModelShape("GPT-3 6.7B", 6_700_000_000, 32, 4096, 32, 16384, 50257),
    ModelShape("GPT-3 13B", 13_000_000_000, 40, 5140, 40, 20560, 50257),
    ModelShape("GPT-3 175B", 175_000_000_000, 96, 12288, 96, 49152, 50257),
    # Llama 2 (Touvron et al. 2023; the Hugging Face configs): SwiGLU FFN, vocabulary 32000
    ModelShape("Llama-2-7B", 6_738_415_616, 32, 4096, 32, 11008, 32000),
    ModelShape("Llama-2-13B", 13_015_864_320, 40, 5120, 40, 13824, 32000),
    ModelShape("Llama-2-70B", 68_976_648_192, 80, 8192, 64, 28672, 32000),
)
"""The real configurations a bare parameter count is given the shape of (the nearest one)."""


def nearest_shape(params: int) -> ModelShape:
    """The real model whose parameter count is nearest ``params`` (by ratio)."""
    return min(MODEL_SHAPES, key=lambda shape: abs(math.log(max(params, 1) / shape.params)))


ATTENTION_KINDS = ("sdpa", "flash", "eager")
"""How the run computes attention (``memtui estimate --attention``)."""


@dataclass(frozen=True)
class FormulaActivations:
    """Activations from the Korthikanti et al. (2022) formula, per sample, for one attention kind."""

    per_sample: int
    layers: int
    hidden: int
    heads: int
    explanation: str


def korthikanti_bytes(seq_len: int, hidden: int, layers: int, heads: int, eager: bool) -> int:
    """``s h L (34 + 5 a s / h)`` bytes (eager), ``34 s h L`` (fused / flash), at 16-bit, b = 1."""
    scores = 5 * heads * seq_len / hidden if eager else 0
    return int(seq_len * hidden * layers * (34 + scores))


def formula_activations(
    params: int,
    seq_len: int,
    activation_bytes: int = 2,
    attention: str = "sdpa",
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
) -> FormulaActivations:
    """Per-sample activations of a transformer by Korthikanti et al. (2022), eq. 2 and 3.

    Eager attention keeps the ``a s^2`` scores, softmax and dropout (``34 + 5 a s / h``);
    flash and SDPA's fused kernels keep none of them (the ``34`` term, as the paper's selective
    recomputation). Scaled by ``activation_bytes / 2`` for fp32 activations. Shapes not given
    come from the nearest real model (``MODEL_SHAPES``). Not modelled: the logits over the
    vocabulary, gradient checkpointing, tensor/sequence parallelism.
    """
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention is one of {', '.join(ATTENTION_KINDS)}, not {attention!r}")
    shape = nearest_shape(params)
    guessed = not (layers and hidden)
    layers = layers or shape.layers
    hidden = hidden or shape.hidden
    heads = heads or (shape.heads if guessed else max(1, hidden // 128))
    eager = attention == "eager"
    per_sample = korthikanti_bytes(seq_len, hidden, layers, heads, eager) * activation_bytes // 2
    source = f"the shape of {shape.name} ({shape.params:,} parameters), " if guessed else ""
    explanation = (
        f"formula s*h*L*(34{' + 5*a*s/h' if eager else ''}) bytes (Korthikanti et al. 2022, "
        f"{attention} attention) with {source}L={layers}, h={hidden}, a={heads}, s={seq_len}"
    )
    return FormulaActivations(per_sample, layers, hidden, heads, explanation)
