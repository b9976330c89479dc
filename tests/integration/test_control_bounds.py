"""What a peer can make the hook store, echo or spend is bounded.

Requests are checked for their shape before anything of them is stored, echoed or logged; every
socket takes small frames only; a telemetry socket sent anything but a viewer's subscription is
reset; the control plane spends a few percent of a core at most, and each connection a few
requests a second; refusals, rate-limited requests and failed authentications are counted and
shown by ``memtui status``. The live cases hit the fault matrix's demo training (its own, for
this module) and assert its four promises afterwards (``survived``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from memtui.hooks import Options, Tuner
from memtui.hooks.control import MAX_CHANGES, MAX_REASON, MAX_TEXT, Control
from memtui.hooks.limits import Budget, ConnectionCap, PeerRates
from memtui.hooks.persist import AuditLog
from memtui.hooks.server import HELD_REQUESTS, ControlServer
from memtui.transport.client import ClientError, ControlClient, hello_many
from memtui.transport.peers import connections, peer_uid
from memtui.transport.security import keygen, load_keys
from memtui.wire import (
    CancelRequest,
    Decoder,
    ErrorReply,
    HookCounters,
    Knobs,
    SetReply,
    SetRequest,
    Snapshot,
    Telemetry,
    encode,
)
from tests.integration import test_faults
from tests.integration.test_faults import Victim, before, survived
from tests.support.clock import patience
from tests.support.processes import wait_for

pytestmark = pytest.mark.heavy

victim = test_faults.victim
"""The fault matrix's demo training, one for this module."""

SNAPSHOT_CAP = 1 << 20
"""What the largest snapshot may weigh after any storm (the clients take up to 64 MiB)."""


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- units


