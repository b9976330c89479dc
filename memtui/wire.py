"""Every message on memtui's wire: versioned msgspec Structs shared by the hook and its viewers.

Frames are msgpack. Every top-level message is a tagged Struct (field ``type``) that carries the
wire version ``v``; a decoder drops (and counts) anything that does not decode or comes from an
unknown major version, so a bad peer can never crash the hook or a viewer. Fields added later get
defaults, and unknown fields are ignored, so minor changes stay compatible both ways.
"""

from __future__ import annotations

import threading
from typing import Any, TypeAlias

import msgspec
from msgspec import Struct

WIRE_VERSION = 1
"""The major version of this schema; a peer speaking another major version is dropped."""

KnobValue: TypeAlias = int | bool
"""The value of one knob: an int (batch_size, grad_accum, num_workers) or a bool (pin_memory)."""


# --------------------------------------------------------------------------- telemetry parts


class StepRecord(Struct, array_like=True, frozen=True):
    """One optimizer step, as measured on the training thread."""

    step: int
    """The step's number: optimizer steps completed when it ended (1-based)."""
    end_time: float
    """Wall-clock time (``time.time()``) at the end of the step."""
    step_time_s: float
    """Wall time of the step, checkpoint saves excluded."""
    data_wait_s: float
    """Time the step spent waiting for the data loader, summed over its micro-batches."""
    samples: int
    """Samples in the step (micro-batch size times micro-batches)."""
    micro_batches: int
    """Micro-batches fetched in the step (the accumulation actually run)."""
    flags: int = 0
    """Bit set of ``STEP_*`` flags."""


STEP_AFTER_CHECKPOINT = 1
"""Flag: the step is the first after a checkpoint boundary."""
STEP_LOADER_REBUILT = 2
"""Flag: the data loader was rebuilt during the step (its wait includes worker start-up)."""


class GpuProcess(Struct, frozen=True):
    """A process holding memory on the same GPU, as NVML reports it."""

    pid: int
    name: str
    used_bytes: int


class DeviceSample(Struct, frozen=True, omit_defaults=True):
    """The training device's memory at one moment (on CPU runs the host is the device).

    On CUDA, ``allocated``/``reserved`` are the torch caching allocator's and the peaks are the
    allocator's peak counters: since the hook's last applied change or rollback (or the
    training's own reset), or since the previous sample where ``MEMTUI_RESET_PEAKS=1``. On CPU, ``allocated`` and ``reserved``
    are the RSS of the process tree (main process plus loader workers) and the peak is the main
    process's RSS high-water mark since the previous sample plus the workers' RSS.
    """

    time: float
    step: int
    kind: str
    """``"cuda"`` or ``"cpu"``."""
    index: int = 0
    name: str = ""
    capacity_bytes: int = 0
    """Device memory (CUDA) or the memory limit (CPU: cgroup limit if set, else total RAM)."""
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    inactive_split_bytes: int = 0
    """Reserved but unallocated bytes in split blocks: the allocator's fragmentation."""
    alloc_retries: int = 0
    """Allocations that had to free the cache and retry (cumulative)."""
    ooms: int = 0
    """Out-of-memory errors the allocator raised (cumulative)."""
    nvml_used_bytes: int | None = None
    """Memory NVML sees used on the device: every process, the CUDA context included."""
    nvml_total_bytes: int | None = None
    utilization_pct: float | None = None
    other_processes: list[GpuProcess] = []


class HostSample(Struct, frozen=True, omit_defaults=True):
    """The host's memory at one moment, and what the training's process tree holds of it."""

    time: float
    ram_total_bytes: int
    ram_available_bytes: int
    ram_used_bytes: int
    swap_total_bytes: int = 0
    swap_used_bytes: int = 0
    limit_bytes: int = 0
    """The memory limit that applies to the run: its cgroup's limit if set, else total RAM."""
    main_rss_bytes: int = 0
    workers: int = 0
    """Live descendants of the training process (its data-loader workers); the job's other
    ranks among them, and their own descendants, are left out."""
    workers_rss_bytes: int = 0
    """RSS summed over the workers (counts pages shared with the main process again)."""
    workers_uss_bytes: int | None = None
    """Memory unique to the workers (USS), sampled less often; None until first measured."""
    cpu_percent: float | None = None
    """CPU used by the process tree since the previous sample, in percent of one core."""


