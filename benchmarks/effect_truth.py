"""The effect memtui states for a change against the change's steady-state effect.

Each training script (the demo, and ``benchmarks/scripts/``' CNN, transformer and MLP) runs on the
CPU through a plan of changes that go back and forth (``num_workers`` 0 -> 2 -> 0, a micro-batch
doubled and halved, ``prefetch_factor``, ``pin_memory``), each queued over the control socket as
``memtui set`` does and landing at the next checkpoint. For each change it records the effect the
hook published (the change of samples/s, its 95% interval, the steps it was measured over and the
warm-up steps it left out), then lets the run go on at the new config until ``--after`` steps
past the change and ``--window`` more: the change's steady-state effect is the samples/s of those
``--window`` steps against the ``--window`` steps before the change (the old config, which had run
as long). The plans go back and forth, so the runs are interleaved: where the change after
returns to the old config, the steady state is also taken against the old config's two windows
either side, weighted by how many steps away they are (``bracketed``: the machine's load that
moved while the new config ran is then on both sides of the comparison).

It prints each change (its stated effect and interval, the steady state, whether the interval
holds it, the load average then), the coverage (the share of the changes measured whose interval
holds their steady state) and, for a change that cannot act on this machine (``pin_memory``
without an accelerator), whether memtui said so instead of crediting it. The bar: coverage of at
least 90% over the changes measured.

A run stops starting changes once ``--budget`` seconds are spent (19 minutes by default); the
JSON (``--json``) is written after each change, with every step of each run.

Usage: python benchmarks/effect_truth.py [--scripts demo,cnn,lm,mlp] [--hogs N] [--after N]
       [--window N] [--budget S] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtet", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtets", dir="/tmp"))

import benchlib
import msgspec

from memtui.advice.effect import describe as describe_effect
from memtui.advice.effect import interval
from memtui.storage import registry
from memtui.transport.client import ClientError, ControlClient
from memtui.wire import AppliedChange, Snapshot, StepRecord

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
BAR = 0.90
EVERY = 25
"""Steps between checkpoints: a change lands within this many steps of being queued."""


@dataclass(frozen=True)
class Script:
    """A training script, its first config and its plan of changes."""

    name: str
    command: tuple[str, ...]
    plan: tuple[dict[str, Any], ...]
    quick_plan: tuple[dict[str, Any], ...] = ()

    def argv(self, out: Path) -> list[str]:
        """The command line of the run."""
        if self.name == "demo":
            tail = ["--steps", "10000000", "--out", str(out), "--checkpoint-every", str(EVERY),
                    "--progress-every", "1000", "--name", "effect"]  # fmt: skip
        else:
            tail = ["--out", str(out), "--checkpoint_every", str(EVERY)]
        return [*self.command, *tail]


WORKERS = ({"num_workers": 2}, {"num_workers": 0}, {"num_workers": 1}, {"num_workers": 0})
SCRIPTS: dict[str, Script] = {
    s.name: s
    for s in (
        Script(
            "demo",
            (PYTHON, "-m", "memtui.demo", "--seq-len", "16", "--width", "32", "--vocab", "64",
             "--layers", "1", "--grad-accum", "1", "--slow-data-ms", "4", "--batch-size", "8"),
            plan=(*WORKERS, {"num_workers": 2}, {"batch_size": 16}, {"batch_size": 8},
                  {"pin_memory": True}, {"pin_memory": False}, {"prefetch_factor": 4},
                  {"prefetch_factor": 2}, {"num_workers": 0}),
            quick_plan=({"num_workers": 2}, {"num_workers": 0}, {"pin_memory": True}),
        ),
        Script(
            "cnn",
            (PYTHON, str(HERE / "scripts" / "cnn.py"), "--slow_data_ms", "3", "--batch_size", "8"),
            plan=(*WORKERS, {"batch_size": 16}, {"batch_size": 8}, {"pin_memory": True},
                  {"pin_memory": False}),
            quick_plan=({"num_workers": 2}, {"num_workers": 0}),
        ),
        Script(
            "lm",
            (PYTHON, str(HERE / "scripts" / "transformer.py"), "--batch_size", "4"),
            plan=({"batch_size": 8}, {"batch_size": 4}, {"num_workers": 2}, {"num_workers": 0}),
            quick_plan=({"batch_size": 8}, {"batch_size": 4}),
        ),
        Script(
            "mlp",
            (PYTHON, str(HERE / "scripts" / "mlp.py"), "--batch_size", "32"),
            plan=({"batch_size": 64}, {"batch_size": 32}, {"num_workers": 2}, {"num_workers": 0}),
            quick_plan=({"batch_size": 64}, {"batch_size": 32}),
        ),
    )
}  # fmt: skip


@dataclass
class Row:
    """One change: what memtui stated and what the run then did at the new config."""

    script: str
    index: int
    changes: dict[str, Any]
    config_before: dict[str, Any] = field(default_factory=dict)
    outcome: str = ""
    """``measured``, ``not measured`` (memtui said why), ``rejected``, ``timed out``."""
    reason: str = ""
    step: int | None = None
    stated: float | None = None
    """The change of samples/s memtui stated."""
    low: float | None = None
    """The low end of its 95% interval."""
    high: float | None = None
    """Its high end."""
    drift: float | None = None
    """How much the run's speed moved at an unchanged config, as the hook counted it (95%)."""
    steps_before: int = 0
    steps_after: int = 0
    warmup: int | None = None
    """Steps after the change memtui left out (its warm-up), where it says."""
    summary: str = ""
    note: str = ""
    """What memtui said instead of an effect, if anything."""
    steady: float | None = None
    """The new config's samples/s ``after`` steps later, over ``window`` steps, against the old
    config's over the ``window`` steps before the change."""
    bracketed: float | None = None
    """The same, against the old config's windows either side, weighted by time (None: the next
    change does not return to the old config)."""
    covered: bool | None = None
    covered_bracketed: bool | None = None
    loadavg: list[float] = field(default_factory=list)
    rate_before: float | None = None
    rate_after: float | None = None
    wall_s: float = 0.0


