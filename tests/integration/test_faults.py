"""The fault matrix: what a peer, a typo or a failing disk does to a live training run.

One real demo training (a subprocess, CPU) is the victim of every fast case in turn. After each
fault the same four things are asserted (``survived``):

1. the run trained on: its step advances;
2. nothing was lost: a change queued after the fault lands, the tuned YAML on disk parses and
   holds it, and every line of the audit log parses;
3. the error, if any, is one clear line: the run printed no traceback;
4. memory stayed bounded: the training process's RSS grew less than ``RSS_CAP``.

Cases that need a run of their own (a kill -9, a restart) start one. The documentation's fault
guarantees (``docs/explanation/faults.md``) are the table of these cases; the cases proven
elsewhere (two ranks, the viewer's side) name their test there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import msgspec
import psutil
import pytest
import yaml
import zmq

from memtui.hooks import Options, Tuner
from memtui.storage import registry
from memtui.transport.client import ControlClient
from memtui.transport.recording import RecordingHeader, RecordingWriter, read_recording
from memtui.wire import WIRE_VERSION, Decoder, ErrorReply, Hello, SetRequest, encode
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.forkserver import ForkedDemo
from tests.support.processes import LIGHT, PLUMBING, ROOT, demo_run_id, launch_demo, wait_for

pytestmark = pytest.mark.heavy

RSS_CAP = 64 << 20
"""How much the training process may grow while a fault is dealt with (bytes)."""


@dataclass
class Victim:
    """The demo training every fast case hits."""

    proc: subprocess.Popen[str] | ForkedDemo
    log: Path
    out: Path
    env: dict[str, str]
    run_id: str = ""
    control: str = ""
    pub: str = ""
    accum: list[int] = field(default_factory=lambda: [2])

    def client(self, timeout_s: float = 10.0) -> ControlClient:
        """A control client of the run."""
        return ControlClient(self.control, timeout_s=timeout_s)

    def output(self) -> str:
        """Everything the run printed."""
        return self.log.read_text(errors="replace")

    def rss(self) -> int:
        """The training process's resident memory."""
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """The ``memtui`` command line, in the run's runtime directory."""
        return memtui_cli(*args, timeout=timeout, env=self.env)


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    """The demo training, checkpointing every 5 steps, with a runtime directory of its own."""
    base = Path(tempfile_dir())
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        MEMTUI_RUNTIME_DIR=str(base / "rt"),
        XDG_STATE_HOME=str(base / "state"),
    )
    out = tmp_path_factory.mktemp("victim")
    log = out / "stdout.log"
    args = ["--out", str(out), "--steps", "1000000", "--checkpoint-every", "5"]
    proc = launch_demo([*args, *PLUMBING, "--progress-every", "1"], env, log)
    run = Victim(proc, log, out, env)
    try:
        run.run_id = demo_run_id(log, proc)
        record = json.loads((base / "rt" / run.run_id / "run.json").read_text())
        run.control, run.pub = record["control"], record["ranks"][0]["pub"]
        # warmed up before the first case: the first steps and checkpoints grow a fresh process
        # by tens of MiB (allocator pools, the loader), which no fault should be charged with
        client = run.client()
        wait_for(lambda: client.hello(history=0).step >= 40, 60, 0.2, "the victim to warm up")
        yield run
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(patience(15))
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(base, ignore_errors=True)


def tempfile_dir() -> str:
    """A short private directory (ipc socket paths must stay short)."""
    import tempfile

    return tempfile.mkdtemp(prefix="mtf", dir="/tmp")


@dataclass
class Before:
    """What a case saw before its fault."""

    rss: int
    log_chars: int


def before(run: Victim) -> Before:
    """Note the run's memory and output before a fault."""
    assert run.proc.poll() is None, run.output()
    return Before(run.rss(), len(run.output()))


