"""A tiny LightningModule trained by a Lightning Trainer with memtui (``hooks.install(trainer)``).

The Trainer keeps Lightning's defaults on: its default progress bar (Rich, where rich is
installed), its default logger and checkpointing, the model summary; ``--out`` is its
``default_root_dir`` (and so memtui's state directory). Records the samples trained on, the
micro-batches of every optimizer step, the learning rate, and the batch counts callbacks read;
waits at step ``--wait-at`` for ``--go``; writes ``--report`` as JSON. ``--devices 2`` runs
``strategy="ddp"`` on two CPU processes (Lightning's launcher, or torchrun when it started this);
each rank writes ``--report`` with ``.rank<r>`` appended. ``--max-epochs N`` bounds the run by
epochs instead of 12 steps; ``--onecycle`` sizes a OneCycleLR from
``trainer.estimated_stepping_batches`` (the usual way) instead of a linear decay sized so;
``--constant-lr`` has no scheduler. ``--progress-bar tqdm`` / ``custom`` replaces the default
bar with Lightning's tqdm one or a user's own; ``--validate`` adds a validation loop (run at
each epoch's end, as by default).
``--die-at S`` ends the process abruptly once the checkpoint of step S is saved (its report
written first); ``--resume`` with ``--ckpt-path`` restarts from that checkpoint with
``hooks.install(trainer, resume=True)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

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
parser.add_argument("--constant-lr", action="store_true", help="no LR scheduler")
parser.add_argument("--tensorboard", action="store_true", help="a TensorBoardLogger in --out/tb")
parser.add_argument("--progress-bar", choices=["default", "tqdm", "custom"], default="default")
parser.add_argument("--validate", action="store_true")
parser.add_argument("--die-at", type=int, default=0)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--ckpt-path", default=None)
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

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.accum_per_step.append(self.micro)
        self.micro = 0
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        self.total = total = int(self.trainer.estimated_stepping_batches)  # 12 with max_steps 12
        if cli.constant_lr:
            return optimizer
        scheduler: Any = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)
        if cli.onecycle:
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=0.1, total_steps=total
            )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


if not cli.validate:
    del Tiny.validation_step  # no validation loop


def finite(count: Any) -> float | None:
    """A batch count as a callback reads it; None (never expected) for inf or NaN."""
    return float(count) if count is not None and math.isfinite(count) else None


class Counts(pl.Callback):
    """Records the batch counts a callback reads: at each epoch's start, at each validation,
    and the training bar's total and position at each epoch's end."""

    def __init__(self) -> None:
        self.at_epoch_start: list[list[float | None]] = []
        self.validations: list[list[int]] = []
        self.bars: list[list[float | None]] = []
        self.epoch_batches: list[int] = []

    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        self.at_epoch_start.append(
            [finite(trainer.num_training_batches), finite(trainer.val_check_batch)]
        )

    def on_validation_start(self, trainer: Any, *_: Any) -> None:
        if not trainer.sanity_checking:
            loop = trainer.fit_loop.epoch_loop
            self.validations.append([trainer.current_epoch, loop.batch_progress.current.ready])

    def on_train_epoch_end(self, trainer: Any, *_: Any) -> None:
        self.epoch_batches.append(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        bar = trainer.progress_bar_callback
        if bar is None or not bar.is_enabled:  # rank 0's alone
            return
        if isinstance(bar, pl.callbacks.RichProgressBar):
            task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
            self.bars.append([finite(task.total), task.completed])
        elif isinstance(bar, pl.callbacks.TQDMProgressBar):
            train = bar.train_progress_bar
            self.bars.append([finite(train.total), train.n])
        elif isinstance(bar, CountingBar):
            self.bars.append([finite(bar.total), bar.done])


class CountingBar(pl.callbacks.ProgressBar):
    """A user's own progress bar: its total is ``trainer.num_training_batches``, read at each
    epoch's start and each batch's end (it stops the run on a count that is not finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True
        self.total: float = 0.0
        self.done = 0

    @property
    def is_enabled(self) -> bool:
        return self.enabled

    def disable(self) -> None:
        self.enabled = False

    def enable(self) -> None:
        self.enabled = True

    def read(self, trainer: Any) -> None:
        total = self.total_train_batches
        if not math.isfinite(total):
            raise ValueError(f"the epoch's batch count is {total}")
        self.total = float(total)

    def on_train_epoch_start(self, trainer: Any, *_: Any) -> None:
        self.read(trainer)
        self.done = 0

    def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
        self.read(trainer)
        self.done += 1


class Die(pl.Callback):
    """Ends the process once the checkpoint of step ``--die-at`` is saved, as a kill would."""

    def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
        if cli.die_at and trainer.global_step == cli.die_at:
            write_report()
            os._exit(0)


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
counts = Counts()
callbacks: list[Any] = [checkpoints, WaitForGo(), counts, Die()]
if cli.progress_bar == "tqdm":
    callbacks.append(pl.callbacks.TQDMProgressBar())
elif cli.progress_bar == "custom":
    callbacks.append(CountingBar())
trainer = pl.Trainer(
    max_steps=-1 if cli.max_epochs else STEPS,
    max_epochs=cli.max_epochs or None,
    accumulate_grad_batches=2,
    accelerator="cpu",
    devices=cli.devices,
    strategy="ddp" if cli.devices > 1 else "auto",
    default_root_dir=cli.out,
    logger=pl.loggers.TensorBoardLogger(cli.out, name="tb") if cli.tensorboard else True,
    log_every_n_steps=1,
    callbacks=callbacks,
)
tuner = hooks.install(trainer, resume=cli.resume)  # the one line
print(f"run {tuner.run_id} rank {trainer.global_rank}", flush=True)
dataset = Indexed(cli.samples)
# the sampler's own seeded generator: the same shuffled order on every rank and in a restarted
# process (a generator given to the DataLoader also seeds each of its iterators)
order = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
loader = tuner.loader(
    lambda batch_size=4: DataLoader(dataset, batch_size=batch_size, sampler=order)
)
model = Tiny()


def write_report() -> None:
    """The report of what the run trained on (each rank its own file)."""
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
        "counts_at_epoch_start": counts.at_epoch_start,
        "validations": counts.validations,
        "bars": counts.bars,
        "epoch_batches": counts.epoch_batches,
        "progress_bar": type(trainer.progress_bar_callback).__name__,
    }
    suffix = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
    Path(cli.report + suffix).write_text(json.dumps(report))


validation = DataLoader(Indexed(16), batch_size=8) if cli.validate else None
trainer.fit(model, train_dataloaders=loader, val_dataloaders=validation, ckpt_path=cli.ckpt_path)
write_report()
tuner.close()
