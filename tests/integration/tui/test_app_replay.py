"""The app on replayed streams (real Textual, run_test + Pilot): layout, keys, modals, modes."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest
from click.testing import CliRunner
from textual.containers import VerticalScroll
from textual.pilot import Pilot
from textual.widgets import Input

from memtui.cli import main
from memtui.runs.events import Status
from memtui.transport.sources import LiveSource, ReplaySource
from memtui.tui.app import MemtuiApp, left_at
from memtui.tui.screens.cancel import CancelScreen
from memtui.tui.screens.edit import EditKnobScreen
from memtui.tui.screens.help import HelpScreen
from tests.support.viewer import (
    OOM,
    STARVING,
    WATCHED,
    pending_offset,
    replay_app,
    run,
    screen_text,
    settle,
    until,
)

pytestmark = pytest.mark.heavy

WIDE = (120, 40)
NARROW = (60, 50)


def text_of(pilot: Pilot[Any], selector: str) -> str:
    """The plain text a widget shows."""
    widget = pilot.app.screen.query_one(selector)
    rendered = widget.render()
    return str(getattr(rendered, "plain", rendered))


def test_starving_with_a_change_pending() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        screen = screen_text(pilot.app)
        assert "demo-" in screen and "● live" in screen and "step " in screen
        assert "STARVED" in text_of(pilot, "#verdict")
        assert "data wait 6" in text_of(pilot, "#verdict")  # 60-70% of each step
        config = text_of(pilot, "#config")
        assert "num_workers" in config and "→ 4" in config
        assert "pending  #1 num_workers=4" in text_of(pilot, "#changes")

    run(replay_app(STARVING, until_s=pending_offset()), check, WIDE)


def test_the_change_lands_and_the_run_ends() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, MemtuiApp)
        assert app.state.connection.status is Status.ENDED
        assert "● ended: run ended at step 500" in screen_text(app)
        assert "applied  step 300  num_workers 0 → 4" in text_of(pilot, "#changes")
        assert "BALANCED" in text_of(pilot, "#verdict")
        # what the viewer prints when it closes: the run, its last step, the tuned config
        info = app.state.info
        assert info is not None and info.tuned_path.endswith("memtui-tuned.yaml")
        assert left_at(app.state) == (
            f"run {info.run}, last step 500; the tuned config: {info.tuned_path}"
        )

    run(replay_app(STARVING), check, WIDE)


def test_the_viewer_says_no_change_was_applied_when_it_closes() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, MemtuiApp) and app.state.info is not None
        words = left_at(app.state)
        assert words.startswith(f"run {app.state.info.run}, last step ")
        assert words.endswith(f"; no change applied (a tuned config would go to "
                              f"{app.state.info.tuned_path})")  # fmt: skip

    run(replay_app(STARVING, until_s=pending_offset()), check, WIDE)


def test_a_watched_loop_shows_every_knob_and_the_change_the_run_ended_with() -> None:
    """The knobs memtui cannot change show the values the run has (the loader's micro-batch and
    workers, the accumulation measured), prefetch_factor took its change with a worker count
    memtui does not set, and the change still pending at the end says it was never applied."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        rows = {
            line.split()[0]: line.split()[1:]
            for line in text_of(pilot, "#config").splitlines()
            if line.split()[:1] and line.split()[0] in ("batch_size", "grad_accum", "num_workers")
        }
        assert rows == {
            "batch_size": ["4"], "grad_accum": ["2", "measured"], "num_workers": ["2"],
        }  # fmt: skip
        assert "effective batch 8 = 4 x 2 x 1 ranks" in text_of(pilot, "#config")
        changes = text_of(pilot, "#changes")
        assert "unapplied #2 pin_memory=true" in changes
        assert "pending at exit: the run ended before its next boundary" in changes
        assert "applied  step 120  prefetch_factor 2 → 4" in changes

    run(replay_app(WATCHED), check, WIDE)


