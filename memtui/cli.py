"""The ``memtui`` command: ls, status, set, cancel, demo, attach.

A public scripting interface: ``--json`` output is stable (fields are added, never renamed),
errors go to stderr, and the exit status says whether the request succeeded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from memtui import registry
from memtui.advice.assess import STATE_NAMES, assess
from memtui.advice.effect import describe as describe_effect
from memtui.advice.verdict import ThresholdConfig, Thresholds, load_thresholds
from memtui.client import ClientError, ControlClient, hello_many
from memtui.knobs import (
    KNOBS,
    KnobError,
    effective_batch,
    format_changes,
    format_value,
    parse_assignments,
    parse_changes,
)
from memtui.security import exposure, tcp_endpoints
from memtui.stats import format_bytes, format_duration, summarize_device, summarize_steps
from memtui.wire import AppliedChange, HostSample, Knobs, SetReply, Snapshot, to_builtins


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"memtui: {message}", err=True)
    sys.exit(code)


def _target(run: str | None) -> registry.Target:
    try:
        target = registry.find_run(run)
    except registry.RunNotFound as exc:
        _fail(str(exc))
        raise  # unreachable
    except registry.RegistryError as exc:
        _fail(str(exc))
        raise
    if target.note:
        click.echo(f"memtui: {target.note}", err=True)
    return target


def _client(target: registry.Target, timeout: float) -> ControlClient:
    return ControlClient(target.control, timeout_s=timeout)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memtui")
def main() -> None:
    """Watch a training run starve or run out of memory, and retune it at the next checkpoint."""


# ---------------------------------------------------------------------------- ls


@main.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_command(as_json: bool) -> None:
    """List live runs on this host."""
    try:
        runs = registry.list_runs()
    except registry.RegistryError as exc:
        _fail(str(exc))
        return
    if as_json:
        rows = [
            {
                "run": r.run,
                "pid": r.pid,
                "host": r.host,
                "ranks": r.world_size,
                "started": r.started,
                "command": r.command,
                "cwd": r.cwd,
                "control": r.control,
                "endpoints": [to_builtins(k) for k in r.ranks],
                "state_dir": r.state_dir,
                "security": r.security,
            }
            for r in runs
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    if not runs:
        click.echo("no live runs")
        return
    click.echo(f"{'RUN':<24} {'PID':>7} {'RANKS':>5}  {'STARTED':<8}  COMMAND")
    for r in runs:
        started = time.strftime("%H:%M:%S", time.localtime(r.started))
        command = " ".join(r.command[1:] if len(r.command) > 1 else r.command)
        click.echo(f"{r.run:<24} {r.pid:>7} {r.world_size:>5}  {started:<8}  {command[:80]}")
        warning = exposure(r.security, tcp_endpoints(r.ranks))
        if warning:
            click.echo(f"  {warning}")


# ---------------------------------------------------------------------------- status


def _knobs_dict(knobs: Knobs) -> dict[str, Any]:
    return {k: getattr(knobs, k) for k in KNOBS}


def _applied_dict(applied: AppliedChange) -> dict[str, Any]:
    error = None
    if applied.predicted_peak_bytes and applied.observed_peak_bytes:
        error = applied.predicted_peak_bytes / applied.observed_peak_bytes - 1
    return {
        "ids": applied.ids,
        "step": applied.step,
        "time": applied.time,
        "changes": {k: {"old": d.old, "new": d.new} for k, d in applied.changes.items()},
        "note": applied.note,
        "rollback": applied.rollback,
        "predicted_peak_bytes": applied.predicted_peak_bytes,
        "observed_peak_bytes": applied.observed_peak_bytes,
        "prediction_error": error,
        "effect": None
        if applied.effect is None
        else {**to_builtins(applied.effect), "summary": describe_effect(applied.effect)},
    }


def _metrics_dict(snapshot: Snapshot) -> dict[str, Any] | None:
    steps = summarize_steps(snapshot.steps)
    if steps is None:
        return None
    return {
        "window_steps": steps.steps,
        "step_time_s": steps.step_time_s,
        "data_wait_s": steps.data_wait_s,
        "data_wait_fraction": steps.data_wait_fraction,
        "samples_per_s": steps.samples_per_s,
        "steps_per_s": steps.steps_per_s,
    }


def _memory_dict(snapshot: Snapshot) -> dict[str, Any] | None:
    memory = summarize_device(snapshot.device)
    if memory is None:
        return None
    return {
        "kind": memory.kind,
        "capacity_bytes": memory.capacity_bytes,
        "current_bytes": memory.current_bytes,
        "reserved_bytes": memory.reserved_bytes,
        "peak_bytes": memory.peak_bytes,
        "peak_allocated_bytes": memory.peak_allocated_bytes,
        "peak_fraction": memory.peak_fraction,
        "fragmentation_bytes": memory.fragmentation_bytes,
        "nvml_used_bytes": memory.nvml_used_bytes,
        "beyond_torch_bytes": memory.beyond_torch_bytes,
        "ooms": memory.ooms,
        "alloc_retries": memory.alloc_retries,
    }


def _rank_dict(rank: Any, snapshot: Snapshot | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "rank": rank.rank,
        "local_rank": rank.local_rank,
        "host": rank.host,
        "pid": rank.pid,
        "reachable": snapshot is not None,
    }
    if snapshot is not None:
        entry.update(
            step=snapshot.step,
            config=_knobs_dict(snapshot.control.config),
            applied=[_applied_dict(a) for a in snapshot.control.applied],
            metrics=_metrics_dict(snapshot),
            memory=_memory_dict(snapshot),
            host_memory=to_builtins(snapshot.host[-1]) if snapshot.host else None,
            counters=to_builtins(snapshot.counters) if snapshot.counters else {},
        )
    return entry


def _thresholds_in_force() -> Thresholds:
    """The verdict's thresholds from the YAML config file (problems said on stderr)."""
    return _threshold_config().thresholds


