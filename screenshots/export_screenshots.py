"""Write the README's screenshots: the viewer on replayed streams, as SVG, into screenshots/.

Recordings from tests/data: a real demo run starving for data (``--workers 0``, with the
fix ``num_workers=4`` queued; and at its end, balanced, the loader workers' own memory counted),
a synthetic two-rank CUDA run at 88% of its memory (and its rank 0
alone, as a single-GPU run), and a
synthetic eight-rank CUDA run with a straggler and a rank near OOM (made without a GPU;
see tests/data/make_oom_stream.py and make_ranks_stream.py), and a real CPU demo under a 900 MiB
limit with a forced micro-batch predicted over it, pending (make_advice_stream.py), and the same
run at its end, after the out-of-memory error and the rollback. Each at full width (120x40) and in
a side pane (60x50). Then ``memtui report`` on the starving demo's recording, 120 columns wide,
with the recording's interpreter and directories written as the demo's own command line
(``python -m memtui.demo``, ``--out out``): the figures are the recording's. Run: ``make
screenshots`` or ``.venv/bin/python screenshots/export_screenshots.py``.
"""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import msgspec

from memtui.runs.after import AfterReport, build_after, render_after
from memtui.runs.summaries import read_recording_summary
from memtui.transport.recording import read_recording
from memtui.transport.sources import ReplaySource
from memtui.tui.app import MemtuiApp
from memtui.wire import Telemetry
from tests.support.viewer import one_rank

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "screenshots"
DATA = ROOT / "tests" / "data"
SIZES = {"wide": (120, 40), "narrow": (60, 50)}


def pending_offset(path: Path, forced: bool = False) -> float:
    """Just after a change was queued in a demo recording (the first, or the first forced one)."""
    offset = read_recording(path).offset_of(
        lambda m: (
            isinstance(m, Telemetry)
            and bool(m.control and any(p.forced or not forced for p in m.control.pending))
        )
    )
    if offset is None:
        raise SystemExit(f"{path}: no pending change recorded")
    return offset + 0.05


async def shoot(source: ReplaySource, size: tuple[int, int], name: str) -> Path:
    """Replay to the end of ``source``, then save the screen."""
    app = MemtuiApp(source)
    async with app.run_test(size=size) as pilot:
        while not app.caught_up:
            await pilot.pause(0.05)
        app.refresh_view()
        for _ in range(3):  # let the layout settle (a scrollbar that is no longer needed goes)
            await pilot.pause(0.1)
        return Path(app.save_screenshot(f"{name}.svg", str(OUT)))


def demo_command(command: list[str]) -> list[str]:
    """A recorded demo's command line as a user types it: ``python -m memtui.demo`` and its
    options, the output directory ``out``."""
    if not command:
        return []
    options = command[2:]
    if "--out" in options:
        options[options.index("--out") + 1] = "out"
    return ["python", "-m", "memtui.demo", *options]


def report_of(path: Path) -> AfterReport:
    """``memtui report``'s report on a demo's recording, its paths as a user's would be."""
    report = build_after(read_recording_summary(path))
    nxt = report.next
    if nxt is not None:
        tuned = "out/memtui-tuned.yaml" if nxt.tuned_path else ""
        nxt = msgspec.structs.replace(nxt, command=demo_command(nxt.command), tuned_path=tuned)
    return msgspec.structs.replace(
        report, command=demo_command(report.command), state_dir="out", next=nxt
    )


def shoot_report(path: Path, name: str, width: int = 120) -> Path:
    """``memtui report``'s text on ``path`` as a terminal ``width`` columns wide shows it."""
    from rich.console import Console
    from rich.text import Text

    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    console.print(Text(f"$ memtui report {path.relative_to(ROOT)}"), style="bold")
    console.print(Text(render_after(report_of(path))))
    out = OUT / f"{name}.svg"
    console.save_svg(str(out), title="memtui report")
    return out


def main() -> int:
    """Write the fifteen screenshots and list them."""
    starving = DATA / "demo_starving.mtrec"
    advice = DATA / "demo_advice.mtrec"
    scenes = {
        "starving": lambda: ReplaySource(starving, speed=None, until_s=pending_offset(starving)),
        "balanced": lambda: ReplaySource(starving, speed=None),
        "oom-risk": lambda: ReplaySource(DATA / "oom_risk.mtrec", speed=None),
        "one-gpu": lambda: ReplaySource(one_rank(DATA / "oom_risk.mtrec"), speed=None),
        "ranks": lambda: ReplaySource(DATA / "ranks_8.mtrec", speed=None),
        "advice": lambda: ReplaySource(
            advice, speed=None, until_s=pending_offset(advice, forced=True)
        ),
        "rollback": lambda: ReplaySource(advice, speed=None),
    }
    for scene, source in scenes.items():
        for layout, size in SIZES.items():
            path = asyncio.run(shoot(source(), size, f"{scene}-{layout}"))
            print(f"{path.relative_to(ROOT)}  {size[0]}x{size[1]}")
    path = shoot_report(starving, "report-starving")
    print(f"{path.relative_to(ROOT)}  120 columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
