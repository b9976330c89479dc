"""Another account on the host never gets memtui's commands, its demo or a run to act for it.

Two real accounts (``tests.support.accounts``): mallory plants files, links and directories where
alice (or root) works, swaps them while she looks, or moves her runtime directory away; alice runs
memtui's commands and trainings, each side as its own account in a forked child. What alice must
never do: run mallory's code, write through mallory's links, read or steer mallory's runs as her
own, change a directory she did not mean to, or lose her run's control.
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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memtui.demo.launcher import DemoFailed, demo_command_line, demo_environment, run_with_viewer
from memtui.hooks import Options, Tuner
from memtui.storage import ownfiles, registry
from memtui.transport.client import ControlClient
from tests.support.accounts import BASHRC, Accounts, Child, as_user, one_line_each, plant
from tests.support.processes import LIGHT, ROOT, launch_demo, wait_for

pytestmark = pytest.mark.heavy  # two accounts' trainings and races of a few seconds each

# ------------------------------------------------------------------ the runtime directory


def swap(path: str, target: str, seconds: float) -> int:
    """As mallory: swap ``path`` between a directory of hers and a link to ``target`` for
    ``seconds`` (moving away whatever alice made there); the swaps made."""
    own, link, junk = path + ".d", path + ".l", path + ".junk"
    os.mkdir(own)
    os.symlink(target, link)
    swaps = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for there in (own, link):
            try:
                os.rename(there, path)
                os.rename(path, there)
                swaps += 1
            except OSError:  # alice's own directory in the way: out of it, where mallory can
                try:
                    os.rename(path, f"{junk}{swaps}")
                except OSError:
                    pass
    return swaps


def check_again_and_again(path: str, public: str, seconds: float) -> dict[str, int]:
    """As alice: take ``path`` as her runtime directory (the check the hook and every command
    make) for ``seconds``; how often it was missing, refused, taken as her own, or taken while
    it was ``public`` (another of her directories) or not hers."""
    public_ino = os.stat(public).st_ino
    counts = {"missing": 0, "refused": 0, "own": 0, "wrong": 0}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            fd = ownfiles.open_private_dir(Path(path), create=False)
        except FileNotFoundError:
            counts["missing"] += 1
            continue
        except OSError:
            counts["refused"] += 1
            continue
        info = os.fstat(fd)
        os.close(fd)
        mine = info.st_uid == os.geteuid() and info.st_ino != public_ino
        counts["own" if mine else "wrong"] += 1
    return counts


def test_swapping_a_directory_and_a_link_never_makes_alice_chmod_or_take_it(
    accounts: Accounts, home: Path, shared: Path
) -> None:
    """The check of the runtime directory and the use of it are one open descriptor: mallory
    swapping her directory and a link to one of alice's (``lstat``, then an ``open`` that
    followed the link) never gets alice to tighten that directory to 0700 or take it."""
    public = home / "public"
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    os.chown(public, accounts.alice.pw_uid, accounts.alice.pw_gid)
    path = str(shared / "memtui-rt")
    mallory = Child(accounts.mallory, swap, path, str(public), 2.0)
    alice = Child(accounts.alice, check_again_and_again, path, str(public), 2.0)
    mallory.start()
    alice.start()
    counts, swaps = alice.result(), mallory.result()
    assert swaps > 100, "the swaps raced the checks"
    assert counts["wrong"] == 0 and counts["own"] == 0, counts
    assert counts["refused"] > 100, counts
    assert stat.S_IMODE(public.stat().st_mode) == 0o755, "never chmod'ed"
    assert list(public.iterdir()) == []


def run_in(runtime: str, state: str, seconds: float, argv: list[str]) -> dict[str, Any]:
    """As mallory: a live run publishing in ``runtime`` for ``seconds``, its command line
    ``argv`` (with terminal escapes); the changes it took, and its run id."""
    os.environ["MEMTUI_RUNTIME_DIR"] = runtime
    sys.argv = argv
    config = SimpleNamespace(batch_size=32, num_workers=0)
    tuner = Tuner(config, name="mallory", state_dir=state, options=Options()).start()
    applied = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tuner.step()
            if tuner.checkpoint() is not None:
                applied.append(dict(vars(config)))
            time.sleep(0.05)
    finally:
        tuner.close()
    return {"applied": applied, "run": tuner.run_id}


def commands_in(runtime: str) -> dict[str, Any]:
    """As alice (or root): ``memtui ls`` and ``memtui set num_workers=2`` with ``runtime`` as
    the runtime directory; each command's exit status and output."""
    from click.testing import CliRunner

    from memtui.cli import main

    os.environ["MEMTUI_RUNTIME_DIR"] = runtime
    said = {}
    for name, args in (("ls", ["ls"]), ("set", ["set", "num_workers=2"])):
        result = CliRunner().invoke(main, args)
        said[name] = {"code": result.exit_code, "out": result.stdout, "err": result.stderr}
    return said


