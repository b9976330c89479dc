"""The documentation's examples that need a training run as written (``tests/integration/test_docs.py`` checks
the rest): the complete plain loop takes a change and resumes with it, the loop without a
DataLoader times its batches and follows a change, the README's short loop takes a change and the
guard rolls one back, every line meant for a live run runs against a demo, and the demo's
out-of-memory command trains."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import pytest
import yaml

from memtui.runs.report import StatusReport
from tests.integration.test_docs import VIEWERS, blocks, example, run_blocks, shell_lines, words_of
from tests.support.cli import memtui_cli, memtui_here
from tests.support.clock import patience
from tests.support.processes import PLUMBING, DemoRun, launch_memtui, launch_script, wait_for

pytestmark = pytest.mark.heavy


def test_plain_loop_example(tmp_path: Path) -> None:
    """Getting started's complete script: it says its run id and its progress, runs long enough
    to attach to by default, takes ``memtui set`` at a checkpoint and resumes with the change."""
    source = example("plain-loop")
    default = re.search(r'"--steps", type=int, default=([\d_]+)', source)
    assert default and int(default.group(1)) >= 10_000, "its default run is too short to attach to"
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "ckpt"
    log = tmp_path / "train.log"
    env = dict(os.environ)
    proc = launch_script(script, ["--steps", "1000", "--out", str(out)], env, tmp_path, log)
    try:
        runs = wait_for(  # asked by click in this process (a subprocess per look: 0.3 CPU-s)
            lambda: json.loads(memtui_here("ls", "--json").stdout), 60, 0.1, "the example's run"
        )
        assert runs[0]["run"].startswith("train-")  # type: ignore[index]
        result = memtui_cli("set", "batch_size=64", "--keep-effective-batch")
        assert result.returncode == 0, result.stderr
        proc.wait(patience(180))
    finally:
        proc.kill()
    output = log.read_text()
    assert proc.returncode == 0, output
    assert re.search(r"applied at step \d+00: batch_size 32 -> 64, grad_accum 2 -> 1", output), (
        output
    )
    assert re.search(r"^run train-\w+: 1000 steps", output, re.M), output
    assert "step 1000/1000  batch_size 64  grad_accum 1" in output, output
    tuned = yaml.safe_load((out / "memtui-tuned.yaml").read_text())
    assert tuned["config"]["batch_size"] == 64 and tuned["config"]["grad_accum"] == 1

    log = tmp_path / "resumed.log"
    resumed = launch_script(
        script, ["--steps", "1100", "--out", str(out), "--is_keep_training"], env, tmp_path, log
    )
    try:
        code = resumed.wait(patience(180))
    finally:
        resumed.kill()
    assert code == 0, log.read_text()
    assert "resumed the tuned config" in log.read_text()
    assert "batch_size 32 -> 64" in log.read_text()


def live_status() -> StatusReport | None:
    """``memtui status --json`` of the only live run, typed (None while it does not answer)."""
    result = memtui_here("status", "--json")
    return msgspec.json.decode(result.stdout, type=StatusReport) if result.exit_code == 0 else None


def test_no_dataloader_example_times_batches_and_follows_a_batch_change(tmp_path: Path) -> None:
    """The guide's nanoGPT-shaped loop (module globals, ``get_batch`` over a tensor, no
    DataLoader) publishes samples/s and the data wait, and ``memtui set batch_size=4`` lands at a
    checkpoint: the global changes and every step's samples follow."""
    script = tmp_path / "train_gpt.py"
    script.write_text(example("no-dataloader"))
    out, log = tmp_path / "out", tmp_path / "train.log"
    argv = ["--max_iters=1000000", "--eval_interval=10", "--eval_iters=2", f"--out_dir={out}"]
    proc = launch_script(script, argv, dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path, log)
    try:

        def timed() -> StatusReport | None:
            status = live_status()
            assert proc.poll() is None, log.read_text()
            metrics = status.metrics if status else None
            if not status or not metrics or status.step < 2:  # step 1 also counts the batch
                return None  # fetched before the loop
            return status if metrics.samples_per_s > 0 and metrics.data_wait_s > 0 else None

        before = cast(StatusReport, wait_for(timed, 90, 0.5, "samples/s and the data wait"))
        assert {"batch_size", "grad_accum"} <= set(before.tunable), before.tunable
        assert before.config["batch_size"] == 8
        assert before.last_step and before.last_step.samples == 8 * 4, before.last_step
        assert before.last_step.micro_batches == 4
        result = memtui_cli("set", "batch_size=4")
        assert result.returncode == 0, result.stdout + result.stderr

        def followed() -> StatusReport | None:
            status = live_status()
            if not status or not status.applied:
                return None
            # a whole step after the boundary: every batch of it fetched at the new size
            return status if status.step > status.applied[0].step + 1 else None

        after = cast(StatusReport, wait_for(followed, 90, 0.5, "the change and a step after it"))
        printed = r"step \d+: train loss [\d.]+, val loss [\d.]+, batch_size 4"
        wait_for(lambda: re.search(printed, log.read_text()), 60, 0.2, "the script's own line")
    finally:
        proc.terminate()
        proc.wait(patience(30))
    assert after.config["batch_size"] == 4
    assert after.last_step and after.last_step.samples == 4 * 4, after.last_step
    assert after.metrics and after.metrics.samples_per_s > 0 and after.metrics.data_wait_s > 0
    output = log.read_text()
    assert re.search(r"applied at step \d*0: batch_size 8 -> 4", output), output


