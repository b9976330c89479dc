"""A pretraining loop on Lightning Fabric, shaped as litgpt's ``pretrain``: no memtui line.

``fabric.setup_dataloaders`` for a training and a validation loader (each rank its own slice),
a validation pass of two batches before training (``model.eval()``, ``torch.no_grad()``), an
endless cycle over the training loader with gradient accumulation (``fabric.no_backward_sync``
on the accumulating micro-batches, an optimizer step every ``--accum``), a whole validation pass
after every ``--eval-every`` optimizer steps. The validation data is slow to load (each row takes
``--eval-row-s``), the training data fast. Prints its own "iter" line per micro-batch, as litgpt
does, then ``DONE`` with what it trained; waits for ``--held`` to be removed before it exits.

    torchrun --standalone --nproc_per_node 2 fabric_train.py --held FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--held", required=True)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--accum", type=int, default=2)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--eval-every", type=int, default=3)
parser.add_argument("--eval-row-s", type=float, default=0.01)
cli = parser.parse_args()

SEQ = 16
VOCAB = 64


class Tokens(Dataset):  # type: ignore[type-arg]
    """Token rows of ``SEQ + 1`` ids (inputs and the next-token targets), each ``delay_s`` to
    load."""

    def __init__(self, rows: int, seed: int, delay_s: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.rows[index]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.embed(ids)))


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@torch.no_grad()
def validate(model: torch.nn.Module, loader: DataLoader, max_iters: int | None = None) -> float:  # type: ignore[type-arg]
    """litgpt's ``validate``: the model in eval mode, no gradients, at most ``max_iters``."""
    model.eval()
    losses = []
    for index, batch in enumerate(loader):
        if max_iters is not None and index >= max_iters:
            break
        losses.append(loss_of(model, batch))
    model.train()
    return float(torch.stack(losses).mean())


def cycle(loader: DataLoader):  # type: ignore[no-untyped-def, type-arg]
    """litgpt's ``CycleIterator``: the training loader again at each epoch's end."""
    while True:
        yield from loader


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")))
    fabric.launch()
    fabric.seed_everything(0)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    rows = cli.micro_batch * fabric.world_size
    train = DataLoader(Tokens(rows * 8, 0), batch_size=cli.micro_batch, shuffle=True)
    val = DataLoader(Tokens(rows * 3, 1, cli.eval_row_s), batch_size=cli.micro_batch)
    train, val = fabric.setup_dataloaders(train, val)
    validate(model, val, max_iters=2)  # the sanity pass litgpt runs before training
    started = time.perf_counter()
    micro = steps = samples = evaluations = 0
    for batch in cycle(train):
        micro += 1
        samples += len(batch)
        accumulating = micro % cli.accum != 0
        t0 = time.perf_counter()
        with fabric.no_backward_sync(model, enabled=accumulating):
            fabric.backward(loss_of(model, batch) / cli.accum)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
        fabric.print(
            f"iter {micro} step {steps}: iter time: {(time.perf_counter() - t0) * 1000:.2f} ms"
        )
        if not accumulating and steps % cli.eval_every == 0:
            validate(model, val)
            evaluations += 1
        if steps == cli.steps:
            break
    seconds = time.perf_counter() - started
    done = {"rank": fabric.global_rank, "steps": steps, "micro": micro, "samples": samples,
            "evaluations": evaluations, "seconds": seconds}  # fmt: skip
    # one write, newline included: the ranks share one unbuffered stdout, where print's text and
    # its newline are two writes another rank's line can fall between
    sys.stdout.write("DONE " + json.dumps(done) + "\n")
    sys.stdout.flush()
    held = Path(cli.held)
    deadline = time.monotonic() + 120
    while held.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
