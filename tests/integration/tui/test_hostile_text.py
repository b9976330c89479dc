"""Text from outside the code is shown as text: a run whose every string field (walked from the
wire's Struct types, so a field added later is covered too) holds markup, an escape sequence, a
NUL, 10,000 characters or right-to-left text is drawn by every widget and screen of the real app
(Pilot) without an error, the markup shown literally, control characters as visible symbols,
and no link or action made of it."""

from __future__ import annotations

import ast
import asyncio
import os
import re
import socket
import threading
import time
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq
from rich.control import strip_control_codes
from textual._compositor import LayoutUpdate
from textual.app import App
from textual.command import CommandPalette
from textual.css.query import NoMatches
from textual.pilot import Pilot
from textual.strip import Strip
from textual.widgets import Input

from memtui.planning.gpus import GpuInfo, GpuProcessInfo
from memtui.runs.events import Notice, ReceivedBatch, Status
from memtui.runs.text import clean
from memtui.storage import registry
from memtui.transport.recording import RecordedFrame, Recording, RecordingHeader
from memtui.transport.sources import LiveSource, ReplaySource
from memtui.tui.app import MemtuiApp
from memtui.tui.screens.advice import AdviceScreen
from memtui.tui.screens.cancel import CancelScreen
from memtui.tui.screens.edit import EditKnobScreen
from memtui.tui.screens.gpus import GpusScreen
from memtui.tui.screens.help import HelpScreen
from memtui.wire import (
    WIRE_VERSION,
    CancelReply,
    CancelRequest,
    Decoder,
    ErrorReply,
    Hello,
    RankInfo,
    RunRecord,
    SetReply,
    SetRequest,
    Snapshot,
    Telemetry,
    encode,
)
from tests.support.clock import patience
from tests.support.processes import ROOT, wait_for
from tests.support.viewer import settle, until

pytestmark = pytest.mark.heavy

WIDE = (120, 40)
NARROW = (60, 50)
LONG = "x" * 9_990 + "[/]" + "y" * 7
HOSTILE = [
    "[/",
    "[/]",
    "[/x]",
    "[bold]",
    "[link=file:///etc]x[/link]",
    "[@click=app.quit]x[/]",
    "\x1b[31mred\x1b]52;c;aGk=\x07",
    "a\x00b\x9bc",
    "שלום 🚀 عربى \u202eevil",
    LONG,
]
"""What a run, a file, a process or the operator may hand the viewer."""
NOW = time.time()
KNOB_KEYS = ("batch_size", "num_workers")
"""Dicts keyed by knob names get a real knob and the hostile text as keys."""


def fake(kind: Any, text: str, name: str = "") -> Any:
    """A value of type ``kind`` (a wire type) with ``text`` in every string, believable numbers
    elsewhere; a type it does not know fails the test (so a new kind of field is noticed)."""
    origin = typing.get_origin(kind)
    if kind is str:
        return text
    if kind is bool:
        return False
    if kind is int:
        if "rank" in name or name in ("index", "local_rank"):
            return 0
        if name == "world_size":
            return 2
        if name == "v":
            return WIRE_VERSION
        return (1 << 30) if name.endswith("bytes") else 4
    if kind is float:
        return NOW if "time" in name or name == "started" else 0.5
    if kind is type(None):
        return None
    if kind is Any:
        return text
    if origin in (typing.Union, types.UnionType):
        choices = [a for a in typing.get_args(kind) if a is not type(None)]
        return fake(choices[0], text, name)
    if origin is list:
        return [fake(typing.get_args(kind)[0], text, name)]
    if origin is dict:
        key_type, value_type = typing.get_args(kind)
        assert key_type is str, kind
        keys = (*KNOB_KEYS, text) if "changes" in name or name == "requested" else (text,)
        return {key: fake(value_type, text, name) for key in keys}
    if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
        return hostile(kind, text)
    raise AssertionError(f"no fake value for {kind!r} ({name})")