def test_the_commands_refuse_a_runtime_dir_another_account_made(
    accounts: Accounts, shared: Path
) -> None:
    """mallory made alice's runtime directory first and runs there, her command line full of
    terminal escapes: alice's ``memtui ls`` and ``memtui set`` refuse the directory in one
    line (as the hook does), show nothing of mallory's run, and change nothing of it."""
    runtime = str(shared / "memtui-alice")
    os.mkdir(runtime, 0o700)
    os.chmod(runtime, 0o700)
    os.chown(runtime, accounts.mallory.pw_uid, accounts.mallory.pw_gid)
    escapes = ["train.py", "\x1b]0;owned\x07\x1b[2J"]
    mallory = Child(accounts.mallory, run_in, runtime, str(shared / "mstate"), 3.0, escapes)
    mallory.start()
    wait_for(lambda: list(Path(runtime).glob("mallory-*/run.json")), 10, what="her run")
    for said in (as_user(accounts.alice, commands_in, runtime), commands_in(runtime)):  # and root
        for command in ("ls", "set"):
            result = said[command]
            assert result["code"] == 1, (command, result)
            assert result["out"] == "", (command, result)
            assert "belongs to mtmallory" in result["err"] and "refused" in result["err"]
            assert result["err"].count("\n") == 1 and "\x1b" not in result["err"], result
    ran = mallory.result()
    assert ran["applied"] == [], "nothing of alice's reached mallory's run"


def live_run(runtime: str, state: str, changes: int, seconds: float) -> dict[str, Any]:
    """As alice: a run publishing in ``runtime`` that keeps stepping until it took ``changes``
    changes (or ``seconds`` passed); its steps, the changes it took, and what memtui said."""
    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("memtui").addHandler(Collect(logging.INFO))
    os.environ["MEMTUI_RUNTIME_DIR"] = runtime
    config = SimpleNamespace(batch_size=32, num_workers=0)
    tuner = Tuner(config, name="alice", state_dir=state, options=Options()).start()
    applied = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(applied) < changes:
            tuner.step()
            if tuner.checkpoint() is not None:
                applied.append(dict(vars(config)))
            time.sleep(0.05)
    finally:
        tuner.close()
    return {"steps": tuner.step_count, "applied": applied, "said": said, "run": tuner.run_id}


def move_away(runtime: str) -> None:
    """As mallory: rename alice's runtime directory and make one of her own in its place."""
    os.rename(runtime, runtime + ".moved")
    os.mkdir(runtime, 0o755)


def take_back(runtime: str) -> None:
    """As mallory: remove her directory from alice's runtime directory's place."""
    os.rmdir(runtime)


def set_workers(runtime: str, workers: int, timeout: float, moved: str = "") -> dict[str, Any]:
    """As alice: queue ``num_workers=WORKERS`` on her live run, found in the registry (or at its
    control socket in the ``moved`` runtime directory), retrying until it answers or ``timeout``
    seconds passed; whether it was queued, or why not."""
    os.environ["MEMTUI_RUNTIME_DIR"] = runtime
    end = time.monotonic() + timeout
    why = ""
    while time.monotonic() < end:
        try:
            if moved:
                (run,) = [p for p in Path(moved).iterdir() if p.name.startswith("alice")]
                control = f"ipc://{run / 'ctl'}"
            else:
                control = registry.find_run("alice").control
            reply = ControlClient(control, timeout_s=2).set({"num_workers": workers})
            return {"ok": reply.ok, "why": reply.reason}
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    return {"ok": False, "why": why}


