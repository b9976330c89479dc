"""The demo training: a small GPT-style model on synthetic tokens whose data loading is slow.

Each sample waits like a read from slow storage (``--slow-data-ms``) and does a little real CPU
work, so with ``--workers 0`` the loop visibly starves on data and more workers fix it: a GPU
starved by a loader with no workers and no pinning, reproducible on any machine (waiting, unlike
busy work, does not compete with the training for the CPU cores). It runs on CUDA when present, else
on the CPU, saves a real checkpoint every ``--checkpoint-every`` steps and resumes from it with
``--resume``.

Run it as ``python -m memtui.demo --help`` or ``memtui demo``; its command line is in
:mod:`memtui.demo.options`.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memtui.core.stats import one_line
from memtui.demo.launcher import out_dir
from memtui.demo.options import claim_out, default_out, parse_args
from memtui.storage import ownfiles

with warnings.catch_warnings():
    # torch warns at import where NumPy is not installed; neither the demo nor memtui uses it,
    # and it was the first line the demo showed (a user's own script keeps the warning)
    warnings.filterwarnings("ignore", "Failed to initialize NumPy", UserWarning)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from memtui import hooks


@dataclass
class DemoConfig:
    """The demo's knobs, found by memtui under their usual names."""

    batch_size: int = 16
    gradient_accumulation_steps: int = 2
    num_workers: int = 0
    pin_memory: bool = False


class SlowTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic token sequences; each sample costs ``slow_ms`` of waiting plus a little CPU work."""

    def __init__(self, size: int, seq_len: int, vocab: int, slow_ms: float) -> None:
        self.size = size
        self.seq_len = seq_len
        self.vocab = vocab
        self.slow_s = slow_ms / 1000.0

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.slow_s > 0:
            time.sleep(self.slow_s)  # a read from slow storage: the loader waits, the CPU does not
        generator = torch.Generator().manual_seed(index)
        # a learnable sequence: a random walk over the vocabulary (real CPU work, a little)
        steps = torch.randint(-2, 3, (self.seq_len + 1,), generator=generator)
        tokens = (steps.cumsum(0) + index) % self.vocab
        return tokens[:-1], tokens[1:]


class TinyGPT(nn.Module):
    """A small causal transformer language model."""

    def __init__(
        self, vocab: int, seq_len: int, width: int = 128, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.after_loss_backward: Callable[[], None] | None = None
        """Called in backward right after the loss's gradient (``--memory-limit`` checks there)."""
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy."""
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.mask[:length, :length], is_causal=True)
        logits = self.head(hidden)
        if self.after_loss_backward is not None and logits.requires_grad:
            # runs right after the loss's backward, the step's memory peak on this model
            callback = self.after_loss_backward
            logits.register_hook(lambda grad: (callback(), grad)[1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tuner: hooks.Tuner,
    config: DemoConfig,
    epoch: int,
) -> None:
    """Write the checkpoint atomically, as memtui writes its own files: a new 0600 temp file
    (never through a link another account planted), flushed to the disk and renamed over it."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "memtui": tuner.state_dict(),
        "config": asdict(config),
        "epoch": epoch,
    }
    ownfiles.replace_with(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint at ``path``, read only if it is the user's own file and nobody else can
    write it (a checkpoint is unpickled: whoever wrote it runs code in the training); raise
    ``ownfiles.UnsafeFile`` otherwise."""
    with open(ownfiles.open_read(path), "rb") as handle:
        state: dict[str, Any] = torch.load(handle, map_location=device, weights_only=False)
    return state


def main(argv: list[str] | None = None) -> int:
    """Train until ``--steps``; print the run id first, then a progress line now and then."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.threads))
    use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:  # under torchrun: one process per rank (gloo on CPU, nccl on GPUs)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    out = args.out or default_out()
    try:
        out_dir(out)
    except OSError as exc:
        print(f"memtui demo: {one_line(exc)}", file=sys.stderr, flush=True)
        return 2
    if rank == 0 and (busy := claim_out(out)):  # the job's other ranks share rank 0's directory
        print(f"memtui demo: {busy}", file=sys.stderr, flush=True)
        return 2
    ckpt_path = out / "checkpoint.pt"
    if rank == 0:
        ownfiles.remove_stale_temps(ckpt_path)  # a save a kill interrupted

    config = DemoConfig(args.batch_size, args.grad_accum, args.workers, args.pin_memory)
    vocab = args.vocab
    net = TinyGPT(vocab, args.seq_len, args.width, args.layers, args.heads).to(device)
    model: nn.Module = DistributedDataParallel(net) if world > 1 else net
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dataset = SlowTokens(1_000_000, args.seq_len, vocab, args.slow_data_ms)

    options = hooks.Options()
    if args.memory_limit and not use_cuda:
        options.memory_limit = args.memory_limit
    tuner = hooks.install(
        config,
        model=net,
        optimizer=optimizer,
        state_dir=out,
        resume=args.resume,
        name=args.name,
        options=options,
        autotune=args.autotune,
        lr_scale=args.lr_scale,
    )
    # a short warm-up, then the base LR: memtui moves the base with the effective batch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    tuner.watch_scheduler(scheduler)

    def make_loader(batch_size: int, num_workers: int, pin_memory: bool) -> DataLoader:
        sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]] = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed
        )
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=num_workers > 0,
        )

    loader = tuner.loader(make_loader)
    epoch = 0
    if args.resume and ckpt_path.exists():
        try:
            state = load_checkpoint(ckpt_path, device)
        except OSError as exc:
            print(f"memtui demo: not resuming: {one_line(exc)}", file=sys.stderr, flush=True)
            tuner.close()
            return 2
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            scheduler.load_state_dict(state["scheduler"])
        tuner.load_state_dict(state["memtui"])
        epoch = int(state.get("epoch", 0))
    say = print if rank == 0 else _quiet
    ranks = f" ranks {world}" if world > 1 else ""
    say(f"run {tuner.run_id} pid {os.getpid()} device {device}{ranks} out {out}", flush=True)
    if tuner.resumed:
        say(
            "resumed tuned config: " + ", ".join(f"{k}={d.new}" for k, d in tuner.resumed.items()),
            flush=True,
        )
    if tuner.step_count:
        say(f"resumed from step {tuner.step_count}", flush=True)

    model.train()
    guard = tuner.guard()
    budget = MemoryBudget(args.memory_limit if not use_cuda else None)
    if budget.limit_bytes:
        net.after_loss_backward = budget.check
    started = time.perf_counter()
    last_report = (started, tuner.step_count, 0)
    samples_seen = 0
    loss = torch.zeros(())
    micro = 0
    try:
        while tuner.step_count < args.steps:
            loader.sampler.set_epoch(epoch)
            for tokens, targets in loader:
                tokens = tokens.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                micro += 1
                last_micro = micro >= config.gradient_accumulation_steps
                # DDP all-reduces on the last micro-batch of a step only: every rank must run the
                # same number of micro-batches per step, which is why changes land on all at once
                sync = nullcontext() if last_micro or world == 1 else model.no_sync()
                with guard, sync:  # an out-of-memory error here is reported (and maybe rolled back)
                    loss = model(tokens, targets) / config.gradient_accumulation_steps
                    loss.backward()
                if guard.rolled_back:  # the hook said what it rolled back; the step starts over
                    micro = 0
                    continue
                samples_seen += tokens.shape[0]
                if not last_micro:
                    continue
                micro = 0
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                tuner.step()
                step = tuner.step_count
                if step % args.checkpoint_every == 0 or step >= args.steps:
                    if rank == 0:
                        save_checkpoint(ckpt_path, net, optimizer, scheduler, tuner, config, epoch)
                    applied = tuner.checkpoint()  # on every rank, at the same step
                    if applied:
                        say(applied, flush=True)
                now = time.perf_counter()
                if rank == 0 and now - last_report[0] >= args.progress_every:
                    last_report = _progress(
                        now, last_report, step, args.steps, samples_seen, config, loss
                    )
                if step >= args.steps:
                    break
            else:
                epoch += 1
                continue
            break
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        return 130
    finally:
        loader.close()
        tuner.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    elapsed = time.perf_counter() - started
    say(f"done: {tuner.step_count} steps in {elapsed:.1f} s", flush=True)
    return 0


