"""What a run keeps on disk: the audit log of changes (JSONL), the tuned config (YAML) and the
run's summary (JSON, ``memtui report``).

Both live in the run's state directory (``install(state_dir=...)``, by default
``~/.local/state/memtui/runs/<run id>``); the tuned config can also be written to a path the
user gives. ``install(resume=True)`` reads the tuned config back so a restarted run keeps it.
Both are opened through ``memtui.storage.ownfiles``: written only as the user's own 0600 files, read
back only if no other account owns or can write them, and a state dir other accounts can write
is said once, loudly.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec
import yaml

from memtui.core.knobs import KNOBS, KnobError, as_dict, parse_value
from memtui.core.stats import one_line
from memtui.storage import ownfiles, paths, safeyaml
from memtui.wire import Ceiling, Knobs, RunSummary, to_builtins

log = logging.getLogger("memtui")

AUDIT_FILE = "memtui-audit.jsonl"
TUNED_FILE = "memtui-tuned.yaml"
SUMMARY_FILE = "memtui-summary.json"
"""The run's summary (``memtui report``), beside the tuned config."""
UNSAVED_WARN_S = 60.0
"""While the tuned config or audit lines are not saved, this is said again at most this often."""


class AuditLog:
    """Appends one JSON line per event (queued, cancelled, rejected, applied); thread-safe.

    Each append is one ``write`` on an ``O_APPEND`` descriptor, so lines of several writers
    never interleave; what a full disk cuts short is truncated away, so the file stays valid
    JSONL (where even the truncation fails, the torn line is ended before the next one and the
    reader skips it). Lines that could not be written are kept (``UNWRITTEN`` at most) and
    written first by the next append or ``flush``. A line is at most ``MAX_LINE`` bytes (long
    strings inside are cut), and the file is rotated to ``.1`` at ``MAX_BYTES``, so the log
    never grows without bound. The file is 0600 and the user's own (``ownfiles.open_write``:
    never through a link another user planted), a directory memtui creates 0700.
    """

    def __init__(self, path: Path, run: str) -> None:
        self.path = path
        self.run = run
        self._lock = threading.Lock()
        self._torn = False
        """A write cut short could not be taken back: the next starts on a new line."""
        self.unwritten: deque[bytes] = deque(maxlen=UNWRITTEN)
        """Lines not written yet (a full disk, an unwritable directory), oldest first."""
        self.dropped = 0
        """Lines lost for good: more failed than ``UNWRITTEN`` holds."""
        self.error = ""
        """Why the last write failed, in one line ("" once one succeeds)."""
        warn_if_shared(path.parent)

    def append(self, event: str, payload: Any, *, durable: bool = False) -> None:
        """Append an event; ``payload`` is a Struct or a dict; ``durable``: on the disk, with the
        log's directory entry, before this returns (a line a crash must not take back); raise
        OSError if it is not written (it is kept and written again first by the next append or
        ``flush``)."""
        line = {"time": time.time(), "run": self.run, "event": event, **to_builtins(payload)}
        data = bounded_line(line)
        with self._lock:
            if len(self.unwritten) == UNWRITTEN:
                self.dropped += 1
            self.unwritten.append(data)
            self._write_unwritten(durable)

    def _write_unwritten(self, durable: bool = False) -> None:
        """Write every unwritten line; keep and say why if they are not."""
        try:
            self._write_lines(durable)
            self.error = ""
        except OSError as exc:
            self.error = f"{self.path}: {one_line(exc)}"
            raise

    def flush(self) -> None:
        """Write the lines an earlier append could not; raise OSError if they are still not."""
        with self._lock:
            if self.unwritten:
                self._write_unwritten()

    def _write_lines(self, durable: bool = False) -> None:
        """Write every unwritten line in one ``write``; keep them all unless it wrote them whole
        (a cut write is truncated away); ``durable``: flushed to the disk with the directory."""
        _private_dir(self.path.parent)
        warn_if_shared(self.path.parent)
        fd = self._open()
        data = (b"\n" if self._torn else b"") + b"".join(self.unwritten)
        try:
            new = durable and os.fstat(fd).st_size == 0  # its directory entry is new too
            written = os.write(fd, data)  # an error here wrote nothing (an O_APPEND regular file)
            if written < len(data):
                self._take_back(fd, written)
                raise OSError(errno.ENOSPC, f"audit line cut at {written} of {len(data)} bytes")
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        self.unwritten.clear()
        self._torn = False
        if new:
            ownfiles.sync_dir(self.path.parent)

    def _open(self) -> int:
        """The log's descriptor, a full log moved to ``.1`` (replacing the previous one) first."""
        fd = ownfiles.open_write(self.path, append=True)
        if os.fstat(fd).st_size < MAX_BYTES:
            return fd
        os.close(fd)
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._torn = False
        return ownfiles.open_write(self.path, append=True)

    def _take_back(self, fd: int, written: int) -> None:
        """Truncate the ``written`` bytes of a cut write away; where that fails too, keep only
        the lines it wrote whole and start the next write on a new line."""
        try:
            os.ftruncate(fd, os.lseek(fd, 0, os.SEEK_CUR) - written)
            return
        except OSError:
            pass
        done = written - (1 if self._torn else 0)
        while self.unwritten and done >= len(self.unwritten[0]):
            done -= len(self.unwritten.popleft())
        self._torn = True

    def read(self) -> list[dict[str, Any]]:
        """Every event written so far, a torn line skipped (for tests and post-mortems)."""
        return read_audit(self.path)


