"""memtui's memory and speed predictions against what real runs then did.

Each training script (the demo, and ``benchmarks/scripts/``: a transformer on variable-length
sequences, a small CNN with BatchNorm, a parameter-heavy MLP) runs on the CPU under a memory
limit (``MEMTUI_MEMORY_LIMIT``: the limit is the run's capacity, and the script's budget raises
``MemoryError`` past it, as a GPU would run out of memory), chosen per script so that the
micro-batches tried sit near it. The benchmark drives it through a sequence of changes, each
queued over the control socket the way ``memtui set`` does (never forced: a change that needs
``--force`` is recorded as refused) and landing at the next checkpoint: micro-batch increases,
the top recommendation, a decrease, a ``num_workers`` change, the largest micro-batch
``memtui status --json`` calls safe (``max_safe_batch_size``), and one past it. It waits for
each change's measured effect before queueing the next, as an operator watching the change log
would.

For each change it records the predicted peak (the applied change's ``predicted_peak_bytes``,
and the set reply's), the observed peak (``observed_peak_bytes``), the error (predicted /
observed - 1), whether the run ran out of memory before the next change landed, and the speed
the hook predicted for the change from the steps before it (``predicted_speed_delta``, the
estimate the recommendations use) against the measured samples/s change, in points, and
whether the prediction lies inside the measured effect's 95% interval. It prints a table, a summary
per script and the verdict against the accuracy bar: mean |error| <= 5% and max |error| <= 10% on
every change, no out of memory from a change accepted without ``--force``, and the max safe batch's
observed peak under the edge band (``memory_edge_fraction``) every time.

Usage: python benchmarks/advice_truth.py [--scripts demo,lm,cnn,mlp] [--quick] [--dwell S] [--hogs N]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

os.environ.setdefault("MEMTUI_RUNTIME_DIR", tempfile.mkdtemp(prefix="mtat", dir="/tmp"))
os.environ.setdefault("XDG_STATE_HOME", tempfile.mkdtemp(prefix="mtats", dir="/tmp"))

import benchlib
import msgspec

from memtui.core.stats import format_bytes, parse_bytes
from memtui.runs.report import Applied, StatusReport, build_status
from memtui.storage import registry
from memtui.storage.userconfig import load_thresholds
from memtui.transport.client import ClientError, ControlClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MEAN_BAR = 0.05
MAX_BAR = 0.10
T = TypeVar("T")


@dataclass(frozen=True)
class Script:
    """A training script, its memory limit, its first micro-batch and its sequence of changes."""

    name: str
    command: list[str]
    limit: str
    batch: int
    plan: tuple[str, ...]
    """Steps: ``batch=N``, ``rec`` (the top applicable recommendation), ``workers`` (0 <-> 2),
    ``max_safe`` and ``over`` (half again the max safe batch)."""
    quick_plan: tuple[str, ...] = ("batch=16", "max_safe")
    quick_limit: str = ""


PYTHON = sys.executable
SCRIPTS: dict[str, Script] = {
    s.name: s
    for s in (
        Script(
            "demo",
            [PYTHON, "-m", "memtui.demo", "--seq-len", "128", "--width", "32", "--vocab", "4096",
             "--layers", "1", "--grad-accum", "1", "--slow-data-ms", "4", "--progress-every",
             "1000"],
            limit="640MiB",
            batch=8,
            plan=("batch=16", "rec", "batch=4", "workers", "max_safe", "over"),
        ),
        Script(
            "lm",
            [PYTHON, str(HERE / "scripts" / "transformer.py")],
            limit="680MiB",
            batch=4,
            plan=("batch=8", "rec", "batch=3", "workers", "max_safe", "over"),
            quick_plan=("batch=8", "max_safe"),
        ),
        Script(
            "cnn",
            [PYTHON, str(HERE / "scripts" / "cnn.py")],
            limit="600MiB",
            batch=8,
            plan=("batch=16", "rec", "batch=6", "workers", "max_safe", "over"),
            quick_limit="520MiB",
        ),
        Script(
            "mlp",
            [PYTHON, str(HERE / "scripts" / "mlp.py")],
            # 690 MiB before the CPU stand-in fixed glibc's mmap threshold; with it the MLP peaks
            # at 588 MiB whatever its micro-batch, 85% of 690 MiB: over the edge before any change
            limit="740MiB",
            batch=32,
            plan=("batch=64", "rec", "batch=12", "workers", "max_safe", "over"),
            quick_plan=("batch=64", "max_safe"),
        ),
    )
}  # fmt: skip


@dataclass
class Row:
    """One change: what was asked, what memtui predicted, what the run then did."""

    script: str
    index: int
    kind: str
    changes: dict[str, Any] = field(default_factory=dict)
    config_before: dict[str, Any] = field(default_factory=dict)
    outcome: str = ""
    """``measured``, ``refused`` (needs --force), ``rejected``, ``skipped``, ``unmeasured``."""
    reason: str = ""
    needs_force: bool = False
    change_id: int = 0
    step_queued: int = 0
    step_applied: int | None = None
    capacity_bytes: int | None = None
    edge_fraction: float = 0.85
    max_safe_at_queue: int | None = None
    confidence: str = ""
    predicted_reply_bytes: int | None = None
    predicted_bytes: int | None = None
    observed_bytes: int | None = None
    error: float | None = None
    observed_fraction: float | None = None
    under_edge: bool | None = None
    oom: bool = False
    rolled_back: bool = False
    run_died: bool = False
    speed_predicted: float | None = None
    speed_note: str = ""
    speed_measured: float | None = None
    speed_margin: float | None = None
    effect: str = ""


# ---------------------------------------------------------------------------- one run


class Run:
    """One training script in its own process, reached through the control client."""

    def __init__(self, script: Script, workdir: Path, limit: str, checkpoint_every: int) -> None:
        self.script = script
        self.log_path = workdir / f"{script.name}.log"
        out = workdir / script.name
        env = dict(os.environ, MEMTUI_MEMORY_LIMIT=limit, PYTHONUNBUFFERED="1")
        if script.name == "demo":
            args = ["--batch-size", str(script.batch), "--steps", "1000000", "--out", str(out),
                    "--checkpoint-every", str(checkpoint_every), "--memory-limit", limit,
                    "--name", "truth-demo"]  # fmt: skip
        else:
            args = ["--batch_size", str(script.batch), "--out", str(out),
                    "--checkpoint_every", str(checkpoint_every)]  # fmt: skip
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [*script.command, *args], stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        self.run_id = benchlib.wait_run_id(self.log_path, self.proc, 120.0, script.name)
        self.client = ControlClient(registry.find_run(self.run_id).control, timeout_s=10.0)
        self.thresholds = load_thresholds()
        self.last: StatusReport | None = None
        """The last report the run answered with (what a run that died said last)."""

    def alive(self) -> bool:
        """Whether the training process still runs."""
        return self.proc.poll() is None

    def status(self) -> StatusReport | None:
        """The run's ``memtui status --json`` report (None if it did not answer)."""
        try:
            snapshot = self.client.hello(history=64)
        except ClientError:
            return None
        self.last = build_status(snapshot, None, self.thresholds)
        return self.last

    def until(self, check: Callable[[StatusReport], T | None], timeout: float) -> T | None:
        """Poll the status once a second until ``check`` returns something (None on timeout or
        when the run ends)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            report = self.status()
            if report is not None and (found := check(report)) is not None:
                return found
            time.sleep(1.0)
        return None

    def tail(self, lines: int = 8) -> str:
        """The last lines of the script's output."""
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self) -> None:
        """End the training process (SIGTERM, then SIGKILL)."""
        benchlib.stop_process(self.proc)
        self._log.close()


