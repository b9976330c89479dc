"""The per-user runtime directory (mode 0700), one registry file per live run, and discovery.

Layout: ``<runtime>/<run id>/run.json`` (the RunRecord) beside the run's ipc sockets
``ctl`` (rank 0's control socket) and ``pub<rank>`` (each rank's telemetry). The runtime
directory is ``$MEMTUI_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/memtui``, else
``~/.cache/memtui/run``. Entries of dead processes are ignored and removed (a run is dead when its
process is gone, or when its pid now names another process and its control socket does not answer:
never because the wall clock stepped). A runtime directory that is another user's, another user's
symbolic link, or not 0700 is refused by the hook and by every command alike
(``ownfiles.open_private_dir``), as OpenSSH and systemd refuse theirs; the commands read it
through the descriptor they checked.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
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
    os.close(open_private_dir(path))
    return path


def open_private_dir(path: Path, create: bool = True) -> int:
    """A checked descriptor of the private directory ``path`` (``ownfiles.open_private_dir``);
    raise RegistryError, in one line, when it is not usable (FileNotFoundError when it is
    missing and not ``create``)."""
    try:
        return ownfiles.open_private_dir(path, create=create)
    except ownfiles.UnsafeFile as exc:
        raise RegistryError(f"{exc} (set MEMTUI_RUNTIME_DIR to a directory of your own)")
    except FileNotFoundError:
        if create:
            raise RegistryError(f"cannot create the runtime directory {path}") from None
        raise
    except OSError as exc:
        raise RegistryError(
            f"cannot open the runtime directory {path}: {exc.strerror or exc} "
            f"(chmod 700 {path}, or set MEMTUI_RUNTIME_DIR to a directory of your own)"
        ) from None


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
        """Create the directory (0700) inside the private runtime directory, through the runtime
        directory's checked descriptor."""
        root = open_private_dir(self.path.parent)
        try:
            try:
                os.mkdir(self.path.name, ownfiles.PRIVATE_DIR, dir_fd=root)
            except FileExistsError:
                pass
            fd = os.open(self.path.name, _DIR_FLAGS, dir_fd=root)
            try:
                if os.fstat(fd).st_uid != os.geteuid():
                    raise RegistryError(f"{self.path} is not yours: refused")
                os.fchmod(fd, ownfiles.PRIVATE_DIR)
            finally:
                os.close(fd)
        except OSError as exc:
            raise RegistryError(f"cannot create {self.path}: {exc.strerror or exc}") from None
        finally:
            os.close(root)

    def write(self, record: RunRecord) -> None:
        """Write the record atomically with mode 0600 (a new temp file renamed over it)."""
        # the runtime directory is often a tmpfs: nothing there outlives a crash to sync for
        ownfiles.replace_file(self.record_path, encode_run_record(record), durable=False)

    def remove(self) -> None:
        """Remove the directory and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_RECORD_BYTES = 1 << 20
"""A registry file is a few KiB: anything larger is not one."""


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


def is_alive(record: RunRecord, run_path: Path | None = None) -> bool:
    """True when the record's process still runs: its pid started when the record says, or, where
    the start times differ (a reused pid, or a wall clock stepped since: the start time is read
    against the boot time, which moves with the clock), its control socket (in ``run_path``, else
    the record's) still takes a connection."""
    created = process_create_time(record.pid)
    if created <= 0:
        return False
    if abs(created - record.create_time) < 1.0:
        return True
    socket_path = run_path / "ctl" if run_path is not None else endpoint_path(record.control)
    return socket_path is not None and answers(socket_path)


def answers(path: Path) -> bool:
    """Whether a process listens on the Unix socket ``path`` (a connection made and closed)."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def process_exited(pid: int, host: str, started: float) -> bool:
    """True when a run's process is known gone: it ran on this host and no process with its
    pid started before the run did (a reused pid starts later; a zombie has exited)."""
    if pid <= 0 or host != _hostname():
        return False
    created = process_create_time(pid)
    return created == 0.0 or created > started + 1.0


def list_runs(clean: bool = True) -> list[RunRecord]:
    """Live runs, oldest first; entries of dead processes are skipped and (``clean``) removed.
    Raise RegistryError, in one line, for a runtime directory that is not the user's private one
    (another user's, a link of theirs, one that cannot be read)."""
    root_path = runtime_dir(create=False)
    try:
        root = open_private_dir(root_path, create=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        return _list_runs(root, root_path, clean)
    finally:
        os.close(root)


def _list_runs(root: int, root_path: Path, clean: bool) -> list[RunRecord]:
    """The live runs in the runtime directory held open as ``root``."""
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise RegistryError(f"cannot read the runtime directory {root_path}: {exc.strerror}")
    runs: list[RunRecord] = []
    held = _held(root, root_path)
    for name in names:
        entry = root_path / name
        data = _read_record(root, name)
        if data is None:
            # a directory without a record: a run still starting, or debris of a dead one
            if clean and _debris(root, name, held / name):
                _remove(root, name, entry)
            continue
        record = decode_run_record(data)
        if record is None:
            continue
        if is_alive(record, held / name):
            runs.append(record)
        elif clean and record.host == _hostname():
            _remove(root, name, entry)
    runs.sort(key=lambda r: (r.started, r.run))
    return runs


def _read_record(root: int, name: str) -> bytes | None:
    """The registry file of the run directory ``name`` (None: none, or not the user's own
    regular file of a registry file's size), read through descriptors, never through a link."""
    try:
        directory = os.open(name, _DIR_FLAGS, dir_fd=root)
    except OSError:
        return None
    try:
        fd = os.open(RUN_FILE, _FILE_FLAGS, dir_fd=directory)
    except OSError:
        return None
    finally:
        os.close(directory)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        chunks, size = [], 0
        while size <= MAX_RECORD_BYTES:
            chunk = os.read(fd, max(info.st_size - size, 0) + 4096)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks) if size <= MAX_RECORD_BYTES else None


_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _held(root: int, root_path: Path) -> Path:
    """The runtime directory as a path through its held descriptor where the system has one
    (``/proc/self/fd``), so that what is probed in it is what was read; else its path."""
    held = Path(f"/proc/self/fd/{root}")
    return held if held.is_dir() else root_path


def _debris(root: int, name: str, held: Path) -> bool:
    """Whether a directory without a record (``held``: its path through the runtime directory's
    descriptor) is a dead run's: older than a minute by its modification time and no socket in it
    answers (a clock stepped forward makes a starting run look old; its sockets say it is not)."""
    try:
        info = os.stat(name, dir_fd=root, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or time.time() - info.st_mtime <= 60.0:
        return False
    try:
        sockets = [held / child for child in os.listdir(held) if child.startswith(("ctl", "pub"))]
    except OSError:
        return False
    return not any(answers(path) for path in sockets)


def _remove(root: int, name: str, entry: Path) -> None:
    """Remove a dead run's directory, inside the held runtime directory where Python can."""
    if sys.version_info >= (3, 11):
        shutil.rmtree(name, ignore_errors=True, dir_fd=root)
    else:
        shutil.rmtree(entry, ignore_errors=True)


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
