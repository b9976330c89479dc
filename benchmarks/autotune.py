"""The autopilot online against an offline grid search over the same knobs.

For each start (four of the demo: starving with 0 workers, a tiny micro-batch, an oversized one
near the memory limit, one already good; from ``benchmarks/scripts/``, the transformer with a tiny
micro-batch, the CNN starving on a slow loader with 0 workers, the MLP with a tiny micro-batch) it
runs the grid first: every point (num_workers x micro-batch, the accumulation recomputed so the
effective batch stays; the same bounds the autopilot has: workers up to the CPUs the run may use)
is a short separate run under the same memory limit (``MEMTUI_MEMORY_LIMIT``: past it the script
raises ``MemoryError`` as a GPU runs out of memory), timed over its steps after a warm-up; a point
that runs out of memory scores 0. Then the run from the start with the autopilot on
(``MEMTUI_AUTOTUNE=1``, a checkpoint every 25 steps) until it converges, and the steps after.
Every config the autopilot went through that the grid lacks (micro-batch 1, which only its move
out of the edge band reaches; a ``prefetch_factor`` other than torch's 2, set through the control
socket at the first checkpoint since the scripts have no flag for it) is then measured the same
way and joins the grid, so every config it reached is judged by the grid's own numbers.

Per start it prints: the best grid throughput and its config, where the autopilot settled (its
config, that config's grid throughput and the throughput measured online after it converged),
the fraction of the grid best (by the grid's numbers, and online), the boundaries it took, the
steps spent in configs the grid says are slower than the start, the OOMs (and whether rolled
back), and the changes it kept that the grid says are worse. Goals: >= 95% of the grid best
within 8 boundaries, no OOM not rolled back, never slower at the end than at the start.

The machine is shared: every number moves with the load (printed with ``os.getloadavg``), and
with ``--rounds N`` each grid point and each autopilot run is repeated N times: the grid's rounds
are interleaved (every point once, then every point again), the grid keeps each point's median
(its rounds printed), the table the autopilot's median round by its fraction of the grid best,
with the spread of the rounds and how many met the goal. On a busy machine a grid point's 20
steps vary as much as the configs differ (beside two CPU hogs on two cores the CNN's configs past
one worker are within 6% of each other, its 20-step rate within +-12-18%): ``--grid-steps``
times each point over more steps, so that the grid the autopilot is judged by is not itself
noise (and its best no winner of a draw).

Usage: python benchmarks/autotune.py [--quick] [--rounds N] [--starts demo-starving,...] [--hogs N]
       [--grid-steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtau", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtaus", dir="/tmp"))

import benchlib

from memtui.advice.autopilot import KEPT, history
from memtui.storage import registry
from memtui.transport.client import ClientError, ControlClient
from memtui.wire import AppliedChange, Snapshot

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PYTHON = sys.executable
EVERY = 25
"""Steps between checkpoints in the autopilot's runs (the fewest its measurement allows)."""


@dataclass(frozen=True)
class Script:
    """A training script, its memory limit, its effective batch and how it names the knobs."""

    name: str
    command: tuple[str, ...]
    limit: str
    effective: int
    flags: dict[str, str]
    """Knob name -> its command-line flag."""
    extra: tuple[str, ...] = ()

    def argv(self, config: dict[str, int], out: Path, steps: int) -> list[str]:
        """The command line of one run with ``config`` (the knobs the script has a flag for)."""
        args = [*self.command]
        for knob, value in config.items():
            if knob in self.flags:
                args += [self.flags[knob], str(value)]
        if self.name == "demo":
            args += ["--steps", str(steps), "--out", str(out), "--checkpoint-every", str(EVERY)]
            args += ["--memory-limit", self.limit, "--progress-every", "1000", "--name", "tune"]
        else:
            args += ["--steps", str(steps), "--out", str(out), "--checkpoint_every", str(EVERY)]
        return [*args, *self.extra]


DEMO = Script(
    "demo",
    (PYTHON, "-m", "memtui.demo", "--seq-len", "128", "--width", "32", "--vocab", "4096",
     "--layers", "1", "--slow-data-ms", "40"),
    limit="720MiB",
    effective=16,
    flags={"batch_size": "--batch-size", "grad_accum": "--grad-accum", "num_workers": "--workers"},
)  # fmt: skip
LM = Script(
    "lm",
    (PYTHON, str(HERE / "scripts" / "transformer.py")),
    limit="680MiB",
    effective=16,
    flags={
        "batch_size": "--batch_size",
        "grad_accum": "--gradient_accumulation_steps",
        "num_workers": "--num_workers",
    },
)