class CheckpointRecord(Struct, array_like=True, frozen=True):
    """A checkpoint boundary the loop reached."""

    step: int
    time: float
    """When the boundary took the pending changes (later ones wait for the next boundary)."""
    save_s: float
    """Time between the end of the step and the boundary call (the loop's own save)."""


# --------------------------------------------------------------------------- config and changes


class Knobs(Struct, omit_defaults=True, frozen=True):
    """The five knobs memtui can change; None means the run does not expose that knob."""

    batch_size: int | None = None
    grad_accum: int | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    """Batches each loader worker loads ahead (used only with ``num_workers > 0``)."""


class KnobDiff(Struct, array_like=True, frozen=True):
    """One knob's value before and after a change."""

    old: KnobValue | None
    new: KnobValue


class PendingChange(Struct, omit_defaults=True):
    """A change queued by a client, waiting for the next checkpoint boundary."""

    id: int
    changes: dict[str, KnobValue]
    """The values it sets, keep-effective-batch arithmetic already resolved."""
    requested: dict[str, KnobValue]
    """What the client asked for."""
    queued_time: float
    queued_step: int
    keep_effective_batch: bool = False
    client: str = ""
    note: str = ""
    predicted_peak_bytes: int | None = None
    """The device peak the memory model predicts with this change (None: no model yet)."""
    forced: bool = False
    """Queued although predicted over the danger band (``--force`` or a confirmation)."""
    origin: str = ""
    """Who queued it: "" an operator, "autopilot" the hook's own autopilot."""
    lr_scale: str = ""
    """How the LR follows if it changes the effective batch: linear, sqrt or none ('': none)."""
    lr_factor: float | None = None
    """The LR factor rank 0 decided for the whole boundary (None: the LR stays)."""


class Effect(Struct, omit_defaults=True):
    """What an applied change did: the steps before it against the steps after it."""

    steps_before: int
    steps_after: int
    samples_per_s_before: float
    samples_per_s_after: float
    step_time_s_before: float
    step_time_s_after: float
    data_wait_s_before: float
    data_wait_s_after: float
    peak_bytes_before: int | None = None
    peak_bytes_after: int | None = None
    speedup_margin: float | None = None
    """Half-width of the 95% interval of the relative change of samples/s toward its farther end
    (None: too few steps)."""
    step_time_margin_s: float | None = None
    """Half-width of the 95% interval of the change of the mean step time."""
    data_wait_margin_s: float | None = None
    """Half-width of the 95% interval of the change of the mean data wait per step."""
    warmup_steps: int | None = None
    """Steps right after the change left out of the steps compared (None: an older hook)."""
    warmup_why: str = ""
    """Why those steps were left out, in words (settling; the rebuilt loader's warm-up)."""
    speedup_low: float | None = None
    """The low end of the 95% interval of the relative change of samples/s (None: an older
    hook's, whose interval is the change plus and minus ``speedup_margin``)."""
    speedup_high: float | None = None
    """Its high end: the interval is on the ratio of the speeds, so not symmetric
    (``speedup_margin`` is then its half-width toward the farther end)."""
    speed_drift: float | None = None
    """How much the run's speed moved at an unchanged config between windows a few hundred steps
    apart (95%, relative), counted in the interval (None: not measured yet)."""


class AppliedChange(Struct, omit_defaults=True):
    """Changes applied together at one checkpoint boundary."""

    ids: list[int]
    step: int
    """The step after which the change took effect: the checkpoint boundary's step."""
    time: float
    changes: dict[str, KnobDiff]
    note: str = ""
    predicted_peak_bytes: int | None = None
    """The peak the memory model predicted for the new config when it was applied."""
    observed_peak_bytes: int | None = None
    """The peak measured over the steps after the change (set once they have run)."""
    effect: Effect | None = None
    """Measured effect, once enough steps ran after the change."""
    rollback: bool = False
    """True for a rollback after an out-of-memory error (it reverts an earlier change)."""
    predicted_speed_delta: float | None = None
    """The change of samples/s predicted from the steps before it (None: no estimate)."""
    speed_note: str = ""
    """How that speed was predicted, or why it could not be ('': not predicted yet)."""
    origin: str = ""
    """Who asked for it: "" an operator, "autopilot" when every change in it was the autopilot's."""
    lr_factor: float | None = None
    """What every optimizer's LR (and its scheduler's base LRs) was multiplied by (None: kept)."""
    lr_note: str = ""
    """The LR change in words (``lr x2.0 (linear)``), or a warning that it did not follow."""
    effect_note: str = ""
    """What the change could not do on this run, in words (``pin_memory does nothing without an
    accelerator: its effect is not measured``); a change none of whose knobs can act here is
    never measured, and ``effect`` stays None."""


