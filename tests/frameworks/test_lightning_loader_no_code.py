"""A Lightning script training on its own torch ``DataLoader`` (from ``train_dataloader()``, a
DataModule, or ``trainer.fit``), with no memtui line under ``memtui run`` or with the one
``hooks.install(trainer)`` line: a batch-size, worker and prefetch change queued by the real
``memtui set`` lands at the next checkpoint (the batches the model sees, the worker processes
that load them, the loader the script reads), a restart from the checkpoint keeps the tuned
loader and the epoch's exact position, the same checkpoint restarts without memtui, every DDP
rank changes at the same step, and a loader memtui cannot rebuild keeps its own knobs and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks.harness import PYTHON, paused_run, recorded_steps
from tests.support.cli import memtui_cli
from tests.support.processes import ROOT, wait_for

SCRIPT = textwrap.dedent(
    '''
    """A tiny LightningModule trained by a Lightning Trainer with its defaults on its own loader."""
    import argparse
    import json
    import os
    import time
    from pathlib import Path

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset
    from torch.utils.data import SequentialSampler

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--go", default="")
    parser.add_argument("--wait-at", type=int, default=2)
    parser.add_argument("--loader", default="module")
    parser.add_argument("--install", action="store_true", help="hooks.install(trainer), one line")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--schedule", action="store_true", help="an LR schedule of the estimate")
    parser.add_argument("--find-batch-size", action="store_true", help="Lightning's BatchSizeFinder")
    parser.add_argument("--validate", action="store_true", help="a slow validation every 4 batches")
    cli = parser.parse_args()


    class Indexed(Dataset):
        """Samples that carry their index and the pid of the process that loaded them."""

        def __init__(self, size):
            generator = torch.Generator().manual_seed(0)
            self.x = torch.randn(size, 8, generator=generator)
            self.y = torch.randn(size, 1, generator=generator)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, index):
            return index, self.x[index], self.y[index], os.getpid()


    class SlowToValidate(Dataset):
        """A validation set of 16 rows that each take 10 ms to load."""

        def __len__(self):
            return 16

        def __getitem__(self, index):
            time.sleep(0.01)
            return index, torch.zeros(8), torch.zeros(1), os.getpid()


    class Stream(IterableDataset):
        def __iter__(self):
            data = Indexed(96)
            return (data[i] for i in range(len(data)))


    class Groups(BatchSampler):
        """A batch sampler of the script's own."""


    def make_loader(batch_size=4):
        data = Indexed(96)
        if cli.loader == "iterable":
            return DataLoader(Stream(), batch_size=4)
        if cli.loader == "batch-sampler":
            return DataLoader(data, batch_sampler=Groups(SequentialSampler(data), 4, False))
        order = torch.Generator().manual_seed(0)
        return DataLoader(data, batch_size=batch_size, shuffle=True, generator=order)


    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.micro = 0
            self.accum_per_step = []
            self.batches = []
            self.batch_size = 4  # what a batch size finder sets

        def training_step(self, batch, batch_idx):
            index, x, y, pids = batch
            loader = self.trainer.train_dataloader
            self.batches.append(
                {
                    "step": self.trainer.global_step,
                    "size": int(x.shape[0]),
                    "index": index.tolist(),
                    "pids": sorted(set(pids.tolist())),
                    "num_workers": loader.num_workers,
                    "prefetch_factor": loader.prefetch_factor,
                }
            )
            self.micro += 1
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer):
            self.accum_per_step.append(self.micro)
            self.micro = 0

        def validation_step(self, batch, batch_idx):
            _index, x, y, _pids = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def val_dataloader(self):
            return DataLoader(SlowToValidate(), batch_size=4)

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            if not cli.schedule:
                return optimizer
            # the usual sizing: Lightning sets the loader up here, before a checkpoint is read
            total = int(self.trainer.estimated_stepping_batches)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)
            stepped = {"scheduler": scheduler, "interval": "step"}
            return {"optimizer": optimizer, "lr_scheduler": stepped}


    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return make_loader()


    if cli.loader == "module":
        Tiny.train_dataloader = lambda self: make_loader(self.batch_size)
    if not cli.validate:
        del Tiny.validation_step, Tiny.val_dataloader


    class WaitForGo(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if cli.go and trainer.global_step == cli.wait_at and not os.path.exists(cli.go):
                rank, step = trainer.global_rank, trainer.global_step
                print(f"rank {rank} waiting at step {step}", flush=True)
                deadline = time.monotonic() + 60
                while not os.path.exists(cli.go) and time.monotonic() < deadline:
                    time.sleep(0.05)


    class Counts(pl.Callback):
        def __init__(self):
            self.at_epoch_start = []

        def on_train_epoch_start(self, trainer, *_):
            self.at_epoch_start.append(float(trainer.num_training_batches))


    counts = Counts()
    finder = pl.callbacks.BatchSizeFinder(init_val=2, max_trials=3, steps_per_trial=2)
    trainer = pl.Trainer(
        max_steps=12,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=cli.devices,
        strategy="ddp" if cli.devices > 1 else "auto",
        default_root_dir=cli.out,
        log_every_n_steps=1,
        val_check_interval=4 if cli.validate else None,
        callbacks=[
            pl.callbacks.ModelCheckpoint(dirpath=cli.out, every_n_train_steps=4, save_top_k=-1),
            WaitForGo(),
            counts,
            *([finder] if cli.find_batch_size else []),
        ],
    )
    if cli.install:
        from memtui import hooks

        hooks.install(trainer, resume=bool(cli.ckpt_path))
    model = Tiny()
    if cli.loader == "datamodule":
        trainer.fit(model, datamodule=Data(), ckpt_path=cli.ckpt_path)
    elif cli.loader == "module":
        trainer.fit(model, ckpt_path=cli.ckpt_path)
    else:
        trainer.fit(model, train_dataloaders=make_loader(), ckpt_path=cli.ckpt_path)
    report = {
        "pid": os.getpid(),
        "model_batch_size": model.batch_size,
        "global_step": trainer.global_step,
        "accum_per_step": model.accum_per_step,
        "batches": model.batches,
        "counts_at_epoch_start": counts.at_epoch_start,
        "progress_bar": type(trainer.progress_bar_callback).__name__,
        "logged": [str(p.name) for p in Path(cli.out, "lightning_logs").glob("version_*/events.*")],
    }
    suffix = f".rank{trainer.global_rank}" if trainer.world_size > 1 else ""
    Path(cli.report + suffix).write_text(json.dumps(report))
    '''
)

MEMTUI_RUN = [sys.executable, "-m", "memtui", "run", "--", sys.executable]
"""``memtui run -- python``: the script with no memtui line."""

SAMPLES = 96


def write_script(tmp_path: Path) -> Path:
    """The training script, written where each test runs it."""
    script = tmp_path / "plain_loader.py"
    script.write_text(SCRIPT)
    return script


def the_one_run() -> str:
    """The id of the run the script registered (each test has its own runtime directory)."""
    from memtui.storage import registry

    runs: Any = wait_for(registry.list_runs, 30, what="the run to register")
    assert len(runs) == 1, runs
    return str(runs[0].run)


def queue(*changes: str) -> subprocess.CompletedProcess[str]:
    """``memtui set`` on the one run (a real client)."""
    return memtui_cli("set", the_one_run(), *changes)


def run(script: Path, launcher: list[str], out: Path, report: Path, *args: str) -> str:
    """Run ``script`` to its end without a pause; its output."""
    command = [*launcher, str(script), "--out", str(out), "--report", str(report), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def restart(script: Path, launcher: list[str], out: Path, report: Path, *args: str) -> str:
    """Run ``script`` again from the checkpoint of step 8 in ``out``; its output."""
    return run(
        script, launcher, out, report, *args, "--ckpt-path", str(out / "epoch=0-step=8.ckpt")
    )


def sizes(report: dict[str, Any]) -> list[int]:
    """The batch size of every batch the model's ``training_step`` saw."""
    return [batch["size"] for batch in report["batches"]]


def loaded_by_workers(batch: dict[str, Any], pid: int) -> bool:
    """Whether a batch was loaded in worker processes, not in the training process."""
    return pid not in batch["pids"]


@pytest.mark.parametrize(
    "source",
    [("--loader", "module"), ("--loader", "fit", "--schedule")],
    ids=["train_dataloader", "fit-argument-with-schedule"],
)
def test_memtui_run_takes_a_batch_size_and_workers_change_and_a_restart_keeps_them(
    tmp_path: Path, source: tuple[str, ...]
) -> None:
    """The loader from ``train_dataloader()``, or passed to ``fit`` with an LR schedule sized from
    ``trainer.estimated_stepping_batches`` (the loader then set up before a checkpoint is read)."""
    pytest.importorskip("lightning.pytorch")
    script = write_script(tmp_path)
    with paused_run(tmp_path, MEMTUI_RUN, script, *source) as paused:
        setting = queue("batch_size=6", "num_workers=2")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(120)
    first = json.loads(paused.report.read_text())
    pid = first["pid"]
    # 8 batches of 4 to the checkpoint of step 4; epoch 0's 64 samples left in 10 batches of 6
    # and one of 4, its last group alone at the epoch's end; epoch 1 at 6
    assert sizes(first) == [4] * 8 + [6] * 10 + [4] + [6] * 4
    assert first["accum_per_step"] == [2] * 9 + [1] + [2] * 2 and first["global_step"] == 12
    assert first["counts_at_epoch_start"] == [24, 16], "the epochs' real, finite batch counts"
    before, after = first["batches"][:8], first["batches"][8:]
    assert all(b["pids"] == [pid] and b["num_workers"] == 0 for b in before)
    assert all(loaded_by_workers(b, pid) and b["num_workers"] == 2 for b in after)
    assert len({p for b in after[:11] for p in b["pids"]}) == 2, "epoch 0 from two workers"
    epoch0 = [i for b in first["batches"][:19] for i in b["index"]]
    assert sorted(epoch0) == list(range(SAMPLES)), "epoch 0: every sample once"
    assert first["progress_bar"] == "RichProgressBar" and first["logged"]
    audit = (tmp_path / "out" / "memtui-audit.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in audit]
    assert [e["step"] for e in events if e.get("event") == "applied"] == [4], "in default_root_dir"

    # started again from the checkpoint of step 8 (48 samples of 6 after the change): the tuned
    # loader from its first batch, the 16 samples epoch 0 had left, then epoch 1
    out = tmp_path / "out"
    restart(script, MEMTUI_RUN, out, tmp_path / "restart.json", *source)
    second = json.loads((tmp_path / "restart.json").read_text())
    assert sizes(second) == [6, 6, 4] + [6] * 4 and second["global_step"] == 12
    assert second["accum_per_step"] == [2, 1, 2, 2]
    assert all(loaded_by_workers(b, second["pid"]) for b in second["batches"])
    assert {b["num_workers"] for b in second["batches"]} == {2}
    trained_before = [i for b in first["batches"] if b["step"] < 8 for i in b["index"]]
    resumed = [i for b in second["batches"][:3] for i in b["index"]]
    assert sorted(trained_before + resumed) == list(range(SAMPLES)), "the epoch went on exactly"


def test_the_install_line_tunes_a_datamodule_loader_whose_checkpoint_restarts_without_memtui(
    tmp_path: Path,
) -> None:
    pytest.importorskip("lightning.pytorch")
    script = write_script(tmp_path)
    args = ("--loader", "datamodule", "--install")
    with paused_run(tmp_path, PYTHON, script, *args) as paused:
        setting = queue("batch_size=6", "num_workers=1", "prefetch_factor=4")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(120)
    report = json.loads(paused.report.read_text())
    assert sizes(report) == [4] * 8 + [6] * 10 + [4] + [6] * 4
    after = report["batches"][8:]
    assert all(loaded_by_workers(b, report["pid"]) for b in after)
    assert {(b["num_workers"], b["prefetch_factor"]) for b in after} == {(1, 4)}
    assert len({p for b in after[:11] for p in b["pids"]}) == 1, "one worker"

    # the checkpoint keeps memtui's loader position apart from Lightning's loader states: the
    # script without its memtui line restarts from it on its own loader, as Lightning does
    output = restart(
        script, PYTHON, tmp_path / "out", tmp_path / "plain.json", "--loader", "datamodule"
    )
    plain = json.loads((tmp_path / "plain.json").read_text())
    assert set(sizes(plain)) == {4} and plain["global_step"] == 12
    assert all(b["pids"] == [plain["pid"]] for b in plain["batches"])
    assert not [line for line in output.splitlines() if line.startswith("memtui")], output


def test_a_batch_size_finder_under_memtui_run_trains_at_the_size_it_found(tmp_path: Path) -> None:
    """Lightning's ``BatchSizeFinder`` sets the loader up again for each trial and for the run:
    each takes the script's own batch size (memtui set none), as without memtui."""
    pytest.importorskip("lightning.pytorch")
    script = write_script(tmp_path)
    report_path = tmp_path / "report.json"
    run(script, MEMTUI_RUN, tmp_path / "out", report_path, "--find-batch-size")
    report = json.loads(report_path.read_text())
    assert report["model_batch_size"] == 8, "2, 4 and 8 fit: the finder chose 8"
    # the trials' batches (the last at 8), then the run's 12 steps of 2 batches of 8
    assert sizes(report)[-24:] == [8] * 24 and report["global_step"] == 12
    assert report["counts_at_epoch_start"][-1] == SAMPLES / 8


@pytest.mark.parametrize("loader", ["batch-sampler", "iterable"])
def test_a_loader_memtui_cannot_rebuild_keeps_its_knobs_and_says_why(
    tmp_path: Path, loader: str
) -> None:
    pytest.importorskip("lightning.pytorch")
    script = write_script(tmp_path)
    with paused_run(tmp_path, MEMTUI_RUN, script, "--loader", loader) as paused:
        refused = queue("batch_size=6")
        workers = queue("num_workers=2")
        setting = queue("grad_accum=3")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(120)
    why = {
        "batch-sampler": "batches with its own batch sampler (__main__.Groups)",
        "iterable": "reads an IterableDataset",
    }[loader]
    for answer, knob in ((refused, "batch_size"), (workers, "num_workers")):
        assert answer.returncode != 0
        assert f"{knob} is not tunable in this run" in answer.stderr, answer.stderr
        assert why in answer.stderr, answer.stderr
    report = json.loads(paused.report.read_text())
    assert set(sizes(report)) == {4}, "its own loader"
    assert all(b["pids"] == [report["pid"]] for b in report["batches"])
    assert report["accum_per_step"][:7] == [2] * 4 + [3] * 3, "the accumulation still changes"


def test_a_loader_memtui_does_not_own_counts_its_training_batches_and_no_validation(
    tmp_path: Path,
) -> None:
    """Under ``memtui run``, a loader memtui cannot rebuild (its own batch sampler) and a
    validation pass every 4 batches (16 rows of 10 ms each): every step counts its two training
    micro-batches of 4 rows, and its data wait leaves the validation pass out."""
    pytest.importorskip("lightning.pytorch")
    script = write_script(tmp_path)
    record = tmp_path / "run.mtrec"
    args = ("--loader", "batch-sampler", "--validate")
    out, report = tmp_path / "out", tmp_path / "report.json"
    command = [*MEMTUI_RUN, str(script), "--out", str(out), "--report", str(report), *args]
    env = {**os.environ, "MEMTUI_RECORD": str(record)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(report.read_text())["accum_per_step"] == [2] * 12
    (steps,) = recorded_steps(record).values()
    assert [s.step for s in steps] == list(range(1, 13))
    assert [s.samples for s in steps] == [8] * 12, "its own batches' rows, none of validation's"
    assert [s.micro_batches for s in steps] == [2] * 12
    # a validation pass takes ~160 ms (16 rows of 10 ms); a training batch is in memory
    waits = [s.data_wait_s for s in steps]
    assert max(waits) < 0.05, waits


def test_every_ddp_rank_takes_the_change_at_the_same_step_on_its_own_samples(
    tmp_path: Path,
) -> None:
    """``strategy="ddp"`` on two CPU processes under ``memtui run``: Lightning's distributed
    sampler stays in the rebuilt loader, each rank trains its half of every epoch."""
    pytest.importorskip("lightning.pytorch")
    script = write_script(tmp_path)
    with paused_run(tmp_path, MEMTUI_RUN, script, "--devices", "2", ranks=2) as paused:
        setting = queue("batch_size=6", "num_workers=1")
        assert setting.returncode == 0, setting.stderr + setting.stdout
        paused.go.touch()
        paused.finish(180)
    epochs: list[list[int]] = []
    for rank in (0, 1):
        report = json.loads(Path(f"{paused.report}.rank{rank}").read_text())
        # 48 samples a rank an epoch: 8 batches of 4, then 6, 6 and 4; epoch 1 at 6
        assert sizes(report) == [4] * 8 + [6, 6, 4] + [6] * 12, rank
        after = report["batches"][8:]
        assert all(loaded_by_workers(b, report["pid"]) for b in after), rank
        epochs.append([i for b in report["batches"][:11] for i in b["index"]])
    assert sorted(epochs[0] + epochs[1]) == list(range(SAMPLES)), "epoch 0: the ranks' halves"


def test_a_loader_is_rebuilt_from_its_own_arguments_with_the_new_knobs() -> None:
    """Everything but the knobs is the loader's own: the very sampler, its batching, collation,
    worker seeding and generator; options torch allows only with workers follow the workers."""
    import multiprocessing

    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    from memtui.hooks.rebuild import rebuild_factory, why_not_rebuilt

    data = TensorDataset(torch.arange(10))
    order = RandomSampler(data, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)

    def collate(batch: list[Any]) -> Any:
        return batch

    def seed_worker(worker: int) -> None:
        del worker

    own = DataLoader(
        data,
        batch_size=4,
        sampler=order,
        drop_last=True,
        num_workers=2,
        collate_fn=collate,
        worker_init_fn=seed_worker,
        generator=generator,
        persistent_workers=True,
        multiprocessing_context=multiprocessing.get_context("spawn"),
        timeout=5.0,
    )
    assert why_not_rebuilt(own) == ""
    factory = rebuild_factory(own)
    same = factory()
    assert (same.batch_size, same.num_workers, same.prefetch_factor) == (4, 2, 2)
    rebuilt = factory(batch_size=3, num_workers=1, pin_memory=False, prefetch_factor=5)
    assert type(rebuilt) is DataLoader and rebuilt.sampler is order and rebuilt.dataset is data
    assert (rebuilt.batch_size, rebuilt.drop_last, rebuilt.num_workers) == (3, True, 1)
    assert rebuilt.prefetch_factor == 5 and rebuilt.persistent_workers and rebuilt.timeout == 5.0
    assert rebuilt.collate_fn is collate and rebuilt.worker_init_fn is seed_worker
    assert rebuilt.generator is generator
    assert rebuilt.multiprocessing_context is own.multiprocessing_context
    alone = factory(num_workers=0)  # torch refuses these without worker processes
    assert alone.multiprocessing_context is None and not alone.persistent_workers
    assert alone.prefetch_factor is None

    # a loader given its own plain BatchSampler is rebuilt with that sampler and batch size
    batched = DataLoader(data, batch_sampler=BatchSampler(order, 2, False))
    assert why_not_rebuilt(batched) == ""
    assert rebuild_factory(batched)(batch_size=5).batch_sampler.sampler is order


def test_a_loader_memtui_cannot_rebuild_faithfully_is_named_with_why() -> None:
    import torch
    from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

    from memtui.hooks.rebuild import why_not_rebuilt

    data = TensorDataset(torch.arange(10))

    class Mine(DataLoader):  # type: ignore[type-arg]
        """A loader class of the script's own."""

    class Endless(Sampler):  # type: ignore[type-arg]
        """A sampler with no length."""

        def __iter__(self) -> Any:
            return iter(range(10))

    class Pairs(BatchSampler):
        """A batch sampler of the script's own."""

    cases = {
        "not a torch DataLoader": [torch.zeros(2)],
        "DataLoader subclass": Mine(data, batch_size=2),
        "does not batch": DataLoader(data, batch_size=None),
        "own batch sampler": DataLoader(data, batch_sampler=Pairs(range(10), 2, False)),
        "sampler has no length": DataLoader(data, batch_size=2, sampler=Endless()),
    }
    for why, loader in cases.items():
        assert why in why_not_rebuilt(loader), why
