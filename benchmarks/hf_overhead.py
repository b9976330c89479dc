"""memtui's overhead inside the Hugging Face Trainer loop on CPU: interleaved A/B, one JSON line.

Each round trains a tiny GPT-2 (built from a config) for ``--steps`` optimizer steps with the
plain Trainer (A) and with ``hooks.install(trainer)`` (B); the step time is measured between
``on_step_end`` calls. Reported: median step time of each and the overhead in %.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtb", dir="/tmp"))

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging

from memtui import hooks

hf_logging.set_verbosity_error()


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Synthetic token ids."""

    def __init__(self, size: int, seq: int) -> None:
        self.ids = torch.randint(0, 256, (size, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepTimes(TrainerCallback):
    """Wall time between optimizer steps."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.times: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def one_run(with_hook: bool, steps: int, out: str) -> list[float]:
    """Train ``steps`` steps; return the step times after the first few (warm-up)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    args = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
    )
    timer = StepTimes()
    trainer = Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(1024, 64), callbacks=[timer]
    )
    tuner = hooks.install(trainer) if with_hook else None
    trainer.train()
    if tuner is not None:
        tuner.close()
    return timer.times[3:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    plain: list[float] = []
    hooked: list[float] = []
    with tempfile.TemporaryDirectory() as out:
        for round_index in range(cli.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for with_hook in order:
                (hooked if with_hook else plain).extend(one_run(with_hook, cli.steps, out))
    a, b = statistics.median(plain), statistics.median(hooked)
    print(
        json.dumps(
            {
                "benchmark": "hf_trainer_overhead",
                "steps_each": len(plain),
                "median_step_ms_without": round(a * 1e3, 3),
                "median_step_ms_with": round(b * 1e3, 3),
                "overhead_percent": round((b - a) / a * 100, 2),
                "torch_threads": 1,
            }
        )
    )


if __name__ == "__main__":
    main()
