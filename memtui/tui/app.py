"""The viewer app: bindings, screens, the receiver worker and the bounded refresh.

Data flow: the receiver (one thread worker, the only owner of sockets) puts batches in an inbox
and posts a ``ReceiverUpdate``; the handler folds every waiting batch into the RunState (cheap,
no drawing); a timer at ``refresh_hz`` (4 Hz) repaints the widgets whose content changed, the
charts and the summaries (per-rank numbers, verdict) every ``chart_every`` ticks (2 Hz; above
``MANY_RANKS`` ranks the rest at 2 Hz, these at 1 Hz), all under ``batch_update``. So the
screen is redrawn at most 4 times a second however fast the run steps (and however many ranks
it has), and not at all while nothing changes.
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
from collections.abc import Iterable
from typing import Any, ClassVar

from textual import constants, events, work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.driver import Driver
from textual.drivers.linux_driver import LinuxDriver
from textual.notifications import SeverityLevel
from textual.reactive import var
from textual.screen import Screen
from textual.worker import get_current_worker

from memtui.advice.recommend import Recommendation
from memtui.core.knobs import KNOBS, next_lr_scale
from memtui.runs.events import MANY_RANKS, RUN, Notice
from memtui.runs.receiver import DEFAULT_TIMINGS, Inbox, Receiver, ReceiverTimings
from memtui.runs.state import RunState, ViewOptions
from memtui.runs.text import clean
from memtui.storage import registry
from memtui.storage.userconfig import load_thresholds
from memtui.transport.sources import LiveSource, ReplaySource, Source, SourceUnavailable
from memtui.tui.compat import SIGNALLED, TerminalDriver, stop_signal
from memtui.tui.messages import ReceiverUpdate
from memtui.tui.screens.advice import AdviceScreen
from memtui.tui.screens.cancel import CancelScreen
from memtui.tui.screens.edit import EditKnobScreen, EditResult
from memtui.tui.screens.help import HelpScreen
from memtui.tui.screens.main import MainScreen
from memtui.tui.widgets.advice import top_applicable
from memtui.wire import AutotuneRequest, CancelRequest, KnobValue, SetRequest

EDIT_GROUP = Binding.Group("set knob")
"""b, a, w and p share one label in the footer (the config panel shows which is which)."""
EDIT_ACTIONS = frozenset(
    {
        "edit",
        "toggle_keep",
        "cancel_change",
        "apply_recommendation",
        "pick_recommendation",
        "toggle_autotune",
    }
)
"""Actions that change the run: disabled (and hidden) in a read-only view."""
NOTICE_LIMIT = 500
"""The most characters a notification shows (a run's reason may be any length)."""


class MemtuiApp(App[int]):
    """Starvation against OOM risk for one training run, and changes queued for its checkpoint."""

    CSS_PATH = "memtui.tcss"
    TITLE = "memtui"
    # the main screen's keys are priority bindings, run when the app takes the key from the
    # terminal, in the order typed: a key typed while the editor opens goes to the editor (a
    # plain binding runs only when the key comes back from the main screen, by when the keys
    # typed after it have been sent there too and are lost); check_action keeps them off
    # while another screen is on top
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("b", "edit('batch_size')", "batch size", group=EDIT_GROUP, priority=True),
        Binding("a", "edit('grad_accum')", "grad accum", group=EDIT_GROUP, priority=True),
        Binding("w", "edit('num_workers')", "workers", group=EDIT_GROUP, priority=True),
        Binding("p", "edit('pin_memory')", "pin memory", group=EDIT_GROUP, priority=True),
        # left out of the footer (a 60-column pane has no room): the help and the config panel name it
        Binding("P", "edit('prefetch_factor')", "prefetch", show=False, priority=True),
        Binding("k", "toggle_keep", "keep", priority=True),
        Binding("l", "cycle_lr_scale", "lr rule", show=False, priority=True),
        Binding("c", "cancel_change", "cancel", priority=True),
        # in the footer where it fits (``ROOMY_FOOTER`` columns), else in the help
        Binding("A", "toggle_autotune", "autopilot", priority=True),
        Binding("o", "apply_recommendation", "queue advice", priority=True),
        Binding("O", "pick_recommendation", "pick advice", show=False, priority=True),
        Binding("g", "gpus", "GPUs", priority=True),
        Binding("space", "toggle_pause", "pause", key_display="␣", priority=True),
        Binding("question_mark", "help", "help", key_display="?", priority=True),
        Binding("q", "leave", "quit", priority=True),
        # as in htop, nvitop and k9s (Textual's own ctrl+c only says "press ctrl+q"); from the
        # editor and its input too
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("r", "reconnect", "reconnect", show=False, priority=True),
        Binding("f", "follow", "follow new run", priority=True),  # shown while a run is offered
        Binding("plus,equals_sign", "replay_speed(2.0)", "faster", key_display="+", priority=True),
        Binding("minus", "replay_speed(0.5)", "slower", key_display="-", priority=True),
    ]

    paused: var[bool] = var(False, init=False)
    """The view is frozen; data is still received and folded, and shows on resume."""
    keep_effective_batch: var[bool] = var(False, init=False)
    """A batch_size change also sets grad_accum so that micro x accum stays the same."""
    lr_scale: var[str] = var("", init=False)
    """How the LR follows an edit that moves the effective batch ('': the run's own rule)."""

    def __init__(
        self,
        source: Source,
        *,
        readonly: bool = False,
        demo_process: subprocess.Popen[Any] | None = None,
        refresh_hz: float = 4.0,
        chart_every: int = 2,
        receiver_timings: ReceiverTimings = DEFAULT_TIMINGS,
        replay_controls: bool = False,
    ) -> None:
        super().__init__()
        self.replay_controls = replay_controls
        """``memtui replay``: + and - change the replay's speed, space stops its clock."""
        self.readonly = readonly
        """Show everything, send nothing."""
        self.demo_process = demo_process
        """The demo training this viewer was started with (``memtui demo``), if any."""
        self.refresh_hz = refresh_hz
        self.chart_every = max(1, chart_every)
        self.state = RunState(hold_summary=True, thresholds=load_thresholds())
        """What the viewer knows about the run (folded from the receiver's batches); its
        summaries are made anew by ``refresh_view``."""
        self.inbox = Inbox()
        self.receiver = Receiver(
            source,
            self.inbox,
            self._post_update,
            readonly=readonly,
            timings=receiver_timings,
        )
        self.batches_folded = 0
        """Receiver batches folded into the state."""
        self.repaints = 0
        """Widget repaints made by the refresh timer."""
        self._ticks = 0
        self._demo_reported = False
        self._error_told = ""
        self._offered = ""

    # ------------------------------------------------------------------ lifecycle

    def get_driver_class(self) -> type[Driver]:
        """The terminal's own driver on Linux and macOS (``TerminalDriver``), else Textual's (or
        the one ``TEXTUAL_DRIVER`` names)."""
        driver = super().get_driver_class()
        return TerminalDriver if driver is LinuxDriver and constants.DRIVER is None else driver

    def get_default_screen(self) -> Screen[Any]:
        """The main screen."""
        return MainScreen()

    @property
    def main(self) -> MainScreen:
        """The main screen (also while a modal is on top)."""
        screen = self.screen_stack[0]
        assert isinstance(screen, MainScreen)
        return screen

    @property
    def view(self) -> ViewOptions:
        """The viewer's switches, as the widgets show them."""
        source = self.receiver.source
        speed = source.speed if self.replay_controls and isinstance(source, ReplaySource) else None
        return ViewOptions(
            self.paused, self.readonly, self.keep_effective_batch, self.lr_scale, speed
        )

    def on_mount(self) -> None:
        """Start the receiver and the refresh timer."""
        self._receive()
        for problem in self.state.thresholds.problems:  # the config file: say what was ignored
            self.say(problem, severity="warning", timeout=10)
        self.set_interval(1 / self.refresh_hz, self._tick, name="refresh")
        self.call_after_refresh(self.refresh_view)

    @work(thread=True, exclusive=True, name="receiver", exit_on_error=False)
    def _receive(self) -> None:
        """The receiver's thread: runs until the app exits (the worker is cancelled)."""
        self.receiver.run(get_current_worker().cancelled_event)

    def on_unmount(self) -> None:
        """Stop the receiver (also when the app leaves on an error)."""
        self.receiver.stop()

    def _post_update(self) -> None:
        """Called by the receiver's thread once per batch."""
        self.post_message(ReceiverUpdate())

    def on_receiver_update(self, message: ReceiverUpdate) -> None:
        """Fold every waiting batch into the state; drawing waits for the timer."""
        for batch in self.inbox.drain():
            try:
                self.state.apply(batch)
            except Exception as error:  # the last line of defence: count it, show it, go on
                self.state.note_viewer_error("folding a batch", error)
            self.batches_folded += 1
            for event in batch.events:
                if isinstance(event, Notice):
                    self.say(event.text, severity="information" if event.ok else "error")
        if self.screen_stack and isinstance(self.screen, CancelScreen):  # it lists the pending
            told = self.screen.follow(self.state.control)
            if told:  # it closed: nothing left to cancel
                self.say(told, severity="warning", timeout=8)
        if self.state.offer.run != self._offered:  # the follow key shows only with an offer
            self._offered = self.state.offer.run
            self.refresh_bindings()
        info = self.state.info
        if info is not None and info.readonly and not self.readonly:
            # attached over plain TCP without the run's control opt-in: nothing can be sent
            self.readonly = self.receiver.readonly = True
            self.refresh_bindings()

    def _tick(self) -> None:
        self._ticks += 1
        self._check_demo()
        self._tell_error()
        if not self.paused:
            charts = self._ticks % self.chart_every == 0
            if len(self.state.series) > MANY_RANKS:  # pace: the rest at 2 Hz, these at 1 Hz
                if not charts:
                    return
                charts = self._ticks % (2 * self.chart_every) == 0
            self.refresh_view(charts=charts)

    def refresh_view(self, charts: bool = True) -> None:
        """Repaint what changed (the charts, and the summaries behind the numbers, made anew,
        too when ``charts``), in one batch."""
        if not self.screen_stack:  # the app is closing: a late tick finds no screen
            return
        try:
            if charts:
                # every record of the rank the charts show is decoded (others' may be sampled)
                self.receiver.decoder.favoured = self.state.refresh_summary().focus_rank
            with self.batch_update():
                self.repaints += self.main.update_view(self.state, self.view, charts)
        except Exception as error:  # the last line of defence: count it, show it, go on
            self.state.note_viewer_error("drawing", error)

    def say(
        self, message: str, *, severity: SeverityLevel = "information", timeout: float | None = None
    ) -> None:
        """Notify the operator of ``message`` as text (never markup, control characters shown)."""
        self.notify(clean(message, NOTICE_LIMIT), severity=severity, timeout=timeout, markup=False)

    def _tell_error(self) -> None:
        """Say once what went wrong when the viewer survives a new kind of error."""
        error = self.state.last_viewer_error
        if error and error != self._error_told:
            self._error_told = error
            self.say(f"viewer error (survived): {error}", severity="error", timeout=10)

    @property
    def caught_up(self) -> bool:
        """A finished source (the end of a replay) has been received and folded entirely."""
        return (
            self.receiver.caught_up.is_set()
            and self.batches_folded >= self.receiver.counts.batches_posted
        )

    def _check_demo(self) -> None:
        if self.demo_process is None or self._demo_reported:
            return
        code = self.demo_process.poll()
        if code is not None:
            self._demo_reported = True
            self.state.add_notice(
                Notice(code == 0, f"the demo training exited with status {code}", who=RUN)
            )

    # ------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Hide and disable the actions that change the run in a read-only view; the main
        screen's keys wait (None: shown, not run) while another screen is on top."""
        if action in main_screen_actions() and self.screen_stack and self.screen is not self.main:
            return None  # the key goes to the screen on top (an editor's input, a list)
        if action == "replay_speed":
            return self.replay_controls and isinstance(self.receiver.source, ReplaySource)
        if action == "follow":
            return bool(self.state.offer.run)
        return not (self.readonly and action in EDIT_ACTIONS)

    def on_key(self, event: events.Key) -> None:
        """A key that changes the run, pressed in a read-only view: say why it does nothing."""
        if not self.readonly or not self.screen_stack or self.screen is not self.main:
            return
        for binding in self.BINDINGS:
            if not isinstance(binding, Binding) or event.key not in binding.key.split(","):
                continue
            if binding.action.split("(")[0] in EDIT_ACTIONS:
                key = binding.key_display or binding.key
                self.say(
                    f"read-only: {key} ({binding.description}) sends nothing: {self.readonly_why}",
                    severity="warning",
                    timeout=4,
                )

    @property
    def readonly_why(self) -> str:
        """Why this view sends no changes, in words."""
        if isinstance(self.receiver.source, ReplaySource):
            return "a replay shows a recording"
        info = self.state.info
        if info is not None and info.readonly:
            return "the run takes no changes over plain TCP (started without --insecure-control)"
        return "the viewer was started with --readonly"

    def action_edit(self, knob: str) -> None:
        """Open the editor for ``knob``; a valid value is sent as a change."""
        control = self.state.control
        if control is None:
            self.say("the run's config is not known yet", severity="warning")
            return
        if knob not in control.tunable:
            why = control.untunable.get(knob)
            self.say(
                f"{knob} is not tunable in this run" + (f": {why}" if why else ""),
                severity="warning",
            )
            return

        def send(result: EditResult | None) -> None:
            if result is None:
                return
            keep = self.keep_effective_batch and knob == "batch_size"
            changes: dict[str, KnobValue | str] = {knob: result.value}
            self.receiver.submit(
                SetRequest(
                    changes=changes,
                    keep_effective_batch=keep,
                    lr_scale=self.lr_scale,
                    client=self.receiver.client,
                    force=result.force,
                )
            )

        self.push_screen(EditKnobScreen(knob, self.state, self.keep_effective_batch), send)

    def _recommendations(self) -> list[Recommendation]:
        advice = self.state.summary().advice
        return advice.recommendations if advice is not None else []

    def queue_recommendation(self, option: Recommendation | None) -> None:
        """Send a recommendation's changes as one queued change (those it cannot apply: refused)."""
        if option is None:
            return
        if not option.applicable:
            self.say(f"{option.title}: memtui cannot apply this one", severity="warning")
            return
        self.receiver.submit(SetRequest(changes=dict(option.changes), client=self.receiver.client))

    def action_apply_recommendation(self) -> None:
        """Queue the top recommendation that memtui can apply."""
        top = top_applicable(self._recommendations())
        if top is None:
            self.say(
                "no recommendation memtui can apply now (or it is pending)", severity="warning"
            )
            return
        self.queue_recommendation(top)

    def action_pick_recommendation(self) -> None:
        """Pick a recommendation to queue."""
        options = self._recommendations()
        if not options:
            self.say("nothing to recommend now", severity="warning")
            return
        self.push_screen(AdviceScreen(options), self.queue_recommendation)

    def action_toggle_keep(self) -> None:
        """Toggle keep-effective-batch for the next batch_size change."""
        self.keep_effective_batch = not self.keep_effective_batch

    def action_cycle_lr_scale(self) -> None:
        """Choose how the LR follows the next edit that moves the effective batch."""
        self.lr_scale = next_lr_scale(self.lr_scale)

    def action_cancel_change(self) -> None:
        """Pick a pending change to cancel."""
        pending = self.state.control.pending if self.state.control else []
        if not pending:
            self.say(nothing_to_cancel(self.state), severity="warning", timeout=8)
            return

        def cancel(change_id: int | None) -> None:
            if change_id is not None:
                self.receiver.submit(CancelRequest(id=change_id, client=self.receiver.client))

        self.push_screen(CancelScreen(pending), cancel)

    def action_toggle_autotune(self) -> None:
        """Turn the run's autopilot on, or off when it is on or paused."""
        control = self.state.control
        pilot = control.autopilot if control is not None else None
        on = pilot is None or pilot.mode == "off"
        self.receiver.submit(AutotuneRequest(on=on, client=self.receiver.client))

    def action_toggle_pause(self) -> None:
        """Freeze or unfreeze the view (and a replay's clock)."""
        self.paused = not self.paused
        source = self.receiver.source
        if self.replay_controls and isinstance(source, ReplaySource):
            source.pause(self.paused)

    def action_replay_speed(self, factor: float) -> None:
        """Replay faster or slower (between 1/16 and 256 times real time)."""
        source = self.receiver.source
        if not (self.replay_controls and isinstance(source, ReplaySource)):
            return
        speed = min(256.0, max(1 / 16, (source.speed or 1.0) * factor))
        source.set_speed(speed)
        self.say(f"replay at {speed:g}x", timeout=2)

    def action_help(self) -> None:
        """Show the keys and the thresholds."""
        demo = self.demo_process is not None
        self.push_screen(HelpScreen(self.readonly, self.state.thresholds, demo))

    def action_gpus(self) -> None:
        """Show every GPU on this host and the processes holding memory (read off-thread)."""
        from memtui.tui.screens.gpus import GpusScreen

        self.push_screen(GpusScreen())

    def action_follow(self) -> None:
        """Follow the run offered (the header names it) now that the one shown is lost."""
        run = self.state.offer.run
        if run:
            self.receiver.follow(run)
            self.say(f"following {run}", timeout=3)

    def action_reconnect(self) -> None:
        """Drop the connection and look for the run again."""
        self.receiver.reconnect()

    async def action_quit(self) -> None:
        """Leave the viewer (the run goes on)."""
        self.exit(0)

    async def action_leave(self) -> None:
        """q on the main screen: leave the viewer (ctrl+c and ctrl+q quit from any screen)."""
        await self.action_quit()

    def watch_paused(self) -> None:
        """Show the pause (or resume) at once."""
        self.refresh_view()

    def watch_keep_effective_batch(self) -> None:
        """Show the switch at once."""
        self.refresh_view(charts=False)

    def watch_lr_scale(self) -> None:
        """Show the LR rule at once."""
        self.refresh_view(charts=False)

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        """The viewer's actions in the command palette."""
        yield from super().get_system_commands(screen)
        if not self.readonly:
            for knob in KNOBS:
                yield SystemCommand(
                    f"Set {knob}",
                    "Queue a new value for the next checkpoint",
                    lambda knob=knob: self.action_edit(knob),
                )
            yield SystemCommand(
                "Toggle keep-effective-batch",
                "A batch_size change recomputes grad_accum",
                self.action_toggle_keep,
            )
            yield SystemCommand(
                "Cancel a pending change", "Unqueue a change", self.action_cancel_change
            )
            yield SystemCommand(
                "Queue the top recommendation",
                "The best option memtui can apply, for the next checkpoint",
                self.action_apply_recommendation,
            )
            yield SystemCommand(
                "Pick a recommendation", "Every ranked option", self.action_pick_recommendation
            )
        yield SystemCommand(
            "Pause or resume the view", "Freeze the display", self.action_toggle_pause
        )
        yield SystemCommand("Reconnect", "Look for the run again now", self.action_reconnect)
        yield SystemCommand("Help: keys and thresholds", "What every key does", self.action_help)


