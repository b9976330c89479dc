"""The client side of the control socket: hello, set and cancel, with timeouts.

Used by the CLI and the TUI's receiver; imports neither torch nor Textual.
"""

from __future__ import annotations

import getpass
import os
import socket
import time
from typing import TypeVar

import zmq

from memtui.transport.security import SecurityError, make_client
from memtui.wire import (
    AutotuneReply,
    AutotuneRequest,
    CancelReply,
    CancelRequest,
    Decoder,
    ErrorReply,
    Hello,
    KnobValue,
    Message,
    SetReply,
    SetRequest,
    Snapshot,
    encode,
)

T = TypeVar("T")


class ClientError(RuntimeError):
    """The run did not answer, or answered with something that is not a reply."""


def client_name(tool: str) -> str:
    """Who is asking, for the audit log: ``tool:user@host:pid``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{tool}:{user}@{socket.gethostname()}:{os.getpid()}"


class ControlClient:
    """Request/reply over a run's control socket; each request uses a fresh REQ socket."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = 3.0,
        context: zmq.Context | None = None,
        client: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.context = context or zmq.Context.instance()
        self.client = client or client_name("cli")
        self.decoder = Decoder()

    def request(self, message: Message, expect: type[T]) -> T:
        """Send one request and return its reply, or raise ClientError."""
        sock = self.context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        try:
            make_client(sock, self.endpoint)
            sock.connect(self.endpoint)
            sock.send(encode(message))
            if not sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                raise ClientError(f"no answer from {self.endpoint} within {self.timeout_s:g} s")
            reply = self.decoder.decode(sock.recv())
        except (zmq.ZMQError, SecurityError) as exc:
            raise ClientError(f"cannot reach {self.endpoint}: {exc}")
        finally:
            sock.close(0)
        if isinstance(reply, ErrorReply):
            raise ClientError(f"the run refused the request: {reply.reason}")
        if not isinstance(reply, expect):
            raise ClientError(f"unexpected reply from {self.endpoint}: {type(reply).__name__}")
        return reply

    def hello(self, history: int = 512) -> Snapshot:
        """Ask for a snapshot of the run."""
        return self.request(Hello(client=self.client, history=history), Snapshot)

    def set(
        self,
        changes: dict[str, KnobValue | str],
        *,
        keep_effective_batch: bool = False,
        dry_run: bool = False,
        force: bool = False,
        lr_scale: str = "",
    ) -> SetReply:
        """Queue a change; the reply says whether it was accepted."""
        request = SetRequest(
            changes=changes,
            keep_effective_batch=keep_effective_batch,
            lr_scale=lr_scale,
            client=self.client,
            dry_run=dry_run,
            force=force,
        )
        return self.request(request, SetReply)

    def cancel(self, change_id: int = 0) -> CancelReply:
        """Cancel one pending change (0: every pending change)."""
        return self.request(CancelRequest(id=change_id, client=self.client), CancelReply)

    def autotune(self, on: bool) -> AutotuneReply:
        """Turn the run's autopilot on or off; the reply carries its state."""
        return self.request(AutotuneRequest(on=on, client=self.client), AutotuneReply)


def send_request(
    context: zmq.Context, endpoint: str, frame: bytes, max_reply: int
) -> zmq.Socket | None:
    """A REQ socket that sent ``frame`` to ``endpoint`` (None if it could not: the caller polls
    it for the reply and closes it)."""
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_reply)
    try:
        make_client(sock, endpoint)
        sock.connect(endpoint)
        sock.send(frame, zmq.NOBLOCK)
    except (zmq.ZMQError, SecurityError):
        sock.close(0)
        return None
    return sock


def hello_many(
    endpoints: list[str],
    *,
    timeout_s: float = 2.0,
    history: int = 64,
    context: zmq.Context | None = None,
    client: str = "",
) -> list[Snapshot | None]:
    """Ask several ranks for a snapshot at once; None for a rank that did not answer in time."""
    context = context or zmq.Context.instance()
    decoder = Decoder()
    frame = encode(Hello(client=client or client_name("cli"), history=history))
    sockets: list[zmq.Socket | None] = []
    poller = zmq.Poller()
    for endpoint in endpoints:
        if not endpoint:
            sockets.append(None)
            continue
        sock = send_request(context, endpoint, frame, 64 << 20)
        if sock is not None:
            poller.register(sock, zmq.POLLIN)
        sockets.append(sock)
    replies: list[Snapshot | None] = [None] * len(endpoints)
    waiting = sum(sock is not None for sock in sockets)
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for sock, _event in poller.poll(int(left * 1000)):
            index = sockets.index(sock)
            reply = decoder.decode(sock.recv())
            replies[index] = reply if isinstance(reply, Snapshot) else None
            poller.unregister(sock)
            waiting -= 1
    for sock in sockets:
        if sock is not None:
            sock.close(0)
    return replies
