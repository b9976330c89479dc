"""``memtui report --html``: one self-contained page, readable offline: the report's text and
its charts (step time, data wait, memory against the limit, the changes and out-of-memory errors
marked on the time axis), drawn with matplotlib into inline SVG.

matplotlib is optional (``pip install 'memtui[report]'``): it is imported here only, when a page
is written, and its absence is said in one line (``PlottingMissing``).
"""

from __future__ import annotations

import html
import io
import time
from typing import TYPE_CHECKING, Any

from memtui.core.knobs import format_value
from memtui.core.stats import format_bytes
from memtui.runs.after import AfterReport, render_after
from memtui.wire import RunSummary

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL = "pip install 'memtui[report]'"
"""How to get the plotting library the page needs."""


class PlottingMissing(RuntimeError):
    """matplotlib is not installed: the one line says how to install it."""


def _figure(height: float) -> Figure:
    """A new matplotlib figure (no pyplot: no global state, no display needed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlottingMissing(f"--html draws its charts with matplotlib: {INSTALL}") from None
    figure = Figure(figsize=(9.0, height), layout="constrained")
    return figure


def _svg(figure: Figure) -> str:
    """The figure as an inline SVG element (its text as paths: the same on every machine)."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def _minutes(summary: RunSummary, at: float) -> float:
    """Wall time ``at`` as minutes since the run's first stretch."""
    origin = summary.windows[0].start if summary.windows else summary.info.started
    return (at - origin) / 60.0


def _mark_changes(axes: Any, summary: RunSummary) -> None:
    """The applied changes (and rollbacks) and the out-of-memory errors as vertical lines."""
    control = summary.control
    if control is None:
        return
    for change in control.applied:
        x = _minutes(summary, change.time)
        colour = "#d62728" if change.rollback else "#2ca02c"
        axes.axvline(x, color=colour, linestyle="--", linewidth=1)
        words = ", ".join(
            f"{k} {format_value(d.old)}->{format_value(d.new)}" for k, d in change.changes.items()
        )
        axes.annotate(
            words or "rollback",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=colour,
        )
    for oom in control.ooms:
        axes.axvline(_minutes(summary, oom.time), color="#d62728", linewidth=2)


def charts(summary: RunSummary) -> list[tuple[str, str]]:
    """The page's charts as (title, inline SVG)."""
    windows = [w for w in summary.windows if w.steps or w.device_peak_bytes or w.host_peak_bytes]
    if not windows:
        return []
    x = [_minutes(summary, w.start + w.seconds / 2) for w in windows]
    timed = [(xi, w) for xi, w in zip(x, windows, strict=True) if w.steps]
    found: list[tuple[str, str]] = []

    figure = _figure(2.8)
    axes = figure.add_subplot()
    axes.plot(
        [xi for xi, _ in timed], [w.step_time_s / w.steps * 1000 for _, w in timed],
        label="mean step", color="#1f77b4",
    )  # fmt: skip
    axes.plot(
        [xi for xi, _ in timed], [w.slowest_step_s * 1000 for _, w in timed],
        label="slowest step", color="#aec7e8", linewidth=1,
    )  # fmt: skip
    axes.set_ylabel("ms per step")
    axes.set_xlabel("minutes")
    axes.set_ylim(bottom=0)
    axes.legend(loc="upper left", fontsize=8)
    _mark_changes(axes, summary)
    found.append(("Step time", _svg(figure)))

    if summary.data_wait_measured:
        figure = _figure(2.2)
        axes = figure.add_subplot()
        axes.fill_between(
            [xi for xi, _ in timed],
            [100 * w.data_wait_s / w.step_time_s if w.step_time_s else 0 for _, w in timed],
            color="#ff7f0e",
            alpha=0.6,
            step="mid",
        )
        axes.set_ylabel("% of step time")
        axes.set_xlabel("minutes")
        axes.set_ylim(0, 100)
        _mark_changes(axes, summary)
        found.append(("Data wait", _svg(figure)))

    memory = summary.memory
    if memory is not None and (memory.device_peak_bytes or memory.host_peak_bytes):
        gib = float(1 << 30)
        figure = _figure(2.8)
        axes = figure.add_subplot()
        sampled = [(xi, w) for xi, w in zip(x, windows, strict=True) if w.device_peak_bytes]
        axes.plot(
            [xi for xi, _ in sampled], [w.device_peak_bytes / gib for _, w in sampled],
            label="device peak", color="#9467bd",
        )  # fmt: skip
        axes.plot(
            [xi for xi, _ in sampled], [w.device_used_bytes / gib for _, w in sampled],
            label="device in use", color="#c5b0d5", linewidth=1,
        )  # fmt: skip
        if memory.kind == "cuda":
            hosted = [(xi, w) for xi, w in zip(x, windows, strict=True) if w.host_peak_bytes]
            axes.plot(
                [xi for xi, _ in hosted], [w.host_peak_bytes / gib for _, w in hosted],
                label="host process tree", color="#8c564b", linewidth=1,
            )  # fmt: skip
        if memory.capacity_bytes:
            axes.axhline(
                memory.capacity_bytes / gib,
                color="#d62728",
                linewidth=1.5,
                label=f"limit {format_bytes(memory.capacity_bytes)}",
            )
        axes.set_ylabel("GiB")
        axes.set_xlabel("minutes")
        axes.set_ylim(bottom=0)
        axes.legend(loc="lower right", fontsize=8)
        _mark_changes(axes, summary)
        found.append(("Memory against the limit", _svg(figure)))
    return found


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; color: #222; }
pre { background: #f6f6f6; padding: 1rem; overflow-x: auto; font-size: 0.85rem; }
h2 { font-size: 1.1rem; margin-top: 2rem; }
svg { max-width: 100%; height: auto; }
.legend { font-size: 0.85rem; color: #555; }
"""


def render_page(report: AfterReport, summary: RunSummary) -> str:
    """The whole page: the report's text, then its charts (raise PlottingMissing without
    matplotlib)."""
    drawn = charts(summary)
    title = f"memtui report: {report.run}"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<pre>{html.escape(render_after(report))}</pre>",
        '<p class="legend">Green dashed lines: changes applied; red dashed: rollbacks; red: '
        "out-of-memory errors. Each point is one stretch of the run "
        f"({summary.window_s:g} s).</p>",
    ]
    for name, svg in drawn:
        parts += [f"<h2>{html.escape(name)}</h2>", svg]
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.written))
    parts.append(f'<p class="legend">Summary written {written}; {html.escape(report.source)}.</p>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
