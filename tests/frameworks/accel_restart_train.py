"""Accelerate's ``complete_nlp_example.py`` loop with memtui's documented lines, on CPU: AdamW
(two param groups, as transformers' examples make them) and transformers'
``get_linear_schedule_with_warmup`` prepared by the accelerator, ``save_state`` every
``--save-every`` steps, ``load_state`` on ``--resume_from_checkpoint`` with ``resume=True``.

A global optimizer step pre-hook (torch's, registered before anything else) appends the step
and every param group's LR to ``--report``.lrs.jsonl before each optimizer step; the loop waits
at ``--wait-at`` for ``--go`` and kills itself (SIGKILL) right after the save of
``--die-after``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, TensorDataset
from transformers import get_linear_schedule_with_warmup

from memtui import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--report", required=True)
parser.add_argument("--state-dir", required=True)
parser.add_argument("--go", default="")
parser.add_argument("--wait-at", type=int, default=2)
parser.add_argument("--steps", type=int, default=16)
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--die-after", type=int, default=0)
parser.add_argument("--resume_from_checkpoint", default="")
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()

completed = 0
"""Optimizer steps done (the script's own count, as ``overall_step`` in the example)."""
record = open(f"{args.report}.lrs.jsonl", "a")  # noqa: SIM115 (open for the whole run)


def witness(optimizer: torch.optim.Optimizer, *_: object) -> None:
    """The LR of every param group at the step about to run, as the step reads it."""
    record.write(json.dumps([completed + 1, [g["lr"] for g in optimizer.param_groups]]) + "\n")
    record.flush()


register_optimizer_step_pre_hook(witness)
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr,
)
lr_scheduler = get_linear_schedule_with_warmup(
    optimizer=optimizer, num_warmup_steps=args.warmup, num_training_steps=args.steps
)
model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
tuner = hooks.install(
    accelerator,
    config=args,
    model=model,
    optimizer=optimizer,
    state_dir=args.state_dir,
    resume=bool(args.resume_from_checkpoint),
)
generator = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(256, 8, generator=generator), torch.randn(256, 1))
loader = tuner.loader(
    lambda batch_size, num_workers=0, pin_memory=False: DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers
    )
)
if args.resume_from_checkpoint:
    accelerator.load_state(args.resume_from_checkpoint)
    completed = int(Path(args.resume_from_checkpoint).name.replace("step_", ""))
    tuner.load_state_dict({"step": completed})
print(f"run {tuner.run_id}", flush=True)

while completed < args.steps:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        completed += 1
        if args.go and completed == args.wait_at:
            print(f"waiting at step {completed}", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(args.go) and time.monotonic() < deadline:
                time.sleep(0.05)
        if completed % args.save_every == 0:
            accelerator.save_state(os.path.join(args.out, f"step_{completed}"))  # the boundary
            if completed == args.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
        if completed >= args.steps:
            break
record.close()
tuner.close()
