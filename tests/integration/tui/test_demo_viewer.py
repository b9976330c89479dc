"""``memtui demo`` when its viewer dies: the real command in a subprocess, the real demo training
under it, and a viewer made to fail (``run_app``'s module replaced in that process). The
training goes on (its steps keep advancing), the operator is told how to reattach, and Ctrl-C
then stops it; a normal quit of the viewer still ends the demo's training, and says so; a
training that died makes the command fail."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from memtui.storage import registry
from tests.support.clock import patience
from tests.support.processes import LIGHT, ROOT, wait_for

pytestmark = pytest.mark.heavy

VIEWER = """
import sys, time, types

def run_app(run_id, **options):
    time.sleep(1.0)  # attached for a while
    if {ending!r} == "training-dies":
        options["demo_process"].kill()
        options["demo_process"].wait()
    if {ending!r} == "raise":
        raise RuntimeError("the viewer broke [/x] \\x1b[31m")
    return 1 if {ending!r} == "crash" else 0  # Textual's status after a crash, or q

viewer = types.ModuleType("memtui.tui.app")  # in place of the viewer's module: no Textual to load
viewer.run_app = run_app
sys.modules["memtui.tui.app"] = viewer
from memtui.cli import main
sys.argv = ["memtui", "demo", "--out", {out!r}, "--steps", "100000", "--progress-every", "0.2",
            *{light!r}]
main()
"""
"""``memtui demo`` with a stand-in viewer (its module, in place of the real one's: a second of
CPU less than importing Textual to replace its ``run_app``) that, after a second, raises, ends
as Textual ends an app that crashed (status 1), quits normally (q), or sees the training killed
and then quits."""


@pytest.fixture
def demos() -> Iterator[list[subprocess.Popen[str]]]:
    """``memtui demo`` processes started by a test, each in its own session (stopped after)."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(patience(10))


def start_demo(out: Path, ending: str, demos: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    """``memtui demo`` in its own session, as a terminal runs it (Ctrl-C reaches the group)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", VIEWER.format(ending=ending, out=str(out), light=LIGHT)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    demos.append(proc)
    return proc


def steps(log: Path) -> int:
    """The latest step the demo's progress lines report."""
    found = re.findall(r"^step (\d+)/", log.read_text() if log.exists() else "", re.M)
    return int(found[-1]) if found else 0


def training_pid(out: Path) -> int:
    """The demo training's pid, from its registry record."""
    log = out / "demo.log"
    run = wait_for(
        lambda: log.exists() and re.search(r"^run (\S+)", log.read_text(), re.M), 60, what="run id"
    )
    assert isinstance(run, re.Match)
    record = registry.find_run(run.group(1)).record
    assert record is not None
    return record.pid


@pytest.mark.parametrize(
    "ending",
    # the exit status of a crashed app is one expression apart from the exception (the same
    # steps after it, each variant a training of its own: 7 CPU-s): under -m slow
    ["raise", pytest.param("crash", marks=pytest.mark.slow)],
)
def test_a_viewer_that_dies_leaves_the_training_running(
    ending: str, tmp_path: Path, demos: list[subprocess.Popen[str]]
) -> None:
    out = tmp_path / "demo"
    proc = start_demo(out, ending, demos)
    pid = training_pid(out)
    assert proc.stderr is not None
    told = [proc.stderr.readline() for _ in range(6)][3:]  # after starting, waiting, attaching
    why = "RuntimeError: the viewer broke [/x] ␛[31m" if ending == "raise" else "exit status 1"
    assert f"the viewer died ({why})" in told[0], told
    assert "the training goes on" in told[1] and str(out / "demo.log") in told[1]
    assert "memtui attach demo-" in told[2] and "Ctrl-C stops the training" in told[2]
    after = steps(out / "demo.log")
    wait_for(lambda: steps(out / "demo.log") > after + 20, 30, what="the training to advance")
    assert proc.poll() is None and psutil.pid_exists(pid)

    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal: the demo and its training
    assert proc.wait(patience(30)) != 0
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", 15)


def test_a_normal_quit_still_ends_the_demo_s_training(
    tmp_path: Path, demos: list[subprocess.Popen[str]]
) -> None:
    out = tmp_path / "demo"
    proc = start_demo(out, "quit", demos)
    pid = training_pid(out)
    assert proc.wait(patience(60)) == 0
    assert proc.stderr is not None
    told = proc.stderr.read()
    assert "viewer died" not in told
    # what happens before the viewer shows and after it closes, in order
    said = [line.removeprefix("memtui demo: ") for line in told.splitlines()]
    assert said == [
        f"starting the demo training (its output: {out / 'demo.log'})...",
        "waiting for the run to register (the training imports torch first)...",
        f"attaching to run {registry_run(out)}...",
        "stopping the demo training...",
    ], told
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie", 15)


def registry_run(out: Path) -> str:
    """The demo's run id, from its first output line."""
    found = re.search(r"^run (\S+)", (out / "demo.log").read_text(), re.M)
    assert found, "no run line in demo.log"
    return found.group(1)


def test_a_demo_whose_training_died_exits_non_zero(
    tmp_path: Path, demos: list[subprocess.Popen[str]]
) -> None:
    """The training killed under the viewer, then q: ``memtui demo`` (``make demo``) fails."""
    out = tmp_path / "demo"
    proc = start_demo(out, "training-dies", demos)
    code = proc.wait(patience(60))
    assert proc.stderr is not None
    told = proc.stderr.read()
    assert code == 128 + signal.SIGKILL, told
    died = f"memtui demo: the demo training died (killed by SIGKILL); see {out / 'demo.log'}"
    assert died in told.splitlines(), told
    assert "stopping the demo training" not in told