def survived(run: Victim, seen: Before, rss_cap: int = RSS_CAP) -> None:
    """The four promises, after a fault (see the module's docstring)."""
    client = run.client()
    start = client.hello(history=0).step
    wait_for(lambda: client.hello(history=0).step >= start + 3, 30, 0.1, "steps to go on")

    # nothing lost: a change lands and is on disk, the audit log parses
    run.accum.append(3 if run.accum[-1] != 3 else 1)
    applied = len(client.hello(history=0).control.applied)
    reply = client.set({"grad_accum": run.accum[-1]})
    assert reply.ok, reply.reason
    wait_for(lambda: len(client.hello(history=0).control.applied) > applied, 30, 0.1, "the change")
    info = client.hello(history=0).info

    def on_disk() -> bool:
        path = Path(info.tuned_path)  # written at the boundary, just after the change is applied
        tuned = yaml.safe_load(path.read_text()) if path.exists() else None
        return bool(tuned and tuned["config"]["grad_accum"] == run.accum[-1])

    wait_for(on_disk, 10, 0.1, "the tuned YAML to hold the change")
    lines = Path(info.audit_path).read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert events and events[-1]["event"] in ("applied", "measured"), events[-1]

    # one clear line: no traceback; memory bounded
    new_output = run.output()[seen.log_chars :]
    assert "Traceback" not in new_output, new_output
    grown = run.rss() - seen.rss
    assert grown < rss_cap, f"RSS grew {grown >> 20} MiB (cap {rss_cap >> 20} MiB)"


