"""The viewer on a run published over plain TCP: a red INSECURE tag, read-only over that TCP."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.pilot import Pilot

from memtui.storage import registry
from memtui.transport.sources import LiveSource
from memtui.tui.app import MemtuiApp
from memtui.tui.screens.edit import EditKnobScreen
from memtui.tui.widgets.header import RunHeader
from tests.support.other_user import OtherUser, make_other_user
from tests.support.viewer import HookLoop, run, screen_text, until


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """A second real user on this host (skipped, saying why, where none can be made)."""
    yield from make_other_user()


@pytest.fixture
def plain_tcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks started now publish over plain loopback TCP (``--insecure``), without control."""
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "none"))
    monkeypatch.setenv("MEMTUI_TCP", "127.0.0.1")
    monkeypatch.setenv("MEMTUI_INSECURE", "1")
    monkeypatch.delenv("MEMTUI_INSECURE_CONTROL", raising=False)


def insecure_styles(app: MemtuiApp) -> list[str]:
    """The styles the header gives its INSECURE tag (none: no tag)."""
    header = app.main.query_one(RunHeader)
    text = header.build(app.state, app.view, 120)
    assert isinstance(text, Text)
    return [
        str(span.style)
        for span in text.spans
        if text.plain[span.start : span.end].strip() == "INSECURE"
    ]


def test_attached_over_plain_tcp_the_view_is_insecure_and_read_only(
    plain_tcp: None, start_hook_loop: Callable[..., HookLoop]
) -> None:
    loop = start_hook_loop(rate=100, seconds=60)
    endpoint = registry.find_run(loop.run_id).ranks[0].control_tcp
    assert endpoint.startswith("tcp://127.0.0.1:")
    app = MemtuiApp(LiveSource(endpoint))

    async def check(pilot: Pilot[Any]) -> None:
        state = app.state
        await until(pilot, lambda: state.step > 0 and state.info is not None, 20, "steps")
        assert state.info is not None and state.info.security == "plain-tcp"
        await until(pilot, lambda: app.readonly, 5, "the view to turn read-only")
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        assert "INSECURE" in text and "READ-ONLY" in text, text
        assert any("red" in style for style in insecure_styles(app))
        await pilot.press("w")
        assert not isinstance(app.screen, EditKnobScreen), "no editor: nothing can be sent"

    run(app, check, (120, 40))


def test_another_users_viewer_stays_live_and_read_only_over_tcp(
    plain_tcp: None, start_hook_loop: Callable[..., HookLoop], other_user: OtherUser
) -> None:
    """Another account on the host attaches to the run's plain TCP endpoint: its header stays
    live (it never tries the run's private ipc socket, which it cannot open), READ-ONLY and
    INSECURE, and the steps advance."""
    loop = start_hook_loop(rate=100, seconds=60)
    endpoint = registry.find_run(loop.run_id).ranks[0].control_tcp
    seen = other_user.report("app", endpoint, "3", env={"MEMTUI_INSECURE": "1"}, timeout=90)
    lines = seen["lines"]
    assert any("● live" in line for line in lines), lines
    assert not [line for line in lines if "disconnected" in line or "error" in line], lines
    assert "INSECURE" in seen["text"] and "READ-ONLY" in seen["text"], seen["text"]
    assert seen["readonly"]
    assert seen["steps"][-1] > seen["steps"][0], seen["steps"]


def test_attached_over_ipc_to_a_plain_tcp_run_the_tag_shows(
    plain_tcp: None, start_hook_loop: Callable[..., HookLoop]
) -> None:
    loop = start_hook_loop(rate=100, seconds=60)
    app = MemtuiApp(LiveSource(loop.run_id))

    async def check(pilot: Pilot[Any]) -> None:
        await until(pilot, lambda: app.state.step > 0, 20, "steps")
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        assert "INSECURE" in text and "READ-ONLY" not in text, text
        assert not app.readonly, "the run's own user, over ipc, may still send changes"

    run(app, check, (120, 40))


def test_a_private_run_has_no_tag(start_hook_loop: Callable[..., HookLoop]) -> None:
    loop = start_hook_loop(rate=100, seconds=60)
    app = MemtuiApp(LiveSource(loop.run_id))

    async def check(pilot: Pilot[Any]) -> None:
        await until(pilot, lambda: app.state.step > 0, 20, "steps")
        app.refresh_view()
        await pilot.pause()
        assert app.state.info is not None and app.state.info.security == "ipc"
        assert "INSECURE" not in screen_text(app) and not insecure_styles(app)

    run(app, check, (120, 40))