class ModelPoint(Struct, array_like=True, frozen=True):
    """One observed (micro-batch, peak) point of the memory model."""

    batch_size: int
    peak_bytes: int
    """Peak allocated (CUDA: torch allocator; CPU: process-tree memory) at that micro-batch."""
    samples: int
    """Device samples the peak was taken over."""
    noise_bytes: int = 0
    """How much the peak readings at that micro-batch spread (0: not measured; a floor applies)."""


class MemoryModel(Struct, omit_defaults=True):
    """Peak device memory as a function of the micro-batch: steady + per_sample x batch.

    The predicted device total adds the allocator's reserve overhead (reserved over allocated at
    peak: fragmentation) and what the device holds beyond torch (CUDA context, NCCL, other
    processes). See ``memtui.advice.predict``.
    """

    kind: str
    batch_size: int
    """The micro-batch the run has now."""
    capacity_bytes: int
    steady_bytes: int
    """Memory that does not grow with the batch: parameters, gradients, optimizer state, runtime."""
    per_sample_bytes: float
    """Activations and temporaries per sample of the micro-batch."""
    overhead_ratio: float = 1.0
    """Peak reserved over peak allocated (>= 1): the allocator's fragmentation overhead."""
    beyond_bytes: int = 0
    """Device memory outside torch's reserve (CUDA context, NCCL, other processes)."""
    points: list[ModelPoint] = []
    fit_error: float | None = None
    """RMS relative error of the fit over its points (None with a single point)."""
    basis: str = ""
    """How the model was made, in words (what it assumes)."""
    workers: int | None = None
    """Loader workers when the model was fitted (None: the run has no ``num_workers`` knob)."""
    per_worker_bytes: int = 0
    """Measured memory of one loader worker of its own (USS; 0: not measured)."""
    returns_freed: bool = False
    """A CPU run whose freed large blocks go back at once (the stand-in fixed glibc's mmap
    threshold): after a decrease it keeps nothing, and its peaks there count in the fit."""
    per_sample_bound_bytes: float = 0.0
    """Where the optimizer's step, not the micro-batch, may have set the peaks, the most
    per-sample memory they allow (the peak over what stays between steps, over the micro-batch):
    the batch's own growth is hidden under the step's, and the interval's high end grows by up to
    this per sample, from the one micro-batch seen, or past the largest of a line the step kept
    flat (0: by ``per_sample_bytes``'s spread only)."""


class StaticMemory(Struct, omit_defaults=True):
    """Memory computed exactly from the model's and optimizer's tensors (bytes, by dtype)."""

    kind: str
    parameters_bytes: int = 0
    gradients_bytes: int = 0
    """Gradients as they exist during backward (one per trainable parameter)."""
    optimizer_bytes: int = 0
    buffers_bytes: int = 0
    by_dtype: dict[str, dict[str, int]] = {}
    """Part (parameters, gradients, optimizer, buffers) to dtype to bytes."""
    optimizer_note: str = ""
    """``measured`` from the optimizer's state, or how it was estimated before the first step."""
    baseline_bytes: int = 0
    """Device allocated (CUDA) or process-tree RSS (CPU) when the hook was installed."""
    gradients_held_bytes: int | None = None
    """Gradients that existed between two steps, at the first step's end and at the last
    checkpoint boundary (None: no step yet). 0 where the loop frees them (``zero_grad(
    set_to_none=True)`` before its step ends): they are then made within each step and the
    memory between steps lacks them."""
    between_steps_bytes: int | None = None
    """Memory in use between two steps, read where ``gradients_held_bytes`` is (CPU: the main
    process's resident memory less what malloc holds free; CUDA: torch's allocated memory; None:
    not read): what stays allocated across steps, measured where the step cycle is known rather
    than sampled at a moment of it."""
    between_steps_resident_bytes: int | None = None
    """On CPU, the main process's resident memory at the reading of ``between_steps_bytes``:
    that memory in use plus what glibc's malloc holds free (None: CUDA, not read, or an older
    hook)."""
    step_temporaries_bytes: int = 0
    """What the optimizer's step allocates and frees within itself, by the optimizer's own
    arithmetic (torch's per-tensor Adam: two of its largest parameter's size; a foreach step:
    all its parameters' size; fused or SGD: none; 0 where not known): memory at the step's
    peak that does not grow with the micro-batch."""