def test_requests_out_of_bounds_are_refused_and_not_stored(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", "run")
    control = Control(lambda: Knobs(batch_size=8), audit=audit)
    too_many = {f"k{i}": 1 for i in range(MAX_CHANGES + 1)}
    for request in (
        SetRequest(changes=too_many),  # type: ignore[arg-type]
        SetRequest(changes={"\0" * (MAX_TEXT + 1): 1}),
        SetRequest(changes={"batch_size": "9" * (MAX_TEXT + 1)}),
        SetRequest(changes={"batch_size": 4}, client="x" * (MAX_TEXT + 1)),
        SetRequest(changes={"\0" * 400_000: 1}, client="\0" * 400_000),
    ):
        reply = control.queue(request)
        assert not reply.ok and len(reply.reason) < 100, reply.reason
    cancel = control.cancel(CancelRequest(client="y" * 400_000))
    assert not cancel.ok and len(cancel.reason) < 100
    assert control.refused == 6
    assert not control.rejected and not control.pending and audit.read() == []
    assert control.queue(SetRequest(changes={"bs": 4}, client="c" * MAX_TEXT)).ok


def test_rejected_requests_are_stored_clipped_and_logged_a_few_a_second(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", "run")
    control = Control(lambda: Knobs(batch_size=8), audit=audit)
    names = {"\0" * (MAX_TEXT - 4) + f"{i:04d}": "\x1b[31m" * 12 for i in range(MAX_CHANGES)}
    for _ in range(500):  # the largest requests in bounds, each rejected
        reply = control.queue(SetRequest(changes=names, client="\0\x1b" * (MAX_TEXT // 2)))  # type: ignore[arg-type]
        assert not reply.ok and len(reply.reason) <= MAX_REASON + 3
    assert len(control.rejected) == 50, "the in-memory record keeps its bound"
    for rejected in control.rejected:
        text = json.dumps(rejected.requested) + rejected.client + rejected.reason
        assert "\\u0000" not in text and "\\u001b" not in text, "stored sanitised"
        assert len(rejected.requested) <= MAX_CHANGES
        assert all(len(name) <= MAX_TEXT for name in rejected.requested)
    assert len(msgspec.msgpack.encode(control.state())) < 128 << 10
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert all(len(line) < 4096 for line in lines), max(map(len, lines))
    assert len(lines) < 60, "a storm of rejections is not written line by line"
    time.sleep(1.0)
    control.queue(SetRequest(changes={"nope": 1}))
    events = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    rejected = [event for event in events if event["event"] == "rejected"]
    assert rejected[-1]["unaudited_before"] > 0, "the next line says how many went unwritten"
    written, counted = len(rejected), sum(e.get("unaudited_before", 0) for e in rejected)
    assert written + counted == 501, "every rejection is written or counted (at any speed)"


def test_the_budget_rests_once_spent_and_each_peer_has_a_rate() -> None:
    clock = Clock()
    budget = Budget(share=0.02, burst=0.1, resume=0.01, clock=clock)
    for _ in range(9):
        budget.spend(0.01)
    assert not budget.resting()
    budget.spend(0.02)  # 10 ms past zero: rests until 10 ms are back, (0.01 + 0.01) / 0.02 s
    assert budget.resting() and budget.rests == 1
    clock.now += 0.9
    assert budget.resting()
    clock.now += 0.2
    assert not budget.resting() and budget.level() == pytest.approx(0.012)
    clock.now += 100
    assert budget.level() == pytest.approx(0.1), "refilled up to the burst, no further"

    rates = PeerRates(rate=2.0, burst=10.0, peers=3, clock=clock)
    assert all(rates.allow(b"a") for _ in range(10))
    assert not rates.allow(b"a"), "over its burst"
    assert rates.allow(b"b"), "another connection has its own"
    clock.now += 0.5
    assert rates.allow(b"a") and not rates.allow(b"a"), "one more every half second"
    for peer in (b"c", b"d", b"e"):
        rates.allow(peer)
    assert len(rates) == 3, "the least recently seen are forgotten"


def test_requests_waiting_through_a_rest_are_held_and_the_newest_answered_after_it() -> None:
    """While the budget rests, the requests waiting are read out of ZeroMQ (which would keep
    each connection's pipes until then) into a bounded queue: the newest are answered once the
    rest ends, the older ones beyond the bound are dropped and counted."""
    control = Control(lambda: Knobs(batch_size=8))
    served = ControlServer(control, lambda: 0, lambda _h: Snapshot(info=None), lambda *_a: None)  # type: ignore[arg-type]
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://control")
    clients = []
    for index in range(HELD_REQUESTS + 44):
        sock = context.socket(zmq.REQ)
        sock.connect("inproc://control")
        sock.send(encode(SetRequest(changes={"batch_size": 4}, client=f"c{index}", dry_run=True)))
        clients.append(sock)
    served.budget.resting_until = time.monotonic() + 60
    assert served.hold_waiting(router) == HELD_REQUESTS + 44
    assert served.shed == 44 and served.holding(tcp=False)
    assert not router.poll(0), "nothing is left in ZeroMQ's queues"
    served.budget.resting_until = 0.0
    while served.holding(tcp=False):
        served.budget = Budget(burst=10.0)
        served.serve(router)
    answered = [index for index, sock in enumerate(clients) if sock.poll(20)]
    assert answered == list(range(44, HELD_REQUESTS + 44)), "the newest, all of them"
    for sock in clients:
        sock.close(0)
    router.close(0)
    context.term()


def test_the_connection_cap_counts_once_a_period_and_at_once_on_a_jump_of_descriptors() -> None:
    clock, descriptors, counted = Clock(), [40], []

    def count(port: int, host: str) -> int:
        counted.append(port)
        return {1: 600, 2: 10}[port]

    cap = ConnectionCap(
        limit=512, period=1.0, step=64, clock=clock, descriptors=lambda: descriptors[0], count=count
    )
    ports = [("127.0.0.1", 1), ("127.0.0.1", 2)]
    assert cap.over(ports) == [1] and counted == [1, 2], "the first look counts"
    clock.now += 0.5
    descriptors[0] += 63
    assert cap.over(ports) == [] and counted == [1, 2], "not due, and few more descriptors"
    descriptors[0] += 1
    assert cap.over(ports) == [1] and len(counted) == 4, "64 more descriptors: counted at once"
    descriptors[0] = 10  # the reset closed them: the next jump is from here
    clock.now += 0.1
    assert cap.over(ports) == [] and len(counted) == 4
    descriptors[0] = 80
    assert cap.over(ports) == [1] and len(counted) == 6
    clock.now += 1.0
    assert cap.over(ports) == [1] and len(counted) == 8, "a period passed"
    assert cap.over([]) == []


def test_the_kernel_counts_a_ports_connections_and_names_a_loopback_peer() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        port = server.getsockname()[1]
        assert connections(port) == 0
        peers = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        accepted = [server.accept()[0] for _ in peers]
        assert connections(port) == 5
        mine = accepted[0]
        assert peer_uid(mine.getsockname(), mine.getpeername()) == os.getuid()
        assert peer_uid(mine.getsockname(), ("127.0.0.1", 1)) is None, "no such connection"
        for sock in peers + accepted:
            sock.close()
        assert connections(port) == 0


# ---------------------------------------------------------------------------- a live run


def snapshot_bytes(run: Victim, history: int = 2048) -> int:
    """The size of the run's snapshot as a viewer asks for it."""
    return len(encode(run.client().hello(history=history)))


def counters(run: Victim) -> dict[str, int]:
    """The run's counters, zeros included."""
    return msgspec.structs.asdict(run.client().hello(history=0).counters or HookCounters())


def test_a_viewer_and_status_are_never_limited(victim: Victim) -> None:
    seen = before(victim)
    start = counters(victim)
    client = victim.client()
    for _ in range(30):  # a viewer connecting, refreshing its snapshot often, and the others
        assert isinstance(client.hello(history=2048), Snapshot)
        assert all(hello_many([victim.control] * 3, history=512))
        time.sleep(0.02)
    assert client.set({"batch_size": 12}, dry_run=True).ok  # 16 is the run's: a no-op
    end = counters(victim)
    for name in ("requests_refused", "requests_rate_limited", "control_rests"):
        assert end.get(name, 0) == start.get(name, 0), (name, start, end)
    survived(victim, seen)


def test_a_storm_of_huge_nul_named_requests(victim: Victim) -> None:
    """Unchecked, ~400 KB requests whose unknown knob name is NUL bytes grew every snapshot past
    the clients' limit; and the largest requests in bounds must not grow it much."""
    seen = before(victim)
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(victim.control)
    huge = encode(SetRequest(changes={"\0" * 400_000: 1}, client="storm"))
    for _ in range(70):
        dealer.send_multipart([b"", huge])
    time.sleep(1.0)
    dealer.close()
    names = {"\0" * (MAX_TEXT - 4) + f"{i:04d}": "\0" * MAX_TEXT for i in range(MAX_CHANGES)}
    largest = encode(SetRequest(changes=names, client="\0" * MAX_TEXT))  # type: ignore[arg-type]
    out_of_bounds = encode(SetRequest(changes={"\0" * (MAX_TEXT + 1): 1}))
    decoder = Decoder()
    for frame in [largest] * 60 + [out_of_bounds] * 5:
        reply = decoder.decode(request_once(victim.control, frame))
        assert isinstance(reply, SetReply) and not reply.ok and len(reply.reason) <= MAX_REASON + 3
    size = snapshot_bytes(victim)
    assert size < SNAPSHOT_CAP, f"the snapshot weighs {size >> 10} KiB"
    status = victim.cli("status", "--json", "--timeout", "10")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["counters"]["requests_refused"] >= 5
    info = victim.client().hello(history=0).info
    lines = Path(info.audit_path).read_text().splitlines()
    assert all(len(line) < 8192 for line in lines), max(map(len, lines))
    survived(victim, seen)


def request_once(endpoint: str, frame: bytes, timeout_ms: int = 5000) -> bytes:
    """Send one frame on a fresh REQ connection and return the answer."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(frame)
        assert sock.poll(timeout_ms), "the run answers"
        return bytes(sock.recv())
    finally:
        sock.close()


BIG_SUBSCRIBER = """
import os, sys, zmq
sock = zmq.Context().socket(zmq.XSUB)
monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
sock.connect(sys.argv[1])
for index in range(16):
    sock.send(b"\\x01" + bytes([index]) * (1 << 20))
print("dropped" if monitor.poll(5000) else "kept", flush=True)
os._exit(0)  # not closed: ZeroMQ would free the XSUB's 1 MiB-deep trie recursively (a crash)
"""
"""A peer sending 16 subscriptions of 1 MiB: says whether the run dropped it."""


def test_big_and_foreign_subscriptions(victim: Victim) -> None:
    """Unbounded, 16 subscriptions of 1 MiB grew the training by hundreds of MB; topics no
    viewer subscribes to reset the socket, and viewers come back by themselves."""
    seen = before(victim)
    context = zmq.Context.instance()
    viewer = context.socket(zmq.SUB)
    viewer.setsockopt(zmq.LINGER, 0)
    viewer.setsockopt(zmq.SUBSCRIBE, b"")
    viewer.connect(victim.pub)
    assert viewer.poll(int(patience(5) * 1000)), "a viewer gets telemetry"
    big = subprocess.run(
        [sys.executable, "-c", BIG_SUBSCRIBER, victim.pub],
        capture_output=True,
        text=True,
        timeout=patience(60),
    )
    assert big.stdout.split() == ["dropped"], big.stdout + big.stderr
    time.sleep(1.5)  # the agent wakes at least once a second
    grown = victim.rss() - seen.rss
    assert grown < 32 << 20, f"the training grew {grown >> 20} MiB"
    decoder = Decoder()

    def telemetry() -> bool:
        return viewer.poll(200) and isinstance(decoder.decode(viewer.recv()), Telemetry)

    refused = counters(victim)["requests_refused"]

    def reset() -> bool:
        return counters(victim)["requests_refused"] > refused

    # a topic no viewer subscribes to, then a storm of subscribe/unsubscribe: each resets
    for storm in ([b"\x01memtui"], [b"\x01", b"\x00"] * 300):
        peer = context.socket(zmq.XSUB)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(victim.pub)
        for frame in storm:
            peer.send(frame)
        wait_for(reset, 10, 0.2, "the telemetry socket reset")
        refused = counters(victim)["requests_refused"]
        peer.close()
        while viewer.poll(0):
            viewer.recv()
        wait_for(telemetry, 15, 0.1, "the viewer to get telemetry again")
    viewer.close()
    survived(victim, seen)


def test_a_socket_reset_with_its_monitor_ready_in_the_same_round_costs_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flood of viewers on a plain TCP telemetry socket can make it ready together with its
    monitor (a handshake failed): reading the socket resets it, closing the monitor too, and
    the round goes on to the monitor it listed. The agent skips the closed socket: no error, no
    rebinding of every socket (which dropped the run's user's requests over ipc)."""
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "nokeys"))
    options = Options(tcp="127.0.0.1", insecure=True)
    tuner = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path, options=options).start()
    try:
        agent = tuner.agent
        assert agent is not None
        poller = agent._poller

        class Together:
            """The agent's poller, listing a socket's monitor as ready whenever the socket is."""

            def poll(self, timeout_ms: int) -> list[tuple[object, int]]:
                ready = poller().poll(timeout_ms)
                monitors = [
                    (monitor, zmq.POLLIN)
                    for monitor, watched in agent._monitors.items()
                    if any(sock is watched for sock, _event in ready)
                ]
                return [*ready, *monitors]

        together = Together()
        monkeypatch.setattr(agent, "_poller", lambda: together)
        peer = zmq.Context.instance().socket(zmq.XSUB)
        peer.setsockopt(zmq.LINGER, 0)
        peer.connect(tuner.ranks[0].pub_tcp)
        peer.send(b"\x01memtui")  # a topic no viewer subscribes to: the socket is reset
        client = ControlClient(tuner.ranks[0].control, timeout_s=5)

        def counted() -> HookCounters:
            found = client.hello(history=0).counters
            assert found is not None
            return found

        wait_for(lambda: counted().requests_refused > 0, 10, 0.2, "the telemetry socket reset")
        peer.close()
        time.sleep(1.0)  # a failed round sleeps half a second before it rebinds every socket
        assert counted().errors == 0, counted().last_error
    finally:
        tuner.close()


def test_a_request_flood_is_rate_limited(victim: Victim) -> None:
    """Unlimited, a flood of valid set requests and of hellos with history doubled the step time.

    The flooding connection gets "rate limited", and the control plane rests once its CPU
    budget is spent; the run trains on, and answers status meanwhile.
    """
    seen = before(victim)
    client = victim.client()
    step = client.hello(history=0).step
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(victim.control)
    frames = [
        encode(SetRequest(changes={"batch_size": 4 + i % 8}, client="flood", dry_run=True))
        for i in range(8)
    ]
    decoder = Decoder()
    limited = sent = 0
    answered = []
    deadline = time.monotonic() + 4.0
    next_status = time.monotonic()
    while time.monotonic() < deadline:
        try:
            dealer.send_multipart([b"", frames[sent % 8]], zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            dealer.poll(5)
        while dealer.poll(0):
            reply = decoder.decode(dealer.recv_multipart()[-1])
            limited += isinstance(reply, ErrorReply) and "rate limited" in reply.reason
        if time.monotonic() >= next_status:  # status answers during the flood
            next_status += 1.0
            try:
                answered.append(client.hello(history=512).step)
            except ClientError:
                answered.append(-1)
    dealer.close()
    assert limited > 100 and sent > limited
    assert sum(s >= 0 for s in answered) >= len(answered) - 1, answered
    assert client.hello(history=0).step > step, "the run trained on"
    seen_counters = counters(victim)
    assert seen_counters["requests_rate_limited"] >= limited
    assert seen_counters["control_rests"] >= 1, seen_counters
    status = victim.cli("status", "--timeout", "10")
    assert status.returncode == 0 and " rate limited, " in status.stdout, status.stdout
    survived(victim, seen)


# ---------------------------------------------------------------------------- authentication


def test_failed_authentications_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unauthenticated CURVE handshakes are counted (a stranger's attempts are otherwise unseen)."""
    monkeypatch.setenv("MEMTUI_KEYS", str(tmp_path / "curve"))
    monkeypatch.delenv("MEMTUI_INSECURE", raising=False)
    keygen()
    tuner = Tuner(
        SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options(tcp="127.0.0.1")
    ).start()
    context = zmq.Context.instance()
    socks = []
    try:
        rank = tuner.ranks[0]
        server = load_keys()
        stranger = load_keys(keygen(directory=tmp_path / "stranger"))
        assert server is not None and stranger is not None
        for server_key in (server.server_public, stranger.server_public, None):
            sock = context.socket(zmq.REQ)  # refused key; wrong server key; no CURVE at all
            sock.setsockopt(zmq.LINGER, 0)
            if server_key is not None:
                sock.curve_serverkey = server_key
                sock.curve_publickey = stranger.client_public
                sock.curve_secretkey = stranger.client_secret
            sock.connect(rank.control_tcp)
            socks.append(sock)
        snapshot = ControlClient(rank.control_tcp, timeout_s=patience(5)).hello(history=0)

        def failures() -> int:
            answer = ControlClient(rank.control_tcp, timeout_s=patience(5)).hello(history=0)
            return answer.counters.auth_failures if answer.counters else 0

        wait_for(lambda: failures() >= 3, 20, 0.2, "three failed authentications counted")
        assert snapshot.info.run == tuner.run_id
    finally:
        for sock in socks:
            sock.close(0)
        tuner.close()