class MemoryBudget:
    """On CPU, the budget ``--memory-limit`` holds the process to: the demo's stand-in for a GPU's
    capacity, so a doubled micro-batch that no longer fits can run out of memory on a CPU too.

    Right after the loss's backward (where this model's memory peaks) it reads the process's peak
    resident memory since its last check (``hooks.peak_rss``: the kernel's mark, which memtui's
    sampler resets at each sample, merged with the peaks the sampler read before it did, so
    that no peak the hook saw escapes the budget): a peak over the budget raises
    ``MemoryError`` with the numbers, like CUDA's out-of-memory error.
    """

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes

    def check(self) -> None:
        """Raise MemoryError if the peak since the last reset went over the budget."""
        if not self.limit_bytes:
            return
        peak = hooks.peak_rss()  # since the last check: the next micro-batch is measured afresh
        if peak > self.limit_bytes:
            gib = 1 << 30
            raise MemoryError(
                f"CPU out of memory (the demo's --memory-limit). Tried to allocate "
                f"{(peak - self.limit_bytes) / gib:.2f} GiB. The budget has a total capacity of "
                f"{self.limit_bytes / gib:.2f} GiB of which 0 bytes is free. Including non-PyTorch "
                f"memory, this process has {peak / gib:.2f} GiB memory in use."
            )


def _quiet(*_args: object, **_kwargs: object) -> None:
    """Ranks other than 0 print nothing (their telemetry is in memtui)."""


def _progress(
    now: float,
    last: tuple[float, int, int],
    step: int,
    total: int,
    samples: int,
    config: DemoConfig,
    loss: torch.Tensor,
) -> tuple[float, int, int]:
    t0, step0, samples0 = last
    dt = max(now - t0, 1e-9)
    ms_per_step = 1000 * dt / max(step - step0, 1)
    rate = (samples - samples0) / dt
    value = float(loss.detach()) * config.gradient_accumulation_steps
    print(
        f"step {step}/{total}  {ms_per_step:.0f} ms/step  {rate:.0f} samples/s  "
        f"batch {config.batch_size}x{config.gradient_accumulation_steps}  "
        f"workers {config.num_workers}  pin {'on' if config.pin_memory else 'off'}  "
        f"loss {value if math.isfinite(value) else float('nan'):.3f}",
        flush=True,
    )
    return now, step, samples


if __name__ == "__main__":
    sys.exit(main())