TRUTH_FLAGS = {
    "batch_size": "--batch_size",
    "grad_accum": "--gradient_accumulation_steps",
    "num_workers": "--num_workers",
}
"""The flags of ``benchmarks/scripts/``' training loops."""
CNN = Script(
    "cnn",
    (PYTHON, str(HERE / "scripts" / "cnn.py"), "--slow_data_ms", "3"),
    limit="600MiB",
    effective=16,
    flags=TRUTH_FLAGS,
)
"""A CNN with BatchNorm whose loader costs 3 ms a sample: it starves with no loader worker."""
MLP = Script(
    "mlp",
    (PYTHON, str(HERE / "scripts" / "mlp.py")),
    limit="740MiB",
    effective=16,
    flags=TRUTH_FLAGS,
)
"""A flat, optimizer-heavy MLP (9.4M parameters, AdamW): mostly static memory."""


@dataclass(frozen=True)
class Start:
    """One starting config of one script."""

    name: str
    script: Script
    batch: int
    workers: int

    @property
    def config(self) -> dict[str, int]:
        """The start's knobs (the accumulation keeps the script's effective batch)."""
        return config_of(self.script, self.batch, self.workers)


def config_of(script: Script, batch: int, workers: int) -> dict[str, int]:
    """Knobs for micro-batch ``batch`` and ``workers``, the effective batch kept."""
    return {"batch_size": batch, "grad_accum": script.effective // batch, "num_workers": workers}


STARTS = (
    Start("demo-starving", DEMO, 8, 0),
    Start("demo-tiny-micro", DEMO, 2, 2),
    Start("demo-oversized", DEMO, 16, 2),
    Start("demo-good", DEMO, 8, 2),
    Start("lm-tiny-micro", LM, 2, 0),
    Start("cnn-starving", CNN, 8, 0),
    Start("mlp-tiny-micro", MLP, 2, 0),
)


@dataclass
class Measured:
    """Steps per second and samples per second of one run (0: it ran out of memory)."""

    samples_per_s: float
    oom: bool = False


@dataclass
class Result:
    """One start: the grid's best, where the autopilot settled, what it cost."""

    start: str
    start_config: dict[str, int]
    grid: dict[str, float] = field(default_factory=dict)
    best_config: str = ""
    best: float = 0.0
    start_grid: float = 0.0
    settled_config: str = ""
    settled_grid: float = 0.0
    settled_online: float = 0.0
    start_online: float = 0.0
    fraction_grid: float = 0.0
    fraction_online: float = 0.0
    boundaries: int = 0
    budget: int = 0
    phase: str = ""
    why: str = ""
    """The autopilot's last words: why it converged."""
    steps_slower: int = 0
    steps_total: int = 0
    ooms: int = 0
    ooms_not_rolled_back: int = 0
    kept_worse: int = 0
    kept: int = 0
    wall_s: float = 0.0
    goal: bool = False
    """>= 95% of the grid best by the grid's numbers, <= 8 boundaries, no OOM not rolled back,
    not slower by the grid at the end than at the start."""
    rounds: list[dict[str, Any]] = field(default_factory=list)
    """Each round of the autopilot: settled config, fractions, boundaries, kept worse, goal."""


PREFETCH = 2
"""torch's own ``prefetch_factor``, what every grid point runs with unless it says otherwise."""


def key(config: dict[str, Any]) -> str:
    """``b8x2 w2`` (``b8x2 w2 p4`` with a prefetch_factor other than torch's): a config in a few
    characters; prefetch does nothing without workers."""
    words = f"b{config['batch_size']}x{config['grad_accum']} w{config['num_workers']}"
    prefetch = config.get("prefetch_factor")
    if config["num_workers"] and prefetch not in (None, PREFETCH):
        words += f" p{prefetch}"
    return words


def parse_key(words: str) -> dict[str, int]:
    """The config of a ``key``."""
    parts = words.split()
    batch, accum = parts[0][1:].split("x")
    config = {"batch_size": int(batch), "grad_accum": int(accum), "num_workers": int(parts[1][1:])}
    if len(parts) > 2:
        config["prefetch_factor"] = int(parts[2][1:])
    return config


class Run:
    """One training process, reached through the control client."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._handle = log.open("w")
        self.proc = subprocess.Popen(
            argv, stdout=self._handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        self.run_id = benchlib.wait_run_id(self.log, self.proc, 180.0, "the training")
        self.client = ControlClient(registry.find_run(self.run_id).control, timeout_s=10.0)

    def snapshot(self) -> Snapshot | None:
        """The run's snapshot with its step history (None: it no longer answers)."""
        if self.proc.poll() is not None:
            return None
        try:
            return self.client.hello(history=2048)
        except ClientError:
            return None

    def stop(self) -> None:
        """End the training."""
        benchlib.stop_process(self.proc, 30.0)
        self._handle.close()


def rate(snapshot: Snapshot, first: int, last: int) -> float:
    """Samples per second over the steps (first, last]."""
    steps = [s for s in snapshot.steps if first < s.step <= last and s.step_time_s > 0]
    total = sum(s.step_time_s for s in steps)
    return sum(s.samples for s in steps) / total if total > 0 else 0.0


def wait_step(run: Run, step: int, timeout: float) -> Snapshot | None:
    """The run's snapshot once it reached ``step`` (None: it ended, e.g. out of memory)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshot = run.snapshot()
        if snapshot is None:
            return None
        if snapshot.control.ooms:
            return snapshot
        if snapshot.step >= step:
            return snapshot
        time.sleep(0.5)
    return run.snapshot()


def grid_point(
    script: Script, config: dict[str, int], work: Path, warm: int, timed: int
) -> Measured:
    """One short separate run at ``config``: samples/s over ``timed`` steps after ``warm`` (a knob
    the script has no flag for is set through the control socket: it lands at the first
    checkpoint, and the steps are counted from there)."""
    out = work / f"grid-{script.name}-{key(config).replace(' ', '-')}-{time.monotonic_ns()}"
    env = dict(
        os.environ, MEMTUI_MEMORY_LIMIT=script.limit, MEMTUI_AUTOTUNE="0", PYTHONUNBUFFERED="1"
    )
    run = Run(script.argv(config, out, 1_000_000), env, out.with_suffix(".log"))
    live = {k: v for k, v in config.items() if k not in script.flags and v != PREFETCH}
    try:
        if live:
            reply = run.client.set(dict(live))
            if not reply.ok:
                raise RuntimeError(f"{key(config)}: {reply.reason}")
            warm += EVERY
        snapshot = wait_step(run, warm + timed, 600)
        if snapshot is None or snapshot.control.ooms:
            return Measured(0.0, oom=True)
        return Measured(rate(snapshot, warm, warm + timed))
    finally:
        run.stop()


def median_of(values: list[float]) -> float:
    """The median (0 for none)."""
    return statistics.median(values) if values else 0.0


@dataclass
class Online:
    """One run with the autopilot on: its last snapshot, the step it settled at, its wall time."""

    start: Start
    snapshot: Snapshot
    settled_at: int | None
    wall_s: float

    def visited(self) -> list[dict[str, Any]]:
        """Every config the run went through, the start's first."""
        config: dict[str, Any] = {**self.start.config, "prefetch_factor": PREFETCH}
        seen = [dict(config)]
        for change in sorted(self.snapshot.control.applied, key=lambda a: a.step):
            config.update({k: d.new for k, d in change.changes.items() if k in config})
            seen.append(dict(config))
        return seen

    def result(self, grid: dict[str, float]) -> Result:
        """Its numbers, judged by ``grid``."""
        result = Result(self.start.name, self.start.config, wall_s=self.wall_s)
        fill(result, self.start, self.snapshot, grid, self.settled_at)
        return result


def autopilot_run(start: Start, work: Path, budget: int, timed: int) -> Online:
    """The run from ``start`` with the autopilot on until it converges, then ``timed`` steps."""
    script = start.script
    out = work / f"auto-{start.name}-{time.monotonic_ns()}"
    env = dict(
        os.environ,
        MEMTUI_MEMORY_LIMIT=script.limit,
        MEMTUI_AUTOTUNE="1",
        MEMTUI_AUTOTUNE_BUDGET=str(budget),
        PYTHONUNBUFFERED="1",
    )
    began = time.monotonic()
    run = Run(script.argv(start.config, out, 1_000_000), env, out.with_suffix(".log"))
    try:
        deadline = time.monotonic() + 900
        snapshot = run.snapshot()
        settled_at: int | None = None
        while time.monotonic() < deadline:
            snapshot = run.snapshot()
            if snapshot is None:
                break
            pilot = snapshot.control.autopilot
            if pilot is not None and pilot.phase == "converged" and not snapshot.control.pending:
                settled_at = snapshot.step if settled_at is None else settled_at
                if snapshot.step >= settled_at + timed + 2:
                    break
            time.sleep(1.0)
        if snapshot is None:
            raise RuntimeError(f"{start.name}: the run died: {run.log.read_text()[-2000:]}")
    finally:
        run.stop()
    return Online(start, snapshot, settled_at, time.monotonic() - began)


def fill(
    result: Result, start: Start, snapshot: Snapshot, grid: dict[str, float], settled_at: int | None
) -> None:
    """The autopilot run's numbers from its last snapshot and the grid."""
    control = snapshot.control
    pilot = control.autopilot
    knobs = ("batch_size", "grad_accum", "num_workers", "prefetch_factor")
    final = {k: getattr(control.config, k) for k in knobs}
    result.settled_config = key(final)
    result.settled_grid = grid.get(key(final), 0.0)
    result.start_grid = grid.get(key(start.config), 0.0)
    result.phase = pilot.phase if pilot is not None else "?"
    result.why = pilot.why if pilot is not None else ""
    result.boundaries = pilot.boundaries if pilot is not None else 0
    result.budget = pilot.budget if pilot is not None else 0
    result.ooms = len(control.ooms)
    result.ooms_not_rolled_back = sum(not o.rolled_back for o in control.ooms)
    applied = list(control.applied)
    first_change = applied[0].step if applied else snapshot.step
    result.start_online = rate(snapshot, 2, min(first_change, 2 + 20))
    if settled_at is not None:
        result.settled_online = rate(snapshot, settled_at, snapshot.step)
    result.steps_slower, result.steps_total = slower_steps(start, snapshot, applied, grid)
    for trial in history(applied).trials:
        if trial.outcome != KEPT:
            continue
        result.kept += 1
        before, after = configs_at(start, applied, trial.step)
        if grid.get(key(after), 0.0) < grid.get(key(before), 0.0):
            result.kept_worse += 1
    result.best_config, result.best = max(grid.items(), key=lambda item: item[1])
    result.fraction_grid = result.settled_grid / result.best if result.best else 0.0
    result.fraction_online = result.settled_online / result.best if result.best else 0.0
    result.goal = (
        result.fraction_grid >= 0.95
        and result.boundaries <= 8
        and not result.ooms_not_rolled_back
        and result.settled_grid >= result.start_grid
    )


def configs_at(
    start: Start, applied: list[AppliedChange], step: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config before and after the change applied at ``step``."""
    config: dict[str, Any] = dict(start.config)
    before = dict(config)
    for change in applied:
        if change.step == step:
            before = dict(config)
        for knob, diff in change.changes.items():
            config[knob] = diff.new
        if change.step == step:
            return before, dict(config)
    return before, dict(config)


def slower_steps(
    start: Start, snapshot: Snapshot, applied: list[AppliedChange], grid: dict[str, float]
) -> tuple[int, int]:
    """Steps run in configs the grid says are slower than the start's, and all the steps."""
    base = grid.get(key(start.config), 0.0)
    config: dict[str, Any] = dict(start.config)
    changes = sorted(applied, key=lambda a: a.step)
    slower = 0
    last = 0
    for change in [*changes, None]:
        end = change.step if change is not None else snapshot.step
        if grid.get(key(config), 0.0) < base:
            slower += max(0, end - last)
        if change is not None:
            for knob, diff in change.changes.items():
                config[knob] = diff.new
            last = change.step
    return slower, snapshot.step


def measure_grid(
    script: Script,
    configs: list[dict[str, int]],
    grid: dict[str, float],
    args: argparse.Namespace,
    work: Path,
) -> None:
    """Measure each of ``configs`` the grid lacks, ``args.rounds`` times (the rounds interleaved),
    into ``grid``."""
    warm, timed = (8, 20) if args.quick else (10, 40)
    timed = args.grid_steps or timed
    missing = list({key(c): c for c in configs if key(c) not in grid}.values())
    measured: dict[str, list[float]] = {key(config): [] for config in missing}
    for _ in range(args.rounds):
        for config in missing:
            point = grid_point(script, config, work, warm, timed)
            measured[key(config)].append(point.samples_per_s)
    for config in missing:
        values = measured[key(config)]
        grid[key(config)] = median_of(values)
        spread = f"[{min(values):.0f}-{max(values):.0f}]" if len(values) > 1 else ""
        print(
            f"  grid {script.name} {key(config)}: {grid[key(config)]:.0f} samples/s {spread}",
            flush=True,
        )


def settle(
    start: Start,
    onlines: list[Online],
    grid: dict[str, float],
    args: argparse.Namespace,
    work: Path,
) -> Result:
    """The median round of ``start`` by its fraction of the grid best, once every config its
    rounds went through is in the grid; with each round's numbers."""
    reached = [config for online in onlines for config in online.visited()]
    measure_grid(start.script, reached, grid, args, work)
    rounds = sorted((online.result(grid) for online in onlines), key=lambda r: r.fraction_grid)
    result = rounds[len(rounds) // 2]
    result.grid = dict(grid)
    result.rounds = [
        {
            "settled": r.settled_config,
            "fraction_grid": round(r.fraction_grid, 4),
            "fraction_online": round(r.fraction_online, 4),
            "boundaries": r.boundaries,
            "kept_worse": r.kept_worse,
            "kept": r.kept,
            "goal": r.goal,
            "why": r.why,
        }
        for r in rounds
    ]
    return result


def main() -> int:
    """Run the grid and the autopilot per start; print the table and the verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid, fewer steps")
    parser.add_argument("--rounds", type=int, default=1, help="repeat and keep medians")
    parser.add_argument("--starts", default=",".join(s.name for s in STARTS))
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hogs", type=int, default=0, help="run N `yes` processes beside it all")
    parser.add_argument(
        "--grid-steps", type=int, default=0, help="steps each grid point is timed over"
    )
    args = parser.parse_args()
    with benchlib.cpu_hogs(args.hogs):
        return run(args)


def run(args: argparse.Namespace) -> int:
    """The grid and the autopilot for every start asked for."""
    wanted = args.starts.split(",")
    starts = [s for s in STARTS if s.name in wanted]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = list(range(0, min(cpus, 4) + 1))  # every count the autopilot may reach
    batches = [4, 8, 16] if args.quick else [2, 4, 8, 16]
    timed = 20 if args.quick else 40
    print(
        f"load {os.getloadavg()}, cpus {cpus}, rounds {args.rounds}, quick {args.quick}, "
        f"{args.hogs} CPU hogs, grid points over {args.grid_steps or timed} steps",
        flush=True,
    )
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="autotune", dir="/tmp"))
    grids: dict[str, dict[str, float]] = {}
    results: list[Result] = []
    for start in starts:
        script = start.script
        if script.name not in grids:
            grids[script.name] = {}
            configs = [
                config_of(script, batch, count)
                for batch in sorted({*batches, *(s.batch for s in starts if s.script is script)})
                for count in sorted({*workers, *(s.workers for s in starts if s.script is script)})
            ]
            measure_grid(script, configs, grids[script.name], args, work)
        onlines = []
        for number in range(args.rounds):
            online = autopilot_run(start, work, args.budget, timed)
            onlines.append(online)
            pilot = online.snapshot.control.autopilot
            why = f"{pilot.phase}: {pilot.why}" if pilot is not None else "?"
            print(
                f"  {start.name} round {number + 1}: settled {key(online.visited()[-1])} ({why}) "
                f"in {online.wall_s:.0f} s, load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            for trial in history(list(online.snapshot.control.applied)).trials:
                print(f"    step {trial.step}: {trial.describe()}", flush=True)
        results.append(settle(start, onlines, grids[script.name], args, work))
    print()
    print(
        "start            best grid (config)    settled (grid / online)      of best (grid / online)  bounds  slower steps  OOMs  kept worse  goal (rounds: of best)"
    )
    for r in results:
        spread = ", ".join(f"{x['fraction_grid']:.0%}" for x in r.rounds)
        met = sum(x["goal"] for x in r.rounds)
        print(
            f"{r.start:<16} {r.best:6.0f} ({r.best_config:<9}) {r.settled_config:<9} {r.settled_grid:6.0f} / {r.settled_online:6.0f}"
            f"   {r.fraction_grid:6.0%} / {r.fraction_online:6.0%}          {r.boundaries}/{r.budget}   "
            f"{r.steps_slower:5d}/{r.steps_total:<5d}  {r.ooms}({r.ooms_not_rolled_back} not rb)  "
            f"{sum(x['kept_worse'] for x in r.rounds)}/{sum(x['kept'] for x in r.rounds)}"
            f"  {met}/{len(r.rounds)} ({spread})"
        )
    print(
        f"\ngoal (>= 95% of the grid best by the grid's numbers, <= 8 boundaries, no OOM not rolled back, never slower at the end), median round: {sum(r.goal for r in results)}/{len(results)} starts"
    )
    print(f"load {os.getloadavg()}; took {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
