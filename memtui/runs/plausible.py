"""Values a run can really report, checked before the viewer folds them (no Textual here).

A well-formed message can still carry numbers no run produces: an infinite step time, a NaN
timestamp, a negative size, step 10^18. Folded as they are, they would break the charts' time
buckets or the summaries, or poison a series for good (every later step looks older). So each
record or sample is checked here, and one with an impossible value is dropped and counted, as an
undecodable frame is. The common case (a batch of good step records) is checked with a few
C-level passes over the batch, not a Python loop per record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TypeVar

import msgspec

from memtui.wire import (
    CheckpointRecord,
    ControlState,
    DeviceSample,
    HostSample,
    MemoryModel,
    Snapshot,
    StepRecord,
    Telemetry,
)

MAX_STEP = 10**12
"""The largest step number believed (a million years at 30,000 steps a second)."""
MAX_TIME = 1e10
"""Timestamps (``time.time()``) are believed up to here (the year 2286)."""
MAX_DURATION_S = 1e6
"""The longest step time, data wait or save believed (eleven days)."""
MAX_BYTES = 1 << 60
"""The largest size believed (an exbibyte)."""
MAX_COUNT = 1 << 40
"""The largest count believed (samples in a step, micro-batches, workers)."""
MAX_RANK = 1 << 20
"""The largest rank believed."""
MAX_SEQ = 1 << 40
"""The largest batch counter believed (3,000 years at ten batches a second)."""
MAX_RANKS = 4096
"""The most ranks the viewer follows (numbers 0 to 4095): every rank it hears from gets its
series, so a peer that sends any rank number must not make it keep one per number. Within a
run the bound is the run's world size (see :func:`rank_limit`)."""

T = TypeVar("T")

_STEP = attrgetter("step")
_END_TIME = attrgetter("end_time")
_STEP_TIME = attrgetter("step_time_s")
_DATA_WAIT = attrgetter("data_wait_s")
_SAMPLES = attrgetter("samples")
_MICRO_BATCHES = attrgetter("micro_batches")

_DEVICE_BYTES = (
    "capacity_bytes",
    "allocated_bytes",
    "peak_allocated_bytes",
    "reserved_bytes",
    "peak_reserved_bytes",
    "inactive_split_bytes",
)
_HOST_BYTES = (
    "ram_total_bytes",
    "ram_available_bytes",
    "ram_used_bytes",
    "swap_total_bytes",
    "swap_used_bytes",
    "limit_bytes",
    "main_rss_bytes",
    "workers_rss_bytes",
)


def is_time(value: float) -> bool:
    """A believable timestamp: finite, from 0 to ``MAX_TIME``."""
    return 0.0 <= value <= MAX_TIME


def is_duration(value: float) -> bool:
    """A believable duration in seconds: finite, from 0 to ``MAX_DURATION_S``."""
    return 0.0 <= value <= MAX_DURATION_S


def is_size(value: int | None) -> bool:
    """A believable size in bytes (or none measured): from 0 to ``MAX_BYTES``."""
    return value is None or 0 <= value <= MAX_BYTES


def is_step(value: int) -> bool:
    """A believable step number: from 0 to ``MAX_STEP``."""
    return 0 <= value <= MAX_STEP


def is_finite(value: float | None) -> bool:
    """A finite number (or none measured)."""
    return value is None or math.isfinite(value)


def step_ok(record: StepRecord) -> bool:
    """One step record with believable values."""
    return (
        is_step(record.step)
        and is_time(record.end_time)
        and is_duration(record.step_time_s)
        and is_duration(record.data_wait_s)
        and 0 <= record.samples <= MAX_COUNT
        and 0 <= record.micro_batches <= MAX_COUNT
    )


def _steps_all_ok(records: Sequence[StepRecord]) -> bool:
    """Every record believable, checked a column at a time (a NaN or an infinity anywhere makes
    a column's sum non-finite; min and max bound the rest)."""
    times = list(map(_STEP_TIME, records))
    waits = list(map(_DATA_WAIT, records))
    ends = list(map(_END_TIME, records))
    if not math.isfinite(sum(times) + sum(waits) + sum(ends)):
        return False
    steps = list(map(_STEP, records))
    samples = list(map(_SAMPLES, records))
    micro = list(map(_MICRO_BATCHES, records))
    return (
        min(times) >= 0
        and max(times) <= MAX_DURATION_S
        and min(waits) >= 0
        and max(waits) <= MAX_DURATION_S
        and min(ends) >= 0
        and max(ends) <= MAX_TIME
        and min(steps) >= 0
        and max(steps) <= MAX_STEP
        and min(samples) >= 0
        and max(samples) <= MAX_COUNT
        and min(micro) >= 0
        and max(micro) <= MAX_COUNT
    )


def device_ok(sample: DeviceSample) -> bool:
    """One device sample with believable values."""
    return (
        is_time(sample.time)
        and is_step(sample.step)
        and all(is_size(getattr(sample, name)) for name in _DEVICE_BYTES)
        and is_size(sample.nvml_used_bytes)
        and is_size(sample.nvml_total_bytes)
        and is_finite(sample.utilization_pct)
        and all(is_size(p.used_bytes) for p in sample.other_processes)
    )


def host_ok(sample: HostSample) -> bool:
    """One host sample with believable values."""
    return (
        is_time(sample.time)
        and all(is_size(getattr(sample, name)) for name in _HOST_BYTES)
        and is_size(sample.workers_uss_bytes)
        and 0 <= sample.workers <= MAX_COUNT
        and is_finite(sample.cpu_percent)
    )