SHORT_LOOP = """
import os, sys, time
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, IterableDataset

from memtui.hooks import event_text

out = sys.argv[1]
LIMIT = 8  # a micro-batch over this raises the CPU's out-of-memory error in forward
stop = [os.path.join(out, "stop-loop")]


class Until(IterableDataset):
    def __iter__(self):  # samples until the test's stop file of the block running exists
        while not os.path.exists(stop[0]):
            time.sleep(0.001)
            yield torch.randn(16), torch.randn(1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 1)

    def forward(self, x):
        if x.shape[0] > LIMIT:
            raise MemoryError(f"CPU out of memory. Tried to allocate {x.shape[0] * 64} bytes")
        return self.body(x)


args = SimpleNamespace(batch_size=4, gradient_accumulation_steps=1, num_workers=0, pin_memory=False)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
dataset = Until()
saved = []
checkpoint = None  # a fresh start


def save_checkpoint(memtui=None):
    assert memtui is None or memtui["step"] == tuner.step_count and "config" in memtui, memtui
    saved.append(tuner.step_count)

"""


def test_the_short_loop_and_the_guard_take_a_change_and_roll_one_back(tmp_path: Path) -> None:
    """The README's four calls in a loop over a real CPU model: its run answers, ``memtui set``
    lands at a checkpoint and the config object holds the new batch size; then the guard's loop,
    on the same run, takes a micro-batch that runs out of memory and rolls it back, and the
    training goes on to its end."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    guarded = "".join(f"    {line}" for line in example("guard").splitlines(True))
    script.write_text(
        SHORT_LOOP
        + example("add-to-loop")
        + 'print("loop done", args.batch_size, len(saved), flush=True)\n'
        + 'stop[0] = os.path.join(out, "stop-guard")\n'
        + 'tuner.on_event(lambda event, step: print("event:", event_text(event), flush=True))\n'
        + "if True:\n"
        + guarded
        + 'print("guard done", args.batch_size, flush=True)\n'
    )
    log = tmp_path / "train.log"
    proc = launch_script(script, [str(out)], dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path, log)
    try:

        def applied(count: int) -> StatusReport | None:
            assert proc.poll() is None, log.read_text()
            status = live_status()
            return status if status and len(status.applied) >= count else None

        wait_for(live_status, 60, 0.1, "the short loop's run")
        assert memtui_here("set", "batch_size=8").exit_code == 0
        wait_for(lambda: applied(1), 60, 0.1, "batch_size 8 applied")
        (out / "stop-loop").touch()
        wait_for(lambda: "loop done" in log.read_text(), 30, 0.1, "the short loop's end")
        result = memtui_here("set", "batch_size=16", "--force")
        assert result.exit_code == 0, result.output
        wait_for(lambda: "event: rollback" in log.read_text(), 60, 0.1, "the rollback")
        (out / "stop-guard").touch()
        assert proc.wait(patience(60)) == 0, log.read_text()
    finally:
        proc.kill()
    output = log.read_text()
    saves = re.search(r"^loop done 8 (\d+)$", output, re.M)
    assert saves and int(saves.group(1)) >= 1, output
    assert re.search(r"^event: batch_size 8 -> 16 at step \d+00", output, re.M), output
    assert re.search(
        r"^event: out of memory at step \d+ with batch_size=16 .*: rolled back", output, re.M
    ), output
    assert re.search(r"^event: rollback: batch_size 16 -> 8", output, re.M), output
    assert "guard done 8" in output, output


OTHER_NAMES = """
import torch
from types import SimpleNamespace
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
args = SimpleNamespace(batch_size=4, gradient_accumulation_steps=1, workers=2)  # no pin_memory
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
dataset = TensorDataset(torch.randn(400, 8), torch.randn(400, 1))


checkpoint = None  # a fresh start