class OomEvent(Struct, omit_defaults=True):
    """An out-of-memory error seen by the hook, parsed, and what was done about it."""

    time: float
    step: int
    kind: str
    message: str
    config: Knobs
    """The knobs in effect when it happened."""
    tried_bytes: int | None = None
    capacity_bytes: int | None = None
    free_bytes: int | None = None
    process_in_use_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    rolled_back: bool = False
    """The change that caused it was reverted and training went on."""
    batch: str = ""
    """What happened to the failing batch (re-queued, skipped, or lost with the run)."""
    safe_config: Knobs | None = None
    """The config written for the restart (the tuned YAML's ``config``)."""


class LrState(Struct):
    """What the optimizers' LR carries over the script's own, as the hook last checked it."""

    factor: float = 1.0
    """The factor memtui applied and the optimizer uses (1.0: the script's own LR)."""
    anchor_batch: int | None = None
    """The effective batch per rank the factor's rule computes from (None: no change yet)."""
    anchor_factor: float = 1.0
    """The factor that is right at ``anchor_batch``."""
    rule: str = ""
    """The rule of the last change that moved the LR ('' none)."""
    fields: list[str] = []
    """The config fields the script's own LR schedule reads, which memtui scales with it."""
    script_schedule: str = ""
    """Why memtui knows the script sets the optimizer's LR itself ('' it does not, so far):
    memtui scales no LR then, and refuses LR rules."""


class LrWithdrawn(Struct, omit_defaults=True):
    """The script set the optimizer's LR itself: the factor memtui had applied no longer holds."""

    time: float
    step: int
    factor: float
    """The factor memtui had applied, withdrawn (the LR is the script's own from here)."""
    note: str


class RejectedChange(Struct, omit_defaults=True):
    """A change that was refused, when queued or at the boundary."""

    id: int
    """Its id if it had been queued, 0 if it was refused when asked."""
    requested: dict[str, Any]
    reason: str
    time: float
    step: int
    client: str = ""


class CancelledChange(Struct, omit_defaults=True):
    """A pending change a client cancelled before its boundary (from any shell or viewer)."""

    id: int
    changes: dict[str, KnobValue]
    time: float
    step: int
    client: str = ""


class Ceiling(Struct, omit_defaults=True):
    """What ran out of memory in this run (or before its restart): values to stay under."""

    batch_size: int | None = None
    """The smallest micro-batch that ran out of memory (the run stays under it)."""
    num_workers: int | None = None
    """The fewest loader workers that ran out of memory, when a change of workers did."""
    pin_memory: bool = False
    """Pinning memory ran out of memory (it stays off)."""
    step: int = 0
    """The step of the out-of-memory error that set it last."""
    note: str = ""
    """Where it came from, in words."""


class AutopilotState(Struct, omit_defaults=True):
    """What the autopilot is doing: off, measuring, trying, kept, reverted, converged or paused."""

    mode: str = "off"
    """off, on or paused (by an operator change or an error)."""
    phase: str = ""
    """What it does now: waiting, trying, measuring, timing (its trial over more steps),
    reverting, refused, converged ('' while off)."""
    why: str = ""
    """The reason for the phase or the pause, in words."""
    trying: dict[str, KnobValue] = {}
    """The trial queued or being measured."""
    last: str = ""
    """Its latest trial and what became of it (``kept num_workers=2: +45% +-6% samples/s``)."""
    boundaries: int = 0
    """Boundaries its changes took since it was turned on (its trials and reverts)."""
    budget: int = 0
    """The most boundaries it may take."""
    since_step: int = 0
    """The step it was turned on at."""


