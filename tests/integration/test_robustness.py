"""The training run comes first: it finishes whatever happens to viewers, peers and files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import zmq

from memtui.hooks import Options, Tuner
from memtui.storage import registry
from memtui.transport.client import ControlClient
from memtui.wire import Decoder, ErrorReply, Telemetry
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.processes import LIGHT, PLUMBING, ROOT, DemoRun, wait_for

VIEWER = """
import sys, time, zmq
from memtui.transport.client import ControlClient
from memtui.wire import Decoder
control, pub = sys.argv[1], sys.argv[2]
sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.setsockopt(zmq.RCVHWM, 1)
sub.connect(pub)
client = ControlClient(control)
decoder = Decoder()
while True:
    client.hello()
    if sub.poll(100):
        decoder.decode(sub.recv())
        print("frame", flush=True)
    time.sleep(0.001)
"""


def goes_on_then_stops(demo: DemoRun, control: str) -> None:
    """Assert the run still trains (its step advances), then stop it as a user would."""
    client = ControlClient(control, timeout_s=patience(5))
    start = client.hello().step
    wait_for(lambda: client.hello().step >= start + 5, 30, 0.1, "steps to go on")
    demo.stop()
    assert demo.proc.returncode == 143, demo.output()


def test_no_viewer_runs_to_the_end_and_leaves_no_entry(
    start_demo: Callable[..., DemoRun], private_runtime: Path
) -> None:
    demo = start_demo("--steps", "30", "--checkpoint-every", "10", *LIGHT, "--slow-data-ms", "0")
    assert demo.wait_exit(120) == 0, demo.output()
    assert "done: 30 steps" in demo.output()
    assert list(private_runtime.iterdir()) == [], "the run removed its registry entry and sockets"


@pytest.mark.slow  # as test_faults' test_a_viewer_stopped_or_killed_mid_stream, on its own run
def test_viewer_killed_mid_stream(start_demo: Callable[..., DemoRun]) -> None:
    demo = start_demo("--steps", "100000", "--checkpoint-every", "10", "--slow-data-ms", "0")
    target = registry.find_run(demo.run_id)
    viewer = subprocess.Popen(
        [sys.executable, "-c", VIEWER, target.control, target.ranks[0].pub],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert viewer.stdout is not None
    assert viewer.stdout.readline().strip() == "frame"
    time.sleep(0.5)
    viewer.send_signal(signal.SIGKILL)
    viewer.wait()
    goes_on_then_stops(demo, target.control)


@pytest.mark.slow  # as test_faults' junk-frame and 100 MiB-frame cases, on its own run
def test_garbage_on_the_control_socket(start_demo: Callable[..., DemoRun]) -> None:
    demo = start_demo("--steps", "100000", "--checkpoint-every", "10", "--slow-data-ms", "0")
    control = registry.find_run(demo.run_id).control
    context = zmq.Context.instance()

    # well-formed ZeroMQ, garbage payloads: each is answered with an error, none crashes the hook
    decoder = Decoder()
    for payload in (
        b"",
        b"\x00\xff garbage",
        b"\x93\x01\x02\x03",
        b'{"type": "set"}',
        os.urandom(4096),
    ):
        req = context.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(control)
        req.send(payload)
        assert req.poll(int(patience(5) * 1000)), "the hook answers"
        reply = decoder.decode(req.recv())
        assert isinstance(reply, ErrorReply) and "undecodable" in reply.reason
        req.close()

    # a frame over the size limit: ZeroMQ drops the peer, the hook carries on
    big = context.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(control)
    big.send_multipart([b"", b"x" * (2 << 20)])
    time.sleep(0.2)
    big.close()

    # not even ZeroMQ: raw bytes on the unix socket
    path = registry.endpoint_path(control)
    assert path is not None
    for junk in (os.urandom(64), b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(300)):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(str(path))
        raw.sendall(junk)
        raw.close()

    snapshot = ControlClient(control, timeout_s=patience(5)).hello()
    assert snapshot.counters is not None and snapshot.counters.bad_frames >= 5
    goes_on_then_stops(demo, control)


def test_runtime_directory_removed_while_running(
    start_demo: Callable[..., DemoRun], private_runtime: Path
) -> None:
    demo = start_demo("--steps", "100000", "--checkpoint-every", "10", *PLUMBING)
    shutil.rmtree(private_runtime)
    gone = memtui_cli("ls", "--json")  # the directory gone: nothing listed, or (once the run
    assert gone.returncode == 0, gone.stderr  # noticed, even before this command ran) the run
    assert [r["run"] for r in json.loads(gone.stdout)] in ([], [demo.run_id])
    listed = wait_for(
        lambda: json.loads(memtui_cli("ls", "--json").stdout), 15, 0.3, "the run to re-register"
    )
    assert [r["run"] for r in listed] == [demo.run_id]  # type: ignore[index]
    result = memtui_cli("status", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["counters"]["recoveries"] == 1
    assert demo.proc.poll() is None, "training went on"


def test_stale_entries_of_dead_runs_are_cleaned(
    start_demo: Callable[..., DemoRun], private_runtime: Path
) -> None:
    demo = start_demo("--steps", "100000", *PLUMBING)
    demo.proc.send_signal(signal.SIGKILL)
    demo.proc.wait()
    assert (private_runtime / demo.run_id).exists(), "SIGKILL leaves the entry behind"
    assert json.loads(memtui_cli("ls", "--json").stdout) == []
    assert not (private_runtime / demo.run_id).exists(), "ls removed it"
    result = memtui_cli("status", demo.run_id)
    assert result.returncode == 1 and "no live run matches" in result.stderr


def test_the_runtime_dir_registry_file_and_sockets_are_the_users_alone(
    tmp_path: Path, private_runtime: Path
) -> None:
    tuner = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path).start()
    try:
        run_dir = private_runtime / tuner.run_id
        wait_for(lambda: (run_dir / "run.json").exists(), 10, what="the registry file")
        assert stat.S_IMODE(private_runtime.stat().st_mode) == 0o700
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((run_dir / "run.json").stat().st_mode) == 0o600
        for name in ("ctl", "pub0"):
            mode = (run_dir / name).stat().st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600, name
    finally:
        tuner.close()


def test_existing_runtime_dir_is_tightened(private_runtime: Path) -> None:
    private_runtime.mkdir(mode=0o755)
    private_runtime.chmod(0o755)
    registry.runtime_dir()
    assert stat.S_IMODE(private_runtime.stat().st_mode) == 0o700


def test_unwritable_runtime_dir_does_not_stop_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """If memtui cannot publish, the loop still runs: the failure is reported, not raised."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(blocker / "rt"))
    tuner = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options()).start()
    try:
        for _ in range(10):
            tuner.step()
        assert tuner.checkpoint() is None
        assert tuner.agent is not None and tuner.agent.failed is not None
        assert tuner.errors.count >= 1 and "agent start" in tuner.errors.last
    finally:
        tuner.close()


