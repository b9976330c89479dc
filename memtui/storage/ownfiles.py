"""The files memtui writes, and reads back to steer a run, are the user's own: never another's.

A run's state dir is often a directory others can write (a team checkpoint directory 0777 or
1777, ``/tmp``). There another account can plant, under the name memtui is about to use, a
symbolic link to one of the user's files, a hard link, a FIFO or a file of its own, so that the
run appends to, truncates or reads what that account chose. Every file memtui writes is opened
here: never through a symbolic link (``O_NOFOLLOW``), created only new and 0600 (``O_EXCL``),
else checked on the open descriptor (``fstat``) to be a regular file the user owns, with one
link where others can write the directory. A file read back to steer a run (the tuned config,
the audit log) must be the user's and writable by nobody else, as ssh's StrictModes asks of
``authorized_keys``. A private directory (the runtime dir) is the user's, never through another
user's symbolic link, and only the user's is tightened to 0700. Every refusal is an
``UnsafeFile`` (an ``OSError``) of one line that says why.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from pathlib import Path

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Never through a link; a FIFO opens at once (and is refused) instead of blocking the run."""


class UnsafeFile(OSError):
    """A path memtui refuses to write or read: a link, another user's file, not a regular file."""


def open_write(path: Path, *, append: bool = False) -> int:
    """A blocking descriptor that writes ``path``: created new (0600) when missing, else the
    user's own regular file, appended to or emptied; raise ``UnsafeFile`` for anything else."""
    mode = os.O_WRONLY | _NOFOLLOW | (os.O_APPEND if append else 0)
    for _ in range(8):
        try:
            fd = os.open(path, mode | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
        except FileExistsError:  # a file or link there already: open it and check it
            try:
                fd = os.open(path, mode)
            except FileNotFoundError:
                continue  # removed in between: create it
            except OSError as exc:
                raise _refusal(path, exc) from None
            try:
                _check_writable(fd, path)
                if not append:
                    os.ftruncate(fd, 0)
            except BaseException:
                os.close(fd)
                raise
        os.set_blocking(fd, True)
        return fd
    raise UnsafeFile(f"{path} keeps appearing and vanishing: refused")


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` atomically: a new 0600 temp file beside it, renamed over it (removed if
    anything fails); raise OSError (``UnsafeFile`` for another user's file there)."""
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, PRIVATE_FILE)
    try:
        try:
            while data:  # a short write is a full disk: os.write raises on the next one
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except PermissionError as exc:  # a sticky directory keeps another user's file there
            raise _refusal(path, exc) from None
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def open_read(path: Path) -> int:
    """A descriptor that reads ``path`` if it is the user's own regular file, writable by nobody
    else (a symbolic link of the user's or root's is followed); raise ``UnsafeFile`` otherwise."""
    _check_link(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{path} is not a regular file: refused")
        _check_owner(info, path)
        writers = _other_writers(info)
        if writers:
            raise UnsafeFile(
                f"{path} is writable by {writers} (mode {stat.S_IMODE(info.st_mode):04o}): "
                f"refused (chmod go-w {path} if it is yours to trust)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) 0700, or check that it is the user's and tighten it to 0700;
    refuse another user's directory or symbolic link, never changing what is not the user's."""
    try:
        path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    except FileExistsError:  # a link to nothing, or not a directory
        _check_link(path)
        raise UnsafeFile(f"{path} is not a directory: refused") from None
    _check_link(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        _check_owner(info, path)
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIR:
            os.fchmod(fd, PRIVATE_DIR)  # the descriptor checked, not the path again
    finally:
        os.close(fd)
    return path


def shared_with(directory: Path) -> str:
    """Who besides the user can add, remove or replace files in ``directory``, in words ("":
    nobody but root; a directory that cannot be read says nothing)."""
    try:
        info = os.stat(directory)
    except OSError:
        return ""
    mode = f"mode {stat.S_IMODE(info.st_mode):04o}"
    if info.st_uid not in (os.geteuid(), 0):
        return f"its owner {user_name(info.st_uid)} ({mode})"
    writers = _other_writers(info)
    return f"{writers} ({mode})" if writers else ""


def user_name(uid: int) -> str:
    """A user's name and uid, for a message."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _other_writers(info: os.stat_result) -> str:
    """Who besides the owner may write what ``info`` describes ("" nobody): every user, or a
    group other than the user's private one (a group of the user alone, named after them)."""
    if info.st_mode & stat.S_IWOTH:
        return "every user"
    if info.st_mode & stat.S_IWGRP and not _own_group(info.st_gid):
        try:
            return f"group {grp.getgrgid(info.st_gid).gr_name}"
        except KeyError:
            return f"group {info.st_gid}"
    return ""


def _own_group(gid: int) -> bool:
    """True for the user's private group (the user's primary group, named after them, with no
    other member), which makes group-writable files the user's alone."""
    try:
        user = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    return (
        gid == user.pw_gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}
    )


def _check_owner(info: os.stat_result, path: Path) -> None:
    """Refuse what another user owns."""
    if info.st_uid != os.geteuid():
        raise UnsafeFile(f"{path} belongs to {user_name(info.st_uid)}, not to you: refused")


def _check_link(path: Path) -> None:
    """Refuse a symbolic link owned by someone other than the user or root."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode) and info.st_uid not in (os.geteuid(), 0):
        raise UnsafeFile(
            f"{path} is a symbolic link{_target(path)} owned by {user_name(info.st_uid)}, "
            "not by you: refused"
        )


def _check_writable(fd: int, path: Path) -> None:
    """Refuse to write an open file that is not the user's own regular file, or one another
    account linked into a directory it can write (a hard link to one of the user's files)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(f"{path} is not a regular file: refused")
    _check_owner(info, path)
    if info.st_nlink > 1:
        others = shared_with(path.parent)
        if others:
            raise UnsafeFile(
                f"{path} has {info.st_nlink} hard links in a directory {others} can write: "
                "refused (it may be another of your files, linked there)"
            )
    if stat.S_IMODE(info.st_mode) & ~PRIVATE_FILE:
        os.fchmod(fd, PRIVATE_FILE)  # the user's own file, written before files were 0600


def _refusal(path: Path, exc: OSError) -> OSError:
    """The error to raise for ``exc`` from opening ``path``: why, in one line."""
    if exc.errno == errno.ELOOP:
        return UnsafeFile(
            f"{path} is a symbolic link{_target(path)}: refused "
            "(memtui writes no file through a link)"
        )
    if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened without blocking
        return UnsafeFile(f"{path} is not a regular file: refused")
    if exc.errno in (errno.EPERM, errno.EACCES):
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            return exc
        if owner != os.geteuid():
            return UnsafeFile(f"{path} belongs to {user_name(owner)}, not to you: refused")
    return exc


def _target(path: Path) -> str:
    """`` (to TARGET)`` for a symbolic link, for a message."""
    try:
        return f" (to {os.readlink(path)})"
    except OSError:
        return ""