def req(endpoint: str) -> zmq.Socket:
    """A REQ socket connected to ``endpoint`` that never lingers."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


# ---------------------------------------------------------------------------- held already


def test_junk_frames_on_the_control_socket(victim: Victim) -> None:
    seen = before(victim)
    counters = victim.client().hello(history=0).counters
    bad_before = counters.bad_frames if counters is not None else 0
    decoder = Decoder()
    payloads = (b"", b"\x00\xff junk", b"\x93\x01\x02\x03", b'{"type": "set"}', os.urandom(4096))
    for payload in payloads:
        sock = req(victim.control)
        sock.send(payload)
        assert sock.poll(int(patience(5) * 1000)), "the hook answers"
        reply = decoder.decode(sock.recv())
        assert isinstance(reply, ErrorReply) and "undecodable" in reply.reason, reply
        sock.close()
    path = registry.endpoint_path(victim.control)
    assert path is not None
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not even ZeroMQ
    raw.connect(str(path))
    raw.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(300))
    raw.close()
    counters = victim.client().hello(history=0).counters
    assert counters is not None and counters.bad_frames >= bad_before + len(payloads), counters
    survived(victim, seen)


def test_a_wrong_wire_version_is_refused_in_one_line(victim: Victim) -> None:
    seen = before(victim)
    frame = msgspec.msgpack.encode({"type": "hello", "v": WIRE_VERSION + 1, "history": 0})
    sock = req(victim.control)
    sock.send(frame)
    assert sock.poll(int(patience(5) * 1000))
    reply = Decoder().decode(sock.recv())
    assert isinstance(reply, ErrorReply) and "wire version" in reply.reason, reply
    sock.close()
    survived(victim, seen)


def test_a_100_mib_frame_is_dropped_by_zeromq(victim: Victim) -> None:
    seen = before(victim)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(victim.control)
    dealer.send_multipart([b"", b"x" * (100 << 20)])
    time.sleep(0.5)
    dealer.close()
    survived(victim, seen)


def test_absurd_values_are_refused(victim: Victim) -> None:
    seen = before(victim)
    client = victim.client()
    for changes in (
        {"batch_size": 10**18},
        {"batch_size": -1},
        {"grad_accum": 0},
        {"num_workers": 1 << 40},
        {"batch_size": "NaN"},
        {"pin_memory": "maybe"},
    ):
        reply = client.set(changes)  # type: ignore[arg-type]
        assert not reply.ok and reply.reason and "\n" not in reply.reason, (changes, reply)
    survived(victim, seen)


def test_a_viewer_stopped_or_killed_mid_stream(victim: Victim) -> None:
    seen = before(victim)
    viewer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, zmq\n"
            "s = zmq.Context().socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b'')\n"
            "s.setsockopt(zmq.RCVHWM, 1); s.connect(sys.argv[1]); s.recv()\n"
            "print('frame', flush=True)\n"
            "while True: s.recv()\n",
            victim.pub,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert viewer.stdout is not None and viewer.stdout.readline().strip() == "frame"
    viewer.send_signal(signal.SIGSTOP)  # a stopped viewer: its queue fills, the run never waits
    time.sleep(2.0)
    survived(victim, seen)
    viewer.send_signal(signal.SIGKILL)
    viewer.wait()
    survived(victim, seen)


def test_the_runtime_directory_deleted(victim: Victim) -> None:
    seen = before(victim)
    run_dir = Path(victim.env["MEMTUI_RUNTIME_DIR"]) / victim.run_id
    shutil.rmtree(run_dir)
    wait_for(lambda: (run_dir / "run.json").exists(), 15, 0.2, "the run to re-register")
    survived(victim, seen)


def test_an_unwritable_tuned_config_is_said_and_written_when_it_can_be(victim: Victim) -> None:
    """A tuned YAML that cannot be written is said, not left stale in silence, and written later."""
    seen = before(victim)
    client = victim.client()
    tuned = Path(client.hello(history=0).info.tuned_path)
    tuned.unlink(missing_ok=True)  # none yet when this case runs first
    tuned.mkdir()  # unwritable as a file, even for root
    try:
        applied = len(client.hello(history=0).control.applied)
        victim.accum.append(3 if victim.accum[-1] != 3 else 1)
        assert client.set({"grad_accum": victim.accum[-1]}).ok
        wait_for(lambda: len(client.hello(history=0).control.applied) > applied, 30, 0.1)
        status = victim.cli("status", victim.run_id)
        assert "tuned config not saved since step" in status.stdout, status.stdout
    finally:
        tuned.rmdir()
    survived(victim, seen)
    assert "tuned config not saved" not in victim.cli("status", victim.run_id).stdout


# ---------------------------------------------------------------------------- corrupt YAML

ALIAS_BOMB = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]\n"
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
)
"""Billion laughs in 9 lines: 9^9 strings once expanded (echoing it in a message never ends)."""

CORRUPT_TUNED = {
    "alias bomb": ALIAS_BOMB + "config: {batch_size: *i}\n",
    "empty": "",
    "not yaml": "config: [unclosed",
    "a list": "- 1\n- 2\n",
    "a scalar": "42\n",
    "config a list": "config: [1, 2]\n",
    "config a string": "config: batch_size\n",
    "no config": "run: x\nstep: 3\n",
    "negative batch": "config: {batch_size: -4}\n",
    "zero accum": "config: {grad_accum: 0}\n",
    "float batch": "config: {batch_size: 1.0e99}\n",
    "huge int": f"config: {{batch_size: {10**40}}}\n",
    "string batch": "config: {batch_size: lots}\n",
    "nested value": "config: {batch_size: {a: [1, 2, {b: 3}]}}\n",
    "tabs": "config:\n\tbatch_size: 8\n",
    "duplicate keys": "config: {batch_size: 8, batch_size: 9, batch_size: [1]}\n",
    "binary": "\x00\x01\x02\xff\xfe config: {",
    "markup in a key": "config: {'[/x]': 1, batch_size: '[bold]8'}\n",
}


@pytest.mark.parametrize("shape", sorted(CORRUPT_TUNED))
def test_a_corrupt_tuned_yaml_at_resume_is_one_warning(
    shape: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "memtui-tuned.yaml").write_text(CORRUPT_TUNED[shape], errors="surrogateescape")
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    started = time.monotonic()
    tuner = Tuner(config, state_dir=tmp_path, resume=True, options=Options(publish=False)).start()
    try:
        assert time.monotonic() - started < patience(2.0)
        assert (config.batch_size, config.grad_accum) == (4, 1), "the script's config stands"
        for _ in range(3):
            tuner.step()
        assert tuner.control.queue(SetRequest(changes={"grad_accum": 2})).ok
        assert tuner.checkpoint() is not None and config.grad_accum == 2
        messages = [r.getMessage() for r in caplog.records if r.name == "memtui"]
        assert all("\n" not in m and len(m) < 600 for m in messages), messages
    finally:
        tuner.close()


@pytest.mark.parametrize(
    "text",
    [
        ALIAS_BOMB + "verdict: {memory_edge_fraction: *i}\n",
        "verdict: {'[/x]': 1, memory_edge_fraction: '[bold]x'}\n",
        "verdict:\n  memory_edge_fraction: [1, 2, 3]\n" + "# padding\n" * 200_000,
    ],
    ids=["alias bomb", "markup", "over 1 MiB"],
)
def test_a_hostile_config_file_at_install_is_one_warning_in_no_time(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Read without bounds, a 412-byte alias bomb in ``$MEMTUI_CONFIG`` blocked install 87 s and
    took 1.5 GB: now it is one warning in no time."""
    (tmp_path / "config.yaml").write_text(text)
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "config.yaml"))
    started = time.monotonic()
    tuner = Tuner(
        SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options(publish=False)
    ).start()
    try:
        assert time.monotonic() - started < patience(2.0)
        messages = [r.getMessage() for r in caplog.records if r.name == "memtui"]
        assert messages and all("\n" not in m and len(m) < 600 for m in messages), messages
        assert tuner.control.thresholds.memory_edge_fraction == 0.85, "the defaults stand"
    finally:
        tuner.close()


