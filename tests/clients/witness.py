"""Run a training script as ``python SCRIPT ARGS...`` would, and write down what it really does,
from outside memtui: ``python witness.py SCRIPT ARGS...``.

torch's global hooks record, as JSON lines in ``$MEMTUI_WITNESS_OUT``:

* ``step``: before every optimizer step, its number in this process (``call``), the optimizer's
  own step count (Adam's ``step`` state + 1: it continues across a resume; null for a stateless
  optimizer), the LR of every param group (what the step uses) and the live child processes
  (the loader's workers);
* ``forward``: every call of a top-level module (none other running): the shape of its first
  tensor input, whether in training mode, and the step (``call``) it feeds: the one running, for
  a forward inside ``optimizer.step(closure)`` as Lightning calls it, else the next one;
* ``paused``: the step (``call``) named in ``$MEMTUI_WITNESS_PAUSE_AT`` (comma-separated) waits
  before it runs until the file ``go-<call>`` exists in ``$MEMTUI_WITNESS_GO_DIR``.
"""

from __future__ import annotations

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

    def __init__(self, out: str, pause_at: set[int], go_dir: Path) -> None:
        self.out = open(out, "a", buffering=1)  # noqa: SIM115 (open until the process ends)
        self.pause_at = pause_at
        self.go_dir = go_dir
        self.calls = 0
        self.stepping = False
        self.local = threading.local()
        import psutil

        self.process = psutil.Process()
        self.write(kind="start", pid=os.getpid(), argv=sys.argv)

    def write(self, **record: Any) -> None:
        """One JSON line."""
        record["t"] = time.time()
        self.out.write(json.dumps(record) + "\n")

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
        )
        self.stepping = True

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The step is done: the next forward feeds the next one."""
        self.stepping = False

    def before_forward(self, module: Any, args: Any) -> None:
        """Count the depth of module calls on this thread."""
        self.local.depth = getattr(self.local, "depth", 0) + 1

    def after_forward(self, module: Any, args: Any, *rest: Any) -> None:
        """Record the call of a top-level module (with its keyword arguments when torch gives them)."""
        self.local.depth = getattr(self.local, "depth", 1) - 1
        if self.local.depth:
            return
        kwargs = rest[0] if len(rest) == 2 else {}
        self.write(
            kind="forward",
            module=type(module).__name__,
            training=bool(module.training),
            step=self.calls if self.stepping else self.calls + 1,
            shape=first_shape(args, kwargs),
        )


def optimizer_step(optimizer: Any) -> int | None:
    """The optimizer's own count of steps taken, plus one (None: it keeps no count)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None:
                return int(float(step)) + 1
    # Adam and its kind keep a count once they have stepped: an empty state is their first step
    return 1 if any("betas" in group for group in optimizer.param_groups) else None


def first_shape(args: Any, kwargs: dict[str, Any]) -> list[int] | None:
    """The shape of the first tensor among a call's inputs (``input_ids`` first)."""
    import torch

    candidates = [kwargs.get("input_ids"), *args, *kwargs.values()]
    for value in candidates:
        if isinstance(value, torch.Tensor):
            return list(value.shape)
    return None


def main() -> None:
    """Install the hooks, then run the script as ``__main__`` with its own arguments."""
    script = Path(sys.argv[1]).resolve()
    pause_at = {int(x) for x in os.environ.get("MEMTUI_WITNESS_PAUSE_AT", "").split(",") if x}
    go_dir = Path(os.environ.get("MEMTUI_WITNESS_GO_DIR", "."))
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.parent)
    witness = Witness(os.environ["MEMTUI_WITNESS_OUT"], pause_at, go_dir)
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
