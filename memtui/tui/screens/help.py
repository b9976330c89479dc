"""The help screen: every key, the verdict's thresholds, and how ranks are compared."""

from __future__ import annotations

import re
from typing import ClassVar

from rich.console import Console
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from memtui.advice.verdict import THRESHOLDS, ThresholdConfig, describe_thresholds
from memtui.core.stats import STRAGGLER_LAG_S, STRAGGLER_STEP_FACTOR, STRAGGLER_WAIT_SHARE
from memtui.runs.state import NEAREST_OOM_FROM, SILENT_AFTER_S
from memtui.tui.safe import as_text

KEYS: tuple[tuple[str, str], ...] = (
    ("b", "set batch_size (micro-batch per rank)"),
    ("a", "set grad_accum (gradient accumulation steps)"),
    ("w", "set num_workers (data loader workers)"),
    ("p", "set pin_memory (prefilled with the opposite of now)"),
    ("P", "set prefetch_factor (batches each loader worker loads ahead)"),
    ("k", "toggle keep-effective-batch: a batch_size change recomputes grad_accum"),
    ("l", "LR rule for an edit that moves the effective batch: run's, linear, sqrt, none"),
    ("c", "cancel a pending change"),
    ("o", "queue the top recommendation memtui can apply (for the next checkpoint)"),
    ("O", "pick a recommendation to queue (advice-only ones are listed, not applicable)"),
    ("A", "autopilot on / off: it tunes the knobs by itself; any change of yours pauses it"),
    ("space", "pause / resume the view (data keeps arriving; a replay's clock stops)"),
    ("+ / -", "replay faster / slower (memtui replay only)"),
    ("r", "reconnect now"),
    ("f", "follow the run the header offers, once this one is gone (plain memtui attach)"),
    ("g", "GPUs on this host: free memory, utilisation, other processes holding memory"),
    ("ctrl+p", "command palette: every action by name"),
    ("?", "this help"),
    ("q", "quit (the run goes on)"),
)
"""The keys, as the help screen lists them (``q`` as a viewer attached to a run says it)."""
DEMO_QUIT = "quit: memtui demo stops its demo training too (ctrl+c as well)"
"""What ``q`` does in the viewer ``memtui demo`` opened: its training stops with it."""


def describe_ranks() -> list[str]:
    """How the per-rank table compares the ranks, in words."""
    return [
        f"straggler    step time >= {STRAGGLER_STEP_FACTOR}x the ranks' median, or data wait "
        f"longer than the median's by {STRAGGLER_WAIT_SHARE:.0%} of the median step, or "
        f"{STRAGGLER_LAG_S:.0f} s of steps behind",
        f"nearest OOM  the highest peak memory share (from {NEAREST_OOM_FROM:.0%} of capacity)",
        f"silent       no data for {SILENT_AFTER_S:.0f} s (listed first; the header counts them)",
        "order        silent ranks, then how close each is to a threshold; a side pane shows "
        "the worst 4 and sums up the rest",
    ]


INDENT = "  "
"""Every entry's indent under its section's heading."""
LABEL = re.compile(r"(\S.*?\S {2,})(\S.*)")
"""A described rule: its label, the spaces that align it, then the rule (``STARVED   data...``)."""
NARROWEST = 16
"""The fewest columns an entry is wrapped to beside its key or label (fewer: under it)."""


def hanging(lead: Text, body: Text, width: int, hang: int = 0) -> Text:
    """``lead`` then ``body`` wrapped to ``width`` columns, its further lines under its own
    first one (``hang`` columns further in), not under ``lead`` (``width`` 0: on one line)."""
    room = width - lead.cell_len
    if width <= 0 or body.cell_len <= room:
        return lead + body
    indent = lead.cell_len
    if room - hang < NARROWEST:  # too narrow beside the lead: under it, at the section's indent
        lead, indent = lead.copy(), len(INDENT)
        lead.rstrip()
        lead.append("\n" + INDENT)
    lines = body.wrap(Console(width=width), width - indent - hang)
    for line in lines:
        line.rstrip()
    under = Text(" " * (indent + hang))
    return Text("\n").join([lead + lines[0], *(under + line for line in lines[1:])])


