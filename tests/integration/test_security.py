"""Multi-node transport: TCP only with CURVE keys; unauthenticated peers get nothing."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from memtui.hooks import Options, Tuner
from memtui.storage import registry
from memtui.transport.client import ClientError, ControlClient, hello_many
from memtui.transport.security import keygen, load_keys
from memtui.transport.sources import LiveSource
from memtui.wire import Decoder, Hello, Snapshot, Telemetry, encode
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.processes import (
    LIGHT,
    ROOT,
    DemoRun,
    demo_run_id,
    free_port,
    launch_memtui,
    launch_ranks,
    launch_script,
    wait_for,
)

pytestmark = pytest.mark.heavy


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "curve"))
    monkeypatch.delenv("MEMTUI_INSECURE", raising=False)
    result = memtui_cli("keygen")
    assert result.returncode == 0, result.stderr
    return tmp_path / "curve"


@pytest.fixture
def tcp_tuner(keys: Path, tmp_path: Path) -> Iterator[Tuner]:
    tuner = Tuner(
        SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options(tcp="127.0.0.1")
    ).start()
    try:
        for _ in range(3):
            tuner.step()
        yield tuner
    finally:
        tuner.close()


def test_keygen_files_are_private(keys: Path) -> None:
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    files = [p for p in keys.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {
        "server.key",
        "server.key_secret",
        "client.key",
        "client.key_secret",
    }
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    loaded = load_keys(keys)
    assert loaded is not None and loaded.client_public in loaded.authorized
    again = memtui_cli("keygen")
    assert again.returncode == 1 and "already exist" in again.stderr


def test_the_authenticated_client_works(tcp_tuner: Tuner) -> None:
    rank = tcp_tuner.ranks[0]
    assert rank.pub_tcp.startswith("tcp://127.0.0.1:") and rank.control_tcp.startswith(
        "tcp://127.0.0.1:"
    )
    snapshot = ControlClient(rank.control_tcp, timeout_s=patience(5)).hello()
    assert snapshot.info.run == tcp_tuner.run_id and snapshot.step == 3
    assert snapshot.ranks[0].pub_tcp == rank.pub_tcp
    sub = zmq.Context.instance().socket(zmq.SUB)
    from memtui.transport.security import make_client

    make_client(sub, rank.pub_tcp)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(rank.pub_tcp)
    try:
        assert sub.poll(int(patience(5) * 1000)), "telemetry arrives over CURVE"
        assert isinstance(Decoder().decode(sub.recv()), Telemetry)
    finally:
        sub.close()


def test_unauthenticated_peers_get_nothing(tcp_tuner: Tuner, tmp_path: Path) -> None:
    rank = tcp_tuner.ranks[0]
    context = zmq.Context.instance()
    # 1. plain ZeroMQ, no CURVE at all
    plain_req = context.socket(zmq.REQ)
    plain_sub = context.socket(zmq.SUB)
    # 2. CURVE with the right server key but a client key nobody authorised
    stranger = keygen(directory=tmp_path / "stranger")
    stranger_keys = load_keys(stranger)
    server_keys = load_keys()
    assert stranger_keys is not None and server_keys is not None
    rogue_req = context.socket(zmq.REQ)
    rogue_sub = context.socket(zmq.SUB)
    for sock in (rogue_req, rogue_sub):
        sock.curve_serverkey = server_keys.server_public
        sock.curve_publickey = stranger_keys.client_public
        sock.curve_secretkey = stranger_keys.client_secret
    try:
        for req in (plain_req, rogue_req):
            req.setsockopt(zmq.LINGER, 0)
            req.connect(rank.control_tcp)
            # not blocking: whatever the server does with the peer, the test must not hang here
            with contextlib.suppress(zmq.Again):
                req.send(encode(Hello(client="intruder")), zmq.NOBLOCK)
        for sub in (plain_sub, rogue_sub):
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(rank.pub_tcp)
        zap = tcp_tuner.agent._zap if tcp_tuner.agent is not None else None
        assert zap is not None
        wait_for(lambda: zap.denied >= 2, 30, what="the rogue peers turned away")
        time.sleep(1.5)  # several telemetry batches go out meanwhile
        for sock in (plain_req, rogue_req, plain_sub, rogue_sub):
            assert not sock.poll(100), "nothing reaches an unauthenticated peer"
    finally:
        for sock in (plain_req, plain_sub, rogue_req, rogue_sub):
            sock.close(0)


def test_tcp_without_keys_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "none"))
    tuner = Tuner(
        SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options(tcp="127.0.0.1")
    ).start()
    try:
        assert tuner.tcp_plan is None and tuner.ranks[0].pub_tcp == ""
        assert "without keys: run `memtui keygen` first" in tuner.errors.last
    finally:
        tuner.close()
    insecure = Tuner(
        SimpleNamespace(batch_size=4),
        state_dir=tmp_path,
        options=Options(tcp="0.0.0.0", insecure=True),
    ).start()
    try:
        assert insecure.tcp_plan is None
        assert "loopback addresses only" in insecure.errors.last
    finally:
        insecure.close()
    with pytest.raises(ClientError, match="memtui keygen"):
        ControlClient("tcp://10.1.2.3:5555", timeout_s=1).hello()


def test_insecure_loopback_is_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "none"))
    monkeypatch.setenv("MEMTUI_INSECURE", "1")
    tuner = Tuner(
        SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options(tcp="127.0.0.1")
    ).start()
    try:
        assert tuner.tcp_plan is not None and tuner.tcp_plan.keys is None
        assert (
            ControlClient(tuner.ranks[0].control_tcp, timeout_s=patience(5)).hello().info.run
            == tuner.run_id
        )
    finally:
        tuner.close()


TORCHRUN_TCP = """
import time, torch.distributed as dist
from types import SimpleNamespace
from memtui import hooks
dist.init_process_group("gloo")
tuner = hooks.install(SimpleNamespace(batch_size=4, grad_accum=1), name="tcp")
if dist.get_rank() == 0:
    print("run", tuner.run_id, flush=True)
