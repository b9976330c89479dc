"""A hooked training on CUDA for the gpu tests: ``python cuda_train.py SCENARIO OUT_DIR``.

Each scenario trains a small token model on ``cuda:0`` with memtui installed (``Tuner``, the
guard, ``checkpoint()`` every few steps) and writes what it saw to ``OUT_DIR/result.json``:

* ``oom``: a micro-batch far past device memory is queued; the OOM in ``tuner.guard()`` is caught,
  rolled back, and training goes on;
* ``predict``: two increases of the micro-batch, each with its predicted and observed peak;
* ``sync``: ``torch.cuda.set_sync_debug_mode("error")`` over the same loop without memtui, then
  with it (the sampler sampling every 20 ms, a change applied at a boundary);
* ``peaks``: the training's own ``max_memory_allocated()`` across many samples of the hook;
* ``nvml``: memtui's CUDA probe (NVML) against ``torch.cuda.mem_get_info``;
* ``serve``: train until ``OUT_DIR/stop`` appears, for a client in another process
  (``client_on_cuda.py``) to watch and change with the command line, as a user would.

``MEMTUI_GPU_TEST_DEVICE`` (default ``cuda:0``) and ``MEMTUI_GPU_TEST_BATCH`` (default 256) move
``serve`` to another device and micro-batch: a rehearsal of the client's steps on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from memtui import hooks
from memtui.wire import SetRequest, all_fields

SEQ = 64
VOCAB = 1024
WIDTH = 1024
HUGE_BATCH = 1 << 17
"""Micro-batch whose first activations alone (HUGE_BATCH x SEQ x 4 WIDTH floats: 128 GiB) exceed
any single GPU's memory; its tokens on the host are only 64 MiB."""


@dataclass
class Config:
    batch_size: int = int(os.environ.get("MEMTUI_GPU_TEST_BATCH", "256"))
    grad_accum: int = 1
    num_workers: int = 0
    pin_memory: bool = True