# ---------------------------------------------------------------------------- the sequence


def resolve(kind: str, report: StatusReport) -> tuple[dict[str, Any] | None, str]:
    """The changes one step of the plan asks for now (None, why: nothing to ask)."""
    batch = report.config.get("batch_size")
    if kind.startswith("batch="):
        return {"batch_size": int(kind.partition("=")[2])}, ""
    if kind == "workers":
        return {"num_workers": 2 if not report.config.get("num_workers") else 0}, ""
    if kind == "rec":
        for option in report.recommendations:
            if option.applicable:
                return dict(option.changes), option.title
        return {"batch_size": 2 * int(batch or 1)}, "no applicable recommendation: batch doubled"
    safe = report.max_safe_batch_size
    if safe is None:
        return None, "no max_safe_batch_size"
    if kind == "max_safe":
        if safe == batch:
            return None, f"already at the max safe batch ({safe})"
        return {"batch_size": safe}, ""
    if kind == "over":
        return {"batch_size": max(math.ceil(1.5 * safe), safe + 1)}, ""
    raise ValueError(f"unknown step {kind!r}")


def _applied(report: StatusReport, change_id: int) -> Applied | None:
    return next((a for a in report.applied if change_id in a.ids and not a.rollback), None)


def _measured(report: StatusReport, change_id: int) -> Applied | None:
    """The applied change once its peak is observed, or once the run ran out of memory at it."""
    applied = _applied(report, change_id)
    if applied is None:
        return None
    if applied.observed_peak_bytes is not None and applied.effect is not None:
        return applied
    if any(o.step >= applied.step for o in report.ooms):
        return applied
    return None


