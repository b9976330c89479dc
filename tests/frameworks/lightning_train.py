"""A tiny LightningModule trained by a Lightning Trainer with memtui (``hooks.install(trainer)``).

Records the samples trained on, the micro-batches of every optimizer step and the learning
rate; waits at step ``--wait-at`` for ``--go``; writes ``--report`` as JSON. ``--devices 2`` runs
``strategy="ddp"`` on two CPU processes (Lightning's launcher, or torchrun when it started this);
each rank writes ``--report`` with ``.rank<r>`` appended. ``--max-epochs N`` bounds the run by
epochs instead of 12 steps; ``--onecycle`` sizes a OneCycleLR from
``trainer.estimated_stepping_batches`` (the usual way) instead of a linear decay sized so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from memtui import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--report", required=True)
parser.add_argument("--go", default="")
parser.add_argument("--wait-at", type=int, default=2)
parser.add_argument("--samples", type=int, default=96)
parser.add_argument("--package", default="lightning.pytorch")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--max-epochs", type=int, default=0)
parser.add_argument("--onecycle", action="store_true")
parser.add_argument("--tensorboard", action="store_true", help="a TensorBoardLogger in --out/tb")
cli = parser.parse_args()
if cli.package == "pytorch_lightning":
    import pytorch_lightning as pl
else:
    import lightning.pytorch as pl

STEPS = 12


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


class Tiny(pl.LightningModule):
    """A two-layer regression model that records what it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        self.seen: list[int] = []
        self.micro = 0
        self.accum_per_step: list[int] = []
        self.lrs: list[float] = []
        self.epoch_starts: list[int] = []
        self.coordinated: list[bool] = []
        self.total = 0

    def on_train_epoch_start(self) -> None:
        self.epoch_starts.append(len(self.seen))
        self.coordinated.append(tuner.coordinator is not None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.seen.extend(index.tolist())
        self.micro += 1
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)  # to the TensorBoardLogger with --tensorboard
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.accum_per_step.append(self.micro)
        self.micro = 0
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = total = int(self.trainer.estimated_stepping_batches)  # 12 with max_steps 12
        scheduler: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)
        if cli.onecycle:
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=0.1, total_steps=total
            )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class WaitForGo(pl.Callback):
    """Holds the run at one step until the test has queued its change."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if cli.go and trainer.global_step == cli.wait_at and not os.path.exists(cli.go):
            print(f"rank {trainer.global_rank} waiting at step {trainer.global_step}", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(cli.go) and time.monotonic() < deadline:
                time.sleep(0.05)


torch.manual_seed(0)
checkpoints = pl.callbacks.ModelCheckpoint(dirpath=cli.out, every_n_train_steps=4, save_top_k=-1)
trainer = pl.Trainer(
    max_steps=-1 if cli.max_epochs else STEPS,
    max_epochs=cli.max_epochs or None,
    accumulate_grad_batches=2,
    accelerator="cpu",
    devices=cli.devices,
    strategy="ddp" if cli.devices > 1 else "auto",
    logger=pl.loggers.TensorBoardLogger(cli.out, name="tb") if cli.tensorboard else False,
    log_every_n_steps=1,
    enable_progress_bar=False,
    enable_model_summary=False,
    callbacks=[checkpoints, WaitForGo()],
)
tuner = hooks.install(trainer)  # the one line
print(f"run {tuner.run_id} rank {trainer.global_rank}", flush=True)
dataset = Indexed(cli.samples)
order = torch.Generator().manual_seed(0)  # the same shuffled order on every rank
loader = tuner.loader(
    lambda batch_size=4: DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=order)
)
model = Tiny()
trainer.fit(model, train_dataloaders=loader)
report = {
    "global_step": trainer.global_step,
    "tuner_step": tuner.step_count,
    "accum_per_step": model.accum_per_step,
    "lrs": model.lrs,
    "seen": model.seen,
    "accumulate_grad_batches": trainer.accumulate_grad_batches,
    "batch_size": loader.batch_size,
    "rank": tuner.rank,
    "world_size": tuner.world_size,
    "run": tuner.run_id,
    "coordinated": model.coordinated,
    "epoch_starts": model.epoch_starts,
    "epochs": trainer.current_epoch,
    "total_steps": model.total,
    "applied": [[a.step, sorted(a.changes)] for a in tuner.control.applied],
}
suffix = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
Path(cli.report + suffix).write_text(json.dumps(report))
tuner.close()
