"""The CPU stand-in's peaks: glibc's moving mmap threshold against the stand-in's fixed one.

On the CPU memtui's device peak is the process's RSS high-water mark. Each round starts one fresh
process per mode, interleaved: ``default`` (glibc as it comes) and ``stand-in`` (the mmap
threshold fixed at 128 KiB, as the hook does when a memory limit is given:
``memtui.hooks.caches.fix_mmap_threshold``). Each process trains the model ``advice_truth.py``'s
demo runs (or the benchmark's MLP) through a sequence of micro-batches, up and back down,
``malloc_trim`` at each decrease as memtui's boundary does, and reports per micro-batch its peak
RSS above the RSS before the first one and its CPU time per step (one torch thread). A device
allocator's peak counter follows the live tensors: a peak in proportion to the micro-batch, and
the same on the way down as on the way up.

Usage: python benchmarks/cpu_heap.py [--model demo|mlp] [--rounds N] [--batches 8,16,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import benchlib

CHILD = """
import ctypes, json, sys, time
import torch
from torch import nn
from memtui.demo.train import TinyGPT
from memtui.hooks.caches import fix_mmap_threshold, trim_heap

mode, which, batches = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")]
torch.set_num_threads(1)
torch.manual_seed(0)
if which == "demo":
    net = TinyGPT(4096, 128, 32, 1)

    def loss_of(batch):
        tokens = torch.randint(0, 4096, (batch, 128))
        return lambda: net(tokens, tokens)
else:
    layers, width = [], 512
    for _ in range(3):
        layers += [nn.Linear(width, 2048), nn.LayerNorm(2048), nn.GELU()]
        width = 2048
    net = nn.Sequential(*layers, nn.Linear(2048, 10))

    def loss_of(batch):
        x, y = torch.randn(batch, 512), torch.randint(0, 10, (batch,))
        return lambda: nn.functional.cross_entropy(net(x), y)
optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
if mode == "stand-in":
    assert fix_mmap_threshold()


def kib(key):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) * 1024


def steps(loss, count):
    for _ in range(count):
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


steps(loss_of(1), 1)  # the optimizer's state exists, as memtui's steady part counts it
trim_heap()
base = kib("VmRSS:")
rows, previous = [], None
for batch in batches:
    if previous is not None and batch < previous:
        trim_heap()
    loss = loss_of(batch)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    began = time.thread_time()
    steps(loss, 15)
    rows.append([batch, kib("VmHWM:") - base, (time.thread_time() - began) / 15])
    previous = batch
print(json.dumps(rows))
"""


def one(mode: str, model: str, batches: str) -> list[list[float]]:
    """One fresh process's rows: [micro-batch, peak above the base (bytes), CPU s per step]."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, model, batches],
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    """Run the rounds and print, per mode and micro-batch, the peak and the CPU per step."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("demo", "mlp"), default="demo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="8,16,27,40,16,4,1")
    parser.add_argument("--json", metavar="PATH", help="write every round's rows here")
    args = parser.parse_args()
    modes = ("default", "stand-in")
    found: dict[str, list[list[list[float]]]] = {mode: [] for mode in modes}
    load_before = benchlib.loadavg()
    started = time.monotonic()
    for _ in range(args.rounds):
        for mode in modes:
            found[mode].append(one(mode, args.model, args.batches))
    order = args.batches.split(",")
    print(f"{args.model}: peak RSS above the base, MiB, and CPU ms per step (median [min-max] of "
          f"{args.rounds} processes), micro-batches in this order: {', '.join(order)}")  # fmt: skip
    for mode in modes:
        print(f"  {mode}:")
        for index, batch in enumerate(order):
            peaks = [run[index][1] / 2**20 for run in found[mode]]
            cpu = [run[index][2] * 1000 for run in found[mode]]
            per_sample = statistics.median(peaks) / int(batch)
            print(
                f"    {batch:>3}: {statistics.median(peaks):6.1f} [{min(peaks):.1f}-{max(peaks):.1f}]"
                f" MiB ({per_sample:.2f} a sample), {statistics.median(cpu):6.1f} "
                f"[{min(cpu):.1f}-{max(cpu):.1f}] ms a step"
            )
    load_after = benchlib.loadavg()
    print(f"load average before {load_before}, after {load_after}; "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rounds": found, "load": [load_before, load_after]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