def test_oom_risk_shows_where_the_memory_goes() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        verdict = text_of(pilot, "#verdict")
        assert "OOM RISK" in verdict and "peak memory 88% (21.1 GiB of 24.0 GiB)" in verdict
        memory = text_of(pilot, "#memory")
        for needle in ("█", "■ not known", "■ frag. 2.9 GiB", "■ beyond 1.1 GiB",
                       "capacity  24.0 GiB", "peak res. 20.0 GiB  83%", "pk alloc. 17.1 GiB  71%",
                       "python[31337]", "retry/OOM    3 / 0"):  # fmt: skip
            assert needle in memory, needle
        assert "peak in use" not in memory, "the verdict says it, beside the per-rank table"
        config = text_of(pilot, "#config")
        assert "effective batch 128 = 32 x 2 x 2 ranks → 144" in config
        assert "2 ranks" in text_of(pilot, "#header")

    run(replay_app(OOM), check, WIDE)


def test_narrow_layout_stacks_and_drops_secondary_columns() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        screen = pilot.app.screen
        assert screen.has_class("narrow")
        config, memory, charts = (
            screen.query_one(s).region for s in ("#config", "#memory", "#charts")
        )
        assert config.y < memory.y < charts.y, "stacked: config, memory, then the charts"
        assert config.width == memory.width == charts.width == 60
        text = screen_text(pilot.app)
        assert "OOM RISK" in text and "step 315" in text
        assert "python[31337]" not in text, "the secondary memory lines are dropped"
        assert all(len(line) <= 60 for line in text.splitlines())

    run(replay_app(OOM), check, NARROW)


def test_edit_validates_before_sending() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        assert isinstance(app, MemtuiApp)
        await pilot.press("w")
        assert isinstance(app.screen, EditKnobScreen)
        await pilot.press("minus", "1", "enter")
        assert isinstance(app.screen, EditKnobScreen), "an invalid value is not sent"
        assert "num_workers must be 0 or more" in str(app.screen.query_one("#preview").render())
        await pilot.press("escape")
        assert not isinstance(app.screen, EditKnobScreen)
        await pilot.press("k", "b")  # keep-effective-batch on, then batch_size
        assert isinstance(app.screen, EditKnobScreen)
        await pilot.press("4", "8")
        preview = str(app.screen.query_one("#preview").render())
        assert "batch_size=48 grad_accum=1" in preview  # 32 x 2 kept as 48 x 1 (~48)
        await pilot.press("enter")
        assert not isinstance(app.screen, EditKnobScreen)
        await pilot.pause(0.3)
        app.refresh_view()
        await pilot.pause()
        assert "takes no changes" in text_of(pilot, "#changes")  # a recording answers none

    run(replay_app(OOM), check, WIDE)


def test_cancel_picks_a_pending_change() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        await pilot.press("c")
        assert isinstance(app.screen, CancelScreen)
        assert "#3 batch_size=24 grad_accum=3" in screen_text(app)
        await pilot.press("escape")
        assert not isinstance(app.screen, CancelScreen)

    run(replay_app(OOM), check, WIDE)


def test_help_shows_keys_and_thresholds() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(pilot.app.screen, HelpScreen)
        text = screen_text(pilot.app)
        for needle in ("keep-effective-batch", "command palette"):
            assert needle in text, needle
        scroll = pilot.app.screen.query_one("#dialog", VerticalScroll)
        scroll.scroll_end(animate=False)  # the thresholds close the help, past 40 lines
        await pilot.pause()
        text = screen_text(pilot.app)
        for needle in ("data wait >= 30%", "85%-90%"):
            assert needle in text, needle
        await pilot.press("escape")
        assert not isinstance(pilot.app.screen, HelpScreen)

    run(replay_app(OOM), check, WIDE)


