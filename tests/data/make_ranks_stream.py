"""Synthesise tests/data/ranks_8.mtrec: eight CUDA ranks, one straggling on data, one near OOM.

The suite runs without a GPU (and the demo on CPU runs one or two ranks), so this stream stands
for an 8 x H100 node: it is built message by message from memtui's own wire Structs
(the hook's exact schema), deterministically (no randomness, fixed clock), and replayed through
the same decoder as a live run, like tests/data/make_oom_stream.py.

The story: data-parallel pretraining, micro-batch 8 x accumulation 4 on 8 ranks; num_workers
went 4 -> 6 at step 1200 on every rank. The ranks step together (synchronous all-reduce), about
450 ms a step. Rank 5 reads its shard from slow storage: it waits ~170 ms of every step for data
(the others ~8 ms, and then wait for rank 5 at the all-reduce): the straggler. Rank 6 holds
more activations (longer sequences in its shard): peak 88% of its 80 GiB, in the 85-90% edge
band: the rank nearest OOM, and the verdict's rank. The others peak at 69-74%.

Like a viewer that attaches, the recording starts with rank 0's snapshot (the control socket)
and every other rank's own snapshot (each rank answers hello), then 20 s of every rank's
telemetry.

    .venv/bin/python tests/data/make_ranks_stream.py [--out tests/data/ranks_8.mtrec]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from memtui.transport.recording import CONTROL_RANK, RecordingHeader, RecordingWriter
from memtui.wire import (
    AppliedChange,
    CheckpointRecord,
    ControlState,
    DeviceSample,
    HostSample,
    KnobDiff,
    Knobs,
    RankInfo,
    RunInfo,
    Snapshot,
    StepRecord,
    Telemetry,
    encode,
)

GIB = 1 << 30
CAPACITY = 80 * GIB
STARTED = 1_761_000_000.0
"""The run's start (wall time), fixed so that every replay reads the same."""
WORLD = 8
RUN = "pretrain-8x-7c1d2e"
HOST = "h100-node-3"
STEP_S = 0.45
"""The ranks' common step time (they meet at every all-reduce)."""
WAIT_S = 0.008
STRAGGLER = 5
STRAGGLER_WAIT_S = 0.17
"""Rank 5's data wait per step: its shard is on slow storage."""
PEAKS = (0.74, 0.71, 0.72, 0.70, 0.73, 0.69, 0.88, 0.71)
"""Each rank's peak device memory over capacity (rank 6: the edge band)."""
CONTEXT_BYTES = int(0.9 * GIB)
"""CUDA context and NCCL buffers: NVML sees them, torch does not."""
CHANGE_STEP = 1200
"""Where num_workers went 4 -> 6 on every rank."""
RECORDING_START = STARTED + 30.0 + 1400 * STEP_S
DURATION_S = 20.0
FLUSH_S = 0.5
"""The synthetic hook flushes every 500 ms (the real one every 100 ms): a smaller file."""
SAMPLE_S = 1.0
"""Device samples every second (the hook's default is 200 ms): a smaller file."""
HOST_S = 2.0
CONFIG = Knobs(batch_size=8, grad_accum=4, num_workers=6, pin_memory=True)
TUNABLE = ["batch_size", "grad_accum", "num_workers", "pin_memory"]


def jitter(k: float, scale: float) -> float:
    """A deterministic wobble in [-scale, scale]."""
    return scale * math.sin(1.7 * k) * math.cos(0.37 * k)


def step_end(step: int) -> float:
    """When ``step`` ended on rank 0 (the others a few ms later)."""
    return STARTED + 30.0 + step * STEP_S + jitter(step, 0.004)


def record(rank: int, step: int) -> StepRecord:
    """Rank ``rank``'s record of ``step``."""
    wait = (STRAGGLER_WAIT_S if rank == STRAGGLER else WAIT_S) + jitter(step + rank, 0.003)
    dt = STEP_S + jitter(step + 0.5, 0.006)
    flags = 1 if step % 100 == 1 else 0
    return StepRecord(step, round(step_end(step) + 0.002 * rank, 4), round(dt, 5),
                      round(wait, 5), 32, 4, flags)  # fmt: skip


def steps_between(rank: int, after: float, until: float) -> list[StepRecord]:
    """Rank ``rank``'s records of the steps that ended in (``after``, ``until``]."""
    first = max(1, int((after - STARTED - 30.0) / STEP_S) - 2)
    out = []
    for step in range(first, first + int((until - after) / STEP_S) + 6):
        rec = record(rank, step)
        if after < rec.end_time <= until:
            out.append(rec)
    return out


def step_at(t: float) -> int:
    """The last step that ended by ``t``."""
    step = max(0, int((t - STARTED - 30.0) / STEP_S) + 1)
    while step > 0 and step_end(step) > t:
        step -= 1
    return step


def device_sample(rank: int, t: float) -> DeviceSample:
    """One allocator + NVML sample of ``rank``'s card."""
    peak_used = PEAKS[rank] * CAPACITY + jitter(t + rank, 0.004 * CAPACITY)
    reserved = int(peak_used - CONTEXT_BYTES - 0.3 * GIB)
    allocated = reserved - 2 * GIB
    return DeviceSample(
        time=round(t, 3),
        step=step_at(t),
        kind="cuda",
        index=rank,
        name="NVIDIA H100 80GB HBM3",
        capacity_bytes=CAPACITY,
        allocated_bytes=allocated,
        peak_allocated_bytes=allocated + GIB,
        reserved_bytes=reserved,
        peak_reserved_bytes=reserved + int(0.3 * GIB),
        inactive_split_bytes=int(1.4 * GIB),
        nvml_used_bytes=reserved + CONTEXT_BYTES,
        nvml_total_bytes=CAPACITY,
        utilization_pct=62.0 if rank == STRAGGLER else 94.0,
    )


