"""Two real accounts on this host, alice and mallory, for what another account can do to a
user's runs, files and commands (``accounts``; skipped, with the reason, where this process may not
create them), and running a function as one of them in a forked child (``as_user``, ``Child``).

Each side runs as its own account in a child forked from the test after memtui is imported
(setgid, then setuid: the interpreter may live where the accounts cannot read); a child that
blocks is killed after ``CHILD_TIMEOUT_S`` and fails its test.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

CHILD_TIMEOUT_S = 20.0
"""A child still running after this long is blocked (a FIFO opened for writing): killed."""
BASHRC = "alias ll='ls -l'\n"
"""What alice's own file holds before the run, and must hold after it."""


@dataclass(frozen=True)
class Accounts:
    """The two accounts: alice runs memtui, mallory shares her directories."""

    alice: pwd.struct_passwd
    mallory: pwd.struct_passwd


@pytest.fixture(scope="session")
def accounts() -> Iterator[Accounts]:
    """Two fresh accounts with private groups, removed after the session."""
    if os.geteuid() != 0:
        pytest.skip("creating a second real user needs root (useradd)")
    missing = [tool for tool in ("useradd", "userdel") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {', '.join(missing)} here: cannot create a second real user")
    names = [f"mtalice{os.getpid()}", f"mtmallory{os.getpid()}"]
    made = []
    try:
        for name in names:
            command = ["useradd", "-M", "-U", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", name]
            for _ in range(10):  # /etc/passwd is locked while another useradd runs
                result = subprocess.run(command, capture_output=True, text=True)
                if result.returncode == 0 or "lock" not in result.stderr:
                    break
                time.sleep(0.5)
            if result.returncode != 0:
                pytest.skip(f"useradd {name} failed: {result.stderr.strip()}")
            made.append(name)
        yield Accounts(*(pwd.getpwnam(name) for name in names))
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True, check=False)


@pytest.fixture
def home(accounts: Accounts) -> Iterator[Path]:
    """alice's private directory (0700), holding her own ``bashrc`` (0600)."""
    path = Path(tempfile.mkdtemp(prefix="mthome", dir="/tmp"))
    (path / "bashrc").write_text(BASHRC)
    for item in (path, path / "bashrc"):
        os.chown(item, accounts.alice.pw_uid, accounts.alice.pw_gid)
    (path / "bashrc").chmod(0o600)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=[0o777, 0o1777], ids=["team-dir-0777", "sticky-1777"])
def shared(request: pytest.FixtureRequest, accounts: Accounts) -> Iterator[Path]:
    """A directory every account can write (a team checkpoint directory, or one like /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="mtshared", dir="/tmp"))
    path.chmod(request.param)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Child:
    """A function run in a forked child as another account, started when told ``go``."""

    def __init__(self, user: pwd.struct_passwd, fn: Callable[..., Any], *args: Any) -> None:
        self._result_r, result_w = os.pipe()
        go_r, self._go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: drop to the account, wait for go, run, answer, exit
            answer: dict[str, Any]
            try:
                os.close(self._result_r)
                os.close(self._go_w)
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                os.read(go_r, 1)
                answer = {"value": fn(*args)}
            except BaseException as exc:
                answer = {"raised": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
            data = json.dumps(answer, default=str).encode()
            while data:
                data = data[os.write(result_w, data) :]
            os._exit(0)
        os.close(result_w)
        os.close(go_r)

    def go(self) -> Any:
        """Let the child run; its function's value (fail the test if it raised or blocked)."""
        self.start()
        return self.result()

    def start(self) -> None:
        """Let the child run, without waiting for it."""
        os.write(self._go_w, b"g")
        os.close(self._go_w)

    def result(self, timeout: float = CHILD_TIMEOUT_S) -> Any:
        """The value of the child's function, once it returns (fail the test if it raised or
        ran past ``timeout`` seconds)."""
        chunks = []
        try:
            while True:
                ready, _, _ = select.select([self._result_r], [], [], timeout)
                if not ready:
                    os.kill(self.pid, signal.SIGKILL)
                    pytest.fail(f"the child blocked for {timeout:.0f} s (killed)")
                chunk = os.read(self._result_r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self._result_r)
            os.waitpid(self.pid, 0)
        answer = json.loads(b"".join(chunks) or b"{}")
        if "value" not in answer:
            pytest.fail(f"the child failed: {answer.get('raised')}\n{answer.get('tb', '')}")
        return answer["value"]


def as_user(user: pwd.struct_passwd, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run as ``user`` in a forked child; its value."""
    return Child(user, fn, *args).go()


def one_line_each(said: list[str]) -> None:
    """Every line memtui said is one line, with no traceback."""
    assert all("\n" not in line and "Traceback" not in line for line in said), said


def plant(kind: str, path: str, target: str) -> None:
    """What another account leaves at ``path``: a link to ``target``, a FIFO, or its own file."""
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "fifo":
        os.mkfifo(path)
        os.chmod(path, 0o666)  # umask aside: alice may open it for writing
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.write(fd, b'{"run": "x", "event": "planted"}\n')
        os.close(fd)
        os.chmod(path, 0o666)  # umask aside: everyone may read what alice appends