for step in range(1, 100000):
    tuner.step()
    time.sleep(0.01)
    if step % 20 == 0:
        tuner.checkpoint()
"""


def test_ranks_over_tcp_are_all_seen_from_rank_0(keys: Path, tmp_path: Path) -> None:
    """Two ranks publishing over CURVE TCP (loopback stands in for a second node), forked with
    torchrun's environment (``launch_ranks``)."""
    script = tmp_path / "tcp_job.py"
    script.write_text(TORCHRUN_TCP)
    env = {**os.environ, "MEMTUI_TCP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    job = DemoRun(
        launch_ranks([], env, ROOT, tmp_path / "job.log", 2, str(script)),
        tmp_path,
        tmp_path / "job.log",
    )
    try:
        run_id = demo_run_id(job.log, job.proc)
        record = wait_for(lambda: registry.find_run(run_id).record, 30, what="the registry")
        ranks = record.ranks  # type: ignore[attr-defined]
        assert [r.rank for r in ranks] == [0, 1]
        assert all(r.pub_tcp.startswith("tcp://127.0.0.1:") and r.control_tcp for r in ranks)
        answers = hello_many([r.control_tcp for r in ranks], timeout_s=patience(5))
        assert [a.info.rank if a else None for a in answers] == [0, 1]
        status = json.loads(memtui_cli("status", run_id, "--json").stdout)
        assert [r["reachable"] for r in status["ranks"]] == [True, True]
        assert memtui_cli("set", run_id, "grad_accum=2").returncode == 0
        wait_for(
            lambda: all(
                s and s.control.config.grad_accum == 2
                for s in hello_many([r.control_tcp for r in ranks], timeout_s=patience(5))
            ),
            30,
            0.2,
            "the change on both ranks, seen over TCP",
        )
    finally:
        job.stop()


def telemetry_from(source: LiveSource, want: set[str], timeout: float = 20.0) -> set[str]:
    """Poll ``source`` until telemetry from every one of ``want`` (``run/rank``) has arrived."""
    decoder = Decoder()
    seen: set[str] = set()
    deadline = time.monotonic() + patience(timeout)
    while time.monotonic() < deadline and not want <= seen:
        for _rank, frame in source.poll(0.2):
            message = decoder.decode(frame)
            if isinstance(message, Telemetry):
                seen.add(f"{message.run}/{message.rank}")
    return seen