def save_checkpoint(memtui=None):
    torch.save({"model": model.state_dict(), "memtui": memtui}, "ckpt.pt")

"""


def test_the_short_loop_on_a_config_with_other_names_trains_and_says_the_fix(
    tmp_path: Path,
) -> None:
    """The README's four calls on a config that names its workers ``workers`` and has no
    ``pin_memory``: the factory gets torch's defaults, memtui says so in one line with the
    ``knobs=`` mapping that takes the config's own, and the training runs to its end."""
    step = "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
    step += "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n"
    loop = re.sub(r"^    \.\.\. .*\n", step, example("add-to-loop"), count=1, flags=re.M)
    assert "loss.backward()" in loop
    script = tmp_path / "train.py"
    script.write_text(OTHER_NAMES + loop + 'print("trained", tuner.step_count, flush=True)\n')
    log = tmp_path / "train.log"
    proc = launch_script(script, [], dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path, log)
    try:
        assert proc.wait(patience(120)) == 0, log.read_text()
    finally:
        proc.kill()
    output = log.read_text()
    assert "trained 100" in output, output
    said = [line for line in output.splitlines() if "torch's DataLoader defaults" in line]
    assert len(said) == 1, output
    assert 'knobs={"num_workers": "workers"}' in said[0], said
    assert "Traceback" not in output, output


LATER = {
    "applied",
    "pending",
    "rejected",
    "cancelled",
    "predicted",
    "autopilot:",
    "memory",
    "option",
}
"""The first words of ``memtui status``'s lines that a young run without changes may lack (its
changes, its fitted memory model, its recommendations)."""


def test_command_lines_run_against_a_demo(start_demo: Callable[..., DemoRun]) -> None:
    """Every ``memtui`` line of the blocks marked ``run: demo``, the reference's first, run as
    written (by click, in this process) against one live demo run, each block from a clean
    queue: each exits 0, the confirmations its comments give come true, and a ``$ memtui
    status`` example shows the lines the command prints, in their order (the viewer's lines,
    ``attach``, are parsed by ``tests/integration/test_docs.py``)."""
    demo = start_demo("--steps", "1000000", "--checkpoint-every", "1000000", *PLUMBING)
    ordered = sorted(run_blocks("demo"), key=lambda b: b.page != "docs/reference/cli.md")
    assert ordered[0].page == "docs/reference/cli.md", [b.where for b in ordered]
    ran = []
    for block in ordered:
        memtui_here("cancel", "all")  # each block from an empty queue (its status unchecked)
        for command, comment in shell_lines(block):
            words = words_of(command)
            if words[1] in VIEWERS:
                continue
            result = memtui_here(*words[1:])
            assert result.exit_code == 0, f"{block.where}: {command}: {result.output}"
            output = result.stdout + result.stderr
            said = comment.replace("demo-...", demo.run_id)
            if said.startswith(("queued #", "cancelled #")):
                assert said in output, (block.where, command, output)
            if command == "memtui status --json":
                assert json.loads(output)["run"] == demo.run_id
            if block.lang == "text":  # an example of what the command prints
                shown = output.splitlines()
                heads = [
                    line.split()[0]
                    for line in block.body.splitlines()[1:]
                    if line.strip() and line.split()[0] not in LATER
                ]
                found = [h for h in heads if any(line.startswith(h) for line in shown)]
                assert found == heads, (block.where, heads, shown)
                positions = [next(i for i, s in enumerate(shown) if s.startswith(h)) for h in heads]
                assert positions == sorted(positions), (block.where, heads, shown)
            ran.append(command)
    for line in (
        "memtui ls",
        "memtui status --json",
        "memtui cancel all",
        "memtui set num_workers=2",
    ):
        assert line in ran, (line, ran)


def test_the_out_of_memory_demo_command_runs(tmp_path: Path) -> None:
    """The advice guide's ``memtui demo --memory-limit ...`` line really trains (a few steps; the
    command forked from the fork server, with torch imported: it trains in its own process)."""
    line = next(
        command
        for block in blocks()
        if block.page == "docs/guides/advice.md" and block.lang == "sh"
        for command, _ in shell_lines(block)
        if command.startswith("memtui demo --memory-limit")
    )
    log = tmp_path / "demo.log"
    argv = [*shlex.split(line)[1:], "--no-tui", "--steps", "3", "--slow-data-ms", "0"]
    proc = launch_memtui([*argv, "--out", str(tmp_path)], dict(os.environ), log)
    try:
        code = proc.wait(patience(120))
    finally:
        proc.kill()
    assert code == 0, log.read_text()
    assert "done: 3 steps" in log.read_text(), log.read_text()
    assert (tmp_path / "checkpoint.pt").exists()
