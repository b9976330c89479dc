"""The header: which run, where, how far and how fast, and the state of the connection."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from rich.console import RenderableType

from memtui.core.stats import format_duration
from memtui.runs.events import Status
from memtui.runs.state import RunState, ViewOptions
from memtui.runs.throughput import samples_words, step_words
from memtui.tui.palette import STATUS_STYLES, chips, counted, rate
from memtui.tui.widgets.base import StateView


def devices(state: RunState) -> str:
    """The run's devices: the control rank's with one rank; with several, each device name the
    ranks report with how many (``8× NVIDIA H100 80GB HBM3``; ``2× cpu``)."""
    info = state.info
    named: Counter[str] = Counter()
    for series in state.series.values():
        if series.device:
            sample = series.device[-1]
            named[sample.name if sample.name and sample.name != "cpu" else sample.kind] += 1
    if len(state.series) <= 1 or not named:
        return info.device if info is not None else ""
    return ", ".join(f"{count}× {name}" for name, count in named.most_common())


class RunHeader(StateView):
    """Run id, host, device, ranks, step, elapsed, speed and the connection."""

    DEFAULT_CSS = "RunHeader { height: auto; }"

    def key(self, state: RunState, view: ViewOptions) -> Hashable:
        """Repaint when the step, the second, the speed or the connection changes."""
        elapsed = state.elapsed_s
        summary = state.summary()
        return (
            state.connection_version,
            state.step,
            int(elapsed) if elapsed is not None else None,
            summary.steps,
            summary.throughput,
            summary.silent,
            view,
        )

    def build(self, state: RunState, view: ViewOptions, width: int) -> RenderableType:
        """Two lines (more when narrow: the chips wrap)."""
        info = state.info
        connection = state.connection
        label = connection.label or (info.run if info else "")
        identity: list[tuple[str, str]] = [] if self.narrow else [("memtui", "bold")]
        if info is not None:
            ranks = state.world_size
            identity += [
                (info.run, "bold cyan"),
                (info.host, ""),
                (devices(state), ""),
                (f"{ranks} rank" + ("s" if ranks != 1 else ""), ""),
            ]
            if info.security.startswith("plain-tcp"):  # any local user can read it: say so
                identity.append(("INSECURE", "bold white on red3"))
        else:
            identity.append((label or "no run yet", "bold cyan"))
        status = f"● {connection.status.value}"
        if view.replay_speed is not None:  # `memtui replay`: never "live"
            status = f"● replay {view.replay_speed:g}x"
            if connection.status is not Status.LIVE:
                status += f", {connection.status.value}"
        if connection.status is not Status.LIVE and connection.detail:
            status += f": {connection.detail}"
        identity.append((status, STATUS_STYLES[connection.status]))
        offer = state.offer
        if offer.run:  # the run is lost: another one may be followed, with a key
            where = f"pid {offer.pid}, {offer.cwd}" if offer.cwd else f"pid {offer.pid}"
            identity.append((f"f: follow {offer.run} ({where}; {offer.why})", "bold black on cyan"))
        silent = state.summary().silent
        if connection.status is Status.LIVE and silent and len(state.series) > 1:
            # live, but not every rank: say which part of the run is heard
            names = f"rank {silent[0]}" if len(silent) == 1 else f"{len(silent)} ranks"
            identity.append((f"{names} silent", "bold yellow"))
        if info is not None and label and label != info.run:
            identity.append((f"({label})", "dim"))  # a replay, or an endpoint

        summary = state.summary()
        progress: list[tuple[str, str]] = [(f"step {state.step:,}", "bold")]
        elapsed = state.elapsed_s
        if elapsed is not None:
            progress.append((f"elapsed {format_duration(elapsed)}", ""))
        steps = summary.steps
        if steps is not None:
            progress.append((f"{rate(steps.steps_per_s)} steps/s", ""))
            throughput = summary.throughput
            seen = steps.data_wait_measured  # else no batch was seen: the verdict says so
            if throughput is not None and (throughput.counted or seen):
                # the job's samples/s, as `memtui status` and the exporter give it; narrow, the
                # ranks it sums only where some are missing (the run's chip names its ranks)
                progress.append((samples_words(throughput, short=self.narrow), ""))
                step = step_words(throughput, short=True)
                if step and not self.narrow:
                    progress.append((step, "dim"))
        if state.lost_batches:
            progress.append((f"lost {state.lost_batches} batches", "yellow"))
        if state.reconnects:
            progress.append((counted(state.reconnects, "reconnect"), "yellow"))
        if state.bad_frames:
            progress.append((f"{state.bad_frames} bad frames", "bold red"))
        if state.bad_values:
            progress.append((counted(state.bad_values, "bad value"), "bold red"))
        if state.viewer_errors:
            progress.append((counted(state.viewer_errors, "viewer error"), "bold red"))
        if state.counters is not None and state.counters.errors:
            progress.append((f"hook errors {state.counters.errors}", "bold red"))
        if view.paused:
            progress.append(("PAUSED", "bold black on yellow"))
        if view.readonly:
            progress.append(("READ-ONLY", "bold black on grey70"))
        text = chips(identity, width=width)
        text.append("\n")
        text.append_text(chips(progress, width=width))
        return text
