"""Synthesise tests/data/oom_risk.mtrec: a two-rank CUDA run climbing into the 85-90% edge band.

The suite runs without a GPU, and the demo on CPU never comes near a memory limit, so this
stream stands for a CUDA device: it is built message by message from memtui's own wire
Structs (the hook's exact schema), deterministically (no randomness, fixed clock), and replayed
through the same decoder as a live run. It is the only fake in the viewer's tests.

The story is a starving run whose fix runs out of room: a run on 24 GiB cards starved for data
with batch 16 x accumulation 8; at step 200 the operator doubled the batch (32 x 2); data wait
fell from 45% to 4%, and memory climbed: torch's reserve to 19.9 GiB (3.2 GiB of it reserved
but unallocated, the allocator's fragmentation), plus 0.6 GiB of CUDA context and NCCL and, on
rank 0, 512 MiB held by another process -- a peak of 88% of the card: OOM RISK, edge band.
Mid-recording the operator queues batch_size=24 with keep-effective-batch.

    .venv/bin/python tests/data/make_oom_stream.py [--out tests/data/oom_risk.mtrec]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from memtui.core.knobs import resolve
from memtui.transport.recording import CONTROL_RANK, RecordingHeader, RecordingWriter
from memtui.wire import (
    AppliedChange,
    CheckpointRecord,
    ControlState,
    DeviceSample,
    GpuProcess,
    HostSample,
    KnobDiff,
    Knobs,
    PendingChange,
    RankInfo,
    RejectedChange,
    RunInfo,
    Snapshot,
    StepRecord,
    Telemetry,
    encode,
)

GIB = 1 << 30
MIB = 1 << 20
CAPACITY = 24 * GIB
"""An RTX 4090's memory, as torch reports it."""
STARTED = 1_760_000_000.0
"""The run's start (wall time), fixed so that every replay reads the same."""
CHANGE_STEP = 200
"""Where batch 16 x 8 became 32 x 2."""
BEFORE_STEP_S, BEFORE_WAIT_S = 0.80, 0.36
AFTER_STEP_S, AFTER_WAIT_S = 0.52, 0.02
CHANGE_TIME = STARTED + 5.0 + CHANGE_STEP * BEFORE_STEP_S
RECORDING_START = CHANGE_TIME + 20.0
DURATION_S = 40.0
FLUSH_S = 0.25
"""The synthetic hook flushes every 250 ms (the real one every 100 ms): a smaller file."""
SAMPLE_S = 0.4
"""Device samples every 400 ms (the hook's default is 200 ms): a smaller file."""
PENDING_AT = RECORDING_START + 8.0
"""When the operator queues batch_size=24 (keep-effective-batch)."""
WORLD = 2
HOST = "gpu-node-07"
RUN = "finetune-4f2a9c"
CONTEXT_BYTES = 600 * MIB
"""CUDA context and NCCL buffers: NVML sees them, torch does not."""
OTHER = GpuProcess(pid=31337, name="python", used_bytes=512 * MIB)
"""Someone else's process on rank 0's card (memory in use that is not the run's)."""


def jitter(k: float, scale: float) -> float:
    """A deterministic wobble in [-scale, scale]."""
    return scale * math.sin(1.7 * k) * math.cos(0.37 * k)


def steps_until(end: float) -> list[StepRecord]:
    """Every step that ended by ``end`` (rank-independent timing)."""
    records: list[StepRecord] = []
    t = STARTED + 5.0
    step = 0
    while True:
        step += 1
        before = step <= CHANGE_STEP
        dt = (BEFORE_STEP_S if before else AFTER_STEP_S) + jitter(step, 0.03)
        wait = (BEFORE_WAIT_S if before else AFTER_WAIT_S) + jitter(step + 0.5, 0.01)
        t += dt
        if t > end:
            return records
        flags = 1 if step % 50 == 1 and step > 1 else 0
        records.append(
            StepRecord(step, round(t, 4), round(dt, 5), round(max(0.0, wait), 5),
                       128 if before else 64, 8 if before else 2, flags)
        )  # fmt: skip


def reserved_at(t: float) -> float:
    """Torch's reserve: flat before the change, then climbing to 19.9 GiB within 50 s."""
    if t < CHANGE_TIME:
        return 9.4 * GIB + jitter(t, 0.05 * GIB)
    ramp = min(1.0, (t - CHANGE_TIME) / 50.0)
    return (15.5 + 4.4 * ramp) * GIB + jitter(t, 0.03 * GIB)


