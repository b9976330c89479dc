"""The per-user runtime directory (mode 0700), one registry file per live run, and discovery.

Layout: ``<runtime>/<run id>/run.json`` (the RunRecord) beside the run's ipc sockets
``ctl`` (rank 0's control socket) and ``pub<rank>`` (each rank's telemetry). The runtime
directory is ``$MEMTUI_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/memtui``, else
``~/.cache/memtui/run``. Entries of dead processes are ignored and removed. A runtime directory
that is another user's, or another user's symbolic link, is refused (``ownfiles.private_dir``),
as OpenSSH and systemd refuse theirs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memtui.storage import ownfiles, paths
from memtui.wire import RankInfo, RunRecord, decode_run_record, encode_run_record

RUN_FILE = "run.json"
MAX_IPC_PATH = 100
"""Unix socket paths must stay under 108 bytes; keep a margin."""


class RegistryError(RuntimeError):
    """The runtime directory is unusable (wrong owner, path too long, not writable)."""


class RunNotFound(LookupError):
    """No live run matches what the user asked for; the message says what is live."""


class AmbiguousRun(RunNotFound):
    """Several runs are live and the command changes one: the user must name it."""


def runtime_dir(create: bool = True) -> Path:
    """The per-user runtime directory, created 0700 (and tightened to 0700) when ``create``."""
    path = paths.runtime_dir()
    if create:
        ensure_private_dir(path)
    return path


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700, or tighten the user's own to 0700; refuse
    another user's directory, or a symbolic link another user owns (never changing its target)."""
    try:
        return ownfiles.private_dir(path)
    except ownfiles.UnsafeFile as exc:
        raise RegistryError(f"{exc} (set MEMTUI_RUNTIME_DIR to a directory of your own)")


def state_home() -> Path:
    """Where runs keep their audit log and tuned config unless the user gives a state_dir."""
    return paths.state_home()


def new_run_id(name: str | None = None) -> str:
    """A short, readable, unique run id: ``<script name>-<6 hex digits>``."""
    import secrets  # the hook's alone: the commands that read the registry start without it

    if not name:
        argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "python"
        name = Path(argv0).stem if argv0 not in ("-c", "-m") else "python"
        if name == "__main__":
            name = Path(argv0).parent.name or "python"
    slug = re.sub(r"[^a-zA-Z0-9_]+", "_", name).strip("_")[:16] or "run"
    return f"{slug}-{secrets.token_hex(3)}"


def ipc_endpoint(path: Path) -> str:
    """The ZeroMQ endpoint of a unix socket path, checked against the length limit."""
    text = str(path)
    if len(text) > MAX_IPC_PATH:
        raise RegistryError(
            f"socket path {text} is longer than {MAX_IPC_PATH} characters; "
            "set MEMTUI_RUNTIME_DIR to a shorter directory"
        )
    return f"ipc://{text}"


def endpoint_path(endpoint: str) -> Path | None:
    """The filesystem path of an ipc endpoint, None for other transports."""
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


@dataclass
class RunDir:
    """One run's directory in the runtime directory: its record and socket paths."""

    path: Path

    @property
    def record_path(self) -> Path:
        """The registry file."""
        return self.path / RUN_FILE

    def control_endpoint(self, rank: int = 0) -> str:
        """A rank's control socket (rank 0's takes changes; every rank answers hello)."""
        return ipc_endpoint(self.path / ("ctl" if rank == 0 else f"ctl{rank}"))

    def pub_endpoint(self, rank: int) -> str:
        """A rank's telemetry socket."""
        return ipc_endpoint(self.path / f"pub{rank}")

    def create(self) -> None:
        """Create the directory (0700) inside a private runtime directory."""
        ensure_private_dir(self.path.parent)
        ensure_private_dir(self.path)

    def write(self, record: RunRecord) -> None:
        """Write the record atomically with mode 0600 (a new temp file renamed over it)."""
        ownfiles.replace_file(self.record_path, encode_run_record(record))

    def remove(self) -> None:
        """Remove the directory and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)


def run_dir(run_id: str) -> RunDir:
    """The RunDir of ``run_id`` in the runtime directory."""
    return RunDir(runtime_dir(create=False) / run_id)


def process_create_time(pid: int) -> float:
    """The start time of ``pid`` as psutil reports it (0.0 if it is gone, a zombie included): on
    Linux psutil's own sum, read from /proc without importing psutil (the commands start sooner)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
        if fields[0] == b"Z":
            return 0.0
        with open("/proc/stat", "rb") as system:
            boot = next(line for line in system if line.startswith(b"btime"))
        # starttime (field 22 of /proc/PID/stat) in clock ticks since boot, plus the boot time
        return int(fields[19]) / os.sysconf("SC_CLK_TCK") + float(boot.split()[1])
    except FileNotFoundError:
        return 0.0 if os.path.isdir("/proc/self") else _psutil_create_time(pid)
    except (OSError, StopIteration, IndexError, ValueError):
        return _psutil_create_time(pid)


