"""The user's tracker in a plain loop: the tracker guide's ``tuner.on_event`` example, run inside a real
CPU training that takes a change from ``memtui set`` and runs out of memory with it, writes each
event into a TensorBoard event file at the step it landed (read back with the tensorboard
package's reader): the change, the post-mortem and the rollback while training goes on, or the
change and the post-mortem of a run that dies of it (no rollback); a callback that raises is
counted in ``memtui status``'s errors and training goes on.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tests.integration.test_docs import example
from tests.support.cli import memtui_here, status_json
from tests.support.clock import patience
from tests.support.forkserver import ForkedDemo
from tests.support.processes import launch_script, wait_for
from tests.support.tbevents import read_events

SETUP = """
import os, sys, time
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, TensorDataset

from memtui import hooks

out = sys.argv[1]
LIMIT = 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 1)

    def forward(self, x):
        if x.shape[0] > LIMIT:  # the CPU analogue of CUDA's out-of-memory error
            raise MemoryError(f"CPU out of memory. Tried to allocate {x.shape[0] * 64} bytes")
        return self.body(x)


config = SimpleNamespace(batch_size=8, gradient_accumulation_steps=1, num_workers=0, pin_memory=False)
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
tuner = hooks.install(
    config, model=net, optimizer=optimizer, state_dir=out, name="tracker", auto_step=True
)
"""

LOOP = """

def broken(event, step):
    raise RuntimeError(f"a tracker that fails at step {step}")


tuner.on_event(broken)
dataset = TensorDataset(torch.randn(512, 16), torch.randn(512, 1))
loader = tuner.loader(
    lambda batch_size, num_workers, pin_memory: DataLoader(dataset, batch_size=batch_size)
)
print("run", tuner.run_id, flush=True)
guard = tuner.guard()
stop = os.path.join(out, "stop")
while not os.path.exists(stop):
    for x, y in loader:
        with guard:
            torch.nn.functional.mse_loss(net(x), y).backward()
        if guard.rolled_back:
            print("rolled back", flush=True)
        else:
            optimizer.step()  # counts the step (auto_step)
            optimizer.zero_grad()
            time.sleep(0.01)
            if tuner.step_count % 5 == 0 and (applied := tuner.checkpoint()):
                print(applied, flush=True)
        if os.path.exists(stop):
            break
tuner.close()
writer.close()
print("done", tuner.step_count, flush=True)
"""


REBUILT = (
    "(the data loader is rebuilt at the next batch; warning: effective batch 8 -> 16, the LR "
    "does not follow (rule none))"
)
AT_16 = "batch_size=16 grad_accum=1 num_workers=0 pin_memory=false prefetch_factor=2"
"""The config the script runs out of memory at."""


@dataclass
class Training:
    """The script above in a subprocess, its run id, and a change to 16 queued by ``memtui set``."""

    proc: subprocess.Popen[str] | ForkedDemo
    log: Path
    run: str

    @classmethod
    def grown(cls, tmp_path: Path, env: dict[str, str] | None = None) -> Training:
        """Start the training and queue batch_size 8 -> 16 (which runs out of memory)."""
        script = tmp_path / "train.py"
        script.write_text(SETUP + example("tracker") + LOOP)
        log = tmp_path / "train.log"
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        proc = launch_script(script, [str(tmp_path / "out")], full_env, tmp_path, log)
        training = cls(proc, log, "")
        training.run = str(wait_for(training.run_id, 60, 0.1, "the run id"))
        result = memtui_here("set", training.run, "batch_size=16")
        assert result.exit_code == 0, result.output
        return training

    def run_id(self) -> str | None:
        """The ``run <id>`` line the script prints (the test fails if it exits first)."""
        for line in self.log.read_text().splitlines():
            if line.startswith("run "):
                return line.split()[1]
        assert self.proc.poll() is None, self.log.read_text()
        return None

    def stop(self) -> None:
        """Kill the training if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()


def test_events_reach_tensorboard_and_a_raising_callback_is_an_error(tmp_path: Path) -> None:
    training = Training.grown(tmp_path)
    proc, log = training.proc, training.log
    try:
        wait_for(lambda: "rolled back" in log.read_text(), 60, 0.1, "the rollback")

        def errors_counted() -> dict[str, Any] | None:
            assert proc.poll() is None, log.read_text()
            status = status_json(training.run)
            counted = status["counters"]["errors"] >= 3 and status["applied"]
            return status if counted and status["step"] > status["applied"][-1]["step"] else None

        status = cast(
            dict[str, Any],
            wait_for(
                errors_counted, 60, 0.2, "three callback errors and a step after the rollback"
            ),
        )
        counters = status["counters"]
        assert counters["errors"] == 3, counters  # the change, the OOM and the rollback
        assert counters["last_error"].startswith("on_event callback broken: RuntimeError"), counters
        (tmp_path / "out" / "stop").touch()
        assert proc.wait(patience(60)) == 0, log.read_text()
    finally:
        training.stop()
    step = int(status["applied"][0]["step"])
    assert step % 5 == 0 and [a["step"] for a in status["applied"]] == [step, step], status
    logged = read_events(tmp_path / "runs")
    assert logged.texts["memtui"] == [
        (step, f"batch_size 8 -> 16 at step {step} {REBUILT}"),
        (
            step,
            f"out of memory at step {step} with {AT_16}: rolled back; re-queued: the step's 1 "
            "micro-batch(es), 16 samples, are trained on again after the rollback",
        ),
        (
            step,
            f"rollback: batch_size 16 -> 8 at step {step} (rollback after out of memory at step {step})",
        ),
    ]
    assert logged.scalars == {"memtui/batch_size": [(step, 16.0), (step, 8.0)]}


def test_a_post_mortem_without_rollback_reaches_tensorboard_before_the_run_dies(
    tmp_path: Path,
) -> None:
    training = Training.grown(tmp_path, {"MEMTUI_ROLLBACK_STEPS": "0"})
    try:
        assert training.proc.wait(patience(60)) == 1, training.log.read_text()
    finally:
        training.stop()
    assert "MemoryError: CPU out of memory" in training.log.read_text()
    logged = read_events(tmp_path / "runs")
    ((step, applied), (oom_step, oom)) = logged.texts["memtui"]
    assert applied == f"batch_size 8 -> 16 at step {step} {REBUILT}"
    assert oom_step == step and oom.startswith(
        f"out of memory at step {step} with {AT_16}: no rollback; lost with the run"
    ), oom
    assert logged.scalars == {"memtui/batch_size": [(step, 16.0)]}
