"""The demo training's command line, without importing torch.

``python -m memtui.demo`` parses it, and ``memtui demo`` validates its pass-through options with
the same parser (and shows them in its ``--help``) before it starts anything, so the two command
lines cannot drift apart.
"""

from __future__ import annotations

import argparse
import os
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
        metavar="RULE",
        help="how the LR follows a change of the effective batch: linear, sqrt or none "
        "(default none)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="checkpoint and state directory (default ~/.local/state/memtui/demo; with "
        "MEMTUI_RUNTIME_DIR set, demo-<8 hex digits of its path> there: demos kept apart by "
        "their runtime directories keep their files apart)",
    )
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


def option_rows(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, str]]:
    """Each training option as ``--help`` lists it: its names with its value's name, and its help
    (``memtui demo --help`` and the command line reference list the same rows)."""
    rows = []
    # argparse lists a parser's actions only through _actions (no public accessor)
    for action in (parser or build_parser())._actions:  # noqa: SLF001
        if not action.option_strings or action.dest == "help":
            continue
        names = "/".join(action.option_strings)
        if action.nargs != 0:
            names += f" {action.metavar or action.dest.upper()}"
        rows.append((names, action.help or ""))
    return rows


def parse_args(
    argv: list[str] | None = None, prog: str = "python -m memtui.demo", usage: str | None = None
) -> argparse.Namespace:
    """Parse the demo's command line (exits 2 with argparse's message when it is wrong)."""
    return build_parser(prog, usage).parse_args(argv)


LOCK_FILE = "demo.lock"
"""The file in the demo's directory its training holds locked while it runs (with its pid)."""
_held: list[int] = []
"""The lock this process's demo training holds (open until the process ends)."""


def default_out() -> Path:
    """The demo's checkpoint and state directory when ``--out`` is not given (one per runtime
    directory, ``memtui.storage.paths.demo_dir``)."""
    from memtui.storage.paths import demo_dir

    return demo_dir()


def out_in_use(out: Path) -> str:
    """Why ``out`` cannot take another demo ("": no live run keeps its state there): two runs in
    one directory would overwrite each other's checkpoint, tuned config and audit log. A run of
    this runtime directory is named; another demo, of another runtime directory, is known by
    the lock its training holds."""
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
    holder = lock_holder(out / LOCK_FILE)
    if holder:
        return (
            f"{out} is the state directory of another live demo ({holder}); give this demo its "
            "own --out DIR, or stop that demo first"
        )
    return ""


def claim_out(out: Path) -> str:
    """Hold ``out`` (a directory the launcher's ``out_dir`` checked) for this process's demo
    training until it ends ("" once held), or say why it cannot (``out_in_use``): the lock keeps
    a demo of another runtime directory out."""
    import fcntl

    from memtui.storage import ownfiles

    busy = out_in_use(out)
    if busy:
        return busy
    try:
        fd = ownfiles.open_write(out / LOCK_FILE, append=True)
    except OSError as exc:  # another account's file there, a directory it cannot make
        return f"cannot hold {out} for this demo: {exc}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # taken between the look and the lock
        os.close(fd)
        return out_in_use(out) or f"{out} is the state directory of another live demo"
    except OSError:  # a file system without locks: the registry's look above is all there is
        os.close(fd)
        return ""
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held.append(fd)
    return ""


def lock_holder(path: Path) -> str:
    """``pid N`` of the process that holds the lock at ``path`` ("": none does)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # no lock file: no demo ever ran here, or the directory is not there
        return ""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip()
            return f"pid {pid}" if pid.isdigit() else "its pid unknown"
        except OSError:  # a file that takes no lock: nobody holds it
            return ""
        return ""
    finally:
        os.close(fd)
