"""A plain loop's own checkpoint carries its tuned config: ``checkpoint["memtui"] =
tuner.state_dict()`` at the save and ``tuner.load_state_dict(checkpoint["memtui"])`` at the
restart give the restarted run the tuned batch and the LR schedule times the factor, once, even
with the checkpoint moved away from the tuned YAML; a run that finds the YAML and was not told to
resume says so once.

What the training ran is read from outside memtui: the batch rows the model sees (a forward
pre-hook) and the LR of each param group at each optimizer step (torch's global step pre-hook).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import torch

from tests.support.cli import memtui_cli, status_json
from tests.support.clock import patience
from tests.support.processes import launch_script, wait_for

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from types import SimpleNamespace

    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.utils.data import DataLoader, TensorDataset

    from memtui import hooks

    out, stop, report = sys.argv[1:4]
    restart = "--restart" in sys.argv
    torch.manual_seed(0)
    args = SimpleNamespace(batch_size=8, gradient_accumulation_steps=2, num_workers=0,
                           pin_memory=False)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + 0.01 * step))
    seen, used = [], []  # the batch rows the model sees; the LRs each optimizer step uses
    model.register_forward_pre_hook(lambda m, inputs: seen.append(inputs[0].shape[0]))
    register_optimizer_step_pre_hook(
        lambda o, *_: used.append([scheduler.last_epoch, [g["lr"] for g in o.param_groups]]))

    tuner = hooks.install(args, model=model, optimizer=optimizer, state_dir=out)
    tuner.watch_scheduler(scheduler)
    data = TensorDataset(torch.randn(64_000, 4), torch.randn(64_000, 1))
    loader = tuner.loader(lambda batch_size, num_workers, pin_memory: DataLoader(
        data, batch_size=batch_size, shuffle=True, num_workers=num_workers, pin_memory=pin_memory))
    path = os.path.join(out, "ckpt.pt")
    if restart:
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        tuner.load_state_dict(checkpoint["memtui"])
    print("run", tuner.run_id, "from step", tuner.step_count, flush=True)
    micro = 0
    while not os.path.exists(stop):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y) / args.gradient_accumulation_steps
            loss.backward()
            micro += 1
            if micro < args.gradient_accumulation_steps:
                continue
            micro = 0
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            tuner.step()
            if tuner.step_count % 10 == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "memtui": tuner.state_dict()}
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
                tuner.checkpoint()
            time.sleep(0.003)
            if os.path.exists(stop):
                break
    with open(report, "w") as handle:
        json.dump({"seen": seen, "used": used, "batch_size": args.batch_size}, handle)
    tuner.close()
    """
)

BASE_LR = 0.1


def schedule(step: int) -> float:
    """The script's own LR after ``step`` scheduler steps."""
    return BASE_LR / (1 + 0.01 * step)


