"""The demo training's command line, without importing torch.

``python -m memtui.demo`` parses it, and ``memtui demo`` validates its pass-through options with
the same parser (and shows them in its ``--help``) before it starts anything, so the two command
lines cannot drift apart.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtui.core.stats import parse_bytes

DESCRIPTION = (
    "The demo training: a small GPT-style model on synthetic tokens whose data loading is slow."
)


def size(text: str) -> int:
    """A byte size such as ``720MiB`` or ``1.5GiB``."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


NUMBERS: tuple[tuple[str, type, float, str, str, float | None], ...] = (
    ("--steps", int, 2000, "N", "optimizer steps to run", 1),
    ("--checkpoint-every", int, 50, "K", "steps between checkpoints", 1),
    ("--batch-size", int, 16, "B", "micro-batch size", 1),
    ("--grad-accum", int, 2, "A", "gradient accumulation steps", 1),
    ("--workers", int, 0, "W", "data loader workers", 0),
    ("--slow-data-ms", float, 2.0, "MS", "wait per sample, in ms", 0),
    ("--seq-len", int, 32, "N", "tokens per sample", 1),
    ("--width", int, 64, "N", "model width", 1),
    ("--layers", int, 2, "N", "transformer layers", 1),
    ("--heads", int, 4, "N", "attention heads", 1),
    ("--vocab", int, 256, "N", "vocabulary size: the logits' memory grows with it", 2),
    ("--threads", int, 1, "N", "torch CPU threads", 1),
    ("--progress-every", float, 5.0, "SECONDS", "seconds between progress lines", 0),
    ("--seed", int, 0, "N", "random seed", None),
)
"""The numeric options: name, type, default, metavar, help, the least value accepted."""


def bounded(kind: type, least: float | None) -> Callable[[str], Any]:
    """An argparse type: ``kind`` of the text, refused below ``least``."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if least is not None and value < least:
            raise argparse.ArgumentTypeError(f"{text} is below {least:g}, the least it can be")
        return value

    convert.__name__ = kind.__name__  # argparse names the type in its messages
    return convert


def build_parser(
    prog: str = "python -m memtui.demo", usage: str | None = None
) -> argparse.ArgumentParser:
    """The demo's argument parser (``prog`` names the command in its messages)."""
    parser = argparse.ArgumentParser(prog=prog, usage=usage, description=DESCRIPTION)
    for flag, kind, default, metavar, text, least in NUMBERS:
        parser.add_argument(
            flag,
            type=bounded(kind, least),
            default=kind(default),
            metavar=metavar,
            help=f"{text} (default {default:g})",
        )
    parser.add_argument(
        "--pin-memory",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pin the loader's batches (default off)",
    )
    parser.add_argument(
        "--autotune", action="store_true", help="start with the autopilot on (it tunes the knobs)"
    )
    parser.add_argument(
        "--lr-scale",
        choices=("linear", "sqrt", "none"),
        default="none",
        help="how the LR follows a change of the effective batch (default none)",
    )
    parser.add_argument("--out", type=Path, metavar="DIR", help="checkpoint and state directory")
    parser.add_argument(
        "--resume", action="store_true", help="resume from the checkpoint and tuned config in --out"
    )
    parser.add_argument(
        "--device", metavar="DEVICE", help="cuda or cpu (default: cuda if available)"
    )
    parser.add_argument(
        "--name", default="demo", metavar="NAME", help="run id prefix (default demo)"
    )
    parser.add_argument(
        "--memory-limit",
        type=size,
        metavar="SIZE",
        help="CPU runs: hold the process to this budget (e.g. 1.5GiB): exceeding it is an "
        "out-of-memory error",
    )
    return parser


def parse_args(
    argv: list[str] | None = None, prog: str = "python -m memtui.demo", usage: str | None = None
) -> argparse.Namespace:
    """Parse the demo's command line (exits 2 with argparse's message when it is wrong)."""
    return build_parser(prog, usage).parse_args(argv)


def default_out() -> Path:
    """The demo's checkpoint and state directory when ``--out`` is not given."""
    from memtui.storage.registry import state_home

    return state_home().parent / "demo"


def out_in_use(out: Path) -> str:
    """Why ``out`` cannot take another demo ("": no live run keeps its state there): two runs in
    one directory would overwrite each other's checkpoint, tuned config and audit log."""
    from memtui.storage.registry import RegistryError, list_runs

    wanted = out.resolve()
    try:
        runs = list_runs(clean=False)
    except RegistryError:  # the runtime directory is refused: the training says so itself
        return ""
    for run in runs:
        if run.state_dir and (Path(run.cwd) / run.state_dir).resolve() == wanted:
            return (
                f"{out} is the state directory of the live run {run.run} (pid {run.pid}); give "
                "this demo its own --out DIR, or stop that run first"
            )
    return ""
