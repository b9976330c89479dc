"""The help screen: every key, the verdict's thresholds, and how ranks are compared."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from memtui.advice.verdict import THRESHOLDS, ThresholdConfig, describe_thresholds
from memtui.stats import STRAGGLER_LAG_S, STRAGGLER_STEP_FACTOR, STRAGGLER_WAIT_SHARE
from memtui.tui.safe import as_text
from memtui.tui.state import NEAREST_OOM_FROM, SILENT_AFTER_S

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
"""The keys, as the help screen lists them."""


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


def help_text(readonly: bool, thresholds: ThresholdConfig | None = None) -> Text:
    """Keys, what a change does, and the thresholds in force (and where they came from)."""
    config = thresholds or ThresholdConfig(THRESHOLDS, "built-in defaults")
    text = Text()
    text.append("Keys\n", "bold")
    for key, what in KEYS:
        text.append(f"  {key:<8}", "bold cyan")
        text.append(f"{what}\n")
    text.append("\nChanges\n", "bold")
    text.append(
        "  are validated here, queued by the run and applied at its next checkpoint boundary;\n"
        "  the change log shows them pending, then applied with their step (or rejected, why).\n"
        "  A batch_size change shows its predicted peak first (the run's memory model); one\n"
        f"  predicted over {config.thresholds.memory_danger_fraction:.0%} takes a second Enter "
        "and is sent forced. After it lands, the log\n"
        "  shows the measured effect and predicted vs observed peak, and the running accuracy.\n"
    )
    if readonly:
        text.append("  This view is read-only: it sends nothing.\n", "bold yellow")
    text.append("\nVerdict ", "bold")
    text.append_text(as_text(f"(thresholds from {config.source})\n", "dim"))
    for line in describe_thresholds(config.thresholds):
        text.append(f"  {line}\n")
    for problem in config.problems:
        text.append_text(as_text(f"  ignored: {problem}\n", "yellow"))
    text.append(
        "  set them in $MEMTUI_CONFIG or ~/.config/memtui/config.yaml (XDG_CONFIG_HOME), under\n"
        "  verdict: (starved_wait_fraction, underused_memory_fraction, memory_edge_fraction,\n"
        "  memory_danger_fraction, host_ram_fraction, swap_growth_bytes, hysteresis)\n",
        "dim",
    )
    text.append("  on several ranks: the worst rank's numbers, and the verdict names it\n")
    text.append("\nRanks (several), worst first\n", "bold")
    for line in describe_ranks():
        text.append(f"  {line}\n")
    text.append("\n  esc or ? closes this help", "dim")
    return text


class HelpScreen(ModalScreen[None]):
    """Keys and thresholds."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def __init__(self, readonly: bool = False, thresholds: ThresholdConfig | None = None) -> None:
        super().__init__()
        self.readonly = readonly
        self.thresholds = thresholds

    def compose(self) -> ComposeResult:
        """The help text in a scrollable dialog."""
        with VerticalScroll(id="dialog"):
            yield Static(help_text(self.readonly, self.thresholds), id="help-text", markup=False)