def device_sample(rank: int, t: float, step: int) -> DeviceSample:
    """One allocator + NVML sample of ``rank``'s card."""
    reserved = int(reserved_at(t) - rank * 0.2 * GIB)
    unallocated = int((3.18 if t >= CHANGE_TIME else 1.3) * GIB)
    others = [OTHER] if rank == 0 else []
    retries = 0 if t < CHANGE_TIME + 30 else 3
    return DeviceSample(
        time=round(t, 3),
        step=step,
        kind="cuda",
        index=rank,
        name="NVIDIA GeForce RTX 4090",
        capacity_bytes=CAPACITY,
        allocated_bytes=reserved - unallocated,
        peak_allocated_bytes=reserved - unallocated + int(0.4 * GIB),
        reserved_bytes=reserved,
        peak_reserved_bytes=reserved + int(0.1 * GIB),
        inactive_split_bytes=int(2.4 * GIB) if t >= CHANGE_TIME else int(0.9 * GIB),
        alloc_retries=retries,
        nvml_used_bytes=reserved + CONTEXT_BYTES + sum(p.used_bytes for p in others),
        nvml_total_bytes=CAPACITY,
        utilization_pct=97.0 if t >= CHANGE_TIME else 58.0,
        other_processes=others,
    )


def host_sample(t: float) -> HostSample:
    """The node's RAM: busy but not pressed; a little swap, not growing."""
    return HostSample(
        time=round(t, 3),
        ram_total_bytes=64 * GIB,
        ram_available_bytes=int(23 * GIB - jitter(t, 0.2 * GIB)),
        ram_used_bytes=int(41 * GIB + jitter(t, 0.2 * GIB)),
        swap_total_bytes=8 * GIB,
        swap_used_bytes=512 * MIB,
        limit_bytes=64 * GIB,
        main_rss_bytes=int(6.2 * GIB),
        workers=4,
        workers_rss_bytes=int(3.1 * GIB),
        workers_uss_bytes=int(1.2 * GIB),
        cpu_percent=410.0,
    )


def control_state(t: float) -> ControlState:
    """Config 32 x 2 (applied at step 200), a rejected try, and later a pending change."""
    config = Knobs(batch_size=32, grad_accum=2, num_workers=4, pin_memory=True)
    applied = AppliedChange(
        ids=[1],
        step=CHANGE_STEP,
        time=round(CHANGE_TIME, 3),
        changes={"batch_size": KnobDiff(16, 32), "grad_accum": KnobDiff(8, 2)},
    )
    rejected = RejectedChange(
        id=0,
        requested={"grad_accum": 0},
        reason="grad_accum must be between 1 and 65536, got 0",
        time=round(CHANGE_TIME - 30, 3),
        step=CHANGE_STEP - 38,
        client="tui:ops@laptop:4242",
    )
    pending: list[PendingChange] = []
    if t >= PENDING_AT:
        tunable = ["batch_size", "grad_accum", "num_workers", "pin_memory"]
        resolved = resolve({"batch_size": 24}, config, tunable, keep_effective_batch=True,
                           world_size=WORLD)  # fmt: skip
        pending.append(
            PendingChange(
                id=3,
                changes=resolved.changes,
                requested={"batch_size": 24},
                queued_time=round(PENDING_AT, 3),
                queued_step=steps_until(PENDING_AT)[-1].step,
                keep_effective_batch=True,
                client="tui:ops@laptop:4242",
                note=resolved.note,
            )
        )
    return ControlState(
        config=config,
        tunable=["batch_size", "grad_accum", "num_workers", "pin_memory"],
        world_size=WORLD,
        pending=pending,
        applied=[applied],
        rejected=[rejected],
    )


def control_seq(t: float) -> int:
    """Bumped by the rejection, the queue, the take and the apply, then by the new pending."""
    return 5 if t < PENDING_AT else 6


def ranks() -> list[RankInfo]:
    """Where the two ranks published (as the run's registry said)."""
    return [
        RankInfo(rank=r, pub=f"ipc:///run/user/1000/memtui/{RUN}/pub{r}", local_rank=r,
                 host=HOST, pid=52000 + r)
        for r in range(WORLD)
    ]  # fmt: skip


