"""A Lightning Fabric loop that saves its training state with ``fabric.save`` every ``--every``
optimizer steps, on every rank, as litgpt's ``pretrain`` does: no memtui line.

``fabric.setup_dataloaders`` gives each rank its slice of a shuffled data set (Fabric's
``DistributedSampler``, reshuffled each epoch); the loop runs ``--epochs`` epochs. A forward
pre-hook on the model, the script's own, prints the row ids each training forward takes
(``ROWS``: the rank, its epoch and step, the ids, the loader worker processes the rows came from);
before step N every rank waits while the file ``hold-N`` exists in ``--gate``; ``DONE`` prints
the final weights.

    torchrun --standalone --nproc_per_node 2 fabric_save_train.py --gate DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--gate", required=True)
parser.add_argument("--rows", type=int, default=64)
parser.add_argument("--micro-batch", type=int, default=4)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--every", type=int, default=3)
cli = parser.parse_args()


class Rows(Dataset):  # type: ignore[type-arg]
    """Rows whose first feature is the row's id; each says which process loaded it."""

    def __len__(self) -> int:
        return cli.rows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        worker = torch.utils.data.get_worker_info()
        features = torch.full((4,), index / cli.rows)
        features[0] = index
        return features, torch.tensor(os.getpid() if worker else 0)


def say(kind: str, **what: Any) -> None:
    """One line, in one write: the ranks share the log."""
    sys.stdout.write(kind + " " + json.dumps(what) + "\n")
    sys.stdout.flush()


def main() -> None:
    gate = Path(cli.gate)
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("WORLD_SIZE", "1")))
    fabric.launch()
    fabric.seed_everything(0)
    rank = fabric.global_rank
    model = torch.nn.Linear(4, 2)
    where = {"epoch": 0, "step": 0, "pids": [0]}

    def witness(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if module.training:
            ids = args[0][:, 0].long().tolist()
            say("ROWS", rank=rank, epoch=where["epoch"], step=where["step"] + 1, ids=ids,
                pids=where["pids"])  # fmt: skip

    model.register_forward_pre_hook(witness)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Rows(), batch_size=cli.micro_batch, shuffle=True))
    steps = 0
    for epoch in range(cli.epochs):
        where["epoch"] = epoch
        for features, pids in loader:
            hold = gate / f"hold-{steps + 1}"
            if hold.exists():
                say("HELD", rank=rank, step=steps + 1)
                deadline = time.monotonic() + 60
                while hold.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)
            where["pids"] = sorted(set(pids.tolist()))
            loss = torch.nn.functional.mse_loss(model(features), torch.zeros(len(features), 2))
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            steps += 1
            where["step"] = steps
            if steps % cli.every == 0:
                state = {"model": model, "optimizer": optimizer, "step": steps}
                fabric.save(gate / "ckpt" / f"step-{steps}.ckpt", state)
    say("DONE", rank=rank, weight=model.module.weight.tolist())


if __name__ == "__main__":
    main()