def _threshold_config() -> ThresholdConfig:
    """The YAML config's verdict: section, if any; what it got wrong is said on stderr."""
    config = load_thresholds()
    for problem in config.problems:
        print(f"memtui: {problem}", file=sys.stderr)
    return config


def _assessment_dict(snapshot: Snapshot, ranks: list[Snapshot | None] | None) -> dict[str, Any]:
    """Verdict, breakdown, recommendations, memory model, prediction accuracy and OOMs."""
    config = _threshold_config()
    found = assess(snapshot, ranks, config.thresholds)
    control = snapshot.control
    model = control.model
    errors = [
        abs(a.predicted_peak_bytes / a.observed_peak_bytes - 1)
        for a in control.applied
        if a.predicted_peak_bytes and a.observed_peak_bytes
    ]
    return {
        "verdict": {
            "state": STATE_NAMES[found.verdict.state],
            "severity": found.verdict.severity,
            "headline": found.verdict.headline,
            "thresholds_from": config.source,
            "thresholds": dataclasses.asdict(config.thresholds),
            "reasons": [
                {"label": r.label, "value": r.value, "severity": r.severity}
                for r in found.verdict.reasons
            ],
        },
        "breakdown": None
        if found.breakdown is None
        else {"capacity_bytes": found.breakdown.capacity_bytes, **found.breakdown.as_dict()},
        "static_memory": to_builtins(control.static) if control.static else None,
        "recommendations": [
            {
                "title": r.title,
                "changes": r.changes,
                "applicable": r.applicable,
                "needs_restart": r.needs_restart,
                "why": r.why,
                "memory_delta_bytes": r.memory_delta_bytes,
                "host_delta_bytes": r.host_delta_bytes,
                "speed_delta": r.speed_delta,
                "speed_note": r.speed_note,
                "predicted_peak_bytes": r.predicted_peak_bytes,
                "effective_batch": r.effective_batch,
            }
            for r in found.recommendations
        ],
        "max_safe_batch_size": found.max_safe_batch_size,
        "model": None
        if model is None
        else {**to_builtins(model), "confidence": found.model_confidence},
        "prediction_accuracy": {
            "changes_measured": len(errors),
            "mean_abs_error": sum(errors) / len(errors) if errors else None,
        },
        "ooms": [to_builtins(o) for o in control.ooms],
    }


def rank_snapshots(snapshot: Snapshot, timeout: float = 2.0) -> list[Snapshot | None]:
    """Rank 0's snapshot and every other rank's (None where a rank did not answer)."""
    others = [r for r in snapshot.ranks if r.rank != snapshot.info.rank]
    answers = hello_many([registry.rank_control(r) for r in others], timeout_s=timeout)
    by_rank = {r.rank: a for r, a in zip(others, answers, strict=True)}
    by_rank[snapshot.info.rank] = snapshot
    return [by_rank.get(r.rank) for r in snapshot.ranks] if snapshot.ranks else [snapshot]


