"""The memory bands in force everywhere in the viewer: a YAML config file ($MEMTUI_CONFIG) that
moves the edge and danger bands changes the config panel's max safe batch, the change log's
predicted peak colour, the memory chart's band labels, the per-rank table's colours and the
help's confirm threshold, as it changes the verdict (real Textual, run_test + Pilot, on the
recorded streams). And the max safe batch said honestly: far past the micro-batches seen, a
floor and the confidence in words that fit the panel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.pilot import Pilot

from memtui.advice.predict import GUESS_MULTIPLE, max_batch
from memtui.transport.recording import read_recording
from memtui.tui.palette import SEVERITY_STYLES
from memtui.tui.screens.help import HelpScreen
from memtui.tui.widgets.config import safe_batch_lines
from memtui.wire import Ceiling, MemoryModel, ModelPoint, Telemetry
from tests.integration.tui.test_app_replay import NARROW, WIDE, text_of
from tests.support.viewer import ADVICE, OOM, STARVING, replay_app, run, settle

MIB = 1 << 20
GIB = 1 << 30


def first_pending_offset() -> float:
    """Just after batch_size=8 was queued in the advice recording (predicted 66% of 900 MiB)."""
    offset = read_recording(ADVICE).offset_of(
        lambda m: isinstance(m, Telemetry) and bool(m.control and m.control.pending)
    )
    assert offset is not None
    return offset + 0.05


def style_at(pilot: Pilot[Any], selector: str, needle: str) -> str:
    """The style the widget draws ``needle`` with (the innermost span over its first cell)."""
    rendered = pilot.app.screen.query_one(selector).render()
    assert isinstance(rendered, Text)
    index = rendered.plain.index(needle)
    styles = [str(s.style) for s in rendered.spans if s.start <= index < s.end]
    return styles[-1] if styles else str(rendered.style)


def use_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **verdict: float) -> Path:
    """Write a config file with these ``verdict:`` keys and point $MEMTUI_CONFIG at it."""
    path = tmp_path / "config.yaml"
    path.write_text("verdict:\n" + "".join(f"  {k}: {v}\n" for k, v in verdict.items()))
    monkeypatch.setenv("MEMTUI_CONFIG", str(path))
    return path


def test_default_bands_on_the_advice_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: with no config file, 85% and 90% (what the next test changes)."""
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        assert "max safe batch  11 (predicted < 85%)" in text_of(pilot, "#config")
        assert "memory ■ now  ■ peak  85% 90%" in text_of(pilot, "#charts")
        assert style_at(pilot, "#changes", "596 MiB = 66%") == "green"

    run(replay_app(ADVICE, until_s=first_pending_offset()), check, WIDE)