def test_last_batch_says_ended(tmp_path: Path) -> None:
    tuner = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path).start()
    target = registry.find_run(tuner.run_id)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(target.ranks[0].pub)
    time.sleep(0.3)  # slow joiner
    for _ in range(5):
        tuner.step()
    tuner.close()
    decoder = Decoder()
    frames = []
    while sub.poll(int(patience(2) * 1000)):
        message = decoder.decode(sub.recv())
        assert isinstance(message, Telemetry)
        frames.append(message)
        if message.ended:
            break
    sub.close()
    assert frames and frames[-1].ended
    assert sum(len(f.steps) for f in frames) == 5


def test_a_process_start_time_is_psutils_without_psutil() -> None:
    """The registry tells a live run from a reused pid by the start time psutil gives (the hook
    writes it, the commands compare it), read from /proc so the commands need not load psutil."""
    import psutil

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (os.getpid(), sleeper.pid, 1):
            assert registry.process_create_time(pid) == pytest.approx(
                psutil.Process(pid).create_time(), abs=0.01
            )
        sleeper.kill()  # not waited for yet: a zombie, which has exited
        wait_for(lambda: registry.process_create_time(sleeper.pid) == 0.0, 30, what="a zombie")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert registry.process_create_time(sleeper.pid) == 0.0, "a pid that is gone"