def status_dict(snapshot: Snapshot, ranks: list[Snapshot | None] | None = None) -> dict[str, Any]:
    """The ``memtui status --json`` object for rank 0's snapshot (and every rank's)."""
    info, control = snapshot.info, snapshot.control
    config = control.config
    eff = None
    if config.batch_size is not None and config.grad_accum is not None:
        eff = effective_batch(config.batch_size, config.grad_accum, control.world_size)
    rank_infos = snapshot.ranks or []
    per_rank = ranks if ranks is not None else [snapshot] * max(1, len(rank_infos))
    return {
        "run": info.run,
        "pid": info.pid,
        "host": info.host,
        "started": info.started,
        "command": info.command,
        "world_size": info.world_size,
        "device": info.device,
        "step": snapshot.step,
        "config": _knobs_dict(config),
        "tunable": control.tunable,
        "effective_batch": eff,
        "pending": [to_builtins(p) for p in control.pending],
        "applied": [_applied_dict(a) for a in control.applied],
        "rejected": [to_builtins(r) for r in control.rejected],
        "metrics": _metrics_dict(snapshot),
        "memory": _memory_dict(snapshot),
        **_assessment_dict(snapshot, ranks),
        "disabled": control.disabled,
        "ranks": [_rank_dict(r, snap) for r, snap in zip(rank_infos, per_rank, strict=False)],
        "last_step": to_builtins(snapshot.steps[-1]) if snapshot.steps else None,
        "host_memory": to_builtins(snapshot.host[-1]) if snapshot.host else None,
        "checkpoints": [
            {"step": c.step, "time": c.time, "save_s": c.save_s} for c in snapshot.checkpoints[-5:]
        ],
        "counters": {  # what peers were refused is always shown, zero included
            "requests_refused": 0,
            "requests_rate_limited": 0,
            "auth_failures": 0,
            **(to_builtins(snapshot.counters) if snapshot.counters else {}),
        },
        "state_dir": info.state_dir,
        "tuned_path": info.tuned_path,
        "requeue": info.requeue,
        "tuned_unsaved_step": snapshot.counters.tuned_unsaved_step if snapshot.counters else None,
        "audit_path": info.audit_path,
    }