@pytest.mark.parametrize("tcp_first", [True, False], ids=["tcp-first", "ipc-first"])
def test_one_viewer_hears_an_ipc_rank_and_a_curve_tcp_rank(
    tcp_tuner: Tuner, tmp_path: Path, tcp_first: bool
) -> None:
    """A plain ipc rank and a CURVE TCP rank, subscribed to in either order, both deliver."""
    local = Tuner(
        SimpleNamespace(batch_size=4), state_dir=tmp_path / "local", options=Options(tcp=None)
    ).start()
    source = LiveSource(None)
    try:
        here = local.ranks[0]
        # the CURVE rank, as a rank on another node is listed: its host is not this one
        remote = msgspec.structs.replace(tcp_tuner.ranks[0], rank=1, host="node1")
        assert registry.endpoint_path(remote.pub) is not None
        assert registry.endpoint_path(remote.pub).exists()  # type: ignore[union-attr]
        assert registry.rank_pub(remote) == remote.pub_tcp, "another host: TCP, not its ipc path"
        assert registry.rank_control(remote) == remote.control_tcp
        assert registry.rank_pub(here) == here.pub
        gone = msgspec.structs.replace(tcp_tuner.ranks[0], pub=here.pub + "-gone")
        assert registry.rank_pub(gone) == gone.pub_tcp, "this host, socket gone: TCP"
        first, second = (remote, here) if tcp_first else (here, remote)
        source.subscribe(first)
        source.poll(0.05)  # connected before the second one is subscribed to
        source.subscribe(second)
        want = {f"{local.run_id}/0", f"{tcp_tuner.run_id}/0"}
        assert telemetry_from(source, want) == want
    finally:
        source.close()
        local.close()


NODE_RANK = """
import os, socket, sys, time
if os.environ.get("FAKE_HOSTNAME"):  # inside its own UTS namespace: another node's name
    socket.sethostname(os.environ["FAKE_HOSTNAME"])
import torch.distributed as dist
from types import SimpleNamespace
from memtui import hooks
dist.init_process_group("gloo")
tuner = hooks.install(SimpleNamespace(batch_size=4, grad_accum=1), name="nodes")
me = tuner.ranks[dist.get_rank()]
print("rank", dist.get_rank(), me.host, me.control_tcp, flush=True)
for step in range(1, 1000000):
    tuner.step()
    time.sleep(0.01)
"""