def test_a_live_run_whose_runtime_dir_is_moved_away_trains_on_and_registers_again(
    accounts: Accounts, home: Path
) -> None:
    """mallory renames alice's runtime directory (its parent is writable by others) and puts one
    of hers in its place: alice's run trains on, says so once and keeps serving its sockets where
    they went (a change queued there lands), and registers again once the place is free (a
    change queued through the registry lands too)."""
    parent = Path(tempfile.mkdtemp(prefix="mtgrp", dir="/tmp"))
    try:
        parent.chmod(0o777)
        runtime = str(parent / "rt")
        alice = Child(accounts.alice, live_run, runtime, str(home / "state"), 2, 60.0)
        alice.start()
        time.sleep(1.5)
        as_user(accounts.mallory, move_away, runtime)
        time.sleep(2.5)  # the run checks its registry every 2 s
        moved = as_user(accounts.alice, set_workers, runtime, 2, 4.0, runtime + ".moved")
        as_user(accounts.mallory, take_back, runtime)
        again = as_user(accounts.alice, set_workers, runtime, 3, 6.0)
        ran = alice.result(70.0)
        assert moved["ok"] and again["ok"], (moved, again, ran["said"])
        assert [a["num_workers"] for a in ran["applied"]] == [2, 3], ran["said"]
        assert ran["steps"] > 40, "training went on"
        displaced = [line for line in ran["said"] if "was moved or replaced" in line]
        assert len(displaced) == 1 and "mtmallory" in displaced[0], ran["said"]
        assert any("vanished; recreated it" in line for line in ran["said"]), ran["said"]
        one_line_each(ran["said"])
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def list_as_user(runtime: str) -> dict[str, Any]:
    """As alice: ``memtui ls`` on ``runtime``; its exit status and stderr."""
    from click.testing import CliRunner

    from memtui.cli import main

    os.environ["MEMTUI_RUNTIME_DIR"] = runtime
    result = CliRunner().invoke(main, ["ls"])
    return {"code": result.exit_code, "err": result.stderr, "out": result.stdout}


def test_ls_on_an_unreadable_runtime_dir_is_one_line(accounts: Accounts, home: Path) -> None:
    runtime = home / "rt"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, accounts.alice.pw_uid, accounts.alice.pw_gid)
    runtime.chmod(0o000)
    said = as_user(accounts.alice, list_as_user, str(runtime))
    assert said["code"] == 1 and said["out"] == "", said
    assert said["err"].startswith(f"memtui: cannot open the runtime directory {runtime}: ")
    assert said["err"].count("\n") == 1 and "Traceback" not in said["err"], said


# ------------------------------------------------------------------ the demo


PLANTED_MODULE = """
import os
open(os.path.join(os.path.dirname(__file__), "ran-" + __name__), "w").close()
raise SystemExit("mallory's {name}.py ran")
"""


def plant_modules(directory: str) -> None:
    """As mallory: modules named as the demo's imports, in her directory (0777 for alice to
    run in), each leaving a mark where it ran."""
    for name in ("torch", "zmq", "yaml", "msgspec", "psutil"):
        Path(directory, f"{name}.py").write_text(PLANTED_MODULE.format(name=name))
    os.chmod(directory, 0o777)


