"""`memtui compare`: two runs side by side, each figure judged from their steps."""

from __future__ import annotations

import click

from memtui.commands.common import TIMEOUT_HELP, fail


@click.command("compare")
@click.argument("first")
@click.argument("second")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def compare_command(first: str, second: str, as_json: bool, timeout: float) -> None:
    """Compare run SECOND against run FIRST: step time, data wait, samples/s and peaks side by
    side with their spread, each judged from the runs' steps: faster or slower (less or more),
    within the noise, or no clear change.

    FIRST and SECOND: each a live run, a finished run's id, its state directory, its summary
    file or a recording, as `memtui report` takes them.
    """
    from memtui.runs.after import after_json, build_compare, render_compare
    from memtui.runs.summaries import SummaryError, find

    try:
        a, b = find(first, timeout), find(second, timeout)
    except SummaryError as exc:
        fail(str(exc))
        return
    report = build_compare(a, b)
    click.echo(after_json(report) if as_json else render_compare(report))