def drive(
    script: Script, workdir: Path, quick: bool, dwell_s: float
) -> tuple[list[Row], dict[str, Any]]:
    """Run one script through its plan; its rows and what memtui said of itself at the end."""
    limit = (script.quick_limit or script.limit) if quick else script.limit
    run = Run(script, workdir, limit, checkpoint_every=12 if quick else 25)
    rows: list[Row] = []
    timeout = 90.0 if quick else 240.0
    try:
        if run.until(lambda r: r.model, timeout) is None:
            raise RuntimeError(f"{script.name}: no memory model: {run.tail()}")
        for index, kind in enumerate(script.quick_plan if quick else script.plan):
            report = run.status()
            if report is None or not run.alive():
                break
            rows.append(step(run, report, index, kind, timeout, dwell_s))
            if not run.alive():
                rows[-1].run_died = True
                rows[-1].reason = rows[-1].reason or "the run ended: " + run.tail(1)
                break
        final = run.status() if run.alive() else run.last
    finally:
        run.stop()
    if final is not None:
        attribute_ooms(rows, final)
    about = {
        "script": script.name,
        "limit": limit,
        "run": run.run_id,
        "log_tail": run.tail(5),
        "memtui_accuracy": None if final is None else asdict_struct(final.prediction_accuracy),
        "ooms": [] if final is None else [asdict_struct(o) for o in final.ooms],
        "model": None if final is None or final.model is None else asdict_struct(final.model),
    }
    return rows, about


def step(
    run: Run, report: StatusReport, index: int, kind: str, timeout: float, dwell_s: float
) -> Row:
    """Queue one change, wait for it to land and be measured, and record what happened."""
    edge = report.verdict.thresholds.memory_edge_fraction
    row = Row(run.script.name, index, kind, config_before=dict(report.config), edge_fraction=edge)
    row.step_queued = report.step
    changes, why = resolve(kind, report)
    if changes is None:
        row.outcome, row.reason = "skipped", why
        return row
    row.changes, row.reason = changes, why
    reply = run.client.set(changes)
    row.predicted_reply_bytes = reply.predicted_peak_bytes
    row.capacity_bytes = reply.capacity_bytes
    row.max_safe_at_queue = reply.max_safe_batch_size
    row.confidence = reply.confidence
    if not reply.ok:
        row.needs_force = reply.needs_force
        row.outcome = "refused" if reply.needs_force else "rejected"
        row.reason = reply.reason
        return row
    row.change_id = reply.id
    measured = run.until(lambda r: _measured(r, reply.id), timeout)
    if measured is None:
        row.outcome = "unmeasured"
        row.run_died = not run.alive()
        row.reason = "the run ended: " + run.tail(3) if row.run_died else "not measured in time"
        later = run.status()
        measured = None if later is None else _applied(later, reply.id)
        if measured is None:
            return row
    else:
        row.outcome = "measured" if measured.observed_peak_bytes else "out of memory"
    if row.outcome == "measured" and dwell_s > 0:
        # an operator watches a change for a while before the next: the config's peak is the
        # highest over its whole stay (it keeps rising on variable-length data), and the points
        # the next prediction stands on have had that time too
        time.sleep(dwell_s)
        later = run.status()
        stayed = None if later is None else _applied(later, reply.id)
        if stayed is not None and stayed.observed_peak_bytes:
            measured = stayed
    row.step_applied = measured.step
    row.predicted_bytes = measured.predicted_peak_bytes
    row.observed_bytes = measured.observed_peak_bytes
    row.error = measured.prediction_error
    # the hook's own speed prediction, made from the steps before the change
    row.speed_predicted, row.speed_note = measured.predicted_speed_delta, measured.speed_note
    if row.observed_bytes and row.capacity_bytes:
        row.observed_fraction = row.observed_bytes / row.capacity_bytes
        if kind == "max_safe":
            row.under_edge = row.observed_fraction < edge
    if measured.effect is not None:
        effect = measured.effect
        row.effect = effect.summary
        if effect.samples_per_s_before > 0:
            row.speed_measured = effect.samples_per_s_after / effect.samples_per_s_before - 1
            row.speed_margin = effect.speedup_margin
    return row