def format_status(snapshot: Snapshot, ranks: list[Snapshot | None] | None = None) -> str:
    """The human ``memtui status`` text."""
    data = status_dict(snapshot, ranks)
    info, control = snapshot.info, snapshot.control
    lines = []
    age = format_duration(max(0.0, time.time() - info.started))
    lines.append(
        f"run {info.run}  pid {info.pid}  host {info.host}  ranks {info.world_size}  up {age}"
    )
    lines += [w for w in [exposure(info.security, tcp_endpoints(snapshot.ranks))] if w]
    verdict = data["verdict"]
    lines.append(f"verdict: {verdict['state']}: {verdict['headline']}")
    metrics = data["metrics"]
    if metrics:
        lines.append(
            f"step {snapshot.step}  {format_duration(metrics['step_time_s'])}/step  "
            f"data wait {format_duration(metrics['data_wait_s'])} ({metrics['data_wait_fraction']:.0%})  "
            f"{metrics['samples_per_s']:.0f} samples/s  {metrics['steps_per_s']:.2f} steps/s"
        )
    else:
        lines.append(f"step {snapshot.step}  (no timed steps yet)")
    memory = data["memory"]
    if memory:
        label = (
            "device cpu (main RSS + workers USS)"
            if memory["kind"] == "cpu"
            else f"device {info.device}"
        )
        line = (
            f"{label}: {format_bytes(memory['current_bytes'])} now, peak {format_bytes(memory['peak_bytes'])} "
            f"of {format_bytes(memory['capacity_bytes'])} ({memory['peak_fraction']:.0%})"
        )
        if memory["kind"] == "cuda":
            line += f", fragmentation {format_bytes(memory['fragmentation_bytes'])}"
            if memory["beyond_torch_bytes"] is not None:
                line += f", beyond torch {format_bytes(memory['beyond_torch_bytes'])}"
        lines.append(line)
    split = data["breakdown"]
    if split:
        parts = [f"{k} {format_bytes(v)}" for k, v in split.items() if k != "capacity_bytes" and v]
        lines.append("breakdown at peak: " + ", ".join(parts))
    if data["model"]:
        safe = data["max_safe_batch_size"]
        edge = verdict["thresholds"]["memory_edge_fraction"]
        lines.append(
            f"memory model: {format_bytes(data['model']['steady_bytes'])} steady + "
            f"{format_bytes(data['model']['per_sample_bytes'])} per sample ({data['model']['confidence']})"
            + (f"; largest micro-batch under {edge:.0%}: {safe}" if safe is not None else "")
        )
    host = snapshot.host[-1] if snapshot.host else None
    if host:
        lines.append(
            f"host: RAM {format_bytes(host.ram_used_bytes)} / {format_bytes(host.ram_total_bytes)} used, "
            f"swap {format_bytes(host.swap_used_bytes)}, main RSS {format_bytes(host.main_rss_bytes)}, "
            + _workers_memory(host)
        )
    config = " ".join(f"{k}={format_value(getattr(control.config, k))}" for k in KNOBS)
    eff = data["effective_batch"]
    lines.append(f"config: {config}" + (f"  (effective batch {eff})" if eff else ""))
    for change in control.pending:
        note = f"  [{change.note}]" if change.note else ""
        predicted = ""
        if change.predicted_peak_bytes:
            predicted = f", predicted peak {format_bytes(change.predicted_peak_bytes)}"
        lines.append(
            f"pending #{change.id}: {format_changes(change.changes)} (queued at step {change.queued_step}{predicted}){note}"
        )
    for applied in list(control.applied)[-5:]:
        diffs = ", ".join(
            f"{k} {format_value(d.old)} -> {format_value(d.new)}"
            for k, d in applied.changes.items()
        )
        ids = ",".join(f"#{i}" for i in applied.ids) or "rollback"
        line = f"applied at step {applied.step}: {diffs or 'no effective change'} ({ids})"
        if applied.effect is not None:
            line += f": {describe_effect(applied.effect)}"
        if applied.predicted_peak_bytes and applied.observed_peak_bytes:
            error = applied.predicted_peak_bytes / applied.observed_peak_bytes - 1
            line += f"; predicted peak {format_bytes(applied.predicted_peak_bytes)} ({error:+.0%})"
        lines.append(line)
    for oom in list(control.ooms)[-3:]:
        lines.append(
            f"OUT OF MEMORY at step {oom.step}: {'rolled back' if oom.rolled_back else 'not rolled back'}; {oom.batch}"
        )
    for index, option in enumerate(data["recommendations"][:3], 1):
        delta = option["speed_delta"]
        speed = (
            f", {delta:+.0%} samples/s" if delta is not None else ", speed unknown until measured"
        )
        lines.append(f"option {index}: {option['title']}{speed}  ({option['why']})")
    for rejected in list(control.rejected)[-3:]:
        lines.append(f"rejected {format_changes(rejected.requested)}: {rejected.reason}")
    if control.disabled:
        lines.append(f"changes are OFF: {control.disabled}")
    if len(data["ranks"]) > 1:
        lines.append("rank  host          step   step time  data wait  peak mem")
        for entry in data["ranks"]:
            if not entry["reachable"]:
                lines.append(f"{entry['rank']:>4}  {entry['host'][:12]:<12}  (no answer)")
                continue
            m, mem = entry["metrics"] or {}, entry["memory"] or {}
            step_time = format_duration(m["step_time_s"]) if m else "-"
            wait = f"{m['data_wait_fraction']:.0%}" if m else "-"
            peak = f"{mem['peak_fraction']:.0%}" if mem else "-"
            lines.append(
                f"{entry['rank']:>4}  {entry['host'][:12]:<12}  {entry['step']:>5}  {step_time:>9}  {wait:>9}  {peak:>8}"
            )
    counters = snapshot.counters
    if info.requeue:
        lines.append(
            f"queued before the restart and never applied; to queue it again: {info.requeue}"
        )
    if counters and counters.tuned_unsaved_step is not None:
        lines.append(
            f"tuned config not saved since step {counters.tuned_unsaved_step} "
            f"({info.tuned_path}; retried at every checkpoint)"
        )
    if counters and counters.errors:
        lines.append(f"hook errors: {counters.errors} (last: {counters.last_error})")
    if counters and (
        counters.requests_refused or counters.requests_rate_limited or counters.auth_failures
    ):
        line = (
            f"peers: {counters.requests_refused} requests refused (out of bounds), "
            f"{counters.requests_rate_limited} rate limited, "
            f"{counters.auth_failures} failed authentications"
        )
        if counters.control_rests:
            line += f"; the control socket paused {counters.control_rests} times to spare training"
        lines.append(line)
    return "\n".join(lines)