def test_a_config_file_moves_the_bands_in_every_panel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Edge 60%, danger 65%: the max safe batch is the model's under 60%, the pending change
    predicted at 66% is over the danger band (red), the chart names 60% and 65%, and the help
    says a change predicted over 65% takes a second Enter."""
    path = use_config(
        monkeypatch,
        tmp_path,
        underused_memory_fraction=0.4,
        memory_edge_fraction=0.6,
        memory_danger_fraction=0.65,
    )
    app = replay_app(ADVICE, until_s=first_pending_offset())

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        assert app.state.thresholds.source == str(path) and not app.state.thresholds.problems
        control = app.state.control
        assert control is not None and control.model is not None
        safe = max_batch(control.model, 0.6)
        assert safe is not None and safe < 13
        assert f"max safe batch  {safe} (predicted < 60%)" in text_of(pilot, "#config")
        assert "memory ■ now  ■ peak  60% 65%" in text_of(pilot, "#charts")
        assert style_at(pilot, "#changes", "596 MiB = 66%") == "bold red"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        help_text = " ".join(str(app.screen.query_one("#help-text").render()).split())
        assert "predicted over 65% takes a second Enter" in help_text  # wrapped to the dialog

    run(app, check, WIDE)


def test_a_config_file_moves_the_bands_of_the_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks at 88% and 85%: yellow (edge band) by default; with danger at 86% rank 0 is
    over it (red) in the table and the medians line, and the chart names 80% and 86%."""

    async def default(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        assert style_at(pilot, "#ranks", " 88% ") == SEVERITY_STYLES[1]
        assert style_at(pilot, "#ranks", "peak 85-88%") == SEVERITY_STYLES[1]
        assert "85% 90%" in text_of(pilot, "#charts")

    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "none.yaml"))
    run(replay_app(OOM), default, WIDE)

    async def moved(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        assert style_at(pilot, "#ranks", " 88% ") == SEVERITY_STYLES[2]
        assert style_at(pilot, "#ranks", "peak 85-88%") == SEVERITY_STYLES[2]
        assert "80% 86%" in text_of(pilot, "#charts")
        assert "over 86%, danger" in text_of(pilot, "#verdict")

    use_config(monkeypatch, tmp_path, memory_edge_fraction=0.8, memory_danger_fraction=0.86)
    run(replay_app(OOM), moved, WIDE)


def cpu_model(points: list[int], capacity: int = 23 * GIB) -> MemoryModel:
    """A CPU run's memory model: 350 MiB steady, 1 MiB a sample, through ``points``."""
    steady, per_sample = 350 * MIB, float(MIB)
    return MemoryModel(
        kind="cpu",
        batch_size=points[-1],
        capacity_bytes=capacity,
        steady_bytes=steady,
        per_sample_bytes=per_sample,
        overhead_ratio=1.0,
        beyond_bytes=0,
        points=[ModelPoint(b, int(steady + per_sample * b), 10) for b in points],
        fit_error=0.014 if len(points) > 1 else None,
        basis="test",
    )


def plain(lines: list[Text]) -> list[str]:
    return [line.plain for line in lines]


def test_max_safe_batch_far_past_the_batches_seen_is_a_floor() -> None:
    """One micro-batch of 16 on a 23 GiB host: even the interval's high end stays under the edge
    for some 10000, which says nothing that far out; the max safe batch is 64 (GUESS_MULTIPLE x
    the largest seen: the most it justifies) and the panel says > 64 with a low confidence, in
    the most words that fit: two lines in the wide layout's column (48), one in a side pane (56)."""
    model = cpu_model([16])
    assert max_batch(model, 0.85) == GUESS_MULTIPLE * 16
    assert plain(safe_batch_lines(model, 0.85, 48, 2)) == [
        f"max safe batch  > {GUESS_MULTIPLE * 16}, 4x the largest seen (16)",
        "  predicted < 85%; low: one micro-batch seen",
    ]
    assert plain(safe_batch_lines(model, 0.85, 56, 1)) == [
        "max safe batch  > 64, 4x the 16 seen (low confidence)"
    ]
    assert plain(safe_batch_lines(model, 0.85, 120, 2)) == [
        "max safe batch  > 64, 4x the largest seen (16); predicted < 85%, low confidence: "
        "one micro-batch seen"
    ]
    # several batches seen: the floor follows the largest, and the fit error is said (not for
    # two: a line through two points fits them exactly)
    assert plain(safe_batch_lines(cpu_model([8, 32]), 0.85, 48, 2)) == [
        "max safe batch  > 128, 4x the largest seen (32)",
        "  predicted < 85%; 2 micro-batches seen",
    ]
    assert plain(safe_batch_lines(cpu_model([4, 8, 32]), 0.85, 48, 2)) == [
        "max safe batch  > 128, 4x the largest seen (32)",
        "  predicted < 85%; 3 sizes seen, fit error 1.4%",
    ]
    # too narrow for any: the shortest, cut with an ellipsis
    cut = safe_batch_lines(model, 0.85, 30, 1)
    assert len(cut) == 1 and cut[0].overflow == "ellipsis"


def test_max_safe_batch_within_reach_is_the_interval_high_end() -> None:
    """A 500 MiB limit and one micro-batch of 16: the line alone would allow 75, but its high end
    (the slope known to +-30% from one point, and the reading's noise) allows 55; two close
    points (8, 16) with 1% noise each pin the slope down less, 38; a third (4) narrows it, 42."""
    model = cpu_model([16], capacity=500 * MIB)
    assert max_batch(model, 0.85) == 55
    assert plain(safe_batch_lines(model, 0.85, 48, 2)) == [
        "max safe batch  55 (predicted < 85%)",
        "  low confidence: one micro-batch seen",
    ]
    assert plain(safe_batch_lines(model, 0.85, 56, 1)) == [
        "max safe batch  55 (< 85%; low: one micro-batch seen)"
    ]
    assert plain(safe_batch_lines(model, 0.85, 100, 2)) == [
        "max safe batch  55 (predicted < 85%) low confidence: one micro-batch seen"
    ]
    assert plain(safe_batch_lines(cpu_model([8, 16], capacity=500 * MIB), 0.85, 56, 1)) == [
        "max safe batch  38 (< 85%; 2 micro-batches seen)"
    ]
    assert plain(safe_batch_lines(cpu_model([4, 8, 16], capacity=500 * MIB), 0.85, 48, 2)) == [
        "max safe batch  42 (predicted < 85%)",
        "  3 micro-batches seen, fit error 1.4%",
    ]


def test_max_safe_batch_stays_under_what_ran_out_of_memory() -> None:
    """An out-of-memory error at micro-batch 30 caps the max safe batch at 29, whatever the
    model says, and the panel says why."""
    model = cpu_model([4, 8, 16], capacity=500 * MIB)
    assert max_batch(model, 0.85, ceiling=Ceiling(batch_size=30)) == 29
    assert plain(safe_batch_lines(model, 0.85, 48, 2, ceiling=Ceiling(batch_size=30))) == [
        "max safe batch  29 (30 ran out of memory)"
    ]
    assert (
        max_batch(model, 0.85, ceiling=Ceiling(batch_size=100)) == 42
    )  # a ceiling above the model's: no effect


@pytest.mark.parametrize("size", [WIDE, NARROW], ids=["wide", "narrow"])
def test_a_cpu_run_without_a_limit_shows_the_floor_whole(size: tuple[int, int]) -> None:
    """The starving demo (CPU, no memory limit: the host's RAM is the capacity): the config
    panel shows the floor and the confidence whole (nothing cut), wide and in a side pane."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        config = text_of(pilot, "#config")
        assert "…" not in config
        width = pilot.app.screen.query_one("#config").content_size.width
        assert max(len(line) for line in config.splitlines()) <= width
        if size == WIDE:
            assert "max safe batch  > 64, 4x the largest seen (16)" in config
            assert "predicted < 85%; low: one micro-batch seen" in config
        else:
            assert "max safe batch  > 64, 4x the 16 seen (low confidence)" in config

    run(replay_app(STARVING), check, size)
