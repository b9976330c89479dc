"""A short plain training loop with none of memtui's lines, as a CI job would train it:

    python ci_train.py --max-steps N

Each step sleeps ``CI_TRAIN_SLEEP_MS`` (20 by default: the step's time is the loop's, whatever
the load on the machine) and ``CI_TRAIN_EXTRA_MIB`` more memory is held for the whole run (0 by
default): the test of the documented CI step makes a slower, hungrier run with them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--max-steps", type=int, default=100)
args = parser.parse_args()
sleep_s = float(os.environ.get("CI_TRAIN_SLEEP_MS", "20")) / 1000
extra_mib = int(os.environ.get("CI_TRAIN_EXTRA_MIB", "0"))

torch.manual_seed(0)
held = torch.ones(extra_mib << 18) if extra_mib else None  # 4-byte floats, touched
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
dataset = TensorDataset(torch.randn(2048, 64), torch.randint(0, 8, (2048,)))
loader = DataLoader(dataset, batch_size=32, shuffle=True)
step = 0
while step < args.max_steps:
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(sleep_s)
        step += 1
        if step >= args.max_steps:
            break
print(f"trained {step} steps")