@functools.cache
def main_screen_actions() -> frozenset[str]:
    """The actions of the app's own keys but ctrl+c's: for the main screen only."""
    return frozenset(
        binding.action.split("(")[0]
        for binding in MemtuiApp.BINDINGS
        if isinstance(binding, Binding) and binding.action != "quit"
    )


def run_app(
    selector: str | None,
    *,
    readonly: bool = False,
    demo_process: subprocess.Popen[Any] | None = None,
    wait: bool = False,
) -> int:
    """Attach the viewer to a live run (id, prefix, pid or endpoint; None: the newest).

    Fails at once (status 1) when no live run matches, unless ``wait``: then the viewer opens
    and waits for one; once attached, it stays on that run and waits for it whenever it is lost.
    Stopped by SIGTERM or SIGHUP, it gives the terminal back and raises ``SystemExit`` (128 + the
    signal's number), so that ``memtui demo`` stops its training too.
    """
    if not wait and (not selector or "://" not in selector):
        try:
            target = registry.find_run(selector)
        except registry.RunNotFound as exc:
            print(f"memtui: {exc}; --wait waits for one", file=sys.stderr)
            return 1
        except registry.RegistryError as exc:
            print(f"memtui: {exc}", file=sys.stderr)
            return 1
        if target.note:
            print(f"memtui: {target.note}", file=sys.stderr)
    app = MemtuiApp(LiveSource(selector), readonly=readonly, demo_process=demo_process)
    # the viewer allocates many short-lived objects (64 ranks: 64,000 step records a second);
    # collecting young objects less often keeps the collector from scanning Textual's widget
    # graph hundreds of times a second (cycles are still collected)
    gc.set_threshold(20_000, 20, 20)
    result = app.run()
    farewell = left_at(app.state)
    if farewell:
        print(f"memtui: {farewell}", file=sys.stderr, flush=True)
    left_on_signal(app)
    if isinstance(result, int):
        return result
    return app.return_code or 0