def checkpoint_ok(record: CheckpointRecord) -> bool:
    """One checkpoint record with believable values."""
    return is_step(record.step) and is_time(record.time) and is_duration(record.save_s)


def model_ok(model: MemoryModel) -> bool:
    """A memory model whose numbers can be predicted with."""
    return (
        is_size(model.capacity_bytes)
        and is_size(model.steady_bytes)
        and is_size(model.beyond_bytes)
        and 0 <= model.batch_size <= MAX_COUNT
        and 0.0 <= model.per_sample_bytes <= MAX_BYTES
        and 0.0 < model.overhead_ratio <= 1000.0
        and is_finite(model.fit_error)
    )


def control_ok(control: ControlState) -> bool:
    """A control state with a believable world size and knob values."""
    config, held = control.config, control.untunable_values
    counts = [config.batch_size, config.grad_accum, config.num_workers]
    counts += [held.get(k) for k in ("batch_size", "grad_accum", "num_workers")]
    return 1 <= control.world_size <= MAX_RANK and all(
        value is None or 0 <= value <= MAX_COUNT for value in counts
    )


@dataclasses.dataclass
class Checked:
    """What one check of a message kept and dropped."""

    dropped: int = 0
    """Records, samples or fields dropped for impossible values."""

    def keep(self, items: list[T], ok: Callable[[T], bool]) -> list[T]:
        """The items that pass ``ok`` (the same list when all do), counting the others."""
        kept = [item for item in items if ok(item)]
        if len(kept) == len(items):
            return items
        self.dropped += len(items) - len(kept)
        return kept

    def steps(self, records: list[StepRecord]) -> list[StepRecord]:
        """The believable step records (all of them, checked fast, in the usual case)."""
        if not records or _steps_all_ok(records):
            return records
        return self.keep(records, step_ok)


def rank_limit(world_size: int | None) -> int:
    """Ranks numbered under this are believed: the run's world size when known (its snapshot
    or control state), at most ``MAX_RANKS``; a batch or snapshot of a rank past it is dropped
    and counted as a bad value."""
    if world_size is None or world_size < 1:
        return MAX_RANKS
    return min(world_size, MAX_RANKS)


def check_telemetry(batch: Telemetry) -> tuple[Telemetry | None, int]:
    """The batch with its impossible records and samples dropped (None: its own step, seq, rank
    or time is impossible), and how many values were dropped."""
    if not (
        is_step(batch.step)
        and 0 <= batch.seq <= MAX_SEQ
        and 0 <= batch.rank <= MAX_RANK
        and math.isfinite(batch.time)
        and 0 <= batch.control_seq <= MAX_SEQ
    ):
        return None, 1
    checked = Checked()
    steps = checked.steps(batch.steps)
    device = checked.keep(batch.device, device_ok)
    checkpoints = checked.keep(batch.checkpoints, checkpoint_ok)
    host = batch.host
    if host is not None and not host_ok(host):
        host = None
        checked.dropped += 1
    control = batch.control
    if control is not None and not control_ok(control):
        control = None
        checked.dropped += 1
    elif control is not None and control.model is not None and not model_ok(control.model):
        control = msgspec.structs.replace(control, model=None)
        checked.dropped += 1
    if not checked.dropped:
        return batch, 0
    kept = msgspec.structs.replace(
        batch, steps=steps, device=device, checkpoints=checkpoints, host=host, control=control
    )
    return kept, checked.dropped


def check_snapshot(snapshot: Snapshot) -> tuple[Snapshot | None, int]:
    """The snapshot with its impossible records, samples and numbers dropped (an impossible
    step or start time is taken as unknown, ranks listed past its world size are dropped; None:
    its config is impossible, or its own rank is past its world size), and how many values
    were dropped."""
    if not control_ok(snapshot.control):
        return None, 1
    limit = rank_limit(max(snapshot.info.world_size, snapshot.control.world_size))
    if snapshot.info.rank >= limit:
        return None, 1  # a rank the run does not have (or past the ranks followed)
    checked = Checked()
    steps = checked.steps(snapshot.steps)
    device = checked.keep(snapshot.device, device_ok)
    host = checked.keep(snapshot.host, host_ok)
    checkpoints = checked.keep(snapshot.checkpoints, checkpoint_ok)
    step, seq, control_seq = snapshot.step, snapshot.seq, snapshot.control_seq
    if not is_step(step):
        step, checked.dropped = 0, checked.dropped + 1
    if not (0 <= seq <= MAX_SEQ and 0 <= control_seq <= MAX_SEQ):
        seq, control_seq, checked.dropped = 0, 0, checked.dropped + 1
    info, control = snapshot.info, snapshot.control
    if not is_time(info.started):
        info, checked.dropped = msgspec.structs.replace(info, started=0.0), checked.dropped + 1
    if not 0 <= info.rank <= MAX_RANK:
        info, checked.dropped = msgspec.structs.replace(info, rank=0), checked.dropped + 1
    if control.model is not None and not model_ok(control.model):
        control, checked.dropped = msgspec.structs.replace(control, model=None), checked.dropped + 1
    ranks = checked.keep(snapshot.ranks, lambda r: 0 <= r.rank < limit)
    if not checked.dropped:
        return snapshot, 0
    kept = msgspec.structs.replace(
        snapshot,
        info=info,
        control=control,
        step=step,
        seq=seq,
        control_seq=control_seq,
        steps=steps,
        device=device,
        host=host,
        checkpoints=checkpoints,
        ranks=ranks,
    )
    return kept, checked.dropped