class ControlState(Struct, omit_defaults=True):
    """Rank 0's view of the config: current knobs, pending, applied and rejected changes."""

    config: Knobs
    tunable: list[str]
    """The knobs this run can change."""
    world_size: int = 1
    pending: list[PendingChange] = []
    applied: list[AppliedChange] = []
    """Most recent last, capped; the audit log keeps them all."""
    rejected: list[RejectedChange] = []
    disabled: str = ""
    """Why this run takes no changes (ranks out of step at a boundary); empty when it does."""
    model: MemoryModel | None = None
    """The memory model the hook predicts with (None until it has seen enough)."""
    static: StaticMemory | None = None
    """Parameters, gradients and optimizer state, exactly (None without model and optimizer)."""
    ooms: list[OomEvent] = []
    """Out-of-memory errors seen, most recent last."""
    ceiling: Ceiling | None = None
    """What ran out of memory: the gate, the max safe batch and the advice stay under it."""
    cancelled: list[CancelledChange] = []
    """Pending changes cancelled, most recent last, capped (an older hook sends none)."""
    autopilot: AutopilotState | None = None
    """The autopilot's state (None: an older hook, or a rank other than 0)."""
    lr: LrState | None = None
    """The LR factor and whether the script owns its schedule (None: an older hook)."""
    untunable: dict[str, str] = {}
    """Why each knob this run cannot change is not tunable, by knob (where the hook knows)."""
    boundary: str = ""
    """Where queued changes apply, in words ("" the run's next checkpoint)."""
    untunable_values: dict[str, KnobValue] = {}
    """The values of knobs this run has but memtui cannot change, as the hook read them (the
    training loader's own workers, its batch size); a knob in neither this nor ``config`` has a
    value memtui does not know."""
    unapplied: list[PendingChange] = []
    """Changes still pending when the run ended: never applied (the run's last word)."""


class HookCounters(Struct, omit_defaults=True):
    """What the hook counts about itself: drops, bad frames and its own failures."""

    records_dropped: int = 0
    """Step records lost because the outbox was full (nobody drained it)."""
    messages_dropped: int = 0
    """Telemetry batches that could not be sent (the socket's queue was full)."""
    bad_frames: int = 0
    """Frames on the control socket that failed to decode."""
    errors: int = 0
    """Exceptions caught inside memtui (training went on)."""
    last_error: str = ""
    recoveries: int = 0
    """Times the runtime directory had vanished and was recreated."""
    requests_refused: int = 0
    """Requests refused for their shape: undecodable, or over the bounds (too many knobs, a name
    or value too long), and subscriptions other than the viewers' (their socket was reset)."""
    requests_rate_limited: int = 0
    """Requests answered "rate limited" unserved: their connection sent too many too fast."""
    auth_failures: int = 0
    """Peers that failed to authenticate on a TCP socket (refused keys, failed handshakes)."""
    control_rests: int = 0
    """Times the control plane spent its CPU budget and stopped reading requests for a while."""

    tuned_unsaved_step: int | None = None
    """The step since which the tuned config could not be written (None: it is on disk)."""


class RankInfo(Struct, omit_defaults=True):
    """Where one rank of a run publishes."""

    rank: int
    pub: str
    """The rank's telemetry endpoint."""
    control: str = ""
    """The rank's control endpoint (every rank answers hello; rank 0 takes changes)."""
    local_rank: int = 0
    pub_tcp: str = ""
    """The same telemetry over authenticated TCP, for viewers on other nodes ("" if off)."""
    control_tcp: str = ""
    host: str = ""
    pid: int = 0


class RunInfo(Struct, omit_defaults=True):
    """What a run is: identity, place, device and files."""

    run: str
    pid: int
    host: str
    started: float
    command: list[str] = []
    cwd: str = ""
    user: str = ""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"
    """A human name for the device, e.g. ``cuda:0 NVIDIA H100 80GB HBM3`` or ``cpu``."""
    device_kind: str = "cpu"
    capacity_bytes: int = 0
    torch_version: str = ""
    hook_version: str = ""
    state_dir: str = ""
    tuned_path: str = ""
    audit_path: str = ""
    security: str = ""
    """How the run can be reached: ``ipc``, ``curve``, ``plain-tcp`` or ``plain-tcp+control``
    (``memtui.transport.security``; "" from a hook that does not say)."""
    readonly: bool = False
    """True in a snapshot from a plain TCP socket without the control opt-in: it takes no set or
    cancel, and leaves out the command line, cwd and paths."""
    requeue: str = ""
    """The command that queues again what the resumed run queued and never applied ("")."""
    cpus: int = 0
    """CPUs the training process may use (its affinity, within its cgroup's quota; 0: unknown)."""
    alloc_conf: str | None = None
    """The CUDA caching allocator's settings as torch holds them (``PYTORCH_CUDA_ALLOC_CONF``'s
    form, e.g. ``expandable_segments:True``; "" when none are set); None from an older hook that
    does not send it, or a run not on CUDA."""


# --------------------------------------------------------------------------- the run's summary