def left_on_signal(app: MemtuiApp) -> None:
    """Raise ``SystemExit`` (128 + the signal's number) when a stop signal closed ``app``."""
    signum = stop_signal(app.return_code)
    if signum:
        raise SystemExit(SIGNALLED + signum)


def nothing_to_cancel(state: RunState) -> str:
    """Why ``c`` finds nothing to cancel: no change is pending, and where this viewer's last
    change already landed, when, how often the run reaches a checkpoint, and how to undo it."""
    control = state.control
    mine = [
        a
        for a in (control.applied if control is not None else [])
        if not a.rollback and state.who_queued(a.ids) == "you"
    ]
    if not mine:
        return "no change is pending"
    last = mine[-1]
    ids = " ".join(f"#{i}" for i in last.ids)
    times = [c.time for c in state.checkpoints][-6:]
    every = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    pace = f" (a checkpoint comes every {every:.1f} s here)" if every else ""
    return (
        f"no change is pending: your {ids} landed at step {last.step:,}{pace}; to undo it, queue "
        "the old value again"
    )


def left_at(state: RunState) -> str:
    """What the viewer leaves on the terminal: the run, its last step and its tuned config."""
    info = state.info
    if info is None:
        return ""
    words = f"run {info.run}, last step {state.step:,}"
    applied = state.control.applied if state.control is not None else []
    if info.tuned_path and applied:
        words += f"; the tuned config: {info.tuned_path}"
    elif info.tuned_path:
        words += f"; no change applied (a tuned config would go to {info.tuned_path})"
    return clean(words, NOTICE_LIMIT)


def run_replay(path: str, *, speed: float = 1.0) -> int:
    """Show a recording (.mtrec) in a read-only viewer: space pauses, + and - change speed."""
    try:
        source = ReplaySource(path, speed=speed)
    except (OSError, ValueError, SourceUnavailable) as exc:
        print(f"memtui: cannot replay {path}: {exc}", file=sys.stderr)
        return 1
    note = source.recording.cut_note
    if note:
        print(f"memtui replay: {note}", file=sys.stderr)
    app = MemtuiApp(source, readonly=True, replay_controls=True)
    gc.set_threshold(20_000, 20, 20)
    result = app.run()
    if note:  # said again: the viewer's screen covered the first one
        print(f"memtui replay: {note}", file=sys.stderr)
    left_on_signal(app)
    if isinstance(result, int):
        return result
    return app.return_code or 0