def hostile(cls: type[Any], text: str) -> Any:
    """An instance of the wire Struct ``cls`` with ``text`` in every string field."""
    hints = typing.get_type_hints(cls)
    return cls(**{f: fake(hints[f], text, f) for f in cls.__struct_fields__})


def strings(value: Any) -> list[str]:
    """Every string inside a wire value (to check that the fakes filled every one)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, msgspec.Struct):
        return [s for f in value.__struct_fields__ for s in strings(getattr(value, f))]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in strings(v)]
    return []


def hostile_run(text: str) -> Recording:
    """A two-rank run whose snapshot and batches hold ``text`` in every string field."""
    snapshot: Snapshot = hostile(Snapshot, text)
    batch: Telemetry = hostile(Telemetry, text)
    frames = [RecordedFrame(0.0, -1, encode(snapshot))]
    for seq in range(1, 4):
        for rank in (0, 1):
            step = msgspec.structs.replace(batch, rank=rank, seq=seq, step=4 + seq, ended=False)
            frames.append(RecordedFrame(0.1 * seq, rank, encode(step)))
    header = RecordingHeader(started=NOW, run=text, source=text, note=text)
    return Recording(header, frames)


def shown(text: str) -> str:
    """What of ``text`` must be on the screen: itself, control characters made visible (those
    Rich drops, such as BEL, may be dropped), and of a very long one its start: the rest wraps,
    and a message that echoes a value cuts it to 40 characters (``memtui.core.stats.shown``)."""
    return clean(strip_control_codes(text))[:30]


def check_screen(pilot: Pilot[Any], text: str, where: str, modal: bool = False) -> str:
    """The app is alive and counts no viewer error, and the screen (``modal``: the modal on top
    alone, not what shows under it) shows ``text`` as written: no control character, link or
    action made of it. Returns the screen's text."""
    app = pilot.app
    assert isinstance(app, MemtuiApp)
    assert app.is_running and app._exception is None, where
    assert app.state.viewer_errors == 0, f"{where}: {app.state.last_viewer_error}"
    update = app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    assert isinstance(update, LayoutUpdate)
    rows = [Strip.join(line) for line in update.strips]
    for row in rows:
        for segment in row:
            bad = [c for c in segment.text if ord(c) < 32 or 0x7F <= ord(c) < 0xA0]
            assert not bad, f"{where}: control characters reach the terminal: {bad!r}"
            style = segment.style
            if style is not None:
                assert not style.link, f"{where}: a link made of text: {style.link}"
                assert "app.quit" not in str(style.meta), f"{where}: an action made of text"
    screen = screen_of(app, rows, modal)
    assert flat(shown(text)) in flat(screen), f"{where}: {shown(text)!r} not shown\n{screen}"
    return flat(screen)


def screen_of(app: App[Any], rows: list[Strip] | None = None, modal: bool = False) -> str:
    """The text of the screen (``modal``: of the modal on top alone)."""
    if rows is None:
        update = app.screen._compositor.render_update(
            full=True, screen_stack=app._background_screens
        )
        assert isinstance(update, LayoutUpdate)
        rows = [Strip.join(line) for line in update.strips]
    region = app.screen.query_one("#dialog").region if modal else app.screen.region
    lines = rows[region.y : region.bottom]
    return "\n".join(row.crop(region.x, region.right).text for row in lines)


async def until_shown(pilot: Pilot[Any], text: str, where: str, modal: bool = False) -> None:
    """Let the app run until ``text`` is drawn (``check_screen`` then says how it is drawn);
    after the deadline, ``check_screen`` fails with what the screen shows instead."""

    def drawn() -> bool:
        try:
            return flat(shown(text)) in flat(screen_of(pilot.app, modal=modal))
        except NoMatches:  # the modal not composed yet: not drawn
            return False

    deadline = time.monotonic() + patience(10)
    while not drawn() and time.monotonic() < deadline:
        await pilot.pause(0.02)
    check_screen(pilot, text, where, modal=modal)


def flat(text: str) -> str:
    """``text`` with its line breaks, runs of spaces and the borders (box drawing and block
    characters) as one space."""
    return " ".join(re.sub("[\u2500-\u259f]", " ", text).split())