def host_sample(rank: int, t: float) -> HostSample:
    """The node's RAM (shared by the ranks) and this rank's own process tree."""
    return HostSample(
        time=round(t, 3),
        ram_total_bytes=1024 * GIB,
        ram_available_bytes=int(600 * GIB - jitter(t, 2 * GIB)),
        ram_used_bytes=int(424 * GIB + jitter(t, 2 * GIB)),
        limit_bytes=1024 * GIB,
        main_rss_bytes=int((5.6 + 0.1 * rank) * GIB),
        workers=6,
        workers_rss_bytes=int(5.2 * GIB),
        workers_uss_bytes=int(2.1 * GIB),
        cpu_percent=380.0,
    )


def control_state() -> ControlState:
    """Every rank's own control state: the same config, the same change applied at step 1200."""
    applied = AppliedChange(
        ids=[1],
        step=CHANGE_STEP,
        time=round(step_end(CHANGE_STEP) + 2.0, 3),
        changes={"num_workers": KnobDiff(4, 6)},
    )
    return ControlState(config=CONFIG, tunable=TUNABLE, world_size=WORLD, applied=[applied])


def ranks() -> list[RankInfo]:
    """Where the eight ranks publish and answer (as the run's registry said)."""
    base = f"ipc:///run/user/1000/memtui/{RUN}"
    return [
        RankInfo(rank=r, pub=f"{base}/pub{r}", control=f"{base}/ctl" + (str(r) if r else ""),
                 local_rank=r, host=HOST, pid=61000 + r)
        for r in range(WORLD)
    ]  # fmt: skip


def snapshot(rank: int, t: float, history: int, device: int, host: int) -> Snapshot:
    """Rank ``rank``'s answer to a hello at ``t``, with that much history."""
    info = RunInfo(
        run=RUN,
        pid=61000 + rank,
        host=HOST,
        started=STARTED,
        command=["torchrun", "--nproc_per_node=8", "pretrain.py", "--config", "7b.yaml"],
        cwd="/home/ops/pretrain",
        user="ops",
        rank=rank,
        local_rank=rank,
        world_size=WORLD,
        device=f"cuda:{rank} NVIDIA H100 80GB HBM3",
        device_kind="cuda",
        capacity_bytes=CAPACITY,
        torch_version="2.13.0",
        hook_version="0.1.0",
        state_dir="/home/ops/pretrain/ckpt",
    )
    last = step_at(t)
    return Snapshot(
        info=info,
        control=control_state(),
        ranks=ranks(),
        step=last,
        seq=int((t - STARTED) / FLUSH_S),
        control_seq=4,
        steps=[record(rank, s) for s in range(max(1, last - history + 1), last + 1)],
        device=[device_sample(rank, t - SAMPLE_S * k) for k in range(device - 1, -1, -1)],
        host=[host_sample(rank, t - HOST_S * k) for k in range(host - 1, -1, -1)],
        checkpoints=[CheckpointRecord(s, step_end(s), 9.5) for s in range(100, last + 1, 100)]
        if rank == 0
        else [],
    )


def frames() -> list[tuple[float, int, bytes]]:
    """Every frame of the recording: (offset, rank, wire frame), in time order."""
    t0 = RECORDING_START
    out: list[tuple[float, int, bytes]] = [
        (0.01, CONTROL_RANK, encode(snapshot(0, t0, 300, 90, 30)))
    ]
    for rank in range(1, WORLD):  # every other rank's answer to the viewer's hello
        out.append((0.02 + 0.001 * rank, CONTROL_RANK, encode(snapshot(rank, t0, 64, 20, 1))))
    for rank in range(WORLD):
        seq = int((t0 - STARTED) / FLUSH_S)
        previous = t0
        sample_t = t0 + SAMPLE_S
        host_t = t0 + HOST_S
        k = 1
        while previous < t0 + DURATION_S:
            now = t0 + k * FLUSH_S + 0.011 * rank  # each rank's agent flushes on its own clock
            seq += 1
            samples = []
            while sample_t <= now:
                samples.append(device_sample(rank, sample_t))
                sample_t += SAMPLE_S
            host = None
            if host_t <= now:
                host = host_sample(rank, host_t)
                host_t += HOST_S
            message = Telemetry(
                run=RUN,
                rank=rank,
                seq=seq,
                time=round(now, 3),
                step=step_at(now),
                steps=steps_between(rank, previous, now),
                device=samples,
                host=host,
                control_seq=4,
            )
            out.append((round(now - t0 + 0.05, 4), rank, encode(message)))
            previous = now
            k += 1
    out.sort(key=lambda f: (f[0], f[1]))
    return out


def main() -> int:
    """Write the recording."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("ranks_8.mtrec"))
    args = parser.parse_args()
    header = RecordingHeader(
        started=RECORDING_START,
        run=RUN,
        source="tests/data/make_ranks_stream.py (synthetic: stands for 8 CUDA devices)",
        note="eight H100 ranks: rank 5 straggles on data, rank 6 peaks at 88%",
    )
    with RecordingWriter(args.out, header) as writer:
        for offset, rank, frame in frames():
            writer.write(offset, rank, frame)
    print(f"{args.out}: {writer.frames} frames, {args.out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
