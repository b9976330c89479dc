"""``--insecure`` plain TCP: said loudly, read-only unless control is asked for a second time."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from memtui.hooks import Options, Tuner
from memtui.transport.client import ClientError, ControlClient
from memtui.wire import (
    CancelRequest,
    Decoder,
    ErrorReply,
    Hello,
    Message,
    SetReply,
    SetRequest,
    Snapshot,
    encode,
)
from tests.support.cli import memtui_cli
from tests.support.clock import patience
from tests.support.other_user import OtherUser, make_other_user

MakeTuner = Callable[..., Tuner]


@pytest.fixture(scope="session")
def other_user() -> Iterator[OtherUser]:
    """A second real user on this host (skipped, saying why, where none can be made)."""
    yield from make_other_user()


@pytest.fixture
def no_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No CURVE keys, and no opt-in from the environment unless a test sets one."""
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "none"))
    for name in ("MEMTUI_INSECURE", "MEMTUI_INSECURE_CONTROL", "MEMTUI_TCP"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_tuner(no_keys: None, tmp_path: Path) -> Iterator[MakeTuner]:
    """Real hooks (real sockets) in this process, closed at the end."""
    tuners: list[Tuner] = []

    def make(**options: object) -> Tuner:
        tuner = Tuner(
            SimpleNamespace(batch_size=4),
            state_dir=tmp_path / f"state{len(tuners)}",
            options=Options(**options),  # type: ignore[arg-type]
        ).start()
        tuners.append(tuner)
        for _ in range(3):
            tuner.step()
        return tuner

    yield make
    for tuner in tuners:
        tuner.close()


def ask(endpoint: str, message: Message, timeout_s: float = 5.0) -> Message | None:
    """One request from a bare ZeroMQ REQ socket, as any local user could send it."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(message))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return Decoder().decode(sock.recv())
    finally:
        sock.close(0)


def test_plain_tcp_warns_loudly_at_install(
    make_tuner: MakeTuner, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="memtui"):
        tuner = make_tuner(tcp="127.0.0.1", insecure=True)
    rank = tuner.ranks[0]
    warnings = [r.getMessage() for r in caplog.records if "INSECURE" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert rank.pub_tcp in warnings[0] and rank.control_tcp in warnings[0]
    assert "any local user can read the telemetry" in warnings[0]
    assert "read-only" in warnings[0]


def test_ipc_and_curve_say_nothing(make_tuner: MakeTuner, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="memtui"):
        tuner = make_tuner()
    assert "INSECURE" not in caplog.text
    assert tuner.info.security == "ipc"
    assert tuner.agent is not None and tuner.agent.record().security == "ipc"


def test_plain_tcp_control_socket_is_read_only(
    make_tuner: MakeTuner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the second opt-in, hello gets a reduced snapshot and set/cancel get refused."""
    tuner = make_tuner(tcp="127.0.0.1", insecure=True)
    rank = tuner.ranks[0]
    snapshot = ask(rank.control_tcp, Hello(client="other user"))
    assert isinstance(snapshot, Snapshot) and snapshot.info.run == tuner.run_id
    info = snapshot.info
    assert info.readonly and info.security == "plain-tcp"
    assert info.command == [] and info.cwd == "" and info.state_dir == ""
    assert info.audit_path == "" and info.tuned_path == ""
    assert snapshot.steps, "telemetry is still there"

    refused = ask(rank.control_tcp, SetRequest(changes={"batch_size": 8}, client="other user"))
    assert isinstance(refused, ErrorReply) and "read-only" in refused.reason
    cancel = ask(rank.control_tcp, CancelRequest(client="other user"))
    assert isinstance(cancel, ErrorReply) and "read-only" in cancel.reason
    monkeypatch.setenv("MEMTUI_INSECURE", "1")  # memtui's own client, asked for plain TCP
    with pytest.raises(ClientError, match="read-only"):
        ControlClient(rank.control_tcp, timeout_s=patience(5)).set({"batch_size": 8})
    tuner.checkpoint()
    assert tuner.knobs().batch_size == 4 and not tuner.control.pending

    # the run's own user, over the private ipc socket, still sees and changes everything
    full = ControlClient(tuner.ranks[0].control, timeout_s=patience(5)).hello()
    assert full.info.command and full.info.cwd and not full.info.readonly
    assert full.info.security == "plain-tcp"
    assert ControlClient(tuner.ranks[0].control, timeout_s=patience(5)).set({"batch_size": 8}).ok


def test_the_read_only_snapshot_names_no_path_of_the_run(
    make_tuner: MakeTuner, private_runtime: Path, tmp_path: Path
) -> None:
    """Over plain TCP the ranks come with their TCP endpoints only: an ipc socket is a path in the
    run's private runtime directory, which the reduced snapshot leaves out like the others."""
    tuner = make_tuner(tcp="127.0.0.1", insecure=True)
    rank = tuner.ranks[0]
    assert rank.pub.startswith("ipc://") and rank.control.startswith("ipc://")
    snapshot = ask(rank.control_tcp, Hello(client="other user"))
    assert isinstance(snapshot, Snapshot) and snapshot.info.readonly
    assert [(r.rank, r.pub, r.control, r.pub_tcp, r.control_tcp) for r in snapshot.ranks] == [
        (0, "", "", rank.pub_tcp, rank.control_tcp)
    ]
    encoded = encode(snapshot)
    assert str(private_runtime).encode() not in encoded and str(tmp_path).encode() not in encoded

    # the run's own user, over ipc, still gets every endpoint
    full = ControlClient(rank.control, timeout_s=patience(5)).hello()
    assert full.ranks == tuner.ranks


def test_another_users_viewer_follows_a_plain_tcp_run_over_tcp(
    make_tuner: MakeTuner, other_user: OtherUser
) -> None:
    """Another account's viewer on the same host reads the telemetry over TCP and stays live: it
    never tries the run's ipc socket (once it said "receiver error: Permission denied" and
    disconnected every second)."""
    tuner = make_tuner(tcp="127.0.0.1", insecure=True)
    rank = tuner.ranks[0]
    seen = other_user.report("viewer", rank.control_tcp, "3", env={"MEMTUI_INSECURE": "1"})
    assert seen["errors"] == 0 and seen["said"][0] == "live: ", seen
    assert not [said for said in seen["said"] if "error" in said or "disconnected" in said], seen
    assert seen["subscribed"] == [rank.pub_tcp], seen
    assert len(seen["steps"]) >= 2, f"telemetry over TCP: {seen}"


def test_an_ipc_socket_another_user_cannot_open_is_a_rank_on_another_node(
    make_tuner: MakeTuner, other_user: OtherUser
) -> None:
    """Ranks as a full snapshot lists them (a rank on this host: its ipc socket and its TCP
    twin): another account cannot open the ipc socket, so its viewer subscribes over TCP."""
    tuner = make_tuner(tcp="127.0.0.1", insecure=True)
    rank = tuner.ranks[0]
    assert rank.pub.startswith("ipc://") and rank.host
    listed = msgspec.json.encode([rank]).decode()
    seen = other_user.report(
        "viewer", rank.control_tcp, "3", "--ranks", listed, env={"MEMTUI_INSECURE": "1"}
    )
    assert seen["errors"] == 0 and seen["said"][0] == "live: ", seen
    assert not [said for said in seen["said"] if "error" in said or "disconnected" in said], seen
    assert seen["subscribed"] == [rank.pub_tcp], seen
    assert len(seen["steps"]) >= 2, f"telemetry over TCP: {seen}"


def test_plain_tcp_control_takes_a_second_opt_in(
    make_tuner: MakeTuner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MEMTUI_INSECURE_CONTROL", "1")
    with caplog.at_level(logging.WARNING, logger="memtui"):
        tuner = make_tuner(tcp="127.0.0.1", insecure=True)
    assert "any local user can read the telemetry, the command line and cwd" in caplog.text
    assert "queue or cancel changes" in caplog.text
    rank = tuner.ranks[0]
    snapshot = ask(rank.control_tcp, Hello(client="other user"))
    assert isinstance(snapshot, Snapshot)
    assert snapshot.info.security == "plain-tcp+control" and not snapshot.info.readonly
    assert snapshot.info.command and snapshot.info.cwd == os.getcwd()
    reply = ask(rank.control_tcp, SetRequest(changes={"batch_size": 8}, client="other user"))
    assert isinstance(reply, SetReply) and reply.ok, reply
    tuner.checkpoint()
    assert tuner.knobs().batch_size == 8


def test_the_control_opt_in_alone_opens_nothing(
    make_tuner: MakeTuner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``MEMTUI_INSECURE_CONTROL`` without ``--insecure``: still no plain TCP at all."""
    monkeypatch.setenv("MEMTUI_INSECURE_CONTROL", "1")
    tuner = make_tuner(tcp="127.0.0.1")
    assert tuner.tcp_plan is None and tuner.ranks[0].control_tcp == ""
    assert tuner.info.security == "ipc"


def test_ls_and_status_print_the_insecure_marker(make_tuner: MakeTuner) -> None:
    plain = make_tuner(tcp="127.0.0.1", insecure=True)
    private = make_tuner()
    rank = plain.ranks[0]

    listed = memtui_cli("ls")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(plain.run_id))
    marker = lines[row + 1]
    assert "INSECURE: plain TCP on" in marker and rank.control_tcp in marker
    assert "any local user can read the telemetry" in marker
    assert sum("INSECURE" in line for line in lines) == 1, "the private run has none"
    rows = {r["run"]: r for r in json.loads(memtui_cli("ls", "--json").stdout)}
    assert rows[plain.run_id]["security"] == "plain-tcp"
    assert rows[private.run_id]["security"] == "ipc"

    status = memtui_cli("status", plain.run_id)
    assert status.returncode == 0, status.stderr
    second = status.stdout.splitlines()[1]
    assert second.startswith("INSECURE: plain TCP on") and rank.pub_tcp in second
    assert "INSECURE" not in memtui_cli("status", private.run_id).stdout


def test_demo_asks_for_control_twice(no_keys: None) -> None:
    alone = memtui_cli("demo", "--tcp", "127.0.0.1", "--insecure-control", "--dry-run")
    assert alone.returncode == 2 and "--insecure-control goes with --insecure" in alone.stderr
    read_only = memtui_cli("demo", "--tcp", "127.0.0.1", "--insecure", "--dry-run")
    assert read_only.returncode == 0, read_only.stderr
    assert "MEMTUI_INSECURE_CONTROL" not in read_only.stdout
    both = memtui_cli("demo", "--tcp", "127.0.0.1", "--insecure", "--insecure-control", "--dry-run")
    assert both.returncode == 0, both.stderr
    assert both.stdout.startswith(
        "MEMTUI_TCP=127.0.0.1 MEMTUI_INSECURE=1 MEMTUI_INSECURE_CONTROL=1 "
    )
