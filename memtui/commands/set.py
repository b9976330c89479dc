"""`memtui set`: queue a change for the next checkpoint."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from memtui.commands.common import TIMEOUT_HELP, client_for, fail, find_target

if TYPE_CHECKING:
    from memtui.wire import SetReply


@click.command("set", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, required=True)
@click.option(
    "--keep-effective-batch", is_flag=True, help="Recompute grad_accum so micro x accum stays."
)
@click.option(
    "--allow-effective-batch",
    is_flag=True,
    help="Let micro x accum x ranks change, the LR following --lr-scale.",
)
@click.option(
    "--lr-scale",
    type=click.Choice(["linear", "sqrt", "none"]),  # knobs.LR_RULES: not imported at start-up
    help="How the LR follows the effective batch (default: the run's install(lr_scale=...)).",
)
@click.option("--dry-run", is_flag=True, help="Validate and resolve only; queue nothing.")
@click.option("--force", is_flag=True, help="Queue even when the change is predicted to be risky.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as JSON.")
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Print only the change id on stdout (nothing for --dry-run); notes still go to stderr.",
)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def set_command(
    args: tuple[str, ...],
    keep_effective_batch: bool,
    allow_effective_batch: bool,
    lr_scale: str | None,
    dry_run: bool,
    force: bool,
    as_json: bool,
    quiet: bool,
    timeout: float,
) -> None:
    """Queue a change for the next checkpoint: memtui set [RUN] KEY=VALUE...

    Keys: batch_size, grad_accum, num_workers, pin_memory, prefetch_factor (aliases such as
    per_device_train_batch_size or gradient_accumulation_steps work too). Prints what was queued
    with its id and predicted peak on stdout (the id alone with -q), notes on stderr.
    A change of micro x accum x ranks moves the LR by the run's rule (install(lr_scale=...),
    none unless set: the LR stays, with a warning), or by --lr-scale with --allow-effective-batch.
    """
    import json

    from memtui.core.knobs import (
        KnobError,
        format_changes,
        names_knob,
        parse_assignments,
        parse_changes,
    )
    from memtui.storage.userconfig import load_thresholds
    from memtui.transport.client import ClientError
    from memtui.wire import to_builtins

    if keep_effective_batch and allow_effective_batch:
        fail("rejected: --keep-effective-batch and --allow-effective-batch contradict", 2)
    if lr_scale and not allow_effective_batch:
        fail("rejected: --lr-scale needs --allow-effective-batch", 2)
    if quiet and as_json:
        fail("rejected: --quiet and --json contradict", 2)
    words = list(args)
    run = words.pop(0) if words and "=" not in words[0] and not names_knob(words[0]) else None
    try:
        raw = parse_assignments(words)
        parse_changes(raw)  # fail early, before contacting the run, on what is wrong anyway
    except KnobError as exc:
        fail(f"rejected: {exc}", 2)
        return
    target = find_target(run, changes=True, usage="memtui set RUN KEY=VALUE...")
    where = f" on {target.run}" if target.run else ""
    try:
        reply = client_for(target, timeout).set(
            dict(raw),
            keep_effective_batch=keep_effective_batch,
            dry_run=dry_run,
            force=force,
            lr_scale=lr_scale or "",
        )
    except ClientError as exc:
        fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps(to_builtins(reply), indent=2))
        sys.exit(0 if reply.ok else 2)
    if not reply.ok:
        fail(f"rejected: {reply.reason}", 2)
    bands = load_thresholds().thresholds  # the run reads the same config file at install
    # the answer on stdout, in the order it reads; notes (warnings among them) on stderr
    if quiet:
        if not dry_run:
            click.echo(str(reply.id))
    elif dry_run:
        click.echo(f"would queue {format_changes(reply.changes)}{where}")
        click.echo(_prediction_line(reply, bands.memory_edge_fraction))
        if reply.needs_force:
            click.echo(
                f"it would need --force: predicted over the "
                f"{bands.memory_danger_fraction:.0%} danger band"
            )
    else:
        click.echo(
            f"queued #{reply.id}{where}: {format_changes(reply.changes)} (applies at "
            f"{reply.boundary or 'the next checkpoint'})"
        )
        click.echo(_prediction_line(reply, bands.memory_edge_fraction))
    if reply.note and not (dry_run and reply.needs_force and not quiet):
        click.echo(f"note: {reply.note}", err=True)


def _prediction_line(reply: SetReply, edge: float) -> str:
    """The memory prediction in a reply, in one line (``edge``: the top of the safe band)."""
    from memtui.core.stats import format_bytes

    if reply.predicted_peak_bytes is None or not reply.capacity_bytes:
        return "predicted peak: no memory model yet (it needs a few steps of samples)"
    share = reply.predicted_peak_bytes / reply.capacity_bytes
    high = reply.predicted_high_bytes
    upto = (
        f", up to {format_bytes(high)} = {high / reply.capacity_bytes:.0%}"
        if high is not None and high > reply.predicted_peak_bytes
        else ""
    )
    line = (
        f"predicted peak {format_bytes(reply.predicted_peak_bytes)} = {share:.0%}{upto} of "
        f"{format_bytes(reply.capacity_bytes)} ({reply.confidence})"
    )
    if reply.max_safe_batch_size is not None:
        safe = reply.max_safe or str(reply.max_safe_batch_size)
        line += f"; largest micro-batch under {edge:.0%}: {safe}"
    return line
