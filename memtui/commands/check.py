"""`memtui check`: hold a run to bounds on speed, memory and data wait (exit 1 past one)."""

from __future__ import annotations

import click

from memtui.commands.common import TIMEOUT_HELP, fail

PERCENT = click.FloatRange(min=0.0)


@click.command("check")
@click.argument("run")
@click.option(
    "--against",
    "reference",
    metavar="REF",
    help="The reference run (a summary file, state directory, run or recording) for the "
    "regression bounds.",
)
@click.option(
    "--max-step-time-regression",
    type=PERCENT,
    metavar="PCT",
    help="Fail if the median step time is slower than REF's by more than PCT percent (and the "
    "steps say it is not noise).",
)
@click.option(
    "--max-peak-memory",
    type=PERCENT,
    metavar="PCT",
    help="Fail if the device peak takes more than PCT percent of the device's memory (a CPU "
    "run: of its memory limit, else of the RAM).",
)
@click.option(
    "--max-peak-memory-regression",
    type=PERCENT,
    metavar="PCT",
    help="Fail if the device peak grew over REF's by more than PCT percent (beyond its noise).",
)
@click.option(
    "--max-data-wait",
    type=PERCENT,
    metavar="PCT",
    help="Fail if the run waited for data more than PCT percent of its step time.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def check_command(
    run: str,
    reference: str | None,
    max_step_time_regression: float | None,
    max_peak_memory: float | None,
    max_peak_memory_regression: float | None,
    max_data_wait: float | None,
    as_json: bool,
    timeout: float,
) -> None:
    """Check RUN against bounds, for CI: one line per bound, exit 1 if any failed.

    RUN and REF: a summary file, a state directory, a run id or a recording, as `memtui report`
    takes them. A bound that cannot be checked (too few steps, nothing measured) fails, saying
    why. Exit 2: a usage error, or a summary that cannot be read.
    """
    from memtui.advice.compare import Bounds
    from memtui.runs.after import after_json, build_check, render_check
    from memtui.runs.summaries import SummaryError, find

    def fraction(pct: float | None) -> float | None:
        return None if pct is None else pct / 100.0

    bounds = Bounds(
        step_time_regression=fraction(max_step_time_regression),
        peak_memory=fraction(max_peak_memory),
        peak_memory_regression=fraction(max_peak_memory_regression),
        data_wait=fraction(max_data_wait),
    )
    if bounds == Bounds():
        raise click.UsageError("name at least one bound (--max-step-time-regression, ...)")
    if bounds.needs_reference and not reference:
        raise click.UsageError("the regression bounds need a reference run: --against REF")
    try:
        found = find(run, timeout)
        against = find(reference, timeout) if reference else None
    except SummaryError as exc:
        fail(str(exc), 2)
        return
    report = build_check(found, bounds, against)
    click.echo(after_json(report) if as_json else render_check(report))
    if not report.passed:
        raise SystemExit(1)
