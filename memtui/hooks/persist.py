"""What a run keeps on disk: the audit log of changes (JSONL) and the tuned config (YAML).

Both live in the run's state directory (``install(state_dir=...)``, by default
``~/.local/state/memtui/runs/<run id>``); the tuned config can also be written to a path the
user gives. ``install(resume=True)`` reads the tuned config back so a restarted run keeps it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from memtui import safeyaml
from memtui.knobs import KNOBS, KnobError, parse_value
from memtui.stats import one_line
from memtui.wire import to_builtins

AUDIT_FILE = "memtui-audit.jsonl"
TUNED_FILE = "memtui-tuned.yaml"


class AuditLog:
    """Appends one JSON line per event (queued, cancelled, rejected, applied); thread-safe."""

    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self._lock = threading.Lock()

    def append(self, event: str, payload: Any) -> None:
        """Append an event; ``payload`` is a Struct or a dict."""
        line = {"time": time.time(), "run": self.run, "event": event, **to_builtins(payload)}
        data = json.dumps(line, sort_keys=False) + "\n"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(data)

    def read(self) -> list[dict[str, Any]]:
        """Every event written so far (for tests and post-mortems)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def write_tuned(
    path: Path, run: str, step: int, config: dict[str, Any], extra: dict[str, Any] | None = None
) -> None:
    """Write the tuned config atomically (temp file and rename); ``extra`` adds sections."""
    body = {
        "run": run,
        "step": step,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in config.items() if v is not None},
        **(extra or {}),
    }
    text = (
        "# memtui tuned config: rewritten at every applied change.\n"
        "# A run started with hooks.install(..., resume=True) and this state_dir starts from it.\n"
        + yaml.safe_dump(body, sort_keys=False)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_tuned(path: Path) -> dict[str, Any]:
    """The knob values in a tuned-config file, validated; raise ValueError if it is not one."""
    try:
        body = safeyaml.read(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read tuned config {path}: {one_line(exc)}")
    config = body.get("config") if isinstance(body, dict) else None
    if not isinstance(config, dict):
        raise ValueError(f"{path} has no 'config' mapping")
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if knob in config:
            try:
                values[knob] = parse_value(knob, config[knob])
            except KnobError as exc:
                raise ValueError(f"{path}: {exc}")
    return values