MAX_LINE = 4096
"""Bytes of one audit line at most."""
MAX_BYTES = 16 << 20
"""The audit log is rotated to ``.1`` at this size."""
UNWRITTEN = 1024
"""Lines kept while they cannot be written (4 MiB at most); older ones are then dropped."""
_STRING_CHARS = 256
"""Characters of a string inside an audit line that is over ``MAX_LINE``."""


def bounded_line(line: dict[str, Any]) -> bytes:
    """One JSON line of at most ``MAX_LINE`` bytes: long strings cut, then only the scalars."""
    data = json.dumps(line, sort_keys=False).encode() + b"\n"
    if len(data) <= MAX_LINE:
        return data
    cut = _cut_strings(line)
    cut["cut"] = len(data)
    data = json.dumps(cut, sort_keys=False).encode() + b"\n"
    if len(data) <= MAX_LINE:
        return data
    scalars: dict[str, Any] = {
        k: v for k, v in cut.items() if isinstance(v, (int, float, bool)) or v is None
    }
    scalars.update(time=line["time"], run=str(line["run"])[:64], event=str(line["event"])[:64])
    return json.dumps(scalars, sort_keys=False).encode() + b"\n"


def _cut_strings(value: Any) -> Any:
    """``value`` with every string over ``_STRING_CHARS`` cut (containers walked)."""
    if isinstance(value, str):
        return value if len(value) <= _STRING_CHARS else value[:_STRING_CHARS] + "…"
    if isinstance(value, dict):
        return {_cut_strings(str(k)): _cut_strings(v) for k, v in list(value.items())[:64]}
    if isinstance(value, list):
        return [_cut_strings(v) for v in value[:64]]
    return value


def read_audit(path: Path) -> list[dict[str, Any]]:
    """The events of an audit log; a line that does not parse (cut by a full disk) is skipped;
    raise ``ownfiles.UnsafeFile`` if the log is not the user's own or others can write it."""
    try:
        fd = ownfiles.open_read(path)
    except FileNotFoundError:
        return []
    with open(fd, "rb") as handle:
        text = handle.read().decode("utf-8", errors="replace")
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def unapplied(events: list[dict[str, Any]], current_run: str) -> tuple[str, dict[str, Any]]:
    """The changes the last earlier run queued and never applied, cancelled or rejected (it
    stopped first), merged oldest first: (that run's id, {knob: value}); ("", {}) if none."""
    earlier = [e for e in events if e.get("run") != current_run]
    if not earlier:
        return "", {}
    run = earlier[-1].get("run", "")
    queued: dict[int, dict[str, Any]] = {}
    for event in (e for e in earlier if e.get("run") == run):
        kind = event.get("event")
        if kind == "queued" and isinstance(event.get("changes"), dict):
            queued[int(event.get("id", 0))] = event["changes"]
        elif kind in ("applying", "applied", "cancelled"):  # an interrupted apply: reconciled
            for done in event.get("ids", []) or []:
                queued.pop(int(done), None)
        elif kind == "rejected":
            queued.pop(int(event.get("id", 0) or 0), None)
    merged: dict[str, Any] = {}
    for _id, changes in sorted(queued.items()):
        merged.update({k: v for k, v in changes.items() if k in KNOBS})
    return (str(run), merged) if merged else ("", {})