def test_pause_freezes_the_view() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("space")
        await pilot.pause()
        assert "PAUSED" in text_of(pilot, "#header")
        await pilot.press("space")
        await pilot.pause()
        assert "PAUSED" not in text_of(pilot, "#header")

    run(replay_app(STARVING, until_s=10), check, WIDE)


def test_readonly_hides_and_disables_the_edit_keys() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        app = pilot.app
        text = screen_text(app)
        assert "READ-ONLY" in text and "set knob" not in text and "? help" in text
        await pilot.press("w", "c", "k", "A")
        assert app.screen is app.screen_stack[0], "no editor opens"
        assert isinstance(app, MemtuiApp) and not app.keep_effective_batch
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Set num_workers" not in titles and "Help: keys and thresholds" in titles
        # each key says why it did nothing (a replay: the recording's run cannot be changed)
        told = [n.message for n in app._notifications]
        why = "sends nothing: a replay shows a recording"
        assert told == [
            f"read-only: w (workers) {why}",
            f"read-only: c (cancel) {why}",
            f"read-only: k (keep) {why}",
            f"read-only: A (autopilot) {why}",
        ], told

    run(replay_app(STARVING, until_s=10, readonly=True), check, WIDE)


def test_readonly_says_when_the_viewer_was_started_so() -> None:
    """``memtui attach --readonly`` on a live run: its reason (here a live source, not a replay:
    the app's own words for a run it may not change)."""
    app = MemtuiApp(LiveSource("no-such-run"), readonly=True)

    async def check(pilot: Pilot[Any]) -> None:
        await pilot.press("o")
        told = [n.message for n in app._notifications]
        assert told == [
            "read-only: o (queue advice) sends nothing: the viewer was started with --readonly"
        ], told

    run(app, check, NARROW)


def test_commands_are_in_the_palette() -> None:
    app = replay_app(STARVING, until_s=1)

    async def check(pilot: Pilot[Any]) -> None:
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("Set batch_size", "Set num_workers", "Toggle keep-effective-batch",
                      "Cancel a pending change", "Pause or resume the view", "Reconnect"):  # fmt: skip
            assert title in titles
        assert isinstance(app.screen.query_one("#config"), object)
        assert not app.screen.query(Input)

    run(app, check, WIDE)


def test_breakpoint_at_eighty_columns() -> None:
    for width, narrow in ((79, True), (80, False)):

        async def check(pilot: Pilot[Any], narrow: bool = narrow) -> None:
            await settle(pilot)
            assert pilot.app.screen.has_class("narrow") is narrow

        run(replay_app(OOM), check, (width, 45))


def test_refresh_is_bounded_however_fast_the_frames_come() -> None:
    app = MemtuiApp(ReplaySource(OOM, speed=20.0))  # 40 s of two ranks in 2 s

    async def check(pilot: Pilot[Any]) -> None:
        painted = 0
        original = app.refresh_view

        def counting(charts: bool = True) -> None:
            nonlocal painted
            before = app.repaints
            original(charts)
            painted += app.repaints > before

        app.refresh_view = counting  # type: ignore[method-assign]
        start = time.monotonic()
        await until(pilot, lambda: app.caught_up, 20, "the replay")
        elapsed = time.monotonic() - start
        assert app.batches_folded >= 5 and app.state.step == 315
        assert painted <= app.refresh_hz * elapsed + 2, (painted, elapsed)

    run(app, check, WIDE)


def test_the_demo_process_exit_is_reported() -> None:
    demo = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    app = replay_app(STARVING, until_s=2, demo_process=demo)

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await until(pilot, lambda: "exited with status 3" in text_of(pilot, "#changes"), 10,
                    "the demo's exit")  # fmt: skip

    run(app, check, WIDE)


