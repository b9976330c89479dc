"""A tiny GPT-2 (built from a config, no download) trained by the Hugging Face Trainer with memtui.

Synthetic token ids; the model records which samples the loop trained on. Waits at step
``--wait-at`` for ``--go`` to exist (the test queues a change meanwhile), then writes what
happened to ``--report`` as JSON (``--report`` with ``.rank<r>`` appended under several
processes): the steps, learning rates and epochs the Trainer logged, the samples, the
optimizer's state at each save and right after each in-process resume (a digest of every
tensor), the loader of each ``train`` segment and the loader worker processes alive at each
step.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from memtui import hooks

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--report", required=True)
parser.add_argument("--go", default="")
parser.add_argument("--wait-at", type=int, default=2)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--max-steps", type=int, default=12)
parser.add_argument("--save-steps", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--grad-accum", type=int, default=2)
parser.add_argument("--no-memtui", action="store_true")
parser.add_argument("--report-to", default="", help="a report_to integration (tensorboard)")
parser.add_argument("--save-only-model", action="store_true")
parser.add_argument("--save-total-limit", type=int, default=None)
parser.add_argument("--best", action="store_true", help="evaluate at each save; keep the best")
parser.add_argument("--drop-scheduler", action="store_true", help="delete scheduler.pt at saves")
parser.add_argument("--resume-from", default="", help="a restart: this checkpoint, the tuned YAML")
cli = parser.parse_args()

SEQ = 16
seen: list[int] = []
seen_at_step: dict[int, int] = {}
workers_at_step: dict[int, int] = {}
saved: dict[int, dict[str, Any]] = {}
"""The optimizer's state at each save (global step: digest)."""
resumed: list[dict[str, Any]] = []
"""What each ``train`` segment after the first started from."""
loaders: list[dict[str, Any]] = []
"""The DataLoader each ``train`` segment iterates."""


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic token ids, distinct per sample (the model's input tells which sample it is)."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (size, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def digest(optimizer: Any) -> dict[str, dict[str, Any]]:
    """Every state tensor of ``optimizer`` (by parameter index): its bytes' hash and its norm."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        str(index): {
            name: [
                hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest(),
                float(t.detach().float().norm()),
            ]
            for name, t in state.items()
        }
        for index, state in inner.state_dict()["state"].items()
    }


class WaitForGo(TrainerCallback):
    """Holds the run at one step until the test has queued its change; records the rest."""

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        loader = kwargs["train_dataloader"]
        loaders.append(
            {
                "num_workers": loader.num_workers,
                "pin_memory": loader.pin_memory,
                "prefetch_factor": loader.prefetch_factor,
            }
        )
        if state.global_step > 0:  # a resume: the optimizer and scheduler are loaded by now
            optimizer, scheduler = kwargs["optimizer"], kwargs["lr_scheduler"]
            resumed.append(
                {
                    "step": state.global_step,
                    "optimizer": digest(optimizer),
                    "lr": optimizer.param_groups[0]["lr"],
                    "scheduler_last_epoch": scheduler.last_epoch,
                }
            )

    def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        saved[state.global_step] = digest(kwargs["optimizer"])
        if cli.drop_scheduler and args.should_save:  # before memtui's boundary (added later)
            Path(args.output_dir, f"checkpoint-{state.global_step}", "scheduler.pt").unlink()

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        seen_at_step[state.global_step] = len(seen)
        workers_at_step[state.global_step] = len(psutil.Process().children())
        if cli.go and state.global_step == cli.wait_at:
            print(f"rank {args.process_index} waiting at step {state.global_step}", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(cli.go) and time.monotonic() < deadline:
                time.sleep(0.05)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2))
dataset = Tokens(cli.samples)
index_of = {tuple(row.tolist()): i for i, row in enumerate(dataset.ids)}


def record(module, args, kwargs):  # type: ignore[no-untyped-def]
    """Every sample the model is trained on, in order (what the loop really consumed)."""
    if module.training:
        seen.extend(index_of[tuple(row.tolist())] for row in kwargs["input_ids"])


model.register_forward_pre_hook(record, with_kwargs=True)
evaluations = itertools.count()
best: dict[str, Any] = {}
if cli.best:  # each evaluation scores lower than the last: the first save stays the best one
    best = {
        "eval_strategy": "steps",
        "eval_steps": cli.save_steps,
        "load_best_model_at_end": True,
        "metric_for_best_model": "order",
        "greater_is_better": True,
    }
args = TrainingArguments(
    output_dir=cli.out,
    max_steps=cli.max_steps,
    per_device_train_batch_size=cli.batch_size,
    gradient_accumulation_steps=cli.grad_accum,
    learning_rate=1e-3,
    lr_scheduler_type="linear",
    save_strategy="steps",
    save_steps=cli.save_steps,
    logging_steps=1,
    report_to=[cli.report_to] if cli.report_to else [],
    use_cpu=True,
    dataloader_num_workers=0,
    # the Trainer's own tqdm progress bar stays on, as in a user's run
    seed=7,
    save_only_model=cli.save_only_model,
    save_total_limit=cli.save_total_limit,
    **best,
)
trainer = Trainer(
    model=model,
    args=args,
    train_dataset=dataset,
    eval_dataset=Tokens(8) if cli.best else None,
    compute_metrics=(lambda _: {"order": -next(evaluations)}) if cli.best else None,
    callbacks=[WaitForGo()],
)
# the one line (a restart also takes the tuned config from the state dir: resume=True)
tuner = None if cli.no_memtui else hooks.install(trainer, resume=bool(cli.resume_from))
if tuner is not None:
    print(f"run {tuner.run_id} rank {tuner.rank} of {tuner.world_size}", flush=True)
output = trainer.train(resume_from_checkpoint=cli.resume_from or None)
steps = [e["step"] for e in trainer.state.log_history if "learning_rate" in e]
lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
epochs = [e["epoch"] for e in trainer.state.log_history if "learning_rate" in e]
report = {
    "global_step": trainer.state.global_step,
    "output_step": output.global_step,
    "steps": steps,
    "lrs": lrs,
    "epochs": epochs,
    "epoch": trainer.state.epoch,
    "seen": seen,
    "seen_at_step": seen_at_step,
    "workers_at_step": workers_at_step,
    "saved": saved,
    "resumed": resumed,
    "loaders": loaders,
    "checkpoints": sorted(p.name for p in Path(cli.out).glob("checkpoint-*")),
    "args": {
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
    },
    "loader_args": {
        "dataloader_num_workers": trainer.args.dataloader_num_workers,
        "dataloader_pin_memory": trainer.args.dataloader_pin_memory,
        "dataloader_prefetch_factor": trainer.args.dataloader_prefetch_factor,
    },
    "tuner_step": tuner.step_count if tuner is not None else None,
    "restarts": tuner.adapter.restarts if tuner is not None else 0,
    "orders": [tuner.adapter.sampler.order(e) for e in range(3)] if tuner is not None else [],
    "rank": args.process_index,
    "world_size": args.world_size,
    "coordinated": tuner is not None and tuner.coordinator is not None,
    "applied": [[a.step, sorted(a.changes)] for a in tuner.control.applied]
    if tuner is not None
    else [],
    "rejected": [[r.step, r.reason] for r in tuner.control.rejected] if tuner is not None else [],
    "disabled": tuner.control.disabled if tuner is not None else "",
}
suffix = f".rank{args.process_index}" if args.world_size > 1 else ""
Path(cli.report + suffix).write_text(json.dumps(report))
if tuner is not None:
    tuner.close()
