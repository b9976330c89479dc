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
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

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


def replace_file(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``path`` atomically: a new 0600 temp file beside it, renamed over it (removed if
    anything fails), flushed to the disk with its directory when ``durable`` (a crash leaves the
    old file or the new one, whole); raise OSError (``UnsafeFile`` for another user's file)."""

    def fill(fd: int) -> None:
        rest = data
        while rest:  # a short write is a full disk: os.write raises on the next one
            rest = rest[os.write(fd, rest) :]

    _replace(path, fill, durable)


def replace_with(path: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Write ``path`` atomically with ``write(handle)`` (a binary file object), as
    ``replace_file`` writes its bytes; raise OSError."""

    def fill(fd: int) -> None:
        with open(fd, "wb", closefd=False) as handle:
            write(handle)

    _replace(path, fill, durable)


def _replace(path: Path, fill: Callable[[int], None], durable: bool) -> None:
    """A new 0600 temp file of a random name beside ``path`` (never through a link), written by
    ``fill(fd)``, flushed to the disk when ``durable``, and renamed over ``path`` (its directory
    flushed too); the temp file is removed if anything fails."""
    tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, PRIVATE_FILE)
    try:
        try:
            os.set_blocking(fd, True)
            fill(fd)
            if durable:
                os.fsync(fd)
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
    if durable:
        sync_dir(path.parent)


TEMP_SUFFIX = ".tmp"
"""The end of the name of a temp file ``replace_with`` writes (``.NAME.<8 hex digits>.tmp``)."""


def sync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries to the disk (a file created or renamed there survives a
    crash); a file system that cannot is left as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory: nothing more to do
        pass
    finally:
        os.close(fd)


def remove_stale_temps(path: Path) -> list[str]:
    """Remove the temp files a killed writer of ``path`` left beside it (``replace_with``'s
    names), the user's own regular files only; the names removed."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}")
    removed: list[str] = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        if not pattern.fullmatch(name):
            continue
        entry = path.parent / name
        try:
            info = os.lstat(entry)
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                entry.unlink()
                removed.append(name)
        except OSError:
            continue
    return removed


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
    """Create ``path`` (and parents) 0700, or check that it is the user's and 0700
    (``open_private_dir``); ``path``."""
    os.close(open_private_dir(path))
    return path


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PATH_OPEN = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC
"""A directory held only to work inside it (search permission is enough where O_PATH exists)."""
_MAX_LINKS = 8


def open_private_dir(path: Path, *, create: bool = True) -> int:
    """A descriptor of the directory ``path``, the user's own and 0700, created 0700 (with its
    parents) when missing and ``create``; raise ``UnsafeFile`` for another user's directory or
    link, FileNotFoundError when it is missing and not ``create``.

    The last component is opened without following a link (``O_NOFOLLOW | O_DIRECTORY``) inside
    a held descriptor of its parent, and every check is made on the open descriptor, so that
    swapping the name between a directory and a link changes nothing memtui checked. A link there
    is followed only if the user or root owns it and no other account can replace it (its
    directory is writable by nobody else, or sticky), its target checked the same way. Only the
    held descriptor is tightened to 0700, and only where nobody else can have put the directory
    there (a user's directory with another mode, moved into a directory others can write, is
    refused instead of changed)."""
    return _open_private_dir(Path(os.path.abspath(path)), create, 0)


def _open_private_dir(path: Path, create: bool, links: int) -> int:
    if links > _MAX_LINKS:
        raise UnsafeFile(f"{path}: too many levels of symbolic links: refused")
    if create and path.parent != path:
        os.makedirs(path.parent, PRIVATE_DIR, exist_ok=True)
    parent = os.open(path.parent, _PATH_OPEN)
    try:
        name = path.name or "."
        created = False
        if create:
            try:
                os.mkdir(name, PRIVATE_DIR, dir_fd=parent)
                created = True
            except FileExistsError:
                pass
        try:
            fd = os.open(name, _DIR_OPEN | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.EACCES):
                owner = os.stat(name, dir_fd=parent, follow_symlinks=False).st_uid
                if owner != os.geteuid():
                    raise UnsafeFile(f"{path} belongs to {user_name(owner)}, not to you: refused")
                raise
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise
            return _follow(path, parent, create, links)
        try:
            _check_private_dir(fd, path, os.fstat(parent), created)
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(parent)


def _follow(path: Path, parent: int, create: bool, links: int) -> int:
    """Open the directory the link ``path`` names, if nobody but the user or root can have put
    the link there; raise ``UnsafeFile`` otherwise."""
    info = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
    if not stat.S_ISLNK(info.st_mode):
        raise UnsafeFile(f"{path} is not a directory: refused")
    target = os.readlink(path.name, dir_fd=parent)
    if info.st_uid not in (os.geteuid(), 0):
        raise UnsafeFile(
            f"{path} is a symbolic link (to {target}) owned by {user_name(info.st_uid)}, "
            "not by you: refused"
        )
    others = _replaceable(os.fstat(parent))
    if others:
        raise UnsafeFile(
            f"{path} is a symbolic link (to {target}) in a directory {others} can write: "
            "refused (they could replace it)"
        )
    return _open_private_dir(Path(os.path.normpath(path.parent / target)), create, links + 1)


def _check_private_dir(fd: int, path: Path, parent: os.stat_result, created: bool) -> None:
    """Refuse another user's directory; tighten the user's own to 0700 through ``fd``, unless
    another account could have moved it there (then refuse it, saying how to fix it)."""
    info = os.fstat(fd)
    _check_owner(info, path)
    mode = stat.S_IMODE(info.st_mode)
    if mode == PRIVATE_DIR:
        return
    others = "" if created else _replaceable(parent)
    if others:
        raise UnsafeFile(
            f"{path} is mode {mode:04o} in a directory {others} can write: refused "
            f"(chmod 700 {path} if it is yours)"
        )
    os.fchmod(fd, PRIVATE_DIR)  # the descriptor checked, never the path again


def _replaceable(parent: os.stat_result) -> str:
    """Who besides the user and root can replace the user's entries in a directory, in words
    ("": nobody): its owner, or the accounts that can write it when it is not sticky."""
    if parent.st_uid not in (os.geteuid(), 0):
        return f"its owner {user_name(parent.st_uid)}"
    if parent.st_mode & stat.S_ISVTX:
        return ""
    return _other_writers(parent)


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