def snapshot() -> Snapshot:
    """Rank 0's answer to the recorder's hello, at the recording's start."""
    t = RECORDING_START
    steps = steps_until(t)
    info = RunInfo(
        run=RUN,
        pid=52000,
        host=HOST,
        started=STARTED,
        command=["python", "train.py", "--config", "configs/finetune.yaml"],
        cwd="/home/ops/finetune",
        user="ops",
        world_size=WORLD,
        device="cuda:0 NVIDIA GeForce RTX 4090",
        device_kind="cuda",
        capacity_bytes=CAPACITY,
        torch_version="2.13.0",
        hook_version="0.1.0",
        state_dir="/home/ops/finetune/ckpt",
    )
    device = [
        device_sample(0, t - SAMPLE_S * k, step_at(steps, t - SAMPLE_S * k))
        for k in range(150, 0, -1)
    ]
    return Snapshot(
        info=info,
        control=control_state(t),
        ranks=ranks(),
        step=steps[-1].step,
        seq=int((t - STARTED) / FLUSH_S),
        control_seq=control_seq(t),
        steps=steps,
        device=device,
        host=[host_sample(t - k) for k in range(120, 0, -1)],
        checkpoints=checkpoints(steps),
    )


def step_at(steps: list[StepRecord], t: float) -> int:
    """The last step that ended by ``t``."""
    done = [s.step for s in steps if s.end_time <= t]
    return done[-1] if done else 0


def checkpoints(steps: list[StepRecord]) -> list[CheckpointRecord]:
    """A checkpoint every 50 steps, 1.2 s to save."""
    return [CheckpointRecord(s.step, s.end_time, 1.2) for s in steps if s.step % 50 == 0]


def frames() -> list[tuple[float, int, bytes]]:
    """Every frame of the recording: (offset, rank, wire frame), in time order."""
    out: list[tuple[float, int, bytes]] = [(0.01, CONTROL_RANK, encode(snapshot()))]
    all_steps = steps_until(RECORDING_START + DURATION_S + 1)
    for rank in range(WORLD):
        seq = int((RECORDING_START - STARTED) / FLUSH_S)
        previous = RECORDING_START
        sent_seq = control_seq(RECORDING_START) if rank == 0 else 2
        sample_t = RECORDING_START + SAMPLE_S
        host_t = RECORDING_START + 1.0
        k = 1
        while previous < RECORDING_START + DURATION_S:
            now = RECORDING_START + k * FLUSH_S + 0.003 * rank
            seq += 1
            records = [s for s in all_steps if previous < s.end_time + 0.01 * rank <= now]
            shifted = [
                StepRecord(s.step, round(s.end_time + 0.01 * rank, 4), s.step_time_s,
                           s.data_wait_s, s.samples, s.micro_batches, s.flags)
                for s in records
            ]  # fmt: skip
            samples = []
            while sample_t <= now:
                samples.append(device_sample(rank, sample_t, step_at(all_steps, sample_t)))
                sample_t += SAMPLE_S
            host = None
            if host_t <= now:
                host = host_sample(host_t)
                host_t += 1.0
            # rank 1 has its own control state (applied changes only): its seq is its own
            seq_now = control_seq(now) if rank == 0 else 2
            message = Telemetry(
                run=RUN,
                rank=rank,
                seq=seq,
                time=round(now, 3),
                step=step_at(all_steps, now),
                steps=shifted,
                device=samples,
                host=host,
                checkpoints=[c for c in checkpoints(records)],
                control_seq=seq_now,
                control=control_state(now) if rank == 0 and seq_now != sent_seq else None,
            )
            sent_seq = seq_now
            out.append((round(now - RECORDING_START + 0.02, 4), rank, encode(message)))
            previous = now
            k += 1
    out.sort(key=lambda f: (f[0], f[1]))
    return out


def main() -> int:
    """Write the recording."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("oom_risk.mtrec"))
    args = parser.parse_args()
    header = RecordingHeader(
        started=RECORDING_START,
        run=RUN,
        source="tests/data/make_oom_stream.py (synthetic: stands for a CUDA device)",
        note="two RTX 4090 ranks climbing to 88% after batch 16x8 -> 32x2",
    )
    with RecordingWriter(args.out, header) as writer:
        for offset, rank, frame in frames():
            writer.write(offset, rank, frame)
    print(f"{args.out}: {writer.frames} frames, {args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
