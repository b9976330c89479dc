"""A second, real user on this host, for what another account sees of a run (``OtherUser``).

``make_other_user`` creates one with ``useradd`` (root only; skipped with the reason anywhere it
cannot be), finds a Python it can run memtui with (this interpreter, or the system's of the same
version over this venv's packages where this one lies in a directory it cannot enter), gives it a
private home, and removes it all at the end. Run as ``python -m tests.support.other_user viewer ...`` (as
that user), this module is also the other user's viewer: it prints what it saw as one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import clock

ROOT = Path(__file__).resolve().parents[2]
_USERS = itertools.count()


@dataclass
class OtherUser:
    """Another account on this host: who it is and how to run memtui as it."""

    name: str
    uid: int
    gid: int
    home: Path
    """Its own 0700 directory: its home, runtime directory and state."""
    python: list[str]
    """The interpreter (and flags) it runs memtui with."""
    env: dict[str, str]
    """Its whole environment: nothing of this process's (runtime dir, keys) leaks into it."""

    def run(
        self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``python ARGS`` as this user, from its home (``env``: added to its environment;
        ``timeout``: seconds of an idle machine, stretched by the load while it runs)."""
        return clock.run(
            [*self.python, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.home,
            env={**self.env, **(env or {})},
            user=self.uid,
            group=self.gid,
            extra_groups=[],
        )

    def report(self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Any:
        """The JSON line ``python -m tests.support.other_user ARGS`` prints, run as this user."""
        done = self.run("-m", "tests.support.other_user", *args, timeout=timeout, env=env)
        assert done.returncode == 0, f"as {self.name}: {done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])


def make_other_user() -> Iterator[OtherUser]:
    """Create a second user for the session (skip, saying why, where none can be made)."""
    if os.geteuid() != 0:
        pytest.skip(f"a second real user needs root to create it (running as uid {os.geteuid()})")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if useradd is None or userdel is None:
        pytest.skip("a second real user needs useradd and userdel, and this host has neither")
    name = f"mtpeer{os.getpid()}n{next(_USERS)}"  # one per fixture that asks, in this test run
    made = subprocess.run(
        [useradd, "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd {name} failed: {made.stderr.strip()}")
    home = Path(tempfile.mkdtemp(prefix="mtpeer", dir="/tmp"))
    try:
        entry = pwd.getpwnam(name)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        home.chmod(0o700)
        user = OtherUser(name, entry.pw_uid, entry.pw_gid, home, [], {})
        user.env = {
            "HOME": str(home),
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "MEMTUI_RUNTIME_DIR": str(home / "rt"),
            "XDG_STATE_HOME": str(home / "state"),
            "MEMTUI_KEYS": str(home / "keys"),
            "OMP_NUM_THREADS": "1",
        }
        user.python = _python_for(user)
        yield user
    finally:
        subprocess.run([userdel, name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def _python_for(user: OtherUser) -> list[str]:
    """An interpreter ``user`` can import memtui with, or skip the test saying why not."""
    packages = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    path = os.pathsep.join([str(ROOT), *sorted(packages)])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [
        [sys.executable],
        [f"/usr/bin/{version}", "-s"],
        [f"/usr/local/bin/{version}", "-s"],
    ]
    probe = (
        "import memtui.transport.sources, memtui.tui.app, zmq, textual, tests.support.other_user"
    )
    failures = []
    for python in candidates:
        if python[0] != sys.executable and not Path(python[0]).exists():
            continue
        user.python = python
        try:
            done = user.run("-c", probe, env={"PYTHONPATH": path}, timeout=60)
        except OSError as exc:  # the interpreter's directory is closed to that user
            failures.append(f"{python[0]}: {exc}")
            continue
        if done.returncode == 0:
            user.env["PYTHONPATH"] = path
            return python
        failures.append(f"{python[0]}: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    pytest.skip(f"no Python that the user {user.name} can run memtui with: {'; '.join(failures)}")


# --------------------------------------------------------------------------- as the other user


def viewer(endpoint: str, seconds: float, extra_ranks: str) -> dict[str, Any]:
    """Watch ``endpoint`` with the viewer's receiver for ``seconds``: what it said and got."""
    import threading

    import msgspec

    from memtui.runs.events import ConnectionEvent, Notice
    from memtui.runs.receiver import Inbox, Receiver
    from memtui.transport.sources import LiveSource
    from memtui.wire import RankInfo

    source = LiveSource(endpoint)
    for rank in msgspec.json.decode(extra_ranks or "[]", type=list[RankInfo]):
        source.subscribe(rank)  # as a full snapshot (over ipc, or CURVE) lists its ranks
    inbox = Inbox()
    receiver = Receiver(source, inbox, lambda: None)
    stop = threading.Event()
    thread = threading.Thread(target=receiver.run, args=(stop,), daemon=True)
    thread.start()
    said: list[str] = []
    steps: list[int] = []
    subscribed: set[str] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for batch in inbox.drain():
            for event in batch.events:
                if isinstance(event, ConnectionEvent):
                    said.append(f"{event.status.value}: {event.detail}")
                elif isinstance(event, Notice):
                    said.append(event.text)
                elif type(event).__name__ == "TelemetryHead":
                    steps.append(int(getattr(event, "step", 0)))
        subscribed.update(source._subs)
        time.sleep(0.1)
    stop.set()
    thread.join(5)
    return {
        "said": said,
        "steps": steps,
        "subscribed": sorted(subscribed),
        "errors": receiver.counts.errors,
    }


def app(endpoint: str, seconds: float) -> dict[str, Any]:
    """Run the viewer app on ``endpoint`` headless for ``seconds`` once it shows steps: every
    screen line it drew with a status dot or an error, the steps it showed, its last screen."""
    from textual.pilot import Pilot

    from memtui.transport.sources import LiveSource
    from memtui.tui.app import MemtuiApp
    from tests.support.viewer import run, screen_text, until

    viewer_app = MemtuiApp(LiveSource(endpoint))
    seen: dict[str, Any] = {"lines": [], "steps": [], "readonly": False, "text": ""}

    async def watch(pilot: Pilot[Any]) -> None:
        state = viewer_app.state
        await until(pilot, lambda: state.step > 0, 20, "steps")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await pilot.pause(0.2)
            viewer_app.refresh_view()
            text = screen_text(viewer_app)
            for line in text.splitlines():
                telling = any(word in line for word in ("●", "error", "denied"))
                if telling and line.strip() not in seen["lines"]:
                    seen["lines"].append(line.strip())
            seen["steps"].append(state.step)
            seen["text"] = text
        seen["readonly"] = viewer_app.readonly

    run(viewer_app, watch, (120, 40))
    return seen


def main() -> int:
    """``viewer|app ENDPOINT SECONDS [--ranks JSON]``: print what it saw as one JSON line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["viewer", "app"])
    parser.add_argument("endpoint")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--ranks", default="", help="more ranks to subscribe to (JSON)")
    args = parser.parse_args()
    if args.what == "app":
        print(json.dumps(app(args.endpoint, args.seconds)))
    else:
        print(json.dumps(viewer(args.endpoint, args.seconds, args.ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
