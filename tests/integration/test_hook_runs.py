"""Real CPU trainings in subprocesses: the out-of-memory paths that do not roll back, a loader
that cannot re-queue, and ``install(record=...)``.

On a CPU the training script's model raises ``MemoryError`` (with CUDA's wording) when its
micro-batch grows past 8: the CPU analogue of a CUDA out-of-memory error, raised where Python sees
it, as the demo's ``--memory-limit`` does. The change that grows it is queued with the real
``memtui set`` over the run's control socket.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from memtui.transport.recording import read_recording
from memtui.wire import Decoder, Telemetry
from tests.support.cli import memtui_cli
from tests.support.processes import ROOT, launch_script, wait_for

SCRIPT = '''
import sys, time
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from memtui import hooks

out, mode = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3])
record = sys.argv[4] if len(sys.argv) > 4 else None
LIMIT = 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )

    def forward(self, x):
        if x.shape[0] > LIMIT:  # the CPU analogue of CUDA's out-of-memory error
            raise MemoryError(
                f"CPU out of memory. Tried to allocate {x.shape[0] * 64} bytes "
                f"(a micro-batch of {x.shape[0]}, over {LIMIT})"
            )
        return self.body(x)


class Stream(IterableDataset):
    """An endless stream: a loader over it cannot hand samples back."""

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(16, generator=generator), torch.randn(1, generator=generator)


config = SimpleNamespace(
    batch_size=8, gradient_accumulation_steps=2, num_workers=0, pin_memory=False
)
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
tuner = hooks.install(
    config, model=net, optimizer=optimizer, state_dir=out, name=mode, record=record
)
if mode == "iterable":
    dataset = Stream()
    make = lambda batch_size, num_workers, pin_memory: DataLoader(dataset, batch_size=batch_size)
else:
    dataset = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    make = lambda batch_size, num_workers, pin_memory: DataLoader(
        dataset, batch_size=batch_size, shuffle=True
    )
loader = tuner.loader(make)
print("run", tuner.run_id, flush=True)
guard = tuner.guard()
micro = 0
while tuner.step_count < steps:
    for x, y in loader:
        if mode == "unguarded":
            loss = torch.nn.functional.mse_loss(net(x), y) / config.gradient_accumulation_steps
            loss.backward()
        else:
            with guard:
                loss = torch.nn.functional.mse_loss(net(x), y) / config.gradient_accumulation_steps
                loss.backward()
            if guard.rolled_back:
                print("rolled back:", tuner.control.ooms[-1].batch, flush=True)
                micro = 0
                steps = tuner.step_count + 10
                continue
        micro += 1
        if micro < config.gradient_accumulation_steps:
            continue
        micro = 0
        optimizer.step()
        optimizer.zero_grad()
        tuner.step()
        time.sleep(0.01)
        if tuner.step_count % 5 == 0 and (applied := tuner.checkpoint()):
            print(applied, flush=True)
        if tuner.step_count >= steps:
            break
tuner.close()
print("done", tuner.step_count, flush=True)
'''


class Training:
    """The script above, running in a subprocess."""

    def __init__(
        self, tmp: Path, mode: str, steps: int, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        script = tmp / "train.py"
        script.write_text(SCRIPT)
        self.out = tmp / "out"
        self.log = tmp / f"{mode}.log"
        argv = [str(self.out), mode, str(steps), *extra]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = launch_script(script, argv, full_env, ROOT, self.log)
        self.run_id = str(wait_for(self._run_id, 60, 0.1, "the run id"))

    def _run_id(self) -> str | None:
        for line in self.output().splitlines():
            if line.startswith("run "):
                return line.split()[1]
        assert self.proc.poll() is None, self.output()
        return None

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def tuned(self) -> dict[str, Any]:
        return dict(yaml.safe_load((self.out / "memtui-tuned.yaml").read_text()))

    def audit(self) -> list[dict[str, Any]]:
        text = (self.out / "memtui-audit.jsonl").read_text()
        return [json.loads(line) for line in text.splitlines()]


def grow_the_micro_batch(run: Training) -> None:
    """Queue batch_size 8 -> 16 (the model raises MemoryError past 8) with ``memtui set``."""
    result = memtui_cli("set", run.run_id, "batch_size=16")
    assert result.returncode == 0, result.stderr


def assert_post_mortem_without_rollback(run: Training) -> None:
    """The run died of the error, after writing the post-mortem and a safe config."""
    output = run.output()
    assert "Traceback" in output and "MemoryError: CPU out of memory" in output, output
    tuned = run.tuned()
    assert tuned["config"]["batch_size"] == 8 and tuned["config"]["grad_accum"] == 2, tuned
    assert tuned["safe_config_reason"].startswith("the config before change #1"), tuned
    oom = tuned["oom"]
    assert oom["rolled_back"] is False and oom["kind"] == "cpu", oom
    assert oom["config"]["batch_size"] == 16
    assert oom["batch"].startswith("lost with the run"), oom["batch"]
    ooms = [e for e in run.audit() if e["event"] == "oom"]
    assert len(ooms) == 1 and ooms[0]["safe_config"]["batch_size"] == 8


def test_oom_with_rollback_off_writes_the_post_mortem_and_still_raises(tmp_path: Path) -> None:
    run = Training(tmp_path, "guarded", 100_000, env={"MEMTUI_ROLLBACK_STEPS": "0"})
    grow_the_micro_batch(run)
    assert run.wait() == 1, run.output()
    assert_post_mortem_without_rollback(run)
    assert "no rollback (rollback is off)" in run.output()


def test_unguarded_oom_post_mortem_from_the_excepthook(tmp_path: Path) -> None:
    run = Training(tmp_path, "unguarded", 100_000)
    grow_the_micro_batch(run)
    assert run.wait() == 1, run.output()
    assert_post_mortem_without_rollback(run)
    assert "outside any tuner.guard()" in run.output()
    assert "the step is not inside tuner.guard()" in run.output()


def test_a_loader_that_cannot_requeue_reports_the_skipped_samples(tmp_path: Path) -> None:
    run = Training(tmp_path, "iterable", 100_000)
    grow_the_micro_batch(run)
    assert run.wait() == 0, run.output()
    skipped = "skipped: the step's 1 micro-batch(es), 16 samples, were dropped"
    assert f"rolled back: {skipped}" in run.output(), run.output()
    tuned = run.tuned()
    assert tuned["oom"]["rolled_back"] is True and tuned["oom"]["batch"].startswith(skipped)
    assert tuned["config"]["batch_size"] == 8
    applied = [e for e in run.audit() if e["event"] == "applied"]
    assert [a.get("rollback", False) for a in applied] == [False, True]
    assert applied[1]["changes"] == {"batch_size": [16, 8]}  # old, new


def test_install_record_writes_a_replayable_recording(tmp_path: Path) -> None:
    path = tmp_path / "run.mtrec"
    run = Training(tmp_path, "record", 40, str(path))
    assert run.wait() == 0, run.output()
    recording = read_recording(path)
    assert recording.header.run == run.run_id
    decoder = Decoder()
    telemetry = [m for f in recording.frames if isinstance(m := decoder.decode(f.frame), Telemetry)]
    steps = [s.step for t in telemetry for s in t.steps]
    assert steps == list(range(1, 41)), steps
    assert sum(len(t.device) for t in telemetry) > 0, "device memory samples"
    assert any(t.host is not None for t in telemetry), "host memory samples"
    assert telemetry[-1].ended
