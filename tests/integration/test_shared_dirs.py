"""Shared ground: what another account plants where a run writes is never turned against its user.

Two real accounts are created for the session (``useradd``; skipped, with the reason, where this
process may not): alice trains with memtui, mallory plants links, FIFOs and files of his own in
a directory both can write: a team checkpoint directory (0777) or one like ``/tmp`` (1777; the
kernel's ``fs.protected_symlinks``, off in many containers, is not relied on). Each side runs as
its own account in a child forked from the test (``tests.support.accounts``). alice's side is a
real Tuner: a change applied at a checkpoint, and the log lines it says.
"""

from __future__ import annotations

# ctypes and secrets: the hook imports them when it starts; imported here, before a child drops
# to an account that may not read the interpreter's own library
import ctypes  # noqa: F401
import logging
import os
import secrets  # noqa: F401
import shutil
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from memtui.hooks import Options, Tuner
from memtui.hooks.persist import AUDIT_FILE, TUNED_FILE
from memtui.storage import registry
from memtui.transport.recording import RecordingHeader, RecordingWriter, read_recording
from memtui.transport.security import SecurityError, keygen
from memtui.wire import SetRequest
from tests.support.accounts import BASHRC, Accounts, Child, as_user, one_line_each, plant


def train(
    state: str, resume: bool = False, runtime: str = "", record: str | None = None
) -> dict[str, Any]:
    """A run in ``state``: install (resuming if asked; publishing in ``runtime``, recording to
    ``record``, if given), apply ``grad_accum=2`` at a checkpoint; what it resumed, whether the
    change applied, and every line memtui said."""
    said: list[str] = []
    if runtime:
        os.environ["MEMTUI_RUNTIME_DIR"] = runtime

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("memtui").addHandler(Collect(logging.WARNING))
    config = SimpleNamespace(batch_size=32, grad_accum=1)
    options = Options(publish=bool(runtime), record=record)
    tuner = Tuner(config, state_dir=state, resume=resume, options=options).start()
    try:
        resumed = dict(vars(config))
        assert tuner.control.queue(SetRequest(changes={"grad_accum": 2})).ok
        tuner.step()
        applied = tuner.checkpoint() is not None and config.grad_accum == 2
    finally:
        tuner.close()
    return {"resumed": resumed, "applied": applied, "said": said}


@pytest.mark.parametrize("kind", ["symlink", "fifo", "own-file"])
def test_the_audit_log_is_never_written_into_what_another_account_planted(
    accounts: Accounts, home: Path, shared: Path, kind: str
) -> None:
    audit = shared / AUDIT_FILE
    as_user(accounts.mallory, plant, kind, str(audit), str(home / "bashrc"))
    before = os.lstat(audit)
    ran = as_user(accounts.alice, train, str(shared))
    assert ran["applied"], "training goes on, and takes its change"
    assert (home / "bashrc").read_text() == BASHRC, "alice's own file is untouched"
    after = os.lstat(audit)
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size), "nothing appended"
    said = [line for line in ran["said"] if str(audit) in line and "refused" in line]
    assert said, ran["said"]
    reason = {"symlink": "is a symbolic link", "fifo": "not a regular file", "own-file": "belongs"}
    assert reason[kind] in said[0]
    one_line_each(ran["said"])
    assert any("WARNING: the state dir" in line for line in ran["said"]), "the shared dir is said"


