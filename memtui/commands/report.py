"""`memtui report`: what a run spent and the config its next run should start with."""

from __future__ import annotations

import click

from memtui.commands.common import TIMEOUT_HELP, fail


@click.command("report")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write one self-contained page with the charts to this file (needs matplotlib).",
)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def report_command(run: str | None, as_json: bool, html_path: str | None, timeout: float) -> None:
    """Say what a run spent (time, data wait, memory), what changed and what it bought, and the
    config to start the next run with; live, finished or recorded.

    RUN: a live run (id, prefix, pid), a finished run's id or prefix in the state home, its
    state directory, its summary file (memtui-summary.json) or a recording (.mtrec); without
    it, the newest live run, else the newest summary.
    """
    from memtui.runs.after import after_json, build_after, render_after
    from memtui.runs.summaries import SummaryError, find

    try:
        found = find(run, timeout)
    except SummaryError as exc:
        fail(str(exc))
        return
    report = build_after(found)
    if html_path:
        from pathlib import Path

        from memtui.runs.page import PlottingMissing, render_page

        try:
            page = render_page(report, found.summary)
        except PlottingMissing as exc:
            fail(str(exc))
            return
        try:
            Path(html_path).write_text(page, encoding="utf-8")
        except OSError as exc:
            fail(f"cannot write {html_path}: {exc}")
            return
        click.echo(f"memtui: wrote {html_path}", err=True)
    click.echo(after_json(report) if as_json else render_after(report))