class SummaryWindow(Struct, array_like=True, frozen=True):
    """One stretch of the run's wall time: its steps' time, data wait and memory (sums, so two
    neighbours merge exactly when the summary coarsens)."""

    start: float
    """Wall time (``time.time()``) the stretch begins."""
    seconds: float
    """How long the stretch is."""
    steps: int
    """Steps that ended in it."""
    step_time_s: float
    """Their step times, summed."""
    data_wait_s: float
    """Their data waits, summed."""
    samples: int
    """Their samples, summed."""
    slowest_step_s: float
    """The slowest of them."""
    device_peak_bytes: int
    """The device peak sampled in it (CUDA: torch's peak reserve since the last change, plus
    memory beyond torch; CPU: the process tree's peak; 0: no sample)."""
    device_used_bytes: int
    """The most the device held at a sample in it (0: no sample)."""
    host_peak_bytes: int
    """The most the process tree held in host memory (main RSS plus the loader workers; 0: no
    sample)."""


class KeptStep(Struct, array_like=True, frozen=True):
    """One step the summary keeps whole, for the comparison of two runs' distributions."""

    step: int
    step_time_s: float
    data_wait_s: float
    samples: int


class VerdictSpan(Struct, omit_defaults=True):
    """A stretch of the run the verdict held, from one look to the next that differed."""

    state: str
    """``STARVED``, ``UNDERUSED``, ``BALANCED``, ``OOM_RISK`` or ``HOST_PRESSURE``."""
    first_step: int
    last_step: int
    start: float
    """When it was first said (wall time)."""
    end: float
    """When it was last said."""
    headline: str = ""
    """The verdict in one line, when it was first said."""
    looks: int = 1
    """How many looks (one every ``SUMMARY_LOOK_S``) said it."""


class SummaryOption(Struct, omit_defaults=True):
    """A recommendation the run had at its last look (untested unless applied)."""

    title: str
    changes: dict[str, KnobValue] = {}
    applicable: bool = False
    why: str = ""
    speed_delta: float | None = None
    predicted_peak_bytes: int | None = None


class RankFigures(Struct, omit_defaults=True):
    """One rank's figures over the run, as it last posted them for rank 0."""

    rank: int
    host: str = ""
    time: float = 0.0
    """When the figures were taken (wall time)."""
    steps: int = 0
    """Steps the rank closed."""
    step_time_s: float = 0.0
    """Its median step time over the steps it kept."""
    data_wait_fraction: float = 0.0
    """Its data wait over its step time, over the run."""
    data_wait_measured: bool = True
    samples_per_s: float = 0.0
    """Its samples over its step time, over the run (0: not counted)."""
    device_peak_bytes: int = 0
    capacity_bytes: int = 0
    host_peak_bytes: int = 0
    ooms: int = 0


class MemorySummary(Struct, omit_defaults=True):
    """The run's peaks, with the room left under its limits."""

    kind: str = "cpu"
    capacity_bytes: int = 0
    """The device's memory, or on the CPU the memory limit (a cgroup's, one given, else RAM)."""
    device_peak_bytes: int = 0
    """The highest device peak sampled (CUDA: torch's peak reserve plus memory beyond torch)."""
    device_peak_step: int = 0
    device_peak_time: float = 0.0
    host_peak_bytes: int = 0
    """The most the process tree held in host memory (main RSS plus the loader workers)."""
    host_limit_bytes: int = 0
    """The host memory limit that applies to the run (its cgroup's, else RAM)."""
    ram_used_peak_bytes: int = 0
    """The most RAM the host had in use (every process)."""
    swap_peak_bytes: int = 0
    alloc_retries: int = 0
    """Allocations torch retried after freeing its cache (CUDA)."""
    allocator_ooms: int = 0
    """Out-of-memory errors torch's allocator counted (CUDA)."""


SUMMARY_FORMAT = 1
"""The version of the summary's layout (``RunSummary.format``)."""


