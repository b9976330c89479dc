"""Run a training script as ``python SCRIPT ARGS...`` would, and write down what it really does,
from outside memtui: ``python witness.py SCRIPT ARGS...``.

torch's global hooks record, as JSON lines in ``$MEMTUI_WITNESS_OUT``:

* ``step``: before every optimizer step, its number in this process (``call``), the optimizer's
  own step count (Adam's ``step`` state + 1: it continues across a resume; null for a stateless
  optimizer), the LR of every param group (what the step uses), the live child processes
  (the loader's workers) and the process's resident memory read then (``rss``);
* ``forward``: every call of a top-level module (none other running): the shape of its first
  tensor input (or of the first inside a batch handed whole), whether in training mode (for a
  ``DistributedDataParallel`` wrapper: the module it wraps), and the step (``call``) it feeds: the one running, for
  a forward inside ``optimizer.step(closure)`` as Lightning calls it, else the next one; in
  training mode also ``rows``, a short digest of each row of that input (``row_digest``), its
  padding left out where the call has an ``attention_mask`` (only the positions whose mask is 1
  count): a sample has the same digest in whatever batch it lands, however that batch is padded;
* ``paused``: the step (``call``) named in ``$MEMTUI_WITNESS_PAUSE_AT`` (comma-separated) waits
  before it runs until the file ``go-<call>`` exists in ``$MEMTUI_WITNESS_GO_DIR``; the training
  forward (``forward``, counted from 1 in this process) named in
  ``$MEMTUI_WITNESS_PAUSE_AT_FORWARD`` waits before it runs until ``go-f<forward>`` exists (a
  position in micro-batches, whatever the optimizer steps they make).

Every record carries the process's ``rank`` (``$RANK``, 0 without it): the ranks of a job append
to the same file, each record in one ``write``.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any


class Witness:
    """The records of one training process."""

    def __init__(
        self,
        out: str,
        pause_at: set[int],
        go_dir: Path,
        pause_at_forward: frozenset[int] = frozenset(),
    ) -> None:
        # one write per record on a file opened for appending: the ranks' lines never interleave
        self.out = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank = int(os.environ.get("RANK") or 0)
        self.pause_at = pause_at
        self.go_dir = go_dir
        self.calls = 0
        self.pause_at_forward = pause_at_forward
        self.training_forwards = 0
        self.stepping = False
        self.local = threading.local()
        import psutil

        self.process = psutil.Process()
        self.write(kind="start", pid=os.getpid(), argv=sys.argv)

    def write(self, **record: Any) -> None:
        """One JSON line."""
        record["t"] = time.time()
        record["rank"] = self.rank
        os.write(self.out, (json.dumps(record) + "\n").encode())

    def workers(self) -> int:
        """The live child processes (a DataLoader's workers)."""
        import psutil

        return sum(1 for child in self.process.children() if child.status() != psutil.STATUS_ZOMBIE)

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Record one optimizer step, after waiting here if told to."""
        self.calls += 1
        opt_step = optimizer_step(optimizer)
        if self.calls in self.pause_at:
            self.write(kind="paused", call=self.calls, opt_step=opt_step)
            go = self.go_dir / f"go-{self.calls}"
            while not go.exists():
                time.sleep(0.02)
        self.write(
            kind="step",
            call=self.calls,
            opt_step=opt_step,
            lrs=[float(group["lr"]) for group in optimizer.param_groups],
            optimizer=type(optimizer).__name__,
            workers=self.workers(),
            rss=self.process.memory_info().rss,
        )
        self.stepping = True

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The step is done: the next forward feeds the next one."""
        self.stepping = False

    def before_forward(self, module: Any, args: Any) -> None:
        """Count the depth of module calls on this thread; wait before a training forward if
        told to."""
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        if depth or not training(module):
            return
        self.training_forwards += 1
        if self.training_forwards in self.pause_at_forward:
            self.write(kind="paused", forward=self.training_forwards, call=None)
            go = self.go_dir / f"go-f{self.training_forwards}"
            while not go.exists():
                time.sleep(0.02)

    def after_forward(self, module: Any, args: Any, *rest: Any) -> None:
        """Record the call of a top-level module (with its keyword arguments when torch gives them)."""
        self.local.depth = getattr(self.local, "depth", 1) - 1
        if self.local.depth:
            return
        kwargs = rest[0] if len(rest) == 2 else {}
        first = first_tensor(args, kwargs)
        record: dict[str, Any] = {
            "kind": "forward",
            "module": type(module).__name__,
            "training": training(module),
            "step": self.calls if self.stepping else self.calls + 1,
            "shape": list(first.shape) if first is not None else None,
        }
        # a model on the meta device (litgpt measures its FLOPs so) has no values to digest
        if record["training"] and first is not None and not first.is_meta:
            record["rows"] = row_digests(first, kwargs.get("attention_mask"))
        self.write(**record)


def training(module: Any) -> bool:
    """Whether a top-level module call trains: the mode of the module a wrapper wraps (a
    ``DistributedDataParallel``'s ``module``: Lightning switches its LightningModule between
    training and evaluation, never the wrapper around it), else the module's own."""
    import torch

    inner = getattr(module, "module", None)
    return bool((inner if isinstance(inner, torch.nn.Module) else module).training)


def optimizer_step(optimizer: Any) -> int | None:
    """The optimizer's own count of steps taken, plus one (None: it keeps no count)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None:
                return int(float(step)) + 1
    # Adam and its kind keep a count once they have stepped: an empty state is their first step
    return 1 if any("betas" in group for group in optimizer.param_groups) else None


def first_tensor(args: Any, kwargs: dict[str, Any]) -> Any:
    """The first tensor among a call's inputs (``input_ids`` first), else the first inside a
    list, tuple or dict among them (a batch handed whole to a wrapper, as Lightning's DDP
    wrapper is called with ``(batch, batch_idx)``); None: no tensor."""
    import torch

    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    for value in candidates:
        if isinstance(value, torch.Tensor):
            return value
    for value in candidates:
        inside = value.values() if isinstance(value, dict) else value
        if isinstance(inside, (list, tuple, type({}.values()))):
            for item in inside:
                if isinstance(item, torch.Tensor):
                    return item
    return None


def row_digest(values: Any) -> str:
    """A short digest of one sample's values (its token ids: a sequence of Python numbers, as
    ``tensor.tolist()`` gives them), the same whichever batch or process it came in: the harness
    computes it from the data set's own rows."""
    text = ",".join(map(str, values))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def row_digests(tensor: Any, mask: Any) -> list[str]:
    """The digest of each row of a batch (its first dimension), only the positions where
    ``mask`` (an attention mask of the same shape) is 1 where there is one."""
    import torch

    if tensor.dim() == 0:
        return [row_digest([tensor.item()])]
    rows = tensor.detach().cpu().reshape(tensor.shape[0], -1)
    if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(tensor.shape):
        keep = mask.detach().cpu().reshape(tensor.shape[0], -1) == 1
        return [row_digest(row[kept].tolist()) for row, kept in zip(rows, keep, strict=True)]
    return [row_digest(row.tolist()) for row in rows]


def main() -> None:
    """Install the hooks, then run the script as ``__main__`` with its own arguments."""
    script = Path(sys.argv[1]).resolve()
    pause_at = {int(x) for x in os.environ.get("MEMTUI_WITNESS_PAUSE_AT", "").split(",") if x}
    go_dir = Path(os.environ.get("MEMTUI_WITNESS_GO_DIR", "."))
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.parent)
    forwards = os.environ.get("MEMTUI_WITNESS_PAUSE_AT_FORWARD", "")
    pause_at_forward = frozenset(int(x) for x in forwards.split(",") if x)
    witness = Witness(os.environ["MEMTUI_WITNESS_OUT"], pause_at, go_dir, pause_at_forward)
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(witness.before_step)
    register_optimizer_step_post_hook(witness.after_step)
    torch.nn.modules.module.register_module_forward_pre_hook(witness.before_forward)
    torch.nn.modules.module.register_module_forward_hook(
        witness.after_forward, with_kwargs=True, always_call=True
    )
    runpy.run_path(str(script), run_name="__main__")
    witness.write(kind="end")


if __name__ == "__main__":
    main()