def namespaces_permitted() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "-r", "--uts", "true"], capture_output=True, timeout=patience(10)
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def test_attach_over_tcp_from_a_node_whose_own_rank_is_local(keys: Path, tmp_path: Path) -> None:
    """Two "nodes": rank 0 in a UTS namespace named node0, rank 1 here (a real hostname).

    A viewer here attaches to rank 0's TCP control endpoint, as ``memtui attach tcp://node0:PORT``
    on node 1 does: rank 0 is reached over CURVE TCP (another host, although its ipc socket is
    visible in the shared runtime directory), rank 1 over ipc, and both deliver.
    """
    if not namespaces_permitted():
        pytest.skip("user and UTS namespaces are not permitted here (unshare -r --uts)")
    script = tmp_path / "node_rank.py"
    script.write_text(NODE_RANK)
    base = {
        **os.environ,
        "MEMTUI_TCP": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
    }
    node0 = subprocess.Popen(
        ["unshare", "-r", "--uts", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env={**base, "RANK": "0", "FAKE_HOSTNAME": "node0"},
    )
    # rank 1, on this node, forked from the fork server (its imports of torch already made)
    node1 = launch_script(script, [], {**base, "RANK": "1"}, ROOT, tmp_path / "rank1.log")
    procs = [node0, node1]
    source: LiveSource | None = None
    try:
        assert node0.stdout is not None
        line = node0.stdout.readline()
        assert line.startswith("rank 0 node0 tcp://127.0.0.1:"), line + node0.stdout.read()
        control_tcp = line.split()[3]
        source = LiveSource(control_tcp)
        source.connect()
        snapshot = source.request(Hello(client="test", history=0), Snapshot)
        rank0, rank1 = snapshot.ranks
        assert (rank0.host, rank1.host) == ("node0", socket.gethostname())
        assert registry.endpoint_path(rank0.pub).exists()  # type: ignore[union-attr]
        assert registry.rank_pub(rank0) == rank0.pub_tcp
        assert registry.rank_pub(rank1) == rank1.pub
        run = snapshot.info.run
        want = {f"{run}/0", f"{run}/1"}
        assert telemetry_from(source, want, timeout=30) == want
    finally:
        if source is not None:
            source.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(patience(30))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(patience(10))


def test_demo_refuses_tcp_without_keys_and_insecure_off_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "none"))
    monkeypatch.delenv("MEMTUI_INSECURE", raising=False)
    out = str(tmp_path / "out")
    refused = {
        ("--tcp", "0.0.0.0"): "refusing TCP on 0.0.0.0 without keys: run `memtui keygen` first",
        ("--tcp", "127.0.0.1"): "refusing TCP on 127.0.0.1 without keys",
        ("--tcp", "0.0.0.0", "--insecure"): "--insecure is for loopback addresses only",
        ("--tcp", "10.1.2.3", "--insecure"): "--insecure is for loopback addresses only",
        ("--insecure",): "--insecure goes with --tcp",
    }
    for flags, message in refused.items():
        result = memtui_cli("demo", "--no-tui", "--steps", "1", "--out", out, *flags)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr)
    assert registry.list_runs() == [], "nothing started"
    dry = memtui_cli("demo", "--tcp", "::1", "--insecure", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("MEMTUI_TCP=::1 MEMTUI_INSECURE=1 ")


def test_demo_insecure_on_loopback_publishes_plain_tcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memtui demo --tcp 127.0.0.1 --insecure``: plain TCP, reached by ``attach --insecure``
    (the command forked from the fork server: ``launch_memtui``)."""
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "none"))
    monkeypatch.delenv("MEMTUI_INSECURE", raising=False)
    log = tmp_path / "demo.log"
    proc = launch_memtui(
        ["demo", "--no-tui", "--tcp", "127.0.0.1", "--insecure", "--steps", "100000",
         "--out", str(tmp_path / "out"), *LIGHT],
        {**os.environ, "PYTHONUNBUFFERED": "1"},
        log,
    )  # fmt: skip
    server = f"memtui-insecure-{os.getpid()}"
    tmux = ["tmux", "-L", server]
    try:

        def run_id() -> str | None:
            for line in log.read_text().splitlines():
                if line.startswith("run "):
                    return line.split()[1]
            assert proc.poll() is None, log.read_text()
            return None

        run = str(wait_for(run_id, 90, what="the demo's run id"))
        rank = registry.find_run(run).ranks[0]
        assert rank.control_tcp.startswith("tcp://127.0.0.1:"), rank
        with pytest.raises(ClientError, match="memtui keygen"):
            ControlClient(rank.control_tcp, timeout_s=2).hello()  # a viewer must ask for it too
        monkeypatch.setenv("MEMTUI_INSECURE", "1")
        assert ControlClient(rank.control_tcp, timeout_s=patience(5)).hello().info.run == run
        if shutil.which("tmux") is None:
            return
        env = [
            f"{k}={os.environ[k]}" for k in ("MEMTUI_RUNTIME_DIR", "XDG_STATE_HOME", "MEMTUI_KEYS")
        ]
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "view", "-x", "120", "-y", "40",
             *(a for pair in env for a in ("-e", pair)),
             f"cd {ROOT} && exec env -u MEMTUI_INSECURE {sys.executable} -m memtui attach "
             f"--insecure {rank.control_tcp}"],
            check=True,
        )  # fmt: skip

        def pane() -> str:
            return subprocess.run(
                [*tmux, "capture-pane", "-p", "-t", "view"], capture_output=True, text=True
            ).stdout

        wait_for(lambda: run in pane(), 45, 0.5, "the run id in the viewer attached over TCP")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        proc.terminate()
        try:
            proc.wait(patience(30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(patience(10))
