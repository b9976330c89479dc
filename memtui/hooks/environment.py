"""The hook's ``MEMTUI_*`` environment variables: the one place the hook reads them.

``VARIABLES`` names every one and the setting it gives; ``HookEnvironment.read`` reads them all
at once, and never raises: a value the hook cannot use is left out and said in ``problems``
(``memtui.hooks.settings`` logs them once, at install, and resolves the options). The variables
of where memtui keeps things (``MEMTUI_RUNTIME_DIR``, ``MEMTUI_CONFIG``, ``MEMTUI_KEYS``) are
``memtui.storage.paths``'s. ``memtui run``'s start-up module
(``memtui/launch/boot/sitecustomize.py``) reads ``MEMTUI_DISABLE`` by the same rule before it may
import anything.

The no-code watch reads this at every interpreter start (``memtui.hooks.auto.activate``): the
module imports nothing the watch does not load already (``os``, ``typing``), and a size's parser
only where a size is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from memtui.core.switches import switch

SWITCH, TEXT, WHOLE, SECONDS, SIZE = "switch", "text", "whole", "seconds", "size"
"""How a variable's value is read: a switch, text, a whole number, a number of seconds, a size
in bytes (``720MiB``)."""

VARIABLES: dict[str, tuple[str, str]] = {
    "MEMTUI_DISABLE": ("disable", SWITCH),
    "MEMTUI_RUN_NAME": ("run_name", TEXT),
    "MEMTUI_RUN_STATE_DIR": ("run_state_dir", TEXT),
    "MEMTUI_TCP": ("tcp", TEXT),
    "MEMTUI_INSECURE": ("insecure", SWITCH),
    "MEMTUI_INSECURE_CONTROL": ("insecure_control", SWITCH),
    "MEMTUI_MEMORY_LIMIT": ("memory_limit", SIZE),
    "MEMTUI_STAND_IN_HEAP": ("stand_in_heap", SWITCH),
    "MEMTUI_RESET_PEAKS": ("reset_peaks", SWITCH),
    "MEMTUI_RECORD": ("record", TEXT),
    "MEMTUI_ROLLBACK_STEPS": ("rollback_steps", WHOLE),
    "MEMTUI_BOUNDARY_TIMEOUT": ("boundary_timeout_s", SECONDS),
    "MEMTUI_AUTOTUNE": ("autotune", SWITCH),
    "MEMTUI_AUTOTUNE_BUDGET": ("autotune_budget", WHOLE),
}
"""Every ``MEMTUI_*`` variable the hook reads: the setting it gives, and how its value is read."""

_NOT_A = {
    SWITCH: "a switch (1, true or yes; 0, false or no)",
    WHOLE: "a whole number",
    SECONDS: "a number of seconds",
    SIZE: "a size (720MiB, 1.5GiB or a number of bytes)",
}


def _parse(kind: str, text: str) -> Any:
    """``text`` read as ``kind``; ValueError where it is not one."""
    if kind == TEXT:
        return text
    if kind == SWITCH:
        value = switch(text)
        if value is None:
            raise ValueError(text)
        return value
    if kind == WHOLE:
        return int(text)
    if kind == SECONDS:
        return float(text)
    from memtui.core.stats import parse_bytes  # only where a size is given: it loads the wire

    return parse_bytes(text)


class HookEnvironment(NamedTuple):
    """What the hook's variables say: None where a variable is unset, empty, or holds a value
    the hook cannot use (``problems`` says which)."""

    disable: bool | None = None
    run_name: str | None = None
    run_state_dir: str | None = None
    tcp: str | None = None
    insecure: bool | None = None
    insecure_control: bool | None = None
    memory_limit: int | None = None
    stand_in_heap: bool | None = None
    reset_peaks: bool | None = None
    record: str | None = None
    rollback_steps: int | None = None
    boundary_timeout_s: float | None = None
    autotune: bool | None = None
    autotune_budget: int | None = None
    problems: tuple[str, ...] = ()
    """One line for each variable whose value was ignored, and why."""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> HookEnvironment:
        """Every variable of ``env`` (this process's environment by default); never raises."""
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        problems: list[str] = []
        for name, (setting, kind) in VARIABLES.items():
            text = source.get(name)
            if not text:
                continue
            try:
                values[setting] = _parse(kind, text)
            except (ValueError, OverflowError):
                problems.append(f"{name}={text[:60]!r} is not {_NOT_A[kind]}: ignored")
        return cls(**values, problems=tuple(problems))
