"""The LR memtui reports is the LR the optimizer uses, read from outside the hook.

A real training process (nanoGPT's shape: its loop sets ``param_group['lr'] = get_lr(it)`` at
the top of every iteration) records the LR each optimizer step uses with a step pre-hook of its
own; the tests queue changes with the real ``memtui set`` and read ``memtui status`` and the
viewer's config panel. Without ``lr_fields`` the factor holds for the boundary's own iteration
only: memtui withdraws it and every surface says the LR is the script's. With ``lr_fields`` the
factor holds on every following step and every surface says it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from memtui.runs.state import RunState, ViewOptions
from memtui.tui.widgets.config import ConfigPanel
from memtui.wire import ControlState, Knobs, LrState
from tests.support.cli import memtui_cli, status_json
from tests.support.clock import patience
from tests.support.processes import ROOT, wait_for

SCRIPT = textwrap.dedent(
    """
    import json, math, os, sys, time
    import torch
    from memtui import hooks

    batch_size = 4
    gradient_accumulation_steps = 1
    learning_rate = 1e-3
    min_lr = 1e-4
    fields = ()
    for arg in sys.argv[1:]:
        key, value = arg.split("=")
        globals()[key] = tuple(value.split(",")) if key == "fields" else value

    def get_lr(it):
        return min_lr + 0.5 * (1 + math.cos(math.pi * min(it, 400) / 400)) * (learning_rate - min_lr)

    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    tuner = hooks.install(globals(), model=model, optimizer=optimizer, state_dir=out,
                          lr_fields=fields)
    print("run", tuner.run_id, flush=True)
    used = []
    optimizer.register_step_pre_hook(
        lambda o, *_: used.append([tuner.step_count, o.param_groups[0]["lr"], it]))
    it = 0
    while not os.path.exists(stop) and it < 4000:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it)
        if it % 10 == 0 and it > 0:
            tuner.checkpoint()
        loss = model(torch.randn(batch_size, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        tuner.step()
        it += 1
        time.sleep(0.005)
    with open(report, "w") as handle:
        json.dump({"used": used, "learning_rate": learning_rate}, handle)
    tuner.close()
    """
)


def own_lr(it: int) -> float:
    """The script's schedule at its own values (1e-3 down to 1e-4)."""
    return 1e-4 + 0.5 * (1 + math.cos(math.pi * min(it, 400) / 400)) * (1e-3 - 1e-4)


def start(tmp_path: Path, *config: str) -> tuple[subprocess.Popen[str], str]:
    """The training in a subprocess, and its run id once it registered."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [f"out={tmp_path / 'out'}", f"stop={tmp_path / 'stop'}", f"report={tmp_path / 'r'}"]
    proc = subprocess.Popen(
        [sys.executable, str(script), *args, *config],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("run "), line
    return proc, line.split()[1]


def finish(tmp_path: Path, proc: subprocess.Popen[str]) -> tuple[dict[str, Any], str]:
    """Stop the training; its report and what it printed."""
    (tmp_path / "stop").touch()
    output, _ = proc.communicate(timeout=patience(60))
    assert proc.returncode == 0, output
    return json.loads((tmp_path / "r").read_text()), output


def panel_line(lr: dict[str, Any]) -> str:
    """The viewer's config panel for a run whose control state carries ``lr``."""
    state = RunState()
    state.control = ControlState(
        config=Knobs(batch_size=8, grad_accum=1),
        tunable=["batch_size"],
        lr=LrState(**lr),
    )
    lines = str(ConfigPanel().build(state, ViewOptions(), 60)).splitlines()
    return next((x for x in lines if x.startswith("lr ")), "")


def test_a_factor_the_loop_overwrites_is_withdrawn_on_every_surface(tmp_path: Path) -> None:
    proc, run = start(tmp_path)
    try:
        queued = memtui_cli(
            "set", run, "batch_size=8", "--allow-effective-batch", "--lr-scale", "linear"
        )
        assert queued.returncode == 0, queued.stderr
        assert "lr x2.0 (linear)" in queued.stdout + queued.stderr
        status = wait_for(
            lambda: (s := status_json(run))["lr"]["script_schedule"] and s, 60, 0.2, "withdrawal"
        )
        assert status["lr"]["factor"] == 1.0
        text = memtui_cli("status", run).stdout
        assert "lr: the script's own schedule, not scaled by memtui" in text, text
        refused = memtui_cli(
            "set", run, "batch_size=16", "--allow-effective-batch", "--lr-scale", "linear"
        )
        assert refused.returncode == 2 and "cannot hold" in refused.stderr, refused.stderr
    finally:
        report, output = finish(tmp_path, proc)
    (boundary,) = [a["step"] for a in status["applied"]]
    scaled = [(step, lr, it) for step, lr, it in report["used"] if not math.isclose(lr, own_lr(it))]
    assert [step for step, *_ in scaled] == [boundary], "x2 for the boundary's own iteration only"
    assert "no longer holds" in output
    assert panel_line(status["lr"]) == "lr the script's own schedule: memtui does not scale it"


def test_lr_fields_make_the_factor_hold_and_every_surface_says_it(tmp_path: Path) -> None:
    proc, run = start(tmp_path, "fields=learning_rate,min_lr")
    try:
        queued = memtui_cli(
            "set", run, "batch_size=8", "--allow-effective-batch", "--lr-scale", "linear"
        )
        assert queued.returncode == 0, queued.stderr
        status = wait_for(lambda: (s := status_json(run))["applied"] and s, 60, 0.2, "the change")
        wait_for(lambda: status_json(run)["step"] > status["applied"][0]["step"] + 20, 60, 0.2)
        status = status_json(run)
        assert status["lr"]["factor"] == 2.0 and not status["lr"].get("script_schedule")
        text = memtui_cli("status", run).stdout
        assert (
            "lr: x2.0 the script's own (linear from effective batch 4), with learning_rate, min_lr"
            in text
        )
    finally:
        report, _ = finish(tmp_path, proc)
    boundary = status["applied"][0]["step"]
    used = report["used"]
    assert all(math.isclose(lr, own_lr(it)) for step, lr, it in used if step < boundary)
    after = [(lr, it) for step, lr, it in used if step >= boundary]
    assert len(after) > 20 and all(math.isclose(lr, 2 * own_lr(it)) for lr, it in after), (
        "get_lr reads the doubled fields on every following step"
    )
    assert report["learning_rate"] == 2e-3
    assert panel_line(status["lr"]) == "lr x2.0 the script's own (linear)"