def test_a_hard_link_to_the_users_file_is_not_appended_to(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    """Where ``fs.protected_hardlinks`` is off any account can link another's file into a
    directory it can write; root plants the link here, as such an account could."""
    os.link(home / "bashrc", shared / AUDIT_FILE)
    ran = as_user(accounts.alice, train, str(shared))
    assert ran["applied"]
    assert (home / "bashrc").read_text() == BASHRC
    assert any("hard links" in line and "refused" in line for line in ran["said"]), ran["said"]
    one_line_each(ran["said"])


def test_a_link_planted_at_the_tuned_configs_temp_name_truncates_nothing(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    """The tuned config is written to a temp file and renamed: a temp name another account can
    guess (the pid is public) must be created new, never opened through a link."""
    alice = Child(accounts.alice, train, str(shared))
    for name in (f".{TUNED_FILE}.{alice.pid}.tmp", f".{TUNED_FILE}.tmp"):
        as_user(accounts.mallory, plant, "symlink", str(shared / name), str(home / "bashrc"))
    ran = alice.go()
    assert ran["applied"]
    assert (home / "bashrc").read_text() == BASHRC, "alice's own file is untouched"
    tuned = shared / TUNED_FILE
    info = os.lstat(tuned)
    assert stat.S_ISREG(info.st_mode) and info.st_uid == accounts.alice.pw_uid
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert yaml.safe_load(tuned.read_text())["config"]["grad_accum"] == 2


PLANTED_TUNED = "run: x\nstep: 1\nconfig:\n  batch_size: 7\n  grad_accum: 9\n"
"""A tuned config another account wrote: it would choose the run's memory."""


def write_tuned_file(path: str, mode: int, group: int | None = None) -> None:
    """Write ``PLANTED_TUNED`` at ``path`` with ``mode`` (and ``group``) as the caller."""
    Path(path).write_text(PLANTED_TUNED)
    os.chmod(path, mode)
    if group is not None:
        os.chown(path, -1, group)


@pytest.mark.parametrize("how", ["mallory's", "world-writable", "group-writable"])
def test_a_tuned_config_others_can_write_is_not_resumed(
    accounts: Accounts, shared: Path, how: str
) -> None:
    tuned = str(shared / TUNED_FILE)
    if how == "mallory's":
        as_user(accounts.mallory, write_tuned_file, tuned, 0o644)
    elif how == "world-writable":
        as_user(accounts.alice, write_tuned_file, tuned, 0o666)
    else:  # alice's, writable by mallory's group
        write_tuned_file(tuned, 0o664, accounts.mallory.pw_gid)
        os.chown(tuned, accounts.alice.pw_uid, -1)
    ran = as_user(accounts.alice, train, str(shared), True)
    assert ran["resumed"] == {"batch_size": 32, "grad_accum": 1}, "the script's config stands"
    refused = [line for line in ran["said"] if "resume failed" in line]
    assert len(refused) == 1, ran["said"]
    why = {"mallory's": "belongs to mtmallory", "world-writable": "every user"}
    assert why.get(how, f"group {accounts.mallory.pw_name}") in refused[0]
    assert "the script's config stands" in refused[0]
    one_line_each(ran["said"])
    assert ran["applied"]


@pytest.mark.parametrize("mode", [0o600, 0o664], ids=["0600", "0664-private-group"])
def test_the_users_own_tuned_config_is_resumed(
    accounts: Accounts, tmp_path: Path, mode: int
) -> None:
    """alice's own file resumes, group-writable too when the group is hers alone (user private
    groups with umask 002)."""
    state = Path(tempfile.mkdtemp(prefix="mtown", dir="/tmp"))
    try:
        os.chown(state, accounts.alice.pw_uid, accounts.alice.pw_gid)
        as_user(accounts.alice, write_tuned_file, str(state / TUNED_FILE), mode)
        ran = as_user(accounts.alice, train, str(state), True)
        assert ran["resumed"] == {"batch_size": 7, "grad_accum": 9}, ran["said"]
        assert not [line for line in ran["said"] if "WARNING: the state dir" in line]
    finally:
        shutil.rmtree(state, ignore_errors=True)


def runtime_dir_of(env: str) -> str:
    """Create the runtime dir named by ``MEMTUI_RUNTIME_DIR``; the error, in one line, if any."""
    os.environ["MEMTUI_RUNTIME_DIR"] = env
    try:
        registry.runtime_dir(create=True)
    except registry.RegistryError as exc:
        return str(exc)
    return ""


def test_a_runtime_dir_that_is_another_accounts_link_is_refused_and_its_target_kept(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    public = home / "public"
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    os.chown(public, accounts.alice.pw_uid, accounts.alice.pw_gid)
    link = shared / "memtui-run"
    as_user(accounts.mallory, plant, "symlink", str(link), str(public))
    refused = as_user(accounts.alice, runtime_dir_of, str(link))
    assert "symbolic link" in refused and "mtmallory" in refused, refused
    assert stat.S_IMODE(public.stat().st_mode) == 0o755, "never chmod'ed"
    assert list(public.iterdir()) == []


def test_a_run_whose_runtime_dir_is_another_accounts_link_trains_on_unpublished(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    link = shared / "memtui-run"
    as_user(accounts.mallory, plant, "symlink", str(link), str(home))
    ran = as_user(accounts.alice, train, str(home / "state"), False, str(link))
    assert ran["applied"], "training goes on, and takes its change"
    refused = [line for line in ran["said"] if "agent start failed" in line]
    assert len(refused) == 1 and "symbolic link" in refused[0], ran["said"]
    one_line_each(ran["said"])
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and sorted(home.iterdir()) == [
        home / "bashrc",
        home / "state",
    ], "nothing of the run's sockets or registry behind the link"


def test_root_refuses_a_runtime_dir_link_another_account_planted(
    accounts: Accounts, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root-owned 0755 directory behind another account's link stays 0755 and empty."""
    target = Path(tempfile.mkdtemp(prefix="mtroot", dir="/tmp"))
    try:
        target.chmod(0o755)
        link = shared / "memtui-run"
        as_user(accounts.mallory, plant, "symlink", str(link), str(target))
        monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(link))
        with pytest.raises(registry.RegistryError, match="symbolic link"):
            registry.runtime_dir()
        assert stat.S_IMODE(target.stat().st_mode) == 0o755 and not list(target.iterdir())
    finally:
        shutil.rmtree(target, ignore_errors=True)


def record(path: str) -> int | str:
    """Write a recording at ``path`` with umask 022; its mode, or why it was refused."""
    os.umask(0o022)
    try:
        with RecordingWriter(path, RecordingHeader(run="r", source="test")) as writer:
            writer.write(0.0, 0, b"frame")
    except OSError as exc:
        return str(exc)
    return stat.S_IMODE(os.stat(path).st_mode)


def test_recordings_are_private_and_never_written_through_a_link(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    """A recording holds the command line, the cwd and paths: 0600, and another account's link
    at a predictable path in /tmp neither truncates nor fills the file it points to."""
    mine = shared / "alice.mtrec"
    assert as_user(accounts.alice, record, str(mine)) == 0o600
    assert len(read_recording(mine).frames) == 1
    planted = shared / "run.mtrec"
    as_user(accounts.mallory, plant, "symlink", str(planted), str(home / "bashrc"))
    refused = as_user(accounts.alice, record, str(planted))
    assert "symbolic link" in str(refused) and "refused" in str(refused), refused
    assert (home / "bashrc").read_text() == BASHRC


def test_the_hooks_recording_is_never_written_through_another_accounts_link(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    planted = shared / "run.mtrec"
    as_user(accounts.mallory, plant, "symlink", str(planted), str(home / "bashrc"))
    runtime = home / "rt"
    ran = as_user(accounts.alice, train, str(home / "state"), False, str(runtime), str(planted))
    assert ran["applied"]
    assert (home / "bashrc").read_text() == BASHRC
    refused = [line for line in ran["said"] if "recording failed" in line]
    assert len(refused) == 1 and "symbolic link" in refused[0], ran["said"]
    one_line_each(ran["said"])


def test_keygen_refuses_another_accounts_link(
    accounts: Accounts, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys decide who may read and steer a run over TCP: never written behind a link
    another account planted (its directory would then hold them)."""
    target = Path(tempfile.mkdtemp(prefix="mtkeys", dir="/tmp"))
    try:
        target.chmod(0o755)
        link = shared / "curve"
        as_user(accounts.mallory, plant, "symlink", str(link), str(target))
        with pytest.raises(SecurityError, match="symbolic link"):
            keygen(directory=link)
        assert stat.S_IMODE(target.stat().st_mode) == 0o755 and not list(target.iterdir())
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_a_recording_made_by_hand_is_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = tmp_path / "run.mtrec"
        RecordingWriter(path, RecordingHeader(run="r")).close()
        path.chmod(0o644)  # one written before recordings were private: tightened when rewritten
        RecordingWriter(path, RecordingHeader(run="r")).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_recording(path).frames == []
