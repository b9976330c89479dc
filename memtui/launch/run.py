"""``memtui run -- COMMAND ...``: the command's environment, then the command in this process."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Mapping, Sequence

BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
"""The directory whose ``sitecustomize`` every Python interpreter of the command imports."""

NAME_VARIABLE = "MEMTUI_RUN_NAME"
STATE_DIR_VARIABLE = "MEMTUI_RUN_STATE_DIR"


def command_environment(
    environ: Mapping[str, str], *, name: str | None = None, state_dir: str | None = None
) -> dict[str, str]:
    """``environ`` with the boot directory first on PYTHONPATH (the user's entries after it, as
    they were) and the run's name and state directory for the hook."""
    env = dict(environ)
    user_path = env.get("PYTHONPATH", "")
    entries = user_path.split(os.pathsep) if user_path else []
    if entries[:1] != [BOOT_DIR]:  # a nested ``memtui run`` adds it once
        # an empty entry would mean the working directory: the user's string is kept verbatim
        env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, user_path]) if user_path else BOOT_DIR
    if name:
        env[NAME_VARIABLE] = name
    if state_dir:
        env[STATE_DIR_VARIABLE] = os.path.abspath(state_dir)  # the same for ranks in other dirs
    return env


COERCED = "LC_CTYPE"
"""What Python sets in its own environment at start-up where the locale is C (PEP 538)."""


def started_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without what this interpreter added to it while it started (``LC_CTYPE``,
    coerced from the C locale): the environment the command was given, as memtui found it."""
    env = dict(environ)
    if COERCED in env and not _given(COERCED):
        del env[COERCED]
    return env


def _given(name: str) -> bool:
    """Whether ``name`` was in the environment this process was started with (``/proc``; where
    that cannot be read, whether it is there now)."""
    try:
        with open("/proc/self/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:
        return name in os.environ
    prefix = os.fsencode(name) + b"="
    return any(entry.startswith(prefix) for entry in entries)


def unwatched_python(command: Sequence[str]) -> str:
    """The option of a ``python`` command that keeps the start-up module out ("" when none):
    ``-I`` and ``-E`` ignore PYTHONPATH, ``-S`` imports no ``sitecustomize``."""
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(command[0])):
        return ""
    words = iter(command[1:])
    for word in words:
        if not word.startswith("-") or word == "-" or word.startswith("--"):
            return ""  # the script, stdin, or a long option: the interpreter's options end
        for index, letter in enumerate(word[1:], 1):
            if letter in "IES":
                return f"-{letter}"
            if letter in "cm":  # the program follows: the interpreter's options end here
                return ""
            if letter in "WX":  # its value is the rest of the word, or the next word
                if index == len(word) - 1:
                    next(words, None)
                break
    return ""


def exec_command(
    command: Sequence[str], *, name: str | None = None, state_dir: str | None = None
) -> int:
    """Replace this process with ``command`` (found on PATH as a shell would), so its exit status,
    signals and output are the command's own; returns only when it cannot start: 127 when it is
    not found, 126 when it cannot be run, as a shell says, with one line on stderr."""
    env = command_environment(started_environment(os.environ), name=name, state_dir=state_dir)
    option = unwatched_python(command)
    if option:
        print(
            f"memtui: {command[0]} {option} does not run memtui's start-up module: "
            "this interpreter is not watched (the processes it starts may be)",
            file=sys.stderr,
        )
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    # Python ignores SIGPIPE and SIGXFSZ at its start, keeping nothing of what it inherited, and
    # an ignored signal stays ignored across exec: the command gets the defaults a shell gives
    # (``... | head`` ends it as usual); every other disposition passes to it as memtui found it
    for number in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, number):
            signal.signal(getattr(signal, number), signal.SIG_DFL)
    try:
        os.execvpe(command[0], list(command), env)
    except FileNotFoundError:
        missing = "No such file or directory" if os.sep in command[0] else "command not found"
        print(f"memtui: {command[0]}: {missing}", file=sys.stderr)
        return 127
    except OSError as error:
        print(f"memtui: {command[0]}: {error.strerror or error}", file=sys.stderr)
        return 126
    return 0  # unreachable: exec returns only by raising