class RunSummary(Struct, omit_defaults=True):
    """What a run spent and learnt, bounded whatever its length: written beside its tuned config
    as it runs (every ``SUMMARY_EVERY_S``) and when it ends, and sent to a client that asks."""

    run: str
    written: float
    """When it was written (wall time)."""
    info: RunInfo
    ended: str = ""
    """How the run ended: ``finished``, ``interrupted`` (Ctrl-C), ``out of memory``, ``failed:
    <error>`` ("": it was still running when this was written)."""
    first_step: int = 0
    """The first step recorded (a resumed run starts past 0)."""
    last_step: int = 0
    steps: int = 0
    """Steps recorded (rank 0's)."""
    step_time_s: float = 0.0
    """Their step times, summed."""
    data_wait_s: float = 0.0
    """Their data waits, summed."""
    samples: int = 0
    data_wait_measured: bool = False
    """Whether any step drew a batch memtui timed (False: the data wait is not known)."""
    window_s: float = 0.0
    """How long each of ``windows`` is (it doubles as the run grows)."""
    windows: list[SummaryWindow] = []
    kept: list[KeptStep] = []
    """A uniform random sample of the run's steps (its first steps and those that rebuilt the
    loader left out): what a comparison of two runs tests."""
    kept_of: int = 0
    """The steps ``kept`` was drawn from."""
    memory: MemorySummary | None = None
    verdicts: list[VerdictSpan] = []
    verdicts_dropped: int = 0
    """Spans left out in the middle of a run whose verdict changed more often than kept."""
    verdict_seconds: dict[str, float] = {}
    """Seconds of the run each verdict held, by state (from one look to the next)."""
    options: list[SummaryOption] = []
    """The recommendations at the run's last look."""
    started_config: Knobs | None = None
    """The knobs when the summary began (the run's start, or its resume)."""
    control: ControlState | None = None
    """The control state when written: the config, every change and its effect, the OOMs."""
    ranks: list[RankFigures] = []
    """Every rank's figures rank 0 had (its own first)."""
    counters: HookCounters | None = None
    records_dropped: int = 0
    """Step records the hook lost before the summary saw them (a stalled agent)."""
    format: int = SUMMARY_FORMAT
    v: int = WIRE_VERSION


# --------------------------------------------------------------------------- messages


class Telemetry(Struct, tag="telemetry", omit_defaults=True):
    """One batch from a rank's PUB socket: every step since the previous batch, the latest samples."""

    run: str
    rank: int
    seq: int
    """Counts this rank's batches; a gap means batches were lost (PUB/SUB is lossy)."""
    time: float
    step: int
    steps: list[StepRecord] = []
    device: list[DeviceSample] = []
    host: HostSample | None = None
    checkpoints: list[CheckpointRecord] = []
    control_seq: int = 0
    """Counts changes to the control state; a viewer that missed one asks for a snapshot."""
    control: ControlState | None = None
    """The control state, sent in the first batch after it changed."""
    counters: HookCounters | None = None
    ended: bool = False
    """True in a run's last batch."""
    v: int = WIRE_VERSION


class Hello(Struct, tag="hello", omit_defaults=True):
    """A viewer's first request: answered with a Snapshot."""

    client: str = ""
    history: int = 512
    """How many recent step records the viewer wants (the hook caps it)."""
    summary: bool = False
    """Also send the run's summary (``memtui report``; an older hook ignores it)."""
    v: int = WIRE_VERSION


class Snapshot(Struct, tag="snapshot", omit_defaults=True):
    """Everything a new viewer needs: the run, its config and changes, and recent history."""

    info: RunInfo
    control: ControlState
    ranks: list[RankInfo] = []
    step: int = 0
    seq: int = 0
    """The telemetry seq of rank 0 when the snapshot was taken."""
    control_seq: int = 0
    steps: list[StepRecord] = []
    device: list[DeviceSample] = []
    host: list[HostSample] = []
    checkpoints: list[CheckpointRecord] = []
    counters: HookCounters | None = None
    summary: RunSummary | None = None
    """The run's summary, when the hello asked for it (None: not asked, or an older hook)."""
    v: int = WIRE_VERSION


class SetRequest(Struct, tag="set", omit_defaults=True):
    """Queue a change: knob name to value (strings are parsed by the hook)."""

    changes: dict[str, KnobValue | str]
    keep_effective_batch: bool = False
    lr_scale: str = ""
    """How the LR follows a change of the effective batch: linear, sqrt, none ('': the run's)."""
    client: str = ""
    dry_run: bool = False
    """Validate and resolve only; queue nothing."""
    force: bool = False
    v: int = WIRE_VERSION