class Tokens(Dataset[torch.Tensor]):
    """Token rows cut from one fixed tensor (cheap for any micro-batch)."""

    def __init__(self, rows: int = 1 << 20) -> None:
        self.rows = rows
        self.table = torch.randint(
            0, VOCAB, (4096, SEQ), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.table[index % len(self.table)]


class Net(nn.Module):
    """Embedding, two MLP blocks and a head: activations grow linearly with the micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                for _ in range(2)
            )
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(tokens)))
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


class Run:
    """The model, optimizer, config and (once installed) the tuner and its loader."""

    def __init__(self, out: Path, options: hooks.Options | None = None) -> None:
        self.device = torch.device(os.environ.get("MEMTUI_GPU_TEST_DEVICE", "cuda:0"))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.net = Net().to(self.device)
        # SGD keeps its state on the device and never reads it back (no synchronisation)
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=1e-3, momentum=0.9)
        self.config = Config()
        self.dataset = Tokens()
        self.out = out
        self.options = options or hooks.Options(
            device_period_s=0.02, idle_device_period_s=0.02, flush_period_s=0.1, idle_flush_s=0.1
        )
        self.tuner: hooks.Tuner | None = None
        self.loader: Any = None
        """The tuner's loader once installed (one for the run), else a plain DataLoader."""
        self.rows_seen: list[int] = []
        """The micro-batch of each step's tokens as the loop received them, in order."""

    def make_loader(self, batch_size: int, num_workers: int, pin_memory: bool) -> DataLoader:
        return DataLoader(
            self.dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory
        )

    def install(self) -> hooks.Tuner:
        self.tuner = hooks.install(
            self.config,
            model=self.net,
            optimizer=self.optimizer,
            state_dir=self.out,
            name="gpu-test",
            options=self.options,
        )
        self.loader = self.tuner.loader(self.make_loader)
        print(f"run {self.tuner.run_id}", flush=True)
        return self.tuner

    def train(self, steps: int, until: Any = None, checkpoint_every: int = 5) -> int:
        """Train ``steps`` optimizer steps (or until ``until()``); returns the rollbacks seen."""
        tuner = self.tuner
        loader = self.loader or self.make_loader(self.config.batch_size, 0, True)
        guard = tuner.guard() if tuner else None
        done = rollbacks = 0
        while done < steps and not (until and until()):
            for tokens in loader:
                tokens = tokens.to(self.device, non_blocking=True)
                if len(self.rows_seen) < 100_000:
                    self.rows_seen.append(int(tokens.shape[0]))
                if guard is not None:
                    with guard:
                        self.net(tokens).backward()
                    if guard.rolled_back:
                        rollbacks += 1
                        continue
                else:
                    self.net(tokens).backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                done += 1
                if tuner is not None:
                    tuner.step()
                    if tuner.step_count % checkpoint_every == 0:
                        tuner.checkpoint()
                if done >= steps or (until and until()):
                    break
        return rollbacks

    def queue(self, **changes: Any) -> None:
        assert self.tuner is not None
        reply = self.tuner.control.queue(SetRequest(changes=changes, client="gpu-test", force=True))
        assert reply.ok, reply.reason


def wait_model(run: Run, batch: int, timeout: float = 120.0) -> None:
    """Train until the memory model is fitted at micro-batch ``batch``."""
    tuner = run.tuner
    assert tuner is not None
    deadline = time.monotonic() + timeout

    def fitted() -> bool:
        model = tuner.control.model
        return (model is not None and model.batch_size == batch) or time.monotonic() > deadline

    run.train(10**9, until=fitted)
    assert tuner.control.model is not None and tuner.control.model.batch_size == batch


def scenario_oom(run: Run) -> dict[str, Any]:
    tuner = run.install()
    wait_model(run, run.config.batch_size)
    safe = run.config.batch_size
    run.queue(batch_size=HUGE_BATCH)
    rollbacks = run.train(20, checkpoint_every=1)
    events = tuner.control.state().ooms
    return {
        "safe_batch": safe,
        "batch_after": run.config.batch_size,
        "rollbacks": rollbacks,
        "steps": tuner.step_count,
        "ooms": [all_fields(e) for e in events],
        "capacity": torch.cuda.get_device_properties(0).total_memory,
        "errors": tuner.errors.count,
    }


def scenario_predict(run: Run) -> dict[str, Any]:
    tuner = run.install()
    wait_model(run, run.config.batch_size)
    for batch in (512, 1024):
        run.queue(batch_size=batch)
        deadline = time.monotonic() + 180

        def measured(batch: int = batch, deadline: float = deadline) -> bool:
            applied = [a for a in tuner.control.applied_changes() if not a.rollback]
            last = applied[-1] if applied else None
            done = last is not None and "batch_size" in last.changes and last.effect is not None
            return bool(done and last and last.changes["batch_size"].new == batch) or (
                time.monotonic() > deadline
            )

        run.train(10**9, until=measured)
    changes = [
        {
            "batch": a.changes["batch_size"].new,
            "predicted": a.predicted_peak_bytes,
            "observed": a.observed_peak_bytes,
        }
        for a in tuner.control.applied_changes()
        if "batch_size" in a.changes and not a.rollback
    ]
    return {"changes": changes, "errors": tuner.errors.count}


def scenario_sync(run: Run) -> dict[str, Any]:
    run.train(5)  # warm up: cuBLAS handles, the caching allocator's first blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    bare = hooked = None
    try:
        run.train(30)
    except RuntimeError as exc:
        bare = str(exc)
    torch.cuda.set_sync_debug_mode(0)
    tuner = run.install()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run.train(20, checkpoint_every=5)
        run.queue(batch_size=128)  # applied at the next boundary: loader rebuilt, peaks reset
        run.train(40, checkpoint_every=5)
    except RuntimeError as exc:
        hooked = str(exc)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    samples = list(tuner.agent.publisher.device) if tuner.agent else []
    return {
        "bare_error": bare,
        "hooked_error": hooked,
        "errors": tuner.errors.count,
        "last_error": str(tuner.errors.last or ""),
        "cuda_samples": sum(s.kind == "cuda" for s in samples),
        "batch_after": run.config.batch_size,
        "steps": tuner.step_count,
    }


def scenario_peaks(run: Run) -> dict[str, Any]:
    tuner = run.install()
    run.train(10)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    spike = torch.empty(8 << 30, dtype=torch.uint8, device=run.device)  # 8 GiB, then freed
    # read while the spike is alive: a reset of the hook's in between cannot hide it
    mine = torch.cuda.max_memory_allocated()
    del spike
    started = time.monotonic()
    run.train(10**9, until=lambda: time.monotonic() - started > 2.0)  # ~100 samples of the hook
    torch.cuda.synchronize()
    later = torch.cuda.max_memory_allocated()
    samples = list(tuner.agent.publisher.device) if tuner.agent else []
    return {
        "mine": mine,
        "later": later,
        "hook_peak": max((s.peak_allocated_bytes for s in samples if s.kind == "cuda"), default=0),
        "cuda_samples": sum(s.kind == "cuda" for s in samples),
        "reset_peaks": run.options.reset_peaks,
        "errors": tuner.errors.count,
    }


def scenario_nvml(run: Run) -> dict[str, Any]:
    import pynvml

    from memtui.hooks.sampler import CudaDeviceProbe

    def both() -> dict[str, int]:
        probe = CudaDeviceProbe(torch.cuda, 0, pynvml)
        probe.NVML_PERIOD_S = 0.0
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(0)
        sample = probe.sample(step=0)
        return {
            "nvml_used": int(sample.nvml_used_bytes or -1),
            "nvml_total": int(sample.nvml_total_bytes or -1),
            "cuda_free": int(free),
            "cuda_total": int(total),
            "capacity": sample.capacity_bytes,
        }

    before = both()
    block = torch.empty(2 << 30, dtype=torch.uint8, device=run.device)
    after = both()
    del block
    return {"before": before, "after": after}


def scenario_serve(run: Run) -> dict[str, Any]:
    tuner = run.install()
    stop = run.out / "stop"
    started = time.monotonic()
    run.train(10**9, until=lambda: stop.exists() or time.monotonic() - started > 300)
    applied = [a for a in tuner.control.applied_changes() if not a.rollback]
    return {
        "device": str(run.device),
        "steps": tuner.step_count,
        "batch_size": run.config.batch_size,
        "num_workers": run.config.num_workers,
        "rows_last": run.rows_seen[-5:],
        "applied": [
            {"step": a.step, "changes": {k: [d.old, d.new] for k, d in a.changes.items()}}
            for a in applied
        ],
        "errors": tuner.errors.count,
        "last_error": str(tuner.errors.last or ""),
        "stopped": stop.exists(),
    }


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    options = None
    if scenario == "peaks":
        options = hooks.Options(device_period_s=0.02, idle_device_period_s=0.02)
    run = Run(out, options)
    result = {
        "oom": scenario_oom,
        "predict": scenario_predict,
        "sync": scenario_sync,
        "peaks": scenario_peaks,
        "nvml": scenario_nvml,
        "serve": scenario_serve,
    }[scenario](run)
    if run.tuner is not None:
        run.tuner.close()
    (out / "result.json").write_text(json.dumps(result, default=str))
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
