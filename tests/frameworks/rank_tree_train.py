"""Two CPU ranks where rank 1 is a child process of rank 0, each with two loader workers of its
own, imported nothing of memtui (``memtui run`` watches it).

``fabric``: Lightning Fabric's own launcher (``Fabric(accelerator="cpu", devices=2,
strategy="ddp").launch()`` starts rank 1 from rank 0 with ``LOCAL_RANK=1``); ``spawn``: rank 0
starts rank 1 with ``torch.multiprocessing.spawn`` and trains itself, rank 1 setting its rank's
variables only once it runs. Each rank writes ``REPORT.rankN`` (its pid and the bytes of its
parameters) after its fifth step, and trains until the ``HOLD`` file is gone.

    python rank_tree_train.py HOLD REPORT fabric|spawn
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

WORKERS = 2


def _loop(
    rank: int, model: Any, optimizer: Any, loader: Any, backward: Any, out: tuple[Path, Path]
) -> None:
    """Train until the hold file is gone; report after the fifth step."""
    hold, report = out
    steps = 0
    while True:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
            steps += 1
            if steps == 5:
                sizes = sum(p.numel() * p.element_size() for p in model.parameters())
                seen = {"pid": os.getpid(), "parameters": sizes}
                Path(f"{report}.rank{rank}").write_text(json.dumps(seen))
            time.sleep(0.02)
        if not hold.exists():
            return


def _model_and_data() -> tuple[torch.nn.Module, TensorDataset]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 2, (1024,)))
    return model, data


def fabric(out: tuple[Path, Path]) -> None:
    """Both ranks under Lightning Fabric's own launcher."""
    from lightning.fabric import Fabric

    runner = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    runner.launch()
    model, data = _model_and_data()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = runner.setup(model, optimizer)
    plain = DataLoader(data, batch_size=8, num_workers=WORKERS, persistent_workers=True)
    loader = runner.setup_dataloaders(plain)
    _loop(runner.global_rank, model, optimizer, loader, runner.backward, out)


def train(rank: int, port: str, out: tuple[Path, Path]) -> None:
    """One rank of a plain DDP job over gloo."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
    )
    dist.init_process_group("gloo")
    model, data = _model_and_data()
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(
        data,
        batch_size=8,
        sampler=DistributedSampler(data),
        num_workers=WORKERS,
        persistent_workers=True,
    )
    _loop(rank, model, optimizer, loader, lambda loss: loss.backward(), out)
    dist.destroy_process_group()


def spawned(index: int, port: str, out: tuple[Path, Path]) -> None:
    """Rank 1, started by rank 0 with ``torch.multiprocessing.spawn``."""
    train(index + 1, port, out)


def main() -> None:
    out = (Path(sys.argv[1]), Path(sys.argv[2]))
    if sys.argv[3] == "fabric":
        fabric(out)
        return
    import torch.multiprocessing

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    ranks = torch.multiprocessing.spawn(spawned, args=(port, out), nprocs=1, join=False)
    train(0, port, out)
    ranks.join()


if __name__ == "__main__":
    main()
