"""A plain Accelerate loop with memtui (``hooks.install(accelerator, ...)``), on CPU.

Each rank records the samples it trained on (by index), the accumulation of every optimizer
step, the learning rate and the loader (its workers and pinning, and the worker processes alive);
waits at step ``--wait-at`` for ``--go`` (the test queues a change
meanwhile) and writes ``--report``.<rank>.json at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from memtui import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--report", required=True)
parser.add_argument("--go", default="")
parser.add_argument("--wait-at", type=int, default=2)
parser.add_argument("--samples", type=int, default=96)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
parser.add_argument("--epochs", type=int, default=0, help="run epochs, not --steps")
parser.add_argument("--onecycle", action="store_true", help="a OneCycleLR sized from the steps")
args = parser.parse_args()


class Indexed(Dataset):  # type: ignore[type-arg]
    """Synthetic regression samples that carry their index."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = torch.randn(size, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / args.steps)
model, optimizer = accelerator.prepare(model, optimizer)  # the schedule: one step per update
dataset = Indexed(args.samples)
if args.onecycle:  # sized from the steps the epochs make, prepared: the usual Accelerate script
    per_epoch = math.ceil(
        math.ceil(args.samples / args.batch_size) / args.gradient_accumulation_steps
    )
    total_steps = args.epochs * per_epoch
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps)
    scheduler = accelerator.prepare(one_cycle)

tuner = hooks.install(accelerator, config=args, model=model, optimizer=optimizer)  # the one line
loader = tuner.loader(
    lambda batch_size, num_workers=0, pin_memory=False: DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(1),
    )
)
if accelerator.is_main_process:
    print(f"run {tuner.run_id}", flush=True)

seen: list[int] = []
accum_per_step: list[int] = []
lrs: list[float] = []
loaders: list[list[Any]] = []
"""Per optimizer step: the loader's num_workers and pin_memory, and the worker processes alive."""
micro = 0
done = False
epochs = 0
while not done:
    if args.epochs and epochs == args.epochs:
        break
    epochs += 1
    for index, x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            if accelerator.sync_gradients or args.onecycle:  # a prepared one knows when
                scheduler.step()
            optimizer.zero_grad()
        seen.extend(index.tolist())
        micro += 1
        if not accelerator.sync_gradients:
            continue
        accum_per_step.append(micro)
        micro = 0
        lrs.append(scheduler.get_last_lr()[0])
        workers = len(psutil.Process().children())
        loaders.append([loader.num_workers, loader.dataloader.pin_memory, workers])
        step = tuner.step_count  # counted by the optimizer's post-step hook
        if args.go and step == args.wait_at:
            print(f"waiting at step {step}", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(args.go) and time.monotonic() < deadline:
                time.sleep(0.05)
            accelerator.wait_for_everyone()
        if step % args.save_every == 0:
            accelerator.save_state(os.path.join(args.out, f"step{step}"))  # the boundary
        if step >= args.steps and not args.epochs:
            done = True
            break

report = {
    "rank": accelerator.process_index,
    "steps": tuner.step_count,
    "accum_per_step": accum_per_step,
    "lrs": lrs,
    "epochs": epochs,
    "loaders": loaders,
    "seen": seen,
    "batch_size": args.batch_size,
    "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
    "config_accum": args.gradient_accumulation_steps,
}
Path(f"{args.report}.{accelerator.process_index}.json").write_text(json.dumps(report))
tuner.close()
