"""The documented plain loop shared by benchmarks/advice_truth.py's scripts, held to MEMTUI_MEMORY_LIMIT by the demo's budget."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from memtui import hooks
from memtui.core.stats import parse_bytes
from memtui.demo.train import MemoryBudget


def parse_args(description: str, batch_size: int) -> argparse.Namespace:
    """The knobs under their usual names, and the loop's own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--batch_size", type=int, default=batch_size)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--pin_memory", action="store_true")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--checkpoint_every", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("ckpt"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slow_data_ms", type=float, default=0.0, help="a loader this slow per sample (it sleeps)"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads))
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def train(
    args: argparse.Namespace,
    tuner: hooks.Tuner,
    loader: Iterable[Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_of: Callable[[Any], torch.Tensor],
) -> int:
    """Train until ``args.steps``; print the run id first and each applied change."""
    print(f"run {tuner.run_id} pid {os.getpid()}", flush=True)
    limit = os.environ.get("MEMTUI_MEMORY_LIMIT")
    budget = MemoryBudget(parse_bytes(limit) if limit else None)
    checkpoint = args.out / "checkpoint.pt"
    guard = tuner.guard()
    started = time.perf_counter()
    micro = 0
    model.train()
    try:
        while tuner.step_count < args.steps:
            for batch in loader:
                with guard:  # a MemoryError here is reported, and a change that grew the run undone
                    loss = loss_of(batch) / args.gradient_accumulation_steps
                    loss.backward()
                    budget.check()
                if guard.rolled_back:
                    micro = 0
                    continue
                micro += 1
                if micro < args.gradient_accumulation_steps:
                    continue
                micro = 0
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tuner.step()
                if tuner.step_count % args.checkpoint_every == 0:
                    state = {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "memtui": tuner.state_dict(),
                    }
                    torch.save(state, checkpoint)
                    if applied := tuner.checkpoint():
                        print(f"step {tuner.step_count}: {applied}", flush=True)
                if tuner.step_count >= args.steps:
                    break
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        tuner.close()
    print(f"done: {tuner.step_count} steps in {time.perf_counter() - started:.1f} s", flush=True)
    return 0


class Slowed(Dataset[Any]):
    """A dataset whose every sample costs ``ms`` milliseconds more (a slow decoder or disk)."""

    def __init__(self, dataset: Dataset[Any], ms: float) -> None:
        self.dataset = dataset
        self.seconds = ms / 1000

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.seconds)
        return self.dataset[index]


def loader_factory(
    dataset: Dataset[Any],
    collate_fn: Callable[[list[Any]], Any] | None = None,
    slow_data_ms: float = 0.0,
) -> Callable[[int, int, bool], DataLoader[Any]]:
    """The DataLoader factory ``tuner.loader`` rebuilds with new knobs (``slow_data_ms``: each
    sample that much slower to load)."""
    if slow_data_ms > 0:
        dataset = Slowed(dataset, slow_data_ms)

    def make(batch_size: int, num_workers: int, pin_memory: bool) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=num_workers,
            pin_memory=pin_memory,
            collate_fn=collate_fn,
            persistent_workers=num_workers > 0,
        )

    return make


def sample_generator(index: int, seed: int = 0) -> torch.Generator:
    """A generator seeded by the sample's index: the same sample in any worker, any epoch."""
    return torch.Generator().manual_seed(seed * 1_000_003 + index)