def _private_dir(path: Path) -> None:
    """Create a directory (and its parents) the way memtui keeps state: 0700."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)


_warned_shared: set[Path] = set()
"""The state dirs already said to be writable by others (once each, per process)."""


def warn_if_shared(directory: Path) -> None:
    """Say once, loudly, that other accounts can write the state dir ``directory``."""
    if directory in _warned_shared:
        return
    others = ownfiles.shared_with(directory)
    if others:
        _warned_shared.add(directory)
        log.warning(
            "memtui: WARNING: the state dir %s is writable by %s: another account can remove "
            "or replace the audit log and tuned config there; memtui writes no file it does "
            "not own and resumes from none (give install() a state_dir of your own)",
            directory,
            others,
        )


def write_tuned(
    path: Path, run: str, step: int, config: dict[str, Any], extra: dict[str, Any] | None = None
) -> None:
    """Write the tuned config atomically (a new 0600 temp file renamed over it, removed if
    anything fails); ``extra`` adds sections; raise OSError if it is not written."""
    body = {
        "run": run,
        "step": step,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in config.items() if v is not None},
        **(extra or {}),
    }
    text = (
        "# memtui tuned config: rewritten at every applied change (flushed to the disk before\n"
        "# the audit log's line that the change applied).\n"
        "# A run started with hooks.install(..., resume=True) and this state_dir starts from it.\n"
        + yaml.safe_dump(body, sort_keys=False)
    )
    _private_dir(path.parent)
    ownfiles.replace_file(path, text.encode("utf-8"))


def write_summary(path: Path, summary: RunSummary) -> None:
    """Write the run's summary atomically (a new 0600 temp file renamed over it, flushed to the
    disk: a run killed at any moment leaves the previous summary or this one, whole); raise
    OSError if it is not written."""
    _private_dir(path.parent)
    warn_if_shared(path.parent)
    ownfiles.replace_file(path, msgspec.json.encode(summary) + b"\n")


def read_section(path: Path, name: str) -> Any:
    """One section of a tuned-config file as YAML reads it (None: none, unreadable, or not the
    user's own)."""
    try:
        body = safeyaml.read(path, private=True)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return body.get(name) if isinstance(body, dict) else None


def read_ceiling(path: Path) -> Ceiling | None:
    """The out-of-memory ceiling a tuned-config file keeps (None: none, or unreadable)."""
    return ceiling_of(read_section(path, "ceiling"))


def ceiling_of(raw: Any) -> Ceiling | None:
    """A kept out-of-memory ceiling as a ``Ceiling`` (None: none, or not one)."""
    if not isinstance(raw, dict):
        return None
    try:
        return msgspec.convert(raw, Ceiling)
    except msgspec.ValidationError:
        return None


def read_tuned(path: Path) -> dict[str, Any]:
    """The knob values in a tuned-config file, validated; raise ``ownfiles.UnsafeFile`` if it is
    not the user's own or others can write it, ValueError if it is not a tuned config."""
    return tuned_values(read_tuned_body(path).get("config"), str(path))


def read_tuned_body(path: Path) -> dict[str, Any]:
    """A tuned-config file's sections as YAML reads them; raise ``ownfiles.UnsafeFile`` if it is
    not the user's own or others can write it, ValueError if it cannot be read as a mapping."""
    try:
        body = safeyaml.read(path, private=True)
    except ownfiles.UnsafeFile:
        raise
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read tuned config {path}: {one_line(exc)}")
    if not isinstance(body, dict):
        raise ValueError(f"{path} has no 'config' mapping")
    return body


def tuned_values(config: Any, where: str) -> dict[str, Any]:
    """The knob values of a tuned config's ``config`` mapping (read from ``where``), validated;
    raise ValueError if it is not one."""
    if not isinstance(config, dict):
        raise ValueError(f"{where} has no 'config' mapping")
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if knob in config:
            try:
                values[knob] = parse_value(knob, config[knob])
            except KnobError as exc:
                raise ValueError(f"{where}: {exc}")
    return values


class Persisted(Protocol):
    """A part whose state the tuned config keeps beside the knobs (the control's ceiling, the
    LR's factor)."""

    def persisted(self) -> dict[str, Any]: ...


class ScriptDir(str):
    """A state directory memtui took from the script (a Trainer's ``output_dir``, Lightning's
    ``default_root_dir``) rather than one it was given: memtui writes there only once it changed
    the run, so the script's directory holds what it would hold without memtui."""


class StateFiles:
    """Where one run keeps its audit log and tuned config: the state directory given (else the
    run's own under the state home), and a second tuned config path if one was given."""

    def __init__(
        self,
        run_id: Callable[[], str],
        state_dir: str | os.PathLike[str] | None = None,
        tuned_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.run_id = run_id
        """The run the files belong to now (rank 0's once the job coordinates)."""
        self._state_dir = Path(state_dir) if state_dir else None
        self._tuned_path = Path(tuned_path) if tuned_path else None
        self._borrowed = isinstance(state_dir, ScriptDir)

    @property
    def state_dir(self) -> Path:
        """Where the audit log and the tuned config are written."""
        return self._state_dir or paths.state_home() / self.run_id()

    @property
    def audit_path(self) -> Path:
        """The run's audit log."""
        return self.state_dir / AUDIT_FILE

    @property
    def summary_path(self) -> Path:
        """The run's summary: beside its tuned config, or in the run's own directory under the
        state home when the state directory is the script's (``ScriptDir``), which the summary
        written from the start would change where memtui changed nothing."""
        home = paths.state_home() / self.run_id() if self._borrowed else self.state_dir
        return home / SUMMARY_FILE

    def tuned_paths(self) -> list[Path]:
        """Every file the tuned config is written to."""
        own = self.state_dir / TUNED_FILE
        return [own, self._tuned_path] if self._tuned_path else [own]


class TunedConfig:
    """The tuned config on disk: written at every applied change (and after an out-of-memory
    error), written again at every boundary until it is, and said once a minute while it is not.

    The one owner of "is the run's tuning saved": ``unsaved_step`` (published in the hook's
    counters) and what the next retry writes.
    """

    def __init__(
        self,
        files: StateFiles,
        report: Callable[[BaseException, str], None],
        audit: AuditLog | None = None,
        sections: Sequence[Persisted] = (),
    ) -> None:
        self._files = files
        self._report = report
        self.audit = audit
        """Rank 0's audit log, whose unwritten lines are flushed with the retries."""
        self._sections = tuple(sections)
        """The parts whose state every write keeps besides the knobs (the control's ceiling, the
        LR's factor), read at the write."""
        self.unsaved_step: int | None = None
        """The step since which the tuned config could not be written (None: it is on disk)."""
        self._retry: tuple[Knobs, dict[str, Any]] | None = None
        """What failed to be written, written again at the next boundary."""
        self._reason = ""
        """Why the tuned config could not be written, last time (one line)."""
        self._warned = -math.inf

    def write(self, knobs: Knobs, step: int, extra: dict[str, Any] | None = None) -> None:
        """Write ``knobs`` (and ``extra`` sections) to every tuned path; what fails is retried."""
        failed = False
        sections: dict[str, Any] = {}
        for part in self._sections:
            sections.update(part.persisted())
        sections.update(extra or {})
        for path in self._files.tuned_paths():
            warn_if_shared(path.parent)
            try:
                write_tuned(path, self._files.run_id(), step, as_dict(knobs), sections)
            except OSError as exc:
                failed = True
                self._reason = f"{path}: {one_line(exc)}"
                self._report(exc, f"writing {path}")
        if failed:
            self._retry = (knobs, extra or {})
            if self.unsaved_step is None:
                self.unsaved_step = step
        else:
            self.unsaved_step, self._retry, self._reason = None, None, ""
        self.say(step)

    def clear_temps(self) -> None:
        """Remove the temp files a killed write of the tuned config left beside it."""
        for path in self._files.tuned_paths():
            removed = ownfiles.remove_stale_temps(path)
            if removed:
                log.info(
                    "memtui: removed %s, left by a tuned config write that did not finish",
                    ", ".join(removed),
                )

    def save_again(self, step: int) -> None:
        """At a boundary: write again what was not written (tuned config, audit lines) and say
        so while it is not."""
        if self._retry is not None:
            knobs, extra = self._retry
            self.write(knobs, step, extra)
        if self.audit is not None and self.audit.unwritten:
            try:
                self.audit.flush()
            except OSError as exc:
                self._report(exc, "audit log")
        self.say(step)

    def say(self, step: int) -> None:
        """Warn once a minute while the tuned config or audit lines are not written, and once
        when they are again."""
        audit = self.audit
        lines = len(audit.unwritten) if audit is not None else 0
        parts = []
        if self.unsaved_step is not None:
            parts.append(f"the tuned config is not saved since step {self.unsaved_step}")
        if audit is not None and lines:
            lost = f", {audit.dropped} more lost" if audit.dropped else ""
            parts.append(f"{lines} audit log lines are not written{lost}")
        now = time.monotonic()
        if not parts:
            if self._warned > -math.inf:
                self._warned = -math.inf
                log.warning(
                    "memtui: the tuned config and audit log are saved again at step %d", step
                )
        elif now - self._warned >= UNSAVED_WARN_S:
            self._warned = now
            log.warning(
                "memtui: %s (%s); a restart would not keep the changes since; retried at every "
                "checkpoint",
                " and ".join(parts),
                self._reason or (audit.error if audit is not None else ""),
            )