def attribute_ooms(rows: list[Row], final: StatusReport) -> None:
    """Mark each applied change the run ran out of memory at, before the next change landed."""
    applied = [r for r in rows if r.step_applied is not None]
    for row, after in zip(applied, [*applied[1:], None], strict=True):
        end = after.step_applied if after is not None else None
        assert row.step_applied is not None
        for oom in final.ooms:
            if oom.step >= row.step_applied and (end is None or oom.step < end):
                row.oom = True
                row.rolled_back = row.rolled_back or oom.rolled_back
        if row.oom and row.kind == "max_safe":
            row.under_edge = False
        if row.run_died:
            row.oom = True


def asdict_struct(value: Any) -> Any:
    """A msgspec Struct as plain JSON-able data."""
    return msgspec.to_builtins(value)


# ---------------------------------------------------------------------------- reporting


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def _changes(row: Row) -> str:
    names = {"batch_size": "batch", "num_workers": "workers", "grad_accum": "accum"}
    parts = [
        f"{names.get(k, k)} {row.config_before.get(k)}->{v}" for k, v in sorted(row.changes.items())
    ]
    return ", ".join(parts) or "-"


def table(rows: list[Row]) -> str:
    """The per-change table."""
    head = ("script", "#", "step", "change", "outcome", "predicted", "observed", "error",
            "obs/limit", "OOM", "speed pred", "speed meas")  # fmt: skip
    lines = [head]
    for r in rows:
        frac = "-" if r.observed_fraction is None else f"{r.observed_fraction:.1%}"
        if r.under_edge is not None:
            frac += " ok" if r.under_edge else " OVER EDGE"
        outcome = r.outcome + (" (needs --force)" if r.needs_force else "")
        lines.append(
            (
                r.script,
                str(r.index),
                r.kind,
                _changes(r),
                outcome,
                _bytes(r.predicted_bytes),
                _bytes(r.observed_bytes),
                _pct(r.error),
                frac,
                ("yes, rolled back" if r.rolled_back else "yes") if r.oom else "no",
                _pct(r.speed_predicted),
                _pct(r.speed_measured),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    notes = [
        f"  {r.script} #{r.index} {r.kind}: {r.reason}"
        for r in rows
        if r.reason and r.outcome != "measured"
    ]
    return "\n".join(out + (["", "not measured:", *notes] if notes else []))


def summarize(rows: list[Row]) -> dict[str, Any]:
    """Mean and max |error|, OOMs of changes accepted without --force, max-safe landing."""
    errors = [abs(r.error) for r in rows if r.error is not None and not r.oom]
    safe = [
        r
        for r in rows
        if r.kind == "max_safe" and r.outcome in ("measured", "unmeasured", "out of memory")
    ]
    checked = [r for r in rows if r.speed_measured is not None and r.speed_predicted is not None]
    speeds = [abs(r.speed_predicted - r.speed_measured) for r in checked]  # type: ignore[operator]
    inside = [
        r
        for r, off in zip(checked, speeds, strict=True)
        if r.speed_margin is not None and off <= r.speed_margin
    ]
    return {
        "changes": len(rows),
        "measured": len(errors),
        "refused_needs_force": sum(r.needs_force for r in rows),
        "mean_abs_error": sum(errors) / len(errors) if errors else None,
        "max_abs_error": max(errors) if errors else None,
        "ooms_unforced": sum(r.oom for r in rows),
        "max_safe_fractions": [r.observed_fraction for r in safe],
        "max_safe_under_edge": [r.under_edge for r in safe],
        "speed_checked": len(speeds),
        "speed_mean_abs_error": sum(speeds) / len(speeds) if speeds else None,
        "speed_max_abs_error": max(speeds) if speeds else None,
        "speed_inside_noise": len(inside),
        "speed_unknown": sum(
            r.speed_measured is not None and r.speed_predicted is None for r in rows
        ),
    }


def verdict(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The accuracy bar, script by script and overall."""
    failures: list[str] = []
    for name, s in summaries.items():
        if s["mean_abs_error"] is None:
            failures.append(f"{name}: no change measured")
        elif s["mean_abs_error"] > MEAN_BAR:
            failures.append(f"{name}: mean |error| {s['mean_abs_error']:.1%} > {MEAN_BAR:.0%}")
        if s["max_abs_error"] is not None and s["max_abs_error"] > MAX_BAR:
            failures.append(f"{name}: max |error| {s['max_abs_error']:.1%} > {MAX_BAR:.0%}")
        if s["ooms_unforced"]:
            failures.append(f"{name}: {s['ooms_unforced']} OOM(s) after unforced changes")
        if not s["max_safe_under_edge"]:
            failures.append(f"{name}: the max safe batch was not tried")
        elif not all(s["max_safe_under_edge"]):
            failures.append(f"{name}: the max safe batch landed over the edge band")
    return {"pass": not failures, "failures": failures}


def print_summary(summaries: dict[str, dict[str, Any]], result: dict[str, Any]) -> None:
    """The per-script summary and the verdict."""
    print("\nper script:")
    for name, s in summaries.items():
        fractions = (
            ", ".join("-" if f is None else f"{f:.1%}" for f in s["max_safe_fractions"])
            or "not tried"
        )
        speed = s["speed_mean_abs_error"]
        print(
            f"  {name:5} mean |error| {_pct(s['mean_abs_error']).lstrip('+')} "
            f"max {_pct(s['max_abs_error']).lstrip('+')} over {s['measured']} changes; "
            f"OOMs after unforced changes {s['ooms_unforced']}; refused (needs --force) "
            f"{s['refused_needs_force']}; max safe landed at {fractions} of the limit; "
            "speed |pred - meas| "
            + (
                "-"
                if speed is None
                else f"mean {speed * 100:.0f} max {s['speed_max_abs_error'] * 100:.0f} points "
                f"over {s['speed_checked']} ({s['speed_inside_noise']} inside the noise)"
            )
            + f"; no speed estimate {s['speed_unknown']}"
        )
    bar = f"mean |error| <= {MEAN_BAR:.0%}, max <= {MAX_BAR:.0%}, 0 OOMs unforced, max safe under the edge"
    print(f"\nverdict against the accuracy bar ({bar}): {'PASS' if result['pass'] else 'FAIL'}")
    for failure in result["failures"]:
        print(f"  {failure}")


def main() -> int:
    """Drive the chosen scripts, print the table, the summaries and the verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scripts", default=",".join(SCRIPTS), help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every row here")
    parser.add_argument("--limit", action="append", default=[], metavar="SCRIPT=SIZE")
    parser.add_argument(
        "--dwell",
        type=float,
        default=None,
        metavar="S",
        help="seconds at each config after its effect is measured, before the next change "
        "(default 10; 0 with --quick)",
    )
    parser.add_argument(
        "--hogs", type=int, default=0, metavar="N", help="run N `yes` processes beside the scripts"
    )
    args = parser.parse_args()
    names = [n for n in args.scripts.split(",") if n]
    if args.dwell is None:
        args.dwell = 0.0 if args.quick else 10.0
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        parser.error(f"unknown script(s) {', '.join(unknown)}; known: {', '.join(SCRIPTS)}")
    limits = dict(item.split("=", 1) for item in args.limit)
    for name, size in limits.items():
        parse_bytes(size)
        if name not in SCRIPTS:
            parser.error(f"--limit for an unknown script {name!r}")
    rows: list[Row] = []
    runs: list[dict[str, Any]] = []
    load_before = benchlib.loadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="advice-truth") as tmp, benchlib.cpu_hogs(args.hogs):
        for name in names:
            script = SCRIPTS[name]
            if name in limits:
                script = Script(**{**asdict(script), "limit": limits[name], "quick_limit": ""})
            began = time.monotonic()
            plan = script.quick_plan if args.quick else script.plan
            limit = (script.quick_limit or script.limit) if args.quick else script.limit
            print(f"{name}: limit {limit}, plan {', '.join(plan)}", flush=True)
            script_rows, about = drive(script, Path(tmp), args.quick, args.dwell)
            about["seconds"] = round(time.monotonic() - began, 1)
            about["loadavg_after"] = benchlib.loadavg()
            rows += script_rows
            runs.append(about)
    print()
    print(table(rows))
    summaries = {n: summarize([r for r in rows if r.script == n]) for n in names}
    result = verdict(summaries)
    print_summary(summaries, result)
    load_after = benchlib.loadavg()
    print(f"\nload average before {load_before}, after {load_after}; {args.hogs} CPU hogs; "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    if args.json:
        data = {
            "benchmark": "advice_truth",
            "quick": args.quick,
            "hogs": args.hogs,
            "rows": [asdict(r) for r in rows],
            "runs": runs,
            "summary": summaries,
            "verdict": result,
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        }
        args.json.write_text(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