def labelled(line: str) -> tuple[Text, Text]:
    """A described rule split into its label (with its alignment) and the rule itself."""
    match = LABEL.fullmatch(line)
    label, rule = match.groups() if match else ("", line)
    return Text(INDENT + label), Text(rule)


def help_text(
    readonly: bool, thresholds: ThresholdConfig | None = None, width: int = 0, demo: bool = False
) -> Text:
    """Keys, what a change does, and the thresholds in force (and where they came from), each
    entry wrapped to ``width`` columns under its own text, never under its key or label (0:
    each on one line); ``demo``: the viewer of ``memtui demo``, whose ``q`` stops its training."""
    config = thresholds or ThresholdConfig(THRESHOLDS, "built-in defaults")
    text = Text()

    def entry(lead: Text | str, body: Text | str) -> None:
        lead = lead if isinstance(lead, Text) else Text(lead)
        body = body if isinstance(body, Text) else Text(body)
        prose = not lead.plain.strip()  # no key or label: its further lines hang 2 further in
        text.append_text(hanging(lead, body, width, 2 if prose else 0))
        text.append("\n")

    text.append("Keys\n", "bold")
    for key, what in KEYS:
        if demo and key == "q":
            what = DEMO_QUIT
        entry(Text(f"{INDENT}{key:<8}", "bold cyan"), what)
    text.append("\nChanges\n", "bold")
    entry(
        INDENT,
        "are validated here, queued by the run and applied at its next checkpoint boundary; "
        "the change log shows them pending, then applied with their step (or rejected, why). "
        "A batch_size change shows its predicted peak first (the run's memory model); one "
        f"predicted over {config.thresholds.memory_danger_fraction:.0%} takes a second Enter "
        "and is sent forced. After it lands, the log shows the measured effect and predicted "
        "vs observed peak, and the running accuracy.",
    )
    if readonly:
        entry(INDENT, Text("This view is read-only: it sends nothing.", "bold yellow"))
    text.append("\nVerdict ", "bold")
    text.append_text(as_text(f"(thresholds from {config.source})\n", "dim"))
    for line in describe_thresholds(config.thresholds):
        entry(*labelled(line))
    for problem in config.problems:
        entry(Text(f"{INDENT}ignored: ", "yellow"), as_text(problem, "yellow"))
    entry(
        INDENT,
        Text(
            "set them in $MEMTUI_CONFIG or ~/.config/memtui/config.yaml (XDG_CONFIG_HOME), "
            "under verdict: (starved_wait_fraction, underused_memory_fraction, "
            "memory_edge_fraction, memory_danger_fraction, host_ram_fraction, "
            "swap_growth_bytes, hysteresis)",
            "dim",
        ),
    )
    entry(INDENT, "on several ranks: the worst rank's numbers, and the verdict names it")
    text.append("\nRanks (several), worst first\n", "bold")
    for line in describe_ranks():
        entry(*labelled(line))
    text.append(f"\n{INDENT}esc or ? closes this help", "dim")
    return text


class HelpText(Static):
    """The help text, wrapped again to its width whenever that changes (a side pane's dialog
    is 49 columns wide): an entry's further lines start under its own text."""

    def __init__(
        self, readonly: bool, thresholds: ThresholdConfig | None, demo: bool = False
    ) -> None:
        super().__init__(help_text(readonly, thresholds, demo=demo), id="help-text", markup=False)
        self.readonly = readonly
        self.thresholds = thresholds
        self.demo = demo
        self.wrapped_to = 0
        """The width the text was last wrapped to (0: not yet, each entry on one line)."""

    def on_resize(self) -> None:
        """Wrap the text to the new width."""
        width = self.content_size.width
        if width and width != self.wrapped_to:
            self.wrapped_to = width
            self.update(help_text(self.readonly, self.thresholds, width, self.demo))


class HelpScreen(ModalScreen[None]):
    """Keys and thresholds."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def __init__(
        self,
        readonly: bool = False,
        thresholds: ThresholdConfig | None = None,
        demo: bool = False,
    ) -> None:
        super().__init__()
        self.readonly = readonly
        self.thresholds = thresholds
        self.demo = demo
        """The viewer ``memtui demo`` opened: ``q`` stops its training too."""

    def compose(self) -> ComposeResult:
        """The help text in a scrollable dialog."""
        with VerticalScroll(id="dialog"):
            yield HelpText(self.readonly, self.thresholds, self.demo)