class SetReply(Struct, tag="set_reply", omit_defaults=True):
    """The answer to a SetRequest: accepted with an id, or rejected with a reason."""

    ok: bool
    id: int = 0
    changes: dict[str, KnobValue] = {}
    reason: str = ""
    note: str = ""
    predicted_peak_bytes: int | None = None
    """The device peak predicted with the change (None: no memory model yet)."""
    capacity_bytes: int | None = None
    max_safe_batch_size: int | None = None
    """The largest micro-batch whose predicted peak's high end stays under the edge band."""
    confidence: str = ""
    """How sure the prediction is (points seen, fit error, the interval's width)."""
    predicted_high_bytes: int | None = None
    """The high end of the predicted peak's interval (the gate's figure)."""
    max_safe: str = ""
    """The largest safe micro-batch in words: a guess far past what was measured, or under what
    ran out of memory."""
    needs_force: bool = False
    """Rejected only because it is predicted over the danger band: ``force`` would queue it."""
    boundary: str = ""
    """Where the change applies, in words ("" the run's next checkpoint)."""
    v: int = WIRE_VERSION


class CancelRequest(Struct, tag="cancel", omit_defaults=True):
    """Remove a pending change by id (0 removes every pending change)."""

    id: int = 0
    client: str = ""
    v: int = WIRE_VERSION


class CancelReply(Struct, tag="cancel_reply", omit_defaults=True):
    """The answer to a CancelRequest."""

    ok: bool
    cancelled: list[int] = []
    reason: str = ""
    v: int = WIRE_VERSION


class AutotuneRequest(Struct, tag="autotune", omit_defaults=True):
    """Turn the autopilot on or off (rank 0 answers with an ``AutotuneReply``)."""

    on: bool
    client: str = ""
    v: int = WIRE_VERSION


class AutotuneReply(Struct, tag="autotune_reply", omit_defaults=True):
    """The autopilot's state after an ``AutotuneRequest``."""

    ok: bool
    state: AutopilotState | None = None
    reason: str = ""
    v: int = WIRE_VERSION


class ErrorReply(Struct, tag="error", omit_defaults=True):
    """The answer to a request the hook could not decode or serve."""

    reason: str
    v: int = WIRE_VERSION


Message: TypeAlias = (
    Telemetry
    | Hello
    | Snapshot
    | SetRequest
    | SetReply
    | CancelRequest
    | CancelReply
    | AutotuneRequest
    | AutotuneReply
    | ErrorReply
)
"""Every frame on the wire is one of these."""


class RunRecord(Struct, omit_defaults=True):
    """A run's registry file (JSON): how to find and reach it."""

    run: str
    pid: int
    create_time: float
    """The process's start time from psutil: tells a live run from a reused pid."""
    started: float
    host: str
    control: str
    """Rank 0's control endpoint."""
    ranks: list[RankInfo]
    command: list[str] = []
    cwd: str = ""
    world_size: int = 1
    state_dir: str = ""
    v: int = WIRE_VERSION
    security: str = ""
    """The run's security mode, as in RunInfo ("" from a hook that does not say)."""


# --------------------------------------------------------------------------- encode / decode

_encoder = msgspec.msgpack.Encoder()
_encode_lock = threading.Lock()


def encode(message: Message) -> bytes:
    """Encode one message to a msgpack frame."""
    with _encode_lock:  # an Encoder keeps an internal buffer: one thread at a time
        return _encoder.encode(message)


class Decoder:
    """Decodes frames into messages, counting (never raising on) anything malformed."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(Message)
        self.bad_frames = 0
        """Frames dropped: undecodable, wrong schema or an unknown major version."""
        self.last_error = ""

    def decode(self, frame: bytes | memoryview) -> Message | None:
        """Return the message in ``frame``, or None (counted) if it is not a valid one."""
        try:
            message = self._decoder.decode(frame)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as exc:
            self.bad_frames += 1
            self.last_error = str(exc)[:200]
            return None
        if message.v != WIRE_VERSION:
            self.bad_frames += 1
            self.last_error = f"wire version {message.v}, expected {WIRE_VERSION}"
            return None
        return message


def to_builtins(obj: Any) -> Any:
    """Convert a Struct (or anything containing them) to plain JSON-ready Python objects."""
    return msgspec.to_builtins(obj)


def all_fields(struct: Struct) -> dict[str, Any]:
    """A Struct's fields as plain objects, defaults included (a record a person reads)."""
    return {
        name: msgspec.to_builtins(value) for name, value in msgspec.structs.asdict(struct).items()
    }


def encode_run_record(record: RunRecord) -> bytes:
    """Encode a registry record as JSON."""
    return msgspec.json.encode(record)


def decode_run_record(data: bytes) -> RunRecord | None:
    """Decode a registry record, or None if the file is not one."""
    try:
        record = msgspec.json.decode(data, type=RunRecord)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    return record if record.v == WIRE_VERSION else None
