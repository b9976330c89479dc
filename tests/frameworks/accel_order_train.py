"""An Accelerate loop shaped as Accelerate's ``complete_nlp_example.py``, with the documented memtui
lines: ``shuffle=True`` and no generator, a model with dropout over batches padded to their
longest row (so each rank's global RNG moves on by its own amount), ``save_state`` at a step
named ``step_<n>``, and a restart with ``load_state`` + ``skip_first_batches``.

A forward pre-hook, outside memtui, writes the row ids of every training batch, with the
script's epoch, to ``--record``.<rank>.jsonl; ``--stop-at N`` ends the process right after the
save of micro-step N (a run that died there), ``--resume DIR`` restarts from it (``--skew K``
skipping K batches more than the checkpoint's step says).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

from memtui import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--record", required=True)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--num_workers", type=int, default=0)
parser.add_argument("--save-at", type=int, default=0)
parser.add_argument("--stop-at", type=int, default=0)
parser.add_argument("--resume", default="")
parser.add_argument("--skew", type=int, default=0, help="skip this many batches more at resume")
args = parser.parse_args()


class Rows(Dataset[dict[str, Any]]):
    """Rows of 1 to 13 tokens that carry their id."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = [
            torch.randint(0, 50, (1 + i * 7 % 13,), generator=generator) for i in range(size)
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"id": index, "tokens": self.rows[index]}


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad to the batch's longest row (as ``tokenizer.pad(padding="longest")``)."""
    tokens = torch.nn.utils.rnn.pad_sequence([r["tokens"] for r in rows], batch_first=True)
    return {"ids": torch.tensor([r["id"] for r in rows]), "tokens": tokens}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, tokens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.embed(tokens)).mean(dim=1))


accelerator = Accelerator()
set_seed(42)
net = Net()
epoch_now = [0]
record = open(f"{args.record}.{accelerator.process_index}.jsonl", "a")  # noqa: SIM115


def write_ids(_module: Any, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    record.write(json.dumps({"epoch": epoch_now[0], "ids": inputs[1].tolist()}) + "\n")


net.register_forward_pre_hook(write_ids)
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
model, optimizer = accelerator.prepare(net, optimizer)
dataset = Rows(args.samples)

# the documented lines
tuner = hooks.install(accelerator, config=args, model=model, optimizer=optimizer)
train_dataloader = tuner.loader(
    lambda batch_size, num_workers=0, pin_memory=False: DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate,
    )
)

# complete_nlp_example.py's resume
overall_step = 0
starting_epoch = 0
resume_step = None
if args.resume:
    accelerator.load_state(args.resume)
    training_difference = os.path.splitext(os.path.basename(args.resume))[0]
    resume_step = int(training_difference.replace("step_", ""))
    starting_epoch = resume_step // len(train_dataloader)
    resume_step -= starting_epoch * len(train_dataloader)
    resume_step += args.skew

for epoch in range(starting_epoch, args.epochs):
    epoch_now[0] = epoch
    model.train()
    if args.resume and epoch == starting_epoch and resume_step is not None:
        active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        overall_step += resume_step
    else:
        active_dataloader = train_dataloader
    for batch in active_dataloader:
        loss = model(batch["tokens"], batch["ids"]).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        overall_step += 1
        if overall_step == args.save_at:
            accelerator.save_state(os.path.join(args.out, f"step_{overall_step}"))
            if overall_step == args.stop_at:
                record.close()
                accelerator.end_training()
                sys.stdout.flush()
                os._exit(0)  # the run died right after its save (no shutdown, as below)
    record.write(json.dumps({"epoch": epoch, "rng": torch.rand(1).item()}) + "\n")

record.close()
tuner.close()
accelerator.end_training()
# Leave without the interpreter's shutdown: torch's gloo worker threads can still hold the last
# reference to a finished gradient all-reduce, whose destructor then needs the GIL of an
# interpreter being torn down and aborts the process (SIGABRT, "terminate called without an
# active exception"), with or without memtui, about one exit in six here. Everything this
# script records is closed above.
sys.stdout.flush()
os._exit(0)