def _workers_memory(host: HostSample) -> str:
    """The loader workers and their memory, labelled: USS (their own pages, as the device total
    counts them) once measured, else RSS (which counts pages shared with the main process)."""
    if not host.workers:
        return "no loader workers"
    if host.workers_uss_bytes:
        return f"{host.workers} loader workers ({format_bytes(host.workers_uss_bytes)} USS)"
    return (
        f"{host.workers} loader workers ({format_bytes(host.workers_rss_bytes)} RSS, "
        "USS not measured yet)"
    )


@main.command("status")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help="Seconds to wait for the run.")
def status_command(run: str | None, as_json: bool, timeout: float) -> None:
    """Show a run's step, speed, memory, config and changes (RUN: id, prefix, pid or endpoint)."""
    target = _target(run)
    try:
        snapshot = _client(target, timeout).hello()
    except ClientError as exc:
        _fail(str(exc))
        return
    ranks = rank_snapshots(snapshot) if len(snapshot.ranks) > 1 else None
    if as_json:
        click.echo(json.dumps(status_dict(snapshot, ranks), indent=2))
    else:
        click.echo(format_status(snapshot, ranks))


# ---------------------------------------------------------------------------- set / cancel


@main.command("set", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, required=True)
@click.option(
    "--keep-effective-batch", is_flag=True, help="Recompute grad_accum so micro x accum stays."
)
@click.option("--dry-run", is_flag=True, help="Validate and resolve only; queue nothing.")
@click.option("--force", is_flag=True, help="Queue even when the change is predicted to be risky.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as JSON.")
@click.option("--timeout", default=3.0, show_default=True)
def set_command(
    args: tuple[str, ...],
    keep_effective_batch: bool,
    dry_run: bool,
    force: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Queue a change for the next checkpoint: memtui set [RUN] KEY=VALUE...

    Keys: batch_size, grad_accum, num_workers, pin_memory (aliases such as
    per_device_train_batch_size or gradient_accumulation_steps work too). Prints the change id.
    """
    words = list(args)
    run = words.pop(0) if words and "=" not in words[0] else None
    try:
        raw = parse_assignments(words)
        parse_changes(raw)  # fail early, before contacting the run, on what is wrong anyway
    except KnobError as exc:
        _fail(f"rejected: {exc}", 2)
        return
    target = _target(run)
    try:
        reply = _client(target, timeout).set(
            dict(raw), keep_effective_batch=keep_effective_batch, dry_run=dry_run, force=force
        )
    except ClientError as exc:
        _fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps(to_builtins(reply), indent=2))
        sys.exit(0 if reply.ok else 2)
    if not reply.ok:
        _fail(f"rejected: {reply.reason}", 2)
    bands = load_thresholds().thresholds  # the run reads the same config file at install
    if dry_run:
        click.echo(f"would queue {format_changes(reply.changes)}")
        click.echo(_prediction_line(reply, bands.memory_edge_fraction))
        if reply.needs_force:
            click.echo(
                f"it would need --force: predicted over the "
                f"{bands.memory_danger_fraction:.0%} danger band"
            )
    else:
        click.echo(str(reply.id))
        click.echo(
            f"queued #{reply.id}: {format_changes(reply.changes)} (applies at the next checkpoint)",
            err=True,
        )
        click.echo(_prediction_line(reply, bands.memory_edge_fraction), err=True)
    if reply.note and not (dry_run and reply.needs_force):
        click.echo(f"note: {reply.note}", err=True)


def _prediction_line(reply: SetReply, edge: float) -> str:
    """The memory prediction in a reply, in one line (``edge``: the top of the safe band)."""
    if reply.predicted_peak_bytes is None or not reply.capacity_bytes:
        return "predicted peak: no memory model yet (it needs a few steps of samples)"
    share = reply.predicted_peak_bytes / reply.capacity_bytes
    line = (
        f"predicted peak {format_bytes(reply.predicted_peak_bytes)} = {share:.0%} of "
        f"{format_bytes(reply.capacity_bytes)} ({reply.confidence})"
    )
    if reply.max_safe_batch_size is not None:
        line += f"; largest micro-batch under {edge:.0%}: {reply.max_safe_batch_size}"
    return line


@main.command("cancel")
@click.argument("args", nargs=-1)
@click.option("--timeout", default=3.0, show_default=True)
def cancel_command(args: tuple[str, ...], timeout: float) -> None:
    """Cancel a pending change: memtui cancel [RUN] ID (or 'all')."""
    words = list(args)
    if not words:
        _fail("give the change id to cancel, or 'all'", 2)
    which = words.pop()
    run = words[0] if words else None
    if which != "all" and not which.lstrip("#").isdigit():
        _fail(f"expected a change id or 'all', got {which!r}", 2)
    change_id = 0 if which == "all" else int(which.lstrip("#"))
    target = _target(run)
    try:
        reply = _client(target, timeout).cancel(change_id)
    except ClientError as exc:
        _fail(str(exc))
        return
    if not reply.ok:
        _fail(reply.reason, 2)
    click.echo("cancelled " + " ".join(f"#{i}" for i in reply.cancelled))


# ---------------------------------------------------------------------------- demo


DEMO_USAGE = "memtui demo [--no-tui] [--ranks N] [--dry-run] [TRAINING OPTIONS] (see --help)"


class _DemoCommand(click.Command):
    """``memtui demo``: its own options, then every option of the demo training, passed through
    (its ``--help`` lists both; the training's come from :mod:`memtui.demo.options`)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_options(ctx, formatter)
        from memtui.demo.options import build_parser

        rows = []
        # argparse lists a parser's actions only through _actions (no public accessor)
        for action in build_parser()._actions:  # noqa: SLF001
            if not action.option_strings or action.dest == "help":
                continue
            names = "/".join(action.option_strings)
            if action.nargs != 0:
                names += f" {action.metavar or action.dest.upper()}"
            rows.append((names, action.help or ""))
        with formatter.section("Training options (passed to python -m memtui.demo)"):
            formatter.write_dl(rows)


@main.command(
    "demo",
    cls=_DemoCommand,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--no-tui", is_flag=True, help="Run the training in the foreground, without the viewer."
)
@click.option(
    "--ranks",
    default=1,
    show_default=True,
    help="Processes under torchrun (gloo on CPU, nccl on GPUs).",
)
@click.option(
    "--dry-run", is_flag=True, help="Check the options, print the training command, run nothing."
)
@click.option(
    "--tcp",
    metavar="ADDRESS",
    help="Also publish over TCP on ADDRESS (CURVE keys from `memtui keygen` required).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="With --tcp: plain TCP, no keys (loopback only): ANY local user can read the "
    "telemetry; changes are not served over it.",
)
@click.option(
    "--insecure-control",
    is_flag=True,
    help="With --insecure: plain TCP serves changes too (ANY local user can queue them).",
)
@click.pass_context
def demo_command(
    ctx: click.Context,
    no_tui: bool,
    ranks: int,
    dry_run: bool,
    tcp: str | None,
    insecure: bool,
    insecure_control: bool,
) -> None:
    """Run the bundled demo training (slow data: it starves until you add workers).

    Every option of the training (python -m memtui.demo) is accepted too, as listed below.
    """
    from memtui.demo.options import parse_args

    argv = list(ctx.args)
    # a wrong training option: argparse's message and exit status 2, before anything starts
    args = parse_args(argv, "memtui demo", DEMO_USAGE)
    if ranks < 1:
        _fail("--ranks must be 1 or more", 2)
    command = demo_command_line(argv, ranks)
    tcp_env = _tcp_env(tcp, insecure, insecure_control)
    os.environ.update(tcp_env)  # the training (in this process or a child) reads them
    if dry_run:
        click.echo(shlex.join([*(f"{k}={v}" for k, v in tcp_env.items()), *command]))
        return
    if no_tui:
        if ranks == 1:
            from memtui.demo.train import main as demo_main

            sys.exit(demo_main(argv))
        sys.exit(_run_forwarding_signals(command))
    _demo_with_tui(command, args.out)


def _tcp_env(tcp: str | None, insecure: bool, insecure_control: bool = False) -> dict[str, str]:
    """The environment that makes the training publish over TCP; refuse (exit 2) what the run
    would refuse: TCP without keys, or ``--insecure`` on an address other than loopback."""
    from memtui.security import SecurityError, plan_tcp

    if insecure_control and not insecure:
        _fail("--insecure-control goes with --insecure (control over plain TCP is asked twice)", 2)
    if insecure and not tcp:
        _fail("--insecure goes with --tcp ADDRESS (a loopback address)", 2)
    if not tcp:
        return {}
    try:
        plan_tcp(tcp, insecure, insecure_control)
    except SecurityError as exc:
        _fail(str(exc), 2)
    env = {"MEMTUI_TCP": tcp, **({"MEMTUI_INSECURE": "1"} if insecure else {})}
    return {**env, **({"MEMTUI_INSECURE_CONTROL": "1"} if insecure_control else {})}


def _run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` in the foreground; SIGTERM and SIGHUP sent to us reach it too.

    torchrun passes them on to its ranks, so stopping ``memtui demo --ranks N --no-tui`` stops
    the whole job instead of leaving the ranks running.
    """
    proc = subprocess.Popen(command)

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to the child too: wait for it
            continue


def demo_command_line(argv: list[str], ranks: int = 1) -> list[str]:
    """The command that runs the demo training, under torchrun when ``ranks`` > 1."""
    if ranks == 1:
        return [sys.executable, "-m", "memtui.demo", *argv]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={ranks}", "-m", "memtui.demo", *argv]


def _demo_with_tui(command: list[str], out: Path | None = None) -> None:
    """Start the demo training in a subprocess and attach the viewer to it (its output goes to
    ``demo.log`` in ``out``, the demo's own default directory without it)."""
    try:
        from memtui.tui.app import run_app
    except ImportError:
        _fail("the viewer is not available in this build; use --no-tui")
        return
    out_dir = out or registry.state_home().parent / "demo"
    log_path = out_dir / "demo.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        run_id = _wait_for_run_id(log_path, proc)
        try:
            code = run_app(run_id, demo_process=proc)
            died = f"exit status {code}" if code else ""
        except Exception as exc:  # the viewer's failure, not the training's: it goes on
            code, died = 1, f"{type(exc).__name__}: {exc}"
        if died and proc.poll() is None:  # only a normal quit (q) stops the demo's training
            _viewer_died(died, run_id, log_path)
            proc.wait()  # until the training ends; Ctrl-C stops it (below), as before
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    sys.exit(code)


def _viewer_died(why: str, run_id: str, log_path: Path) -> None:
    """Tell the operator that the demo's viewer died and that its training goes on."""
    from memtui.tui.safe import clean

    print(f"memtui demo: the viewer died ({clean(why, 300)})", file=sys.stderr)
    print(f"memtui demo: the training goes on; its output: {log_path}", file=sys.stderr)
    print(
        f"memtui demo: reattach with `memtui attach {run_id}`; Ctrl-C stops the training",
        file=sys.stderr,
        flush=True,
    )


def _wait_for_run_id(log_path: Any, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("run "):
                return str(line.split()[1])
        if proc.poll() is not None:
            _fail(f"the demo training exited early; see {log_path}")
        time.sleep(0.1)
    _fail(f"the demo training did not start within {timeout:.0f} s; see {log_path}")
    return ""


# ---------------------------------------------------------------------------- replay


@main.command("replay")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option("--speed", default=1.0, show_default=True, help="Playback speed (x real time).")
def replay_command(path: str, speed: float) -> None:
    """Show a recorded stream (.mtrec) in the viewer, with pause and speed controls."""
    from memtui.tui.app import run_replay

    sys.exit(run_replay(path, speed=speed))


# ---------------------------------------------------------------------------- keygen


@main.command("keygen")
@click.option("--force", is_flag=True, help="Replace existing keys.")
def keygen_command(force: bool) -> None:
    """Make the CURVE keys for multi-node runs over TCP (files 0600 in ~/.config/memtui/curve)."""
    from memtui.security import SecurityError, keygen

    try:
        root = keygen(force=force)
    except SecurityError as exc:
        _fail(str(exc))
        return
    click.echo(f"keys written to {root}")
    click.echo("copy this directory to every node of the job (or share the home directory)")


# ---------------------------------------------------------------------------- gpus


@main.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, freest first.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option(
    "--pick",
    "pick_count",
    type=int,
    default=None,
    is_flag=False,
    flag_value=1,
    help="Print the ids of the N freest GPUs for CUDA_VISIBLE_DEVICES (default 1).",
)
@click.option("--uuid", is_flag=True, help="With --pick: print GPU UUIDs instead of indices.")
def gpus_command(
    as_json: bool, watch: bool, interval: float, pick_count: int | None, uuid: bool
) -> None:
    """Every GPU on this host: free / used / total memory, utilisation, processes; freest first.

    Without an NVIDIA driver it says so on stderr and exits 1 (with or without --pick).
    """
    from memtui.gpus import NoDriver, format_gpus, host_gpus, pick

    def read() -> list[Any]:
        try:
            return host_gpus()
        except NoDriver as exc:
            _fail(str(exc))
            raise

    if pick_count is not None:
        found = read()
        if pick_count < 1 or pick_count > len(found):
            _fail(f"asked for {pick_count} GPU(s), this host has {len(found)}")
        click.echo(pick(found, pick_count, uuid))
        return
    while True:
        found = read()
        if as_json:
            click.echo(json.dumps([g.as_dict() for g in found], indent=2))
        else:
            if watch:
                click.clear()
            click.echo(format_gpus(found, format_bytes))
        if not watch:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return


# ---------------------------------------------------------------------------- estimate


@main.command("estimate")
@click.option("--params", default=None, help="A parameter count: 7B, 110M, 1.3e9.")
@click.option("--model", default=None, help="module:factory (or class) building the model.")
@click.option("--hf-config", default=None, help="A Hugging Face config.json on disk.")
@click.option("--dtype", default=None, help="Parameter dtype: float32, bfloat16, float16.")
@click.option(
    "--mixed-precision",
    type=click.Choice(["none", "amp", "master"]),
    default="none",
    show_default=True,
    help="amp: torch.autocast, fp32 params; master: 16-bit params + fp32 master copy.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "sgd-momentum", "adam", "adamw", "adam8bit"]),
    default="adamw",
    show_default=True,
)
@click.option("--freeze", multiple=True, help="Freeze parameters matching a glob or prefix.")
@click.option("--lora-rank", default=0, show_default=True, help="LoRA rank r (0: no LoRA).")
@click.option("--lora-modules", default="q_proj,v_proj", show_default=True)
@click.option("--zero-stage", type=click.IntRange(0, 3), default=0, show_default=True)
@click.option("--world-size", type=click.IntRange(1), default=1, show_default=True)
@click.option("--batch-size", default=1, show_default=True, help="Micro-batch per GPU.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sample.")
@click.option("--gpu-memory", default=None, help="Card size for the fit, e.g. 24GiB.")
@click.option("--layers", type=int, default=None, help="Formula only: transformer layers.")
@click.option("--hidden", type=int, default=None, help="Formula only: hidden size.")
@click.option("--heads", type=int, default=None, help="Formula only: attention heads.")
@click.option("--no-measure", is_flag=True, help="Use the formula even when the model runs.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def estimate_command(**kwargs: Any) -> None:
    """The memory a training job needs per GPU, by part, and the largest micro-batch that fits."""
    from memtui.estimate import EstimateError, Options, as_dict, estimate, format_table
    from memtui.stats import parse_bytes

    as_json = kwargs.pop("as_json")
    gpu_memory = kwargs.pop("gpu_memory")
    try:
        card = parse_bytes(gpu_memory) if gpu_memory else None
    except ValueError as exc:
        _fail(str(exc), 2)
        return
    options = Options(
        **{k: v for k, v in kwargs.items() if k not in {"freeze", "lora_modules", "no_measure"}},
        freeze=tuple(kwargs["freeze"]),
        lora_modules=tuple(m.strip() for m in kwargs["lora_modules"].split(",") if m.strip()),
        gpu_memory=card,
        measure=not kwargs["no_measure"],
        thresholds=_thresholds_in_force(),
    )
    try:
        result = estimate(options)
    except EstimateError as exc:
        _fail(str(exc), 2)
        return
    if as_json:
        click.echo(json.dumps(as_dict(result), indent=2))
    else:
        click.echo(format_table(result))


# ---------------------------------------------------------------------------- attach


@main.command("attach")
@click.argument("run", required=False)
@click.option("--readonly", is_flag=True, help="Show everything, send nothing (for shared panes).")
@click.option(
    "--insecure",
    is_flag=True,
    help="Reach plain (keyless) TCP endpoints, on loopback only (read-only unless the run "
    "was started with --insecure-control).",
)
def attach_command(run: str | None, readonly: bool, insecure: bool) -> None:
    """Open the viewer on a run (RUN: id, prefix, pid or endpoint; default: the newest)."""
    from memtui.tui.app import run_app

    if insecure:
        os.environ["MEMTUI_INSECURE"] = "1"  # read by every client socket the viewer makes

    sys.exit(run_app(run, readonly=readonly))


if __name__ == "__main__":
    main()