def test_the_demo_viewers_help_says_q_stops_the_demo_training() -> None:
    """In the viewer ``memtui demo`` opened, the help says ``q`` stops the demo's training too;
    a viewer attached to a run says the run goes on."""
    demo = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(pilot.app.screen, HelpScreen)
        text = " ".join(screen_text(pilot.app).split())
        if isinstance(pilot.app, MemtuiApp) and pilot.app.demo_process is not None:
            assert "q quit: memtui demo stops its demo training too" in text, text
            assert "the run goes on" not in text, text
        else:
            assert "q quit (the run goes on)" in text, text

    try:
        run(replay_app(STARVING, until_s=2, demo_process=demo), check, WIDE)
        run(replay_app(STARVING, until_s=2), check, WIDE)
    finally:
        demo.kill()
        demo.wait()


@pytest.mark.parametrize(("width", "shown"), [(120, True), (110, True), (100, False), (60, False)])
def test_the_footer_shows_the_autopilot_key_where_it_fits(width: int, shown: bool) -> None:
    """``A autopilot`` in the footer from 110 columns (the 120-column terminal included) beside
    every other key; narrower, the footer keeps ``? help`` and ``q quit`` instead."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        footer = screen_text(pilot.app).rstrip("\n").splitlines()[-1]
        assert ("A autopilot" in footer) == shown, footer
        if width >= 100:
            assert "? help" in footer and "q quit" in footer, footer

    run(replay_app(STARVING, until_s=10), check, (width, 40))


def test_replay_keys_pause_the_clock_and_change_speed() -> None:
    """The keys change the replay's clock, and the header says it is a replay at that speed
    (not "live", and not without its speed)."""
    source = ReplaySource(STARVING, speed=2.0)
    app = MemtuiApp(source, readonly=True, replay_controls=True)

    async def check(pilot: Pilot[Any]) -> None:
        await until(pilot, lambda: app.state.step > 0, 20, "the first steps")
        await until(pilot, lambda: "● replay 2x" in text_of(pilot, "#header"), 5, "replay 2x")
        assert "live" not in text_of(pilot, "#header")
        await pilot.press("plus")
        assert source.speed == 4.0
        await until(pilot, lambda: "● replay 4x" in text_of(pilot, "#header"), 5, "replay 4x")
        await pilot.press("minus")
        assert source.speed == 2.0
        await pilot.press("space")
        assert source.paused and app.paused
        held = source.position()
        await pilot.pause(0.3)
        assert source.position() == held
        await pilot.press("space")
        assert not source.paused

    run(app, check, WIDE)


def test_memtui_replay_refuses_a_speed_of_zero_or_less() -> None:
    """``--speed 0`` would sit at step 0 forever: click refuses it (exit status 2)."""
    for speed in ("0", "-1"):
        result = CliRunner().invoke(main, ["replay", str(STARVING), "--speed", speed])
        assert result.exit_code == 2, result.output
        assert "--speed" in result.output and "not in the range x>0" in result.output


def test_memtui_replay_command_refuses_a_damaged_file(tmp_path: Any) -> None:
    bad = tmp_path / "bad.mtrec"
    bad.write_bytes(b"nope")
    from memtui.tui.app import run_replay

    assert run_replay(str(bad)) == 1


def test_ctrl_c_quits_as_in_htop_even_from_the_editor() -> None:
    """Ctrl-C quits the viewer (Textual's own only says "press ctrl+q"), from the main
    screen and from the knob editor's input alike."""
    for keys in (["ctrl+c"], ["w", "3", "ctrl+c"], ["question_mark", "ctrl+q"]):
        app = replay_app(STARVING)

        async def check(pilot: Pilot[Any], keys: list[str] = keys) -> None:
            await settle(pilot)
            await pilot.press(*keys)
            await pilot.pause()
            assert pilot.app.return_code == 0, keys

        run(app, check, WIDE)
        assert app.return_code == 0


def test_q_closes_the_screen_on_top_and_quits_from_the_main_one() -> None:
    """The main screen's keys wait while another screen is on top: q there is that screen's."""
    app = replay_app(STARVING)

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        assert app.screen is app.main and app.return_code is None, "q closed the help only"
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0

    run(app, check, WIDE)