# ---------------------------------------------------------------------------- kill -9


def test_kill_9_at_a_boundary_leaves_a_readable_state(tmp_path: Path) -> None:
    """A run killed in the middle of its boundaries resumes from what it wrote."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = tmp_path / "run"
    args = [
        "--out",
        str(out),
        "--steps",
        "100000",
        "--checkpoint-every",
        "2",
        *LIGHT,
        "--slow-data-ms",
        "0",
    ]
    proc = launch_demo([*args, "--progress-every", "1"], env, tmp_path / "log")
    try:
        run_id = demo_run_id(tmp_path / "log", proc)
        client = ControlClient(registry.find_run(run_id).control, timeout_s=patience(10))
        # two changes land, each waited for (changes queued between two boundaries land as one:
        # on a loaded machine a slow run took all five in one boundary and never applied two)
        for count, accum in enumerate((3, 1), start=1):
            assert client.set({"grad_accum": accum}).ok
            wait_for(lambda n=count: len(client.hello(history=0).control.applied) >= n, 60)
        for accum in (3, 1, 3):  # then more, and the kill while they land
            assert client.set({"grad_accum": accum}).ok
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    info_dir = out
    tuned = yaml.safe_load(next(info_dir.rglob("memtui-tuned.yaml")).read_text())
    assert tuned["config"]["grad_accum"] in (1, 3)
    for line in next(info_dir.rglob("memtui-audit.jsonl")).read_text().splitlines():
        json.loads(line)


def test_a_hello_is_cheap_to_refuse_when_it_is_junk(victim: Victim) -> None:
    seen = before(victim)
    sock = req(victim.control)
    sock.send(encode(Hello(history=10**9)))
    assert sock.poll(int(patience(5) * 1000))
    sock.recv()
    sock.close()
    survived(victim, seen)


# ---------------------------------------------------------------------------- recordings


def test_a_recording_cut_anywhere_replays_what_is_whole(tmp_path: Path) -> None:
    """A recording whose tail is cut (kill -9) or has bytes appended still loads what is whole."""
    path = tmp_path / "whole.mtrec"
    with RecordingWriter(path, RecordingHeader(started=0.0, run="r")) as writer:
        for index in range(20):
            writer.write(index * 0.1, 0, encode(Hello(history=index)))
    whole = path.read_bytes()
    assert read_recording(path).cut_at is None and len(read_recording(path).frames) == 20
    for cut in (len(whole) - 1, len(whole) - 7, len(whole) // 2, 40):
        path.write_bytes(whole[:cut])
        recording = read_recording(path)
        assert recording.cut_at is not None and recording.cut_at <= cut
        assert len(recording.frames) < 20 and "cut at byte" in recording.cut_note
    for junk in (b"\x00\x00\x00\x05abcde", os.urandom(3), b"\xff" * 64):
        path.write_bytes(whole + junk)
        recording = read_recording(path)
        assert len(recording.frames) == 20 and recording.cut_at == len(whole), junk


def test_a_run_killed_while_recording_replays_up_to_its_last_second(tmp_path: Path) -> None:
    record = tmp_path / "run.mtrec"
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEMTUI_RECORD=str(record))
    args = ["--out", str(tmp_path / "out"), "--steps", "100000", *PLUMBING]
    log = tmp_path / "log"
    proc = launch_demo(args, env, log)
    try:
        wait_for(lambda: "run " in log.read_text() or proc.poll() is not None, 60)
        time.sleep(4.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    recording = read_recording(record)
    # the run recorded for 4 s after its first line; a kill loses at most the last second
    assert recording.duration_s >= 4.0 - 1.5, (recording.duration_s, recording.cut_note)
    replay = subprocess.run(
        [sys.executable, "-c", "import sys; from memtui.tui.app import run_replay; "
         "from memtui.transport.sources import ReplaySource; "
         "print(len(ReplaySource(sys.argv[1], speed=None).recording.frames))", str(record)],
        capture_output=True, text=True, timeout=patience(60), cwd=ROOT,
    )  # fmt: skip
    assert replay.returncode == 0 and int(replay.stdout) == len(recording.frames), replay.stderr


# ---------------------------------------------------------------------------- restarts


def test_a_change_pending_at_a_crash_is_named_at_resume_with_the_command_to_requeue_it(
    tmp_path: Path,
) -> None:
    """A change queued but not applied when the run died is named, not lost without a word."""
    out = tmp_path / "run"
    args = ["--out", str(out), "--steps", "100000", *PLUMBING]

    def start(*extra: str) -> tuple[subprocess.Popen[str] | ForkedDemo, Path, str]:
        log = tmp_path / f"log{len(list(tmp_path.glob('log*')))}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = launch_demo([*args, "--checkpoint-every", "100000", *extra], env, log)
        run_id = demo_run_id(log, proc)
        return proc, log, str(run_id)

    first, _log, run_id = start()
    try:
        client = ControlClient(registry.find_run(run_id).control, timeout_s=patience(10))
        assert client.set({"grad_accum": 3}).ok and client.set({"num_workers": 1}).ok
        assert client.set({"grad_accum": 4}).ok
        assert client.cancel(3).ok  # cancelled: not to be queued again
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    second, log, new_id = start("--resume")
    try:
        command = f"memtui set {new_id} grad_accum=3 num_workers=1"
        wait_for(lambda: command in log.read_text(), 30, 0.1, "the warning at resume")
        said = [ln for ln in log.read_text().splitlines() if "never applied" in ln]
        assert len(said) == 1 and f"run {run_id} stopped" in said[0], said
        status = memtui_cli("status", new_id)
        assert f"to queue it again: {command}" in status.stdout, status.stdout
        again = memtui_cli(*command.split()[1:])
        assert again.returncode == 0, again.stderr
        pending = ControlClient(registry.find_run(new_id).control).hello(history=0).control.pending
        assert [p.changes for p in pending] == [{"grad_accum": 3, "num_workers": 1}]
    finally:
        second.kill()
        second.wait()