@pytest.fixture
def mallorys_dir(accounts: Accounts) -> Iterator[Path]:
    """A directory of mallory's that anyone may run a command from, her modules planted."""
    path = Path(tempfile.mkdtemp(prefix="mtcwd", dir="/tmp"))
    os.chown(path, accounts.mallory.pw_uid, accounts.mallory.pw_gid)
    as_user(accounts.mallory, plant_modules, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def demo_in(cwd: Path, argv: list[str], ranks: int = 1) -> subprocess.CompletedProcess[str]:
    """The demo training's own command line (``memtui demo``'s), run from ``cwd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **demo_environment()}
    return subprocess.run(
        demo_command_line(argv, ranks),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture
def team_dir() -> Iterator[Path]:
    """A directory every account can write, like ``/tmp`` (1777)."""
    path = Path(tempfile.mkdtemp(prefix="mtteam", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_demo_neither_imports_nor_writes_what_another_account_planted(
    accounts: Accounts, mallorys_dir: Path, home: Path, team_dir: Path
) -> None:
    """Run from mallory's directory, the demo's training imports none of her modules (the
    working directory is off its module search path); with ``--out`` in a shared directory
    where she linked ``checkpoint.tmp`` and ``demo.log`` to a file the user can write, nothing
    is written through the links, and its checkpoint is the user's 0600 file."""
    victim = home / "bashrc"
    out = team_dir / "demo"
    as_user(accounts.mallory, os.mkdir, str(out))
    os.chmod(out, 0o777)
    for name in ("checkpoint.tmp", "demo.log", ".checkpoint.pt.tmp"):
        as_user(accounts.mallory, plant, "symlink", str(out / name), str(victim))
    ran = demo_in(mallorys_dir, [*LIGHT, "--steps", "4", "--checkpoint-every", "2",
                                 "--out", str(out)])  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not list(mallorys_dir.glob("ran-*")), "mallory's modules never ran"
    assert victim.read_text() == BASHRC, "nothing written through her links"
    checkpoint = os.lstat(out / "checkpoint.pt")
    assert stat.S_ISREG(checkpoint.st_mode) and checkpoint.st_uid == os.geteuid()
    assert stat.S_IMODE(checkpoint.st_mode) == 0o600
    left = [p for p in out.iterdir() if p.name.startswith(".checkpoint.pt.")]
    assert [os.lstat(p).st_uid for p in left] == [accounts.mallory.pw_uid], "no temp file left"
    with pytest.raises(DemoFailed, match="symbolic link"):  # the viewer's log, before it starts
        run_with_viewer([sys.executable, "-c", "pass"], out)
    assert victim.read_text() == BASHRC


def test_the_demo_keeps_the_working_directory_off_every_processs_module_path() -> None:
    """The demo's command line runs its module with ``-P`` (or a start that removes the working
    directory) and gives the interpreters it starts (torchrun's ranks) ``PYTHONSAFEPATH``."""
    one, job = demo_command_line(["--steps", "1"]), demo_command_line(["--steps", "1"], 2)
    if sys.version_info >= (3, 11):
        assert one[1:4] == ["-P", "-m", "memtui.demo"] and job[1:4] == [
            "-P",
            "-m",
            "torch.distributed.run",
        ]
        assert demo_environment() == {"PYTHONSAFEPATH": "1"}
    else:
        assert one[1] == job[1] == "-c" and "del sys.path[0]" in one[2]


@pytest.mark.slow  # torchrun's launcher and two ranks, each importing torch: ~12 s
def test_the_demo_under_torchrun_imports_nothing_from_the_working_directory(
    mallorys_dir: Path, tmp_path: Path
) -> None:
    """``--ranks 2``: torchrun's launcher and both ranks keep the working directory off their
    module search path."""
    out = tmp_path / "out"
    ran = demo_in(mallorys_dir, [*LIGHT, "--steps", "2", "--out", str(out)], ranks=2)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not list(mallorys_dir.glob("ran-*")), "mallory's modules never ran"


def plant_checkpoint(path: str) -> None:
    """As mallory: a checkpoint of hers where the demo resumes from (a pickle runs code)."""
    Path(path).write_bytes(b"not the user's checkpoint")
    os.chmod(path, 0o666)


def test_the_demo_resumes_from_no_checkpoint_another_account_wrote(
    accounts: Accounts, team_dir: Path
) -> None:
    """A checkpoint is unpickled (whoever wrote it runs code in the training): one that mallory
    wrote, or that others can write, is refused in one line."""
    out = team_dir / "resume"
    as_user(accounts.mallory, os.mkdir, str(out))
    os.chmod(out, 0o777)
    as_user(accounts.mallory, plant_checkpoint, str(out / "checkpoint.pt"))
    log = team_dir / "resume.log"
    demo = launch_demo([*LIGHT, "--steps", "2", "--resume", "--out", str(out)], {**os.environ}, log)
    assert demo.wait(60) == 2, log.read_text()[-3000:]
    said = log.read_text()
    refused = [line for line in said.splitlines() if "not resuming" in line]
    assert len(refused) == 1 and "belongs to mtmallory" in refused[0], said[-3000:]
    assert "Traceback" not in said