def test_the_fakes_fill_every_string_field() -> None:
    """Every string of the snapshot and the batch is the hostile text (no field left empty)."""
    for cls in (Snapshot, Telemetry):
        found = strings(hostile(cls, "HOSTILE"))
        assert found and set(found) <= {"HOSTILE", *KNOB_KEYS}
        assert len(found) > 30


SLOW_HOSTILE = {"[/", "[/]", "[bold]", "[/x]", "[link=file:///etc]x[/link]"}
"""Markup forms of the same kinds as "[@click=app.quit]x[/]" (a tag that would be swallowed and
one that closes nothing): under ``-m slow``; the default suite types every form into an
editor and the palette and has the run say them everywhere (the test below), checks every widget's construction
(the last test), and shows the action tag, the escapes, the control bytes, the bidi text and
the long line through every widget and screen here."""


@pytest.mark.parametrize(
    "text",
    [pytest.param(t, marks=pytest.mark.slow) if t in SLOW_HOSTILE else t for t in HOSTILE],
    ids=lambda t: repr(t[:20]),
)
def test_every_widget_and_screen_shows_hostile_text_as_text(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.yaml"  # a file's contents: an unknown key and a bad value
    config.write_text(yaml.safe_dump({"verdict": {text: text, "hysteresis": text}}))
    monkeypatch.setenv("MEMTUI_CONFIG", str(config))
    app = MemtuiApp(ReplaySource(hostile_run(text), speed=None))

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        assert app.state.info is not None and app.state.info.host == text
        check_screen(pilot, text, "main screen, wide")

        # the modal screens that show the run's strings (and the config file's)
        screens: list[tuple[str, Any]] = [
            ("help", HelpScreen(False, app.state.thresholds)),
            ("cancel", CancelScreen(app.state.control.pending if app.state.control else [])),
            ("advice", AdviceScreen(app._recommendations())),
        ]
        gpu = GpuInfo(0, text, text, 1 << 34, 1 << 33, 1 << 33, 50.0,
                      [GpuProcessInfo(4242, 1 << 30, text, text)])  # fmt: skip
        screens.append(("gpus", GpusScreen(reader=lambda: [gpu])))
        app.clear_notifications()  # the config file's problems, told on mount: not over these
        for name, screen in screens:
            await app.push_screen(screen)
            await until(pilot, lambda s=screen: app.screen is s and s.is_mounted, 10, name)
            await pilot.pause()
            if name == "help":  # the file's problems are at its end
                screen.query_one("#dialog").scroll_end(animate=False)
                await pilot.pause()
            if name == "gpus":
                await until(pilot, lambda s=screen: "pid 4242" in s.body_text, 10, "the table")
            if name != "advice":  # advice titles are the code's words
                await until_shown(pilot, text, f"the {name} screen", modal=True)
            else:
                await pilot.pause()
                check_screen(pilot, "", "the advice screen", modal=True)
            await pilot.press("escape")
            await until(pilot, lambda: len(app.screen_stack) == 1, 10, f"{name} closed")

        # the notification paths: a request's outcome or the run's word, a viewer error
        app.inbox.put(ReceivedBatch([Notice(False, f"rejected: {text}")], app.state.clock))
        app._post_update()
        await until_shown(pilot, text, "a notice")
        app.clear_notifications()
        app.state.note_viewer_error(text, ValueError(text))
        await until(pilot, lambda: app.state.viewer_errors > 0, 10, "the viewer error counted")
        app.state.viewer_errors = 0  # counted on purpose
        await until_shown(pilot, text, "a viewer error")

        # and the main screen laid out narrow, last (one layout less than going back to wide)
        app.clear_notifications()
        await pilot.resize_terminal(*NARROW)
        await settle(pilot)
        check_screen(pilot, text, "main screen, narrow")

    async def main() -> None:
        async with app.run_test(size=WIDE, notifications=True) as pilot:
            await check(pilot)

    asyncio.run(main())
    assert app.return_code in (None, 0)


MARKUP = "[/x] [/] [bold] [link=file:///etc]x[/link] [@click=app.quit]x[/] [/"
"""Every markup-looking form in one string: what the live stand-in says everywhere."""
TUNABLE = ["batch_size", "grad_accum", "num_workers", "pin_memory"]


class HostileRun:
    """A run as the viewer sees one (a PUB and a ROUTER socket, registered as a hook registers
    them) whose every string is ``text``: its snapshot and batches (two ranks, the second with
    ``text`` for endpoints), a set answered with ``text`` as the reason, then with an error
    reply, and a cancel refused for ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.run = registry.new_run_id("hostile")
        self.rundir = registry.run_dir(self.run)
        self.requests: list[object] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        text = self.text
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.rundir.pub_endpoint(0))
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.rundir.control_endpoint(0))
        rank0 = RankInfo(rank=0, pub=self.rundir.pub_endpoint(0),
                         control=self.rundir.control_endpoint(0), pid=os.getpid())  # fmt: skip
        rank1 = msgspec.structs.replace(hostile(RankInfo, text), rank=1)
        pid = os.getpid()
        self.rundir.write(RunRecord(run=self.run, pid=pid,
                                    create_time=registry.process_create_time(pid),
                                    started=NOW, host=socket.gethostname(),
                                    control=self.rundir.control_endpoint(0), ranks=[rank0],
                                    command=[text], world_size=2))  # fmt: skip
        snapshot: Snapshot = hostile(Snapshot, text)
        control = msgspec.structs.replace(snapshot.control, tunable=[*TUNABLE, text])
        snapshot = msgspec.structs.replace(snapshot, control=control, ranks=[rank0, rank1])
        batch = msgspec.structs.replace(hostile(Telemetry, text), control=None)
        decoder = Decoder()
        seq = 0
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                if router.poll(20):
                    frames = router.recv_multipart()
                    request = decoder.decode(frames[-1])
                    self.requests.append(request)
                    reply: Any = ErrorReply(reason=text)
                    if isinstance(request, Hello):
                        reply = msgspec.structs.replace(snapshot, seq=seq)
                    elif isinstance(request, SetRequest):
                        sets = sum(isinstance(r, SetRequest) for r in self.requests)
                        reply = SetReply(ok=False, reason=text) if sets == 1 else reply
                    elif isinstance(request, CancelRequest):
                        reply = CancelReply(ok=False, reason=text)
                    router.send_multipart([*frames[:-1], encode(reply)])
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + 1.0
                    seq += 1
                    for rank in (0, 1):
                        beat = msgspec.structs.replace(
                            batch, rank=rank, seq=seq, time=time.time(), step=4 + seq
                        )
                        pub.send(encode(beat))
        finally:
            pub.close(0)
            router.close(0)
            context.term()
            self.rundir.remove()

    def __enter__(self) -> HostileRun:
        self.rundir.create()
        self._thread.start()
        wait_for(lambda: self.rundir.record_path.exists(), 5, what="the stand-in's record")
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(patience(5))


async def type_text(pilot: Pilot[Any], field: Input, text: str) -> None:
    """Type ``text`` into ``field`` anew: key by key when short (each key is a wait on a busy
    app), else pasted (the same change event: the same checks and preview)."""
    field.value = ""
    await pilot.pause()
    if len(text) <= 4:
        await pilot.press(*text)
    else:
        field.insert_text_at_cursor(text)
    await pilot.pause()
    assert field.value == text


async def close_modals(pilot: Pilot[Any]) -> None:
    """Escape back to the main screen."""
    while len(pilot.app.screen_stack) > 1:
        await pilot.press("escape")
        await pilot.pause()


def test_markup_typed_into_every_input_and_said_by_the_run_is_text() -> None:
    """The operator types each markup form into an editor (b; one form into a, w and p) and the
    command palette, queues a change the run refuses for a reason in markup, then one it answers with an
    error, and cancels a change it refuses to cancel: every word is shown as typed or sent, the
    viewer lives on, and no action is taken from text (``[@click=app.quit]`` is not a quit)."""
    forms = [form for form in MARKUP.split(" ") if form]
    with HostileRun(MARKUP) as run:
        app = MemtuiApp(LiveSource(run.run))

        async def check(pilot: Pilot[Any]) -> None:
            state = app.state
            await until(pilot, lambda: state.control is not None and state.step > 4, 20, "the run")
            await until(pilot, lambda: 1 in state.series, 10, "its second rank")
            app.refresh_view()
            await pilot.pause()
            check_screen(pilot, MARKUP, "the main screen")

            # every form in one editor, one that closes nothing in the others (the same screen
            # class: each key by key, the key presses being most of this test's CPU)
            for key in "bawp":
                await pilot.press(key)
                assert isinstance(app.screen, EditKnobScreen), key
                field = app.screen.query_one(Input)
                for form in forms if key == "b" else ["[/x]"]:
                    await type_text(pilot, field, form)
                    shown = check_screen(pilot, form, f"{form!r} typed for {key}", modal=True)
                    assert f"got {form!r}" in shown, shown  # the editor quotes it
                    await pilot.press("enter")  # not a value: nothing is sent
                    assert isinstance(app.screen, EditKnobScreen)
                await close_modals(pilot)
            assert not [r for r in run.requests if isinstance(r, SetRequest)]

            await pilot.press("ctrl+p")
            await until(pilot, lambda: isinstance(app.screen, CommandPalette), 5, "the palette")
            for form in forms:
                await type_text(pilot, app.screen.query_one(Input), form)
                await until_shown(pilot, form, f"{form!r} typed in the palette")
            await close_modals(pilot)

            async def queue(value: str) -> None:
                await pilot.press("b", *value, "enter")
                if isinstance(app.screen, EditKnobScreen):  # over the danger band: confirm
                    await pilot.press("enter")
                assert not isinstance(app.screen, EditKnobScreen)

            # a change the run refuses, for a reason in markup
            await queue("64")
            await until(pilot, lambda: len(state.notices) >= 1, 10, "the refusal")
            assert MARKUP in state.notices[-1].text
            await until_shown(pilot, MARKUP, "a refused change")
            app.clear_notifications()  # so that the next notice is the one seen
            # the next one answered with an error reply
            await queue("32")
            await until(pilot, lambda: len(state.notices) >= 2, 10, "the error")
            assert MARKUP in state.notices[-1].text
            await until_shown(pilot, MARKUP, "an error reply")
            app.clear_notifications()
            # a cancel the run refuses
            await pilot.press("c")
            assert isinstance(app.screen, CancelScreen)
            check_screen(pilot, MARKUP, "the cancel screen", modal=True)
            await pilot.press("enter")
            await until(pilot, lambda: len(state.notices) >= 3, 10, "the refused cancel")
            await until_shown(pilot, MARKUP, "a refused cancel")
            assert state.connection.status is Status.LIVE

        async def main() -> None:
            async with app.run_test(size=WIDE, notifications=True) as pilot:
                await check(pilot)

        asyncio.run(main())
    assert app.return_code in (None, 0)


def test_no_text_of_the_viewer_is_parsed_as_markup_unless_written_in_the_code() -> None:
    """Every notification is sent with ``markup=False`` (``MemtuiApp.say``), and every Static,
    Label or Option made of anything but a literal gets a Text (``as_text``) or ``markup=False``:
    a later change cannot bring markup parsing back for text from outside."""
    problems = []
    for path in sorted((ROOT / "memtui" / "tui").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else ""
            name = node.func.id if isinstance(node.func, ast.Name) else name
            plain = any(
                k.arg == "markup" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in node.keywords
            )
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name == "notify" and node.args and not plain:  # (the receiver's has none)
                problems.append(f"{where}: notify without markup=False")
            if name in ("Static", "Label", "Option") and node.args and not plain:
                first = node.args[0]
                literal = isinstance(first, ast.Constant)
                made = isinstance(first, ast.Call) and getattr(first.func, "id", "") in (
                    "as_text",
                    "Text",
                )
                if not (literal or made):
                    problems.append(f"{where}: {name} of a string that may be parsed as markup")
    assert not problems, "\n".join(problems)
