"""The LR factor of a plain loop whose LR moves every step, read from outside memtui: a torch
``CosineAnnealingLR`` memtui was not given runs at the schedule x the factor after a change and
after a restart from the script's own checkpoint (saved at the change or after it), with no
withdrawal; a loop that sets its LR from its own unscaled config still gets the factor withdrawn.

The training records the LR of every optimizer step with a global step pre-hook (torch's, which
runs before any hook of memtui's) in a file it flushes at each step; the change is queued with the
real ``memtui set``; the first run kills itself (SIGKILL) right after a checkpoint.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from memtui.hooks.persist import AUDIT_FILE, TUNED_FILE, read_audit
from tests.support.cli import memtui_cli, status_json
from tests.support.clock import patience
from tests.support.processes import ROOT, wait_for

SCRIPT = textwrap.dedent(
    """
    import json, math, os, signal, sys, time
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from memtui import hooks

    batch_size = 4
    learning_rate = 0.003
    schedule = "cosine"
    resume = ""
    die_at = until = wait_at = 0
    for arg in sys.argv[1:]:
        key, value = arg.split("=")
        globals()[key] = int(value) if key in ("die_at", "until", "wait_at") else value

    it = 0
    record = open(used, "a")
    def witness(optimizer, *_):
        record.write(json.dumps([it, optimizer.param_groups[0]["lr"]]) + "\\n")
        record.flush()
    register_optimizer_step_pre_hook(witness)

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    tuner = hooks.install(globals(), model=model, optimizer=optimizer, state_dir=out,
                          resume=bool(resume))
    cosine = None
    if schedule == "cosine":  # never given to memtui
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4000)
    start = 0
    if resume:
        saved = torch.load(resume)
        optimizer.load_state_dict(saved["optimizer"])
        cosine.load_state_dict(saved["scheduler"])
        start = it = saved["it"]
        tuner.load_state_dict({"step": it})
    print("run", tuner.run_id, flush=True)
    while it < until:
        if schedule == "own":  # from the config's own value, every iteration
            for group in optimizer.param_groups:
                group["lr"] = learning_rate * (1 + math.cos(math.pi * it / 4000)) / 2
        if it % 10 == 0 and it > start:
            torch.save({"optimizer": optimizer.state_dict(), "it": it,
                        "scheduler": cosine.state_dict() if cosine else None},
                       os.path.join(out, f"it{it}.pt"))
            tuner.checkpoint()
            if it == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
        if it == wait_at:
            print("waiting", flush=True)
            while not os.path.exists(go):
                time.sleep(0.02)
        model(torch.randn(batch_size, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if cosine is not None:
            cosine.step()
        tuner.step()
        it += 1
    record.close()
    tuner.close()
    """
)


def cosine(it: int) -> float:
    """The script's schedule at its own LR, at iteration ``it``."""
    return 0.003 * (1 + math.cos(math.pi * it / 4000)) / 2


class Training:
    """One process of the training script, waiting at ``wait_at`` until told to go on."""

    def __init__(self, tmp_path: Path, name: str, *config: str) -> None:
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        self.used = tmp_path / f"{name}.lrs"
        self.go = tmp_path / f"{name}.go"
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        args = [f"out={out}", f"used={self.used}", f"go={self.go}", *config]
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        self.printed = ""
        self.run = self.line_after("run ").split()[1]
        self.line_after("waiting")

    def line_after(self, start: str) -> str:
        """The first line it prints from now on that starts with ``start``."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.printed += line
            if line.startswith(start):
                return line
        pytest.fail(f"the training ended before printing {start!r}: {self.printed}")

    def finish(self, returncode: int = 0) -> str:
        """Let it go on to its end; what it printed."""
        self.go.touch()
        output, _ = self.proc.communicate(timeout=patience(60))
        assert self.proc.returncode == returncode, self.printed + output
        return self.printed + output

    def lrs(self) -> dict[int, float]:
        """The LR each iteration's optimizer step used."""
        lines = self.used.read_text().splitlines()
        return {it: lr for it, lr in (json.loads(x) for x in lines)}


def doubled_at(lrs: dict[int, float], boundary: int) -> list[Any]:
    """(iteration, LR used, LR expected) where the LR is not the schedule, x2 from ``boundary``."""
    out = []
    for it, lr in sorted(lrs.items()):
        expected = cosine(it) * (2.0 if it >= boundary else 1.0)
        if not math.isclose(lr, expected, rel_tol=1e-9):
            out.append((it, lr, expected))
    return out


@pytest.mark.parametrize("die_at", [10, 20], ids=["saved at the change", "saved after it"])
def test_a_scheduler_memtui_was_not_given_runs_times_the_factor_across_a_restart(
    tmp_path: Path, die_at: int
) -> None:
    first = Training(tmp_path, "first", f"die_at={die_at}", "until=60", "wait_at=5")
    queued = memtui_cli(
        "set", first.run, "batch_size=8", "--allow-effective-batch", "--lr-scale", "linear"
    )
    assert queued.returncode == 0 and "lr x2.0 (linear)" in queued.stderr, queued.stderr
    first.finish(returncode=-9)  # the change lands at iteration 10's checkpoint
    lrs = first.lrs()
    assert sorted(lrs) == list(range(die_at))
    assert not doubled_at(lrs, 10)

    resume = f"resume={tmp_path / 'out' / f'it{die_at}.pt'}"
    again = Training(tmp_path, "again", resume, "until=60", f"wait_at={die_at + 20}")
    status = wait_for(lambda: (s := status_json(again.run))["step"] >= die_at + 20 and s, 30)
    output = again.finish()
    assert status["config"]["batch_size"] == 8
    assert status["lr"]["factor"] == 2.0 and not status["lr"].get("script_schedule")
    lrs = again.lrs()
    assert sorted(lrs) == list(range(die_at, 60))
    assert not doubled_at(lrs, 10), "the schedule x2 at every step after the restart"
    assert "no longer holds" not in output
    assert not [
        e for e in read_audit(tmp_path / "out" / AUDIT_FILE) if e["event"] == "lr_withdrawn"
    ]
    tuned = yaml.safe_load((tmp_path / "out" / TUNED_FILE).read_text())
    assert tuned["lr"]["factor"] == 2.0 and "script_schedule" not in tuned["lr"]


def test_a_loop_that_sets_its_lr_from_its_unscaled_config_gets_the_factor_withdrawn(
    tmp_path: Path,
) -> None:
    own = Training(tmp_path, "own", "schedule=own", "until=30", "wait_at=5")
    queued = memtui_cli(
        "set", own.run, "batch_size=8", "--allow-effective-batch", "--lr-scale", "linear"
    )
    assert queued.returncode == 0, queued.stderr
    output = own.finish()
    lrs = own.lrs()
    assert [it for it in lrs if not math.isclose(lrs[it], cosine(it))] == [10], (
        "x2 for the boundary's own iteration only: the loop overwrites it at the next"
    )
    assert "at step 11 the LR factor x2.0 no longer holds" in output
    (withdrawn,) = [
        e for e in read_audit(tmp_path / "out" / AUDIT_FILE) if e["event"] == "lr_withdrawn"
    ]
    assert withdrawn["factor"] == 2.0
    assert withdrawn["note"].startswith(
        f"the script sets the optimizer's LR itself: a step used {cosine(11):.6g} where memtui "
        f"had {2 * cosine(10):.6g} (an LR scheduler memtui does not know, or the loop's own "
        "schedule; give the scheduler to tuner.watch_scheduler"
    )
    tuned = yaml.safe_load((tmp_path / "out" / TUNED_FILE).read_text())
    assert tuned["lr"] == {"script_schedule": withdrawn["note"]}
