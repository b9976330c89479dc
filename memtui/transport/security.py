"""Authenticated TCP for multi-node runs: CURVE keys from ``memtui keygen`` and the server-side check.

Local runs never need this: they use ipc sockets in the per-user 0700 runtime directory. When a
run publishes over TCP (``install(..., tcp="0.0.0.0")`` or ``MEMTUI_TCP``), every rank's TCP
sockets are CURVE servers with the user's server key, and a ZAP handler in the hook's agent
thread admits only clients whose public key is in ``<keys>/authorized/``. Viewers connect with
the user's client key. ``memtui keygen`` makes both key pairs (files 0600 in a 0700 directory)
and authorises its own client key; copy the directory to the other nodes (or share the home
directory) like an SSH key. Plain TCP is refused, except with ``insecure`` on a loopback address,
where any local user can connect: it then publishes telemetry and answers hello with a reduced,
read-only snapshot (no command line, cwd or paths; set and cancel refused), unless control is
asked for a second time (``MEMTUI_INSECURE_CONTROL=1``, ``memtui demo --insecure-control``).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq
from zmq.utils import z85

from memtui.core.switches import switch
from memtui.storage import paths
from memtui.storage.ownfiles import UnsafeFile, private_dir
from memtui.wire import RankInfo, RunInfo

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = "memtui"

IPC = "ipc"
"""Security mode: private ipc sockets only (the run's user alone)."""
CURVE = "curve"
"""Security mode: ipc, and TCP for holders of an authorised CURVE client key."""
PLAIN = "plain-tcp"
"""Security mode: ipc, and plain loopback TCP that any local user reads (telemetry, no control)."""
PLAIN_CONTROL = "plain-tcp+control"
"""Security mode: plain loopback TCP with the control socket too (any local user queues changes)."""
READONLY_REASON = (
    "read-only: this plain TCP socket takes no changes "
    "(the run was not started with --insecure-control / MEMTUI_INSECURE_CONTROL=1)"
)
"""The error a set or cancel gets on a plain TCP socket without the control opt-in."""


class SecurityError(RuntimeError):
    """TCP was asked for without the keys (or insecurely on a non-loopback address)."""


def key_dir() -> Path:
    """Where the CURVE keys live: ``$MEMTUI_KEYS``, else ``~/.config/memtui/curve``."""
    return paths.key_dir()


def keygen(force: bool = False, directory: Path | None = None) -> Path:
    """Make the server and client key pairs and authorise the client key; return the directory."""
    root = directory or key_dir()
    if (root / "server.key_secret").exists() and not force:
        raise SecurityError(f"keys already exist in {root} (use --force to replace them)")
    try:  # the user's own directories, never another user's link (the keys would be theirs)
        private_dir(root)
        authorized = root / "authorized"
        if force and authorized.exists():
            shutil.rmtree(authorized)
        private_dir(authorized)
    except UnsafeFile as exc:
        raise SecurityError(str(exc)) from None
    import zmq.auth

    for name in ("server", "client"):
        zmq.auth.create_certificates(root, name)
    shutil.copyfile(root / "client.key", authorized / "client.key")
    for path in [*root.iterdir(), *authorized.iterdir()]:
        if path.is_file():
            path.chmod(0o600)
    return root


@dataclass(frozen=True)
class Keys:
    """The user's CURVE keys (z85-encoded) and the client keys the servers admit."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized: frozenset[bytes]


def load_keys(directory: Path | None = None) -> Keys | None:
    """The keys made by ``memtui keygen``, or None when there are none."""
    root = directory or key_dir()
    if not (root / "server.key_secret").exists():
        return None  # no keys: zmq.auth (and its logging) is not loaded, and the CLI starts sooner
    import zmq.auth

    try:
        server_public, server_secret = zmq.auth.load_certificate(root / "server.key_secret")
        client_public, client_secret = zmq.auth.load_certificate(root / "client.key_secret")
    except (OSError, ValueError):
        return None
    if server_secret is None or client_secret is None:
        return None
    authorized = set()
    for path in (root / "authorized").glob("*.key"):
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError):
            continue
        authorized.add(public)
    return Keys(server_public, server_secret, client_public, client_secret, frozenset(authorized))


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(endpoint: str) -> str:
    """The host part of a ``tcp://host:port`` endpoint."""
    rest = endpoint.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


def insecure_requested() -> bool:
    """``MEMTUI_INSECURE=1``: plain TCP, allowed on loopback addresses only."""
    return bool(switch(os.environ.get("MEMTUI_INSECURE")))


def insecure_control_requested() -> bool:
    """``MEMTUI_INSECURE_CONTROL=1``: plain TCP also serves changes (asked for a second time)."""
    return bool(switch(os.environ.get("MEMTUI_INSECURE_CONTROL")))


@dataclass(frozen=True)
class TcpPlan:
    """How a rank binds TCP: the address, CURVE keys (None: insecure loopback), and control."""

    address: str
    keys: Keys | None
    control: bool = True
    """Whether the TCP control socket takes set/cancel and gives the full snapshot."""

    @property
    def mode(self) -> str:
        """The security mode: ``curve``, ``plain-tcp`` or ``plain-tcp+control``."""
        if self.keys is not None:
            return CURVE
        return PLAIN_CONTROL if self.control else PLAIN

    def advertised(self, port: int) -> str:
        """The endpoint other nodes use to reach a socket bound on ``port``."""
        host = self.address
        if host in ("0.0.0.0", "*", "::"):
            host = socket.gethostname()
        return f"tcp://{host}:{port}"


def plan_tcp(
    address: str | None, insecure: bool = False, control: bool | None = None
) -> TcpPlan | None:
    """Decide how to bind TCP for ``address`` (None: no TCP), plain TCP serving changes only
    with ``control`` (None: ``MEMTUI_INSECURE_CONTROL``); raise SecurityError to refuse."""
    if not address:
        return None
    keys = load_keys()
    if keys is not None and not insecure:
        return TcpPlan(address, keys)
    if insecure and is_loopback(address):
        return TcpPlan(address, None, insecure_control_requested() if control is None else control)
    if insecure:
        raise SecurityError(
            f"refusing plain TCP on {address}: --insecure is for loopback addresses only"
        )
    raise SecurityError(f"refusing TCP on {address} without keys: run `memtui keygen` first")


def exposure(mode: str, endpoints: Iterable[str]) -> str:
    """The loud one-line warning for a run on plain TCP at ``endpoints`` ("" for ipc and CURVE)."""
    if mode not in (PLAIN, PLAIN_CONTROL):
        return ""
    where = ", ".join(e for e in endpoints if e) or "loopback TCP"
    if mode == PLAIN_CONTROL:
        return (
            f"INSECURE: plain TCP on {where}: any local user can read the telemetry, "
            "the command line and cwd, and queue or cancel changes"
        )
    return (
        f"INSECURE: plain TCP on {where}: any local user can read the telemetry "
        "(read-only: no changes, no command line or cwd over TCP)"
    )


def tcp_endpoints(ranks: Iterable[RankInfo]) -> list[str]:
    """Every TCP endpoint the ranks bound (telemetry and control), for ``exposure``."""
    return [e for rank in ranks for e in (rank.pub_tcp, rank.control_tcp) if e]


def public_info(info: RunInfo) -> RunInfo:
    """The RunInfo a read-only plain TCP socket gives: no command line, cwd or paths."""
    return msgspec.structs.replace(
        info, command=[], cwd="", state_dir="", tuned_path="", audit_path="", readonly=True
    )


def make_server(sock: zmq.Socket, keys: Keys | None) -> None:
    """Make a TCP socket a CURVE server checked by ZAP (nothing for insecure loopback)."""
    if keys is None:
        return
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = DOMAIN.encode()


def client_keys(endpoint: str) -> Keys | None:
    """The CURVE keys a client needs to reach ``endpoint`` (None: plain, for ipc and insecure
    loopback TCP); raise SecurityError when it cannot be reached safely."""
    if not endpoint.startswith("tcp://"):
        return None
    keys = load_keys()
    if keys is not None and not insecure_requested():
        return keys
    if insecure_requested() and is_loopback(host_of(endpoint)):
        return None
    raise SecurityError(
        f"{endpoint} is TCP: run `memtui keygen` (or copy its keys here) to reach it"
    )


def client_domain(endpoint: str) -> bytes:
    """Which sockets may share a connection to ``endpoint``: b"" for plain (ipc, insecure
    loopback TCP), else the CURVE server key it is reached with.

    A ZeroMQ socket's security options apply to every connection made after they are set, so
    one socket cannot reach a plain peer once it has been made a CURVE client (the plain peer's
    handshake silently fails): a client that reaches several peers keeps one socket per domain.
    Raises SecurityError like ``make_client``.
    """
    keys = client_keys(endpoint)
    return b"" if keys is None else keys.server_public


def make_client(sock: zmq.Socket, endpoint: str) -> None:
    """Give a client socket what it needs to reach ``endpoint``; raise SecurityError if it can't.

    The options stay on the socket for every later ``connect``: give a socket only endpoints
    of one ``client_domain``.
    """
    keys = client_keys(endpoint)
    if keys is not None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret


class ZapHandler:
    """Answers ZeroMQ's authentication requests: CURVE clients with an authorised key only."""

    def __init__(self, context: zmq.Context, keys: Keys) -> None:
        self.keys = keys
        self.socket: Any = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.denied = 0
        """Peers refused (unknown key or wrong mechanism)."""

    def handle(self, limit: int = 64) -> None:
        """Answer the pending requests, at most ``limit`` (the caller comes back for more)."""
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self.answer(frames))

    def answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27)."""
        if len(frames) < 6:
            self.denied += 1
            return [b"1.0", b"", b"400", b"malformed request", b"", b""]
        version, request_id, domain, _address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        if mechanism == b"CURVE" and credentials and domain == DOMAIN.encode():
            public = z85.encode(credentials[0])
            if public in self.keys.authorized:
                return [version, request_id, b"200", b"OK", public, b""]
        self.denied += 1
        return [version, request_id, b"400", b"not authorised", b"", b""]

    def close(self) -> None:
        """Stop answering."""
        self.socket.close(0)
