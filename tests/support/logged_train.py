"""A plain training loop with memtui's lines that logs its own numbers, as a script's own log
would: each step's wall time (from the end of its previous step, after its checkpoint save, to
its own end), the steps it ran, and the most resident memory it read at any step.

    python logged_train.py --state-dir DIR --log FILE [--steps N] [--sleep-ms MS]
        [--extra-mib MIB] [--oom-at STEP]

``--sleep-ms`` makes every step slower by a sleep inside it, ``--extra-mib`` holds that much
more memory for the whole run, ``--oom-at`` raises an out-of-memory error (``MemoryError``)
outside any guard at that step, which ends the run.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from memtui import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--state-dir", required=True)
parser.add_argument("--log", required=True)
parser.add_argument("--steps", type=int, default=150)
parser.add_argument("--batch_size", type=int, default=32)
parser.add_argument("--num_workers", type=int, default=0)
parser.add_argument("--sleep-ms", type=float, default=0.0)
parser.add_argument("--extra-mib", type=int, default=0)
parser.add_argument("--oom-at", type=int, default=0)
args = parser.parse_args()


def resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
dataset = TensorDataset(torch.randn(2048, 64), torch.randint(0, 8, (2048,)))
held = torch.ones(args.extra_mib << 18) if args.extra_mib else None  # 4-byte floats, touched
tuner = hooks.install(args, model=model, optimizer=optimizer, state_dir=args.state_dir)
loader = tuner.loader(
    lambda batch_size, num_workers: DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers
    )
)
print(f"run {tuner.run_id}", flush=True)
peak = resident_bytes()
with open(args.log, "w") as log:
    last = time.perf_counter()
    while tuner.step_count < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000)
            if args.oom_at and tuner.step_count + 1 == args.oom_at:
                raise MemoryError("out of memory: the test's own, at its chosen step")
            tuner.step()
            now = time.perf_counter()
            peak = max(peak, resident_bytes())
            log.write(json.dumps({"step": tuner.step_count, "time_s": now - last}) + "\n")
            if tuner.step_count % 25 == 0:
                tuner.checkpoint()
            last = time.perf_counter()
            if tuner.step_count >= args.steps:
                break
    log.write(json.dumps({"steps": tuner.step_count, "peak_rss_bytes": peak}) + "\n")
tuner.close()
print(f"done: {tuner.step_count} steps", flush=True)
