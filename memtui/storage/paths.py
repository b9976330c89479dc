"""Where memtui keeps things on disk, from the environment: the one place that reads the XDG
variables and memtui's own overrides of them.

=================  ==============================================  ===========================
what               where                                           set by
=================  ==============================================  ===========================
runtime directory  ``$XDG_RUNTIME_DIR/memtui``                     ``MEMTUI_RUNTIME_DIR``
                   (``~/.cache/memtui/run`` without it)
run state          ``$XDG_STATE_HOME/memtui/runs``                 a run's ``state_dir``
                   (``~/.local/state``)
the demo's state   ``$XDG_STATE_HOME/memtui/demo``, or              ``memtui demo --out``
                   ``demo-<digest of $MEMTUI_RUNTIME_DIR>``
config file        ``$XDG_CONFIG_HOME/memtui/config.yaml``         ``MEMTUI_CONFIG``
                   (``~/.config``)
CURVE keys         ``$XDG_CONFIG_HOME/memtui/curve``               ``MEMTUI_KEYS``
exporter's token   ``$XDG_CONFIG_HOME/memtui/export-token``        ``memtui export --token-file``
=================  ==============================================  ===========================

Nothing here creates a directory or reads a file: the owners do (``registry``, ``security``,
``userconfig``, the exporter's ``auth``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """The per-user runtime directory (the registry's, and the runs' ipc sockets)."""
    env = _env(env)
    if env.get("MEMTUI_RUNTIME_DIR"):
        return Path(env["MEMTUI_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "memtui"
    return Path.home() / ".cache" / "memtui" / "run"


def state_home(env: Mapping[str, str] | None = None) -> Path:
    """Where runs keep their audit log and tuned config unless the user gives a state_dir."""
    base = _env(env).get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "memtui" / "runs"


def demo_dir(env: Mapping[str, str] | None = None) -> Path:
    """The demo's checkpoint and state directory when ``--out`` is not given: ``demo`` beside
    the runs' state, or, where ``MEMTUI_RUNTIME_DIR`` names a runtime directory of its own,
    ``demo-`` and 8 hex digits of that directory's path, so that demos kept apart by their
    runtime directories keep their checkpoints, tuned configs and audit logs apart too."""
    env = _env(env)
    base = state_home(env).parent
    if not env.get("MEMTUI_RUNTIME_DIR"):
        return base / "demo"
    import hashlib

    runtime = os.path.abspath(os.path.expanduser(env["MEMTUI_RUNTIME_DIR"]))
    return base / f"demo-{hashlib.sha256(runtime.encode()).hexdigest()[:8]}"


def config_file(env: Mapping[str, str] | None = None) -> Path:
    """``$MEMTUI_CONFIG``, else ``$XDG_CONFIG_HOME/memtui/config.yaml`` (``~/.config`` default)."""
    env = _env(env)
    if env.get("MEMTUI_CONFIG"):
        return Path(env["MEMTUI_CONFIG"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "memtui" / "config.yaml"


def config_file_named(env: Mapping[str, str] | None = None) -> bool:
    """Whether the user named the config file (``MEMTUI_CONFIG``): its absence is then said."""
    return bool(_env(env).get("MEMTUI_CONFIG"))


def key_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the CURVE keys live: ``$MEMTUI_KEYS``, else ``~/.config/memtui/curve``."""
    env = _env(env)
    if env.get("MEMTUI_KEYS"):
        return Path(env["MEMTUI_KEYS"])
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "memtui" / "curve"


def export_token_file(env: Mapping[str, str] | None = None) -> Path:
    """The exporter's bearer token: ``$XDG_CONFIG_HOME/memtui/export-token``."""
    base = _env(env).get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "memtui" / "export-token"