class Run:
    """One training process, reached through the control client; its steps gathered as they go."""

    def __init__(self, script: Script, workdir: Path) -> None:
        self.log = workdir / f"{script.name}.log"
        self._handle = self.log.open("w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            script.argv(workdir / script.name),
            stdout=self._handle,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        self.run_id = benchlib.wait_run_id(self.log, self.proc, 180.0, script.name)
        self.client = ControlClient(registry.find_run(self.run_id).control, timeout_s=10.0)
        self.steps: dict[int, StepRecord] = {}
        self.applied: list[AppliedChange] = []
        self.config: dict[str, Any] = {}

    def poll(self) -> Snapshot | None:
        """Read the run once: its new steps, its changes and config (None: it did not answer)."""
        if self.proc.poll() is not None:
            return None
        try:
            snapshot = self.client.hello(history=2048)
        except ClientError:
            return None
        for record in snapshot.steps:
            self.steps[record.step] = record
        self.applied = list(snapshot.control.applied)
        self.config = {
            k: getattr(snapshot.control.config, k)
            for k in ("batch_size", "grad_accum", "num_workers", "pin_memory", "prefetch_factor")
        }
        return snapshot

    def until_step(self, step: int, timeout: float) -> bool:
        """Poll until the run has closed ``step`` (False: timed out or ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is None:
                return False
            if self.steps and max(self.steps) >= step:
                return True
            time.sleep(1.0)
        return False

    def rate(self, first: int, last: int) -> float | None:
        """Samples/s over steps (first, last] (None: a step is missing or untimed)."""
        window = [self.steps.get(s) for s in range(first + 1, last + 1)]
        if not window or any(r is None or r.step_time_s <= 0 for r in window):
            return None
        return sum(r.samples for r in window if r) / sum(r.step_time_s for r in window if r)

    def raw(self) -> dict[str, Any]:
        """Every step and applied change gathered, as JSON-able data."""
        return {
            "steps": [list(msgspec.to_builtins(r)) for _, r in sorted(self.steps.items())],
            "applied": [msgspec.to_builtins(a) for a in self.applied],
        }

    def stop(self) -> None:
        """End the training."""
        benchlib.stop_process(self.proc, 30.0)
        self._handle.close()


def stated_of(applied: AppliedChange) -> tuple[float | None, str]:
    """The change of samples/s memtui stated (None: not yet), or what it said instead."""
    note = applied.effect_note
    effect = applied.effect
    if effect is None:
        return None, note
    if effect.samples_per_s_before <= 0:
        return None, note or "no speed before"
    return effect.samples_per_s_after / effect.samples_per_s_before - 1, note


@dataclass
class Session:
    """One benchmark run: its options, its rows and raw steps so far, and its time budget."""

    after: int
    window: int
    hogs: int
    budget_s: float
    json_path: Path | None
    started: float = field(default_factory=time.monotonic)
    rows: list[Row] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    """Every step and applied change of each script's run."""
    load_before: list[float] = field(default_factory=benchlib.loadavg)
    commit: str = field(default_factory=benchlib.commit)
    """The code measured (read at the start: the scripts import it as they start)."""

    script_ends: float = 0.0
    """When the script running now must stop starting changes (its share of the budget)."""

    def share(self, scripts_left: int) -> None:
        """Give the script starting now its share of the budget left."""
        left = self.budget_s - (time.monotonic() - self.started)
        self.script_ends = time.monotonic() + left / max(scripts_left, 1)

    def time_left(self, needed_s: float) -> bool:
        """Whether a change that takes ``needed_s`` still fits in the script's share."""
        return time.monotonic() + needed_s <= self.script_ends

    def save(self) -> None:
        """Write what was measured so far (every row, every step) to the JSON path, if any."""
        if self.json_path is None:
            return
        for row in self.rows:
            row.covered = held(row, row.steady)
            row.covered_bracketed = held(row, row.bracketed)
        data = {
            "benchmark": "effect_truth",
            "hogs": self.hogs,
            "after": self.after,
            "window": self.window,
            "cpu": benchlib.cpu_model(),
            "commit": self.commit,
            "seconds": round(time.monotonic() - self.started),
            "rows": [asdict(r) for r in self.rows],
            "loadavg_before": self.load_before,
            "loadavg_now": benchlib.loadavg(),
            "raw": self.raw,
        }
        self.json_path.write_text(json.dumps(data))


def drive(
    session: Session, script: Script, workdir: Path, plan: tuple[dict[str, Any], ...]
) -> None:
    """Run one script through its plan (while the budget lasts); a row a change."""
    after, window = session.after, session.window
    run = Run(script, workdir)
    rows: list[Row] = []
    timeout = 600.0
    longest = 0.0
    try:
        if not run.until_step(window + 2 * EVERY, timeout):
            raise RuntimeError(f"{script.name} did not reach step {window + 2 * EVERY}")
        for index, changes in enumerate(plan):
            if not session.time_left(longest):
                print(f"  {script.name}: the time budget is spent before #{index}", flush=True)
                break
            began = time.monotonic()
            row = Row(script.name, index, dict(changes), config_before=dict(run.config))
            rows.append(row)
            session.rows.append(row)
            reply = run.client.set(changes)
            if not reply.ok:
                row.outcome, row.reason = "rejected", reply.reason
                continue
            applied = None
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and run.poll() is not None:
                applied = next((a for a in run.applied if reply.id in a.ids), None)
                if applied is not None and (applied.effect is not None or applied.effect_note):
                    break
                time.sleep(1.0)
            if applied is None:
                row.outcome, row.reason = "timed out", "the change did not land"
                break
            row.step = applied.step
            row.stated, row.note = stated_of(applied)
            effect = applied.effect
            if effect is not None:
                bounds = interval(effect)
                row.low, row.high = bounds if bounds is not None else (None, None)
                row.steps_before, row.steps_after = effect.steps_before, effect.steps_after
                row.warmup, row.drift = effect.warmup_steps, effect.speed_drift
                row.summary = describe_effect(effect)
                row.outcome = "measured"
            else:
                row.outcome = "not measured" if row.note else "timed out"
            end = applied.step + after + window
            if not run.until_step(end, timeout):
                row.reason = "the run did not reach the steady window"
                break
            row.loadavg = benchlib.loadavg()
            row.rate_before = run.rate(applied.step - window, applied.step)
            row.rate_after = run.rate(applied.step + after, end)
            if row.rate_before and row.rate_after:
                row.steady = row.rate_after / row.rate_before - 1
            row.wall_s = round(time.monotonic() - began, 1)
            longest = max(longest, row.wall_s)
            bracket(rows, window, after)
            session.raw[script.name] = run.raw()
            session.save()
            print(f"  {describe(row)}", flush=True)
    finally:
        run.stop()
    session.raw[script.name] = run.raw()
    session.save()


def bracket(rows: list[Row], window: int, after: int) -> None:
    """The bracketed steady state of each change that the next change undoes: the new config's
    window against the old config's rate at that time, interpolated between the old config's
    window before the change and its steady window after the change back."""
    for row, following in itertools.pairwise(rows):
        if row.step is None or following.step is None or row.rate_after is None:
            continue
        if any(following.changes.get(k) != row.config_before.get(k) for k in row.changes):
            continue
        earlier, later = row.rate_before, following.rate_after
        if later is None or earlier is None:
            continue
        left = row.step - window / 2
        centre = row.step + after + window / 2
        right = following.step + after + window / 2
        weight = (centre - left) / (right - left)
        row.bracketed = row.rate_after / ((1 - weight) * earlier + weight * later) - 1


def held(row: Row, steady: float | None) -> bool | None:
    """Whether the stated interval holds ``steady`` (None: nothing to compare)."""
    if steady is None or row.low is None or row.high is None:
        return None
    return row.low <= steady <= row.high


def describe(row: Row) -> str:
    """One change in a line."""
    change = ", ".join(f"{k} {row.config_before.get(k)}->{v}" for k, v in row.changes.items())
    if row.stated is None:
        return f"{row.script} #{row.index} {change}: {row.outcome} {row.note or row.reason}"
    steady = "-" if row.steady is None else f"{row.steady:+.0%}"
    return f"{row.script} #{row.index} {change}: {row.summary}; steady {steady}; load {row.loadavg}"


def table(rows: list[Row]) -> str:
    """The per-change table."""
    head = ("script", "#", "change", "stated", "95% interval", "steps b/a", "warm-up", "drift",
            "steady", "held", "bracketed", "held", "load 1m")  # fmt: skip
    lines = [head]
    for r in rows:
        change = ", ".join(f"{k} {r.config_before.get(k)}->{v}" for k, v in r.changes.items())
        yes = {True: "yes", False: "NO", None: "-"}
        lines.append(
            (
                r.script,
                str(r.index),
                change,
                "-" if r.stated is None else f"{r.stated:+.0%}",
                "-" if r.low is None or r.high is None else f"{r.low:+.0%} to {r.high:+.0%}",
                f"{r.steps_before}/{r.steps_after}" if r.stated is not None else "-",
                "-" if r.warmup is None else str(r.warmup),
                "-" if r.drift is None else f"+-{r.drift:.0%}",
                "-" if r.steady is None else f"{r.steady:+.0%}",
                yes[r.covered],
                "-" if r.bracketed is None else f"{r.bracketed:+.0%}",
                yes[r.covered_bracketed],
                f"{r.loadavg[0]:.1f}" if r.loadavg else "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {r.script} #{r.index}: {r.note or r.reason}" for r in rows if r.stated is None]
    return "\n".join(out + (["", "not measured:", *notes] if notes else []))


def main() -> int:
    """Drive the chosen scripts, print the table and the coverage."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", default="demo,cnn", help="comma-separated subset")
    parser.add_argument("--hogs", type=int, default=0, metavar="N", help="N `yes` processes beside")
    parser.add_argument(
        "--after",
        type=int,
        default=200,
        metavar="N",
        help="steps from the change to the steady window (default 200)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=150,
        metavar="N",
        help="steps of each steady window (default 150)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=1140.0,
        metavar="S",
        help="no change is started that would end past this many seconds",
    )
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write every row and step here (after each change)",
    )
    args = parser.parse_args()  # fmt: skip
    names = [n for n in args.scripts.split(",") if n]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        parser.error(f"unknown script(s) {', '.join(unknown)}; known: {', '.join(SCRIPTS)}")
    session = Session(args.after, args.window, args.hogs, args.budget, args.json)
    with tempfile.TemporaryDirectory(prefix="effect-truth") as tmp, benchlib.cpu_hogs(args.hogs):
        for index, name in enumerate(names):
            script = SCRIPTS[name]
            session.share(len(names) - index)
            plan = script.quick_plan if args.quick else script.plan
            print(f"{name}: {len(plan)} changes", flush=True)
            drive(session, script, Path(tmp), plan)
    rows = session.rows
    for row in rows:
        row.covered = held(row, row.steady)
        row.covered_bracketed = held(row, row.bracketed)
    print()
    print(table(rows))
    judged = [r for r in rows if r.covered is not None]
    inside = sum(bool(r.covered) for r in judged)
    bracketed = [r for r in rows if r.covered_bracketed is not None]
    inside_b = sum(bool(r.covered_bracketed) for r in bracketed)
    idle = [r for r in rows if r.changes.keys() == {"pin_memory"}]
    credited = [r for r in idle if r.stated is not None]
    coverage = f"{inside / len(judged):.0%}" if judged else "-"
    print(
        f"\ncoverage: {inside} of {len(judged)} stated intervals hold the steady state "
        f"({coverage}; bar {BAR:.0%}); against the bracketed steady state {inside_b} of "
        f"{len(bracketed)}"
    )
    print(f"pin_memory changes without an accelerator: {len(idle)}, credited with an effect: "
          f"{len(credited)}")  # fmt: skip
    loads = [r.loadavg[0] for r in rows if r.loadavg]
    seen = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
    print(f"load average (1 min) {session.load_before[0]:.1f} before, {seen} at the changes, "
          f"{benchlib.loadavg()[0]:.1f} after; {args.hogs} CPU hogs; "
          f"{time.monotonic() - session.started:.0f} s on {benchlib.cpu_model()}, "
          f"{os.cpu_count()} CPUs; commit {session.commit or '-'}")  # fmt: skip
    session.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