def _psutil_create_time(pid: int) -> float:
    import psutil

    try:
        process = psutil.Process(pid)
        return 0.0 if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except (psutil.Error, OSError):
        return 0.0


def is_alive(record: RunRecord) -> bool:
    """True when the record's process still runs (and is the same process, not a reused pid)."""
    created = process_create_time(record.pid)
    return created > 0 and abs(created - record.create_time) < 1.0


def process_exited(pid: int, host: str, started: float) -> bool:
    """True when a run's process is known gone: it ran on this host and no process with its
    pid started before the run did (a reused pid starts later; a zombie has exited)."""
    if pid <= 0 or host != _hostname():
        return False
    created = process_create_time(pid)
    return created == 0.0 or created > started + 1.0


def list_runs(clean: bool = True) -> list[RunRecord]:
    """Live runs, oldest first; entries of dead processes are skipped and (``clean``) removed."""
    root = runtime_dir(create=False)
    if not root.is_dir():
        return []
    runs: list[RunRecord] = []
    for entry in root.iterdir():
        record_file = entry / RUN_FILE
        try:
            data = record_file.read_bytes()
        except OSError:
            # a directory without a record: a run still starting, or debris of a dead one
            if clean and entry.is_dir() and _older_than(entry, 60.0):
                shutil.rmtree(entry, ignore_errors=True)
            continue
        record = decode_run_record(data)
        if record is None:
            continue
        if is_alive(record):
            runs.append(record)
        elif clean and record.host == _hostname():
            shutil.rmtree(entry, ignore_errors=True)
    runs.sort(key=lambda r: (r.started, r.run))
    return runs


def _older_than(path: Path, seconds: float) -> bool:
    with contextlib.suppress(OSError):
        return time.time() - path.stat().st_mtime > seconds
    return False


def _hostname() -> str:
    import socket

    return socket.gethostname()


@dataclass
class Target:
    """What a client connects to: a control endpoint, known telemetry endpoints, and why."""

    control: str
    ranks: list[RankInfo]
    run: str = ""
    note: str = ""
    """Said to the user on stderr, e.g. that the newest of several runs was picked."""
    record: RunRecord | None = None


def find_run(selector: str | None = None, *, changes: bool = False) -> Target:
    """Resolve a run id (or prefix), pid or endpoint to a Target; raise RunNotFound. Without a
    selector the newest live run is taken, unless several are live and the command ``changes``
    one (``set``, ``cancel``): then AmbiguousRun, which lists them."""
    if selector and ("://" in selector):
        return Target(control=selector, ranks=[], run="")
    runs = list_runs()
    if not selector:
        if not runs:
            raise RunNotFound("no live memtui run (start one, or run `memtui demo --no-tui`)")
        if changes and len(runs) > 1:
            listed = "; ".join(f"{r.run} (pid {r.pid}, {r.cwd or '?'})" for r in runs)
            raise AmbiguousRun(
                f"{len(runs)} live runs: name the one to change (memtui set RUN ...): {listed}"
            )
        newest = runs[-1]
        note = ""
        if len(runs) > 1:
            others = ", ".join(r.run for r in runs[:-1])
            note = f"{len(runs)} live runs; picked the newest, {newest.run} (others: {others})"
        return _target(newest, note)
    matches = [r for r in runs if r.run == selector]
    if not matches and selector.isdigit():
        pid = int(selector)
        matches = [r for r in runs if r.pid == pid or any(k.pid == pid for k in r.ranks)]
    if not matches:
        matches = [r for r in runs if r.run.startswith(selector)]
    if len(matches) == 1:
        return _target(matches[0], "")
    live = ", ".join(r.run for r in runs) or "none"
    if not matches:
        raise RunNotFound(f"no live run matches {selector!r} (live: {live})")
    raise RunNotFound(f"{selector!r} matches several runs: {', '.join(r.run for r in matches)}")


def _target(record: RunRecord, note: str) -> Target:
    return Target(
        control=record.control, ranks=list(record.ranks), run=record.run, note=note, record=record
    )


def _pick(local: str, tcp: str, host: str) -> str:
    """The local ipc endpoint when the rank is on this host and its socket is there for this
    user (another user's run dir is 0700: its socket is as good as on another node), else TCP."""
    path = endpoint_path(local) if local else None
    if path is not None and (not host or host == _hostname()):
        try:
            usable = path.exists() and os.access(path, os.R_OK | os.W_OK)
        except OSError:  # a directory this user cannot search
            usable = False
        if usable:
            return local
    return tcp or local


def rank_pub(rank: RankInfo) -> str:
    """The endpoint to subscribe to for a rank's telemetry from this host."""
    return _pick(rank.pub, rank.pub_tcp, rank.host)


def rank_control(rank: RankInfo) -> str:
    """The endpoint to ask a rank for its snapshot from this host."""
    return _pick(rank.control, rank.control_tcp, rank.host)