class Training:
    """The script, started in ``out``: its output, its run id, and what it ran once stopped."""

    def __init__(self, tmp_path: Path, out: Path, *extra: str) -> None:
        self.name = f"t{len(list(tmp_path.glob('t*.log')))}"
        self.log, self.stop = tmp_path / f"{self.name}.log", tmp_path / f"{self.name}.stop"
        self.report = tmp_path / f"{self.name}.json"
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        argv = [str(out), str(self.stop), str(self.report), *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = launch_script(script, argv, env, tmp_path, self.log)
        self.run = str(wait_for(self._run_id, 60, 0.05, f"{self.name}'s run id"))

    def _run_id(self) -> str | None:
        assert self.proc.poll() is None, self.output()
        for line in self.output().splitlines():
            if line.startswith("run "):
                return line.split()[1]
        return None

    def output(self) -> str:
        """What the training printed so far (memtui's lines included)."""
        return self.log.read_text() if self.log.exists() else ""

    def finish(self) -> dict[str, Any]:
        """Stop the training; what it ran."""
        self.stop.touch()
        try:
            assert self.proc.wait(patience(60)) == 0, self.output()
        finally:
            self.proc.kill()
        return dict(json.loads(self.report.read_text()))


def saved_after(path: Path, step: int) -> dict[str, Any]:
    """The script's checkpoint once one was saved after ``step``."""

    def load() -> dict[str, Any] | None:
        try:
            state = torch.load(path, weights_only=True)
        except (OSError, EOFError, RuntimeError):
            return None
        return state if state["memtui"]["step"] > step else None

    return wait_for(load, 60, 0.1, f"a checkpoint after step {step}")  # type: ignore[return-value]


def test_a_checkpoint_moved_alone_restarts_at_the_tuned_batch_and_lr_once(
    tmp_path: Path,
) -> None:
    first_dir, moved_dir = tmp_path / "first", tmp_path / "moved"
    first_dir.mkdir()
    moved_dir.mkdir()
    first = Training(tmp_path, first_dir)
    try:
        queued = memtui_cli(
            "set", first.run, "batch_size=16", "--allow-effective-batch", "--lr-scale", "linear"
        )
        assert queued.returncode == 0, queued.stderr
        assert "lr x2.0 (linear)" in queued.stdout + queued.stderr
        status = wait_for(lambda: (s := status_json(first.run))["applied"] and s, 60, 0.1)
        boundary = status["applied"][0]["step"]  # type: ignore[index]
        saved = saved_after(first_dir / "ckpt.pt", boundary)
    finally:
        ran = first.finish()
    entry = saved["memtui"]
    assert entry["config"] == {"batch_size": 16, "prefetch_factor": 2}, entry
    assert entry["lr"]["factor"] == 2.0 and entry["lr"]["rule"] == "linear", entry
    before = [(step, lrs) for step, lrs in ran["used"] if step < boundary]
    after = [(step, lrs) for step, lrs in ran["used"] if step >= boundary]
    assert before and all(math.isclose(lrs[0], schedule(step)) for step, lrs in before)
    assert after and all(math.isclose(lrs[0], 2 * schedule(step)) for step, lrs in after)

    # the checkpoint alone, away from the tuned YAML it was saved beside
    shutil.move(first_dir / "ckpt.pt", moved_dir / "ckpt.pt")
    assert (first_dir / "memtui-tuned.yaml").exists()
    restarted = Training(tmp_path, moved_dir, "--restart")
    try:
        resumed_at = entry["step"]
        assert f"from step {resumed_at}" in restarted.output()
        status = wait_for(
            lambda: (s := status_json(restarted.run))["step"] >= resumed_at + 20 and s, 60, 0.1
        )
    finally:
        rerun = restarted.finish()
    assert status["lr"]["factor"] == 2.0, status["lr"]  # type: ignore[index]
    assert status["config"]["batch_size"] == 16, status["config"]  # type: ignore[index]
    assert rerun["batch_size"] == 16
    assert len(rerun["seen"]) >= 40 and set(rerun["seen"]) == {16}, "every batch at the tuned 16"
    steps = [step for step, _ in rerun["used"]]
    assert steps[0] == resumed_at and len(steps) >= 20
    assert all(math.isclose(lr, 2 * schedule(step)) for step, lrs in rerun["used"] for lr in lrs), (
        "the schedule times the factor, once"
    )
    output = restarted.output()
    said = [line for line in output.splitlines() if "resumed the tuned config" in line]
    assert said == [
        f"memtui: resumed the tuned config from the checkpoint (step {resumed_at}): "
        "batch_size 8 -> 16, lr x2.0"
    ], output
    assert "keeps a tuned config" not in output, "no YAML beside the moved checkpoint"

    # the tuned YAML left behind: a run started there without resuming says so, once
    tuned = (first_dir / "memtui-tuned.yaml").read_text()
    again = Training(tmp_path, first_dir)
    try:
        first_words = again.output()
    finally:
        again.finish()
    said = [line for line in again.output().splitlines() if "keeps a tuned config" in line]
    assert len(said) == 1, again.output()
    assert said[0] in first_words, "said at install, before the run's first line"
    assert "batch_size 16" in said[0] and "lr x2.0" in said[0] and "resume=True" in said[0]
    assert 'tuner.load_state_dict(checkpoint["memtui"])' in said[0]
    assert (first_dir / "memtui-tuned.yaml").read_text() == tuned, "not written over unsaid"
