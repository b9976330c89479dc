"""``memtui export``'s HTTP server: prometheus-client's WSGI app behind a bounded server.

prometheus-client's own server takes every connection on a thread of its own and waits for its
request as long as the client likes: held connections cost a thread each, without end. This one
serves at most ``max_connections`` at once (one thread each), and at most ``max_per_peer`` of
them for one peer, and answers any connection beyond either with a ``503`` at once, from the
accepting thread; a connection must deliver its request (line and headers) within ``timeout_s``
of being taken, however slowly it drips in, and each write of the reply may take ``timeout_s``
at most: a held connection is closed within that time.

A peer is an account where the server can tell: the owner of the other end of a Unix socket
(``SO_PEERCRED``) or of a loopback TCP connection (the kernel's socket diagnostics,
``transport.peers``), so that every local account has its own share however many connections
another one holds; else the peer's address. Who may read at all is the listener's: a Unix
socket is 0600 and answers its owner and root only; over TCP, with a ``token``, a request
without ``Authorization: Bearer <token>`` is answered ``401``.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import io
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import IO, Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

from memtui.transport.peers import peer_uid

DEFAULT_MAX_CONNECTIONS = 32
"""Connections served at once (threads): Prometheus takes one per scrape."""
DEFAULT_TIMEOUT_S = 5.0
"""The time a connection has to deliver its request (line and headers), and each write of the
reply."""
DEFAULT_MAX_PER_PEER = 4
"""Connections served at once for one peer (an account, or an address): a scraper takes one
per scrape, so another account's held connections never take the scraper's."""
BACKLOG = 128
"""Connections the kernel queues before the server takes them (socketserver's default of 5
drops a burst's connections, which the clients then retry for seconds)."""
LINGER_S = 0.5
"""How long a refused connection stays open after its ``503``, so that the client's request,
arriving after it, does not make the close reset the connection before the answer is read."""
MAX_LINGERING = 1024
"""Refused connections kept lingering at most (beyond: closed at once)."""

BUSY_TEXT = b"memtui export: too many connections open\n"
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"Content-Length: %d\r\n"
    b"\r\n%s" % (len(BUSY_TEXT), BUSY_TEXT)
)
"""The answer to a connection beyond the cap (written whole, without reading its request)."""
UNAUTHORIZED_TEXT = (
    b"memtui export: this exporter answers a bearer token only "
    b"(Authorization: Bearer <the contents of its --token-file>)\n"
)


@dataclass
class HttpCounts:
    """What the server counted (written under the server's lock, read as they are)."""

    served: int = 0
    """Connections handled to their end (a reply sent, or an error answered)."""
    refused: int = 0
    """Connections answered ``503`` at once: ``max_connections`` were open."""
    timed_out: int = 0
    """Connections closed because the request or the reply did not pass in time."""
    refused_peer: int = 0
    """Connections answered ``503`` at once: their peer had ``max_per_peer`` open (among
    ``refused``)."""
    unauthorized: int = 0
    """Requests answered ``401``: no bearer token, or another one."""
    failed: int = 0
    """Connections that ended on another error (the client reset it, say)."""
    open: int = 0
    """Connections being served now."""


class DeadlineReader(io.RawIOBase):
    """A socket's bytes, each read given only the time left before ``deadline``: a request that
    drips in byte by byte still has to be whole by then."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = deadline
        """On ``time.monotonic``'s clock."""

    def readable(self) -> bool:
        """It is read from."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Read into ``buffer``; TimeoutError once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class ReplyWriter(ServerHandler):
    """wsgiref's handler of one reply: a client that stops reading ends its connection, with no
    traceback on stderr (the server counts it); the app's own errors are reported as before."""

    def handle_error(self) -> None:
        """Pass a socket's error on to the server; report any other."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # TimeoutError among them
            raise error
        super().handle_error()


class BoundedHandler(WSGIRequestHandler):
    """wsgiref's handler (one request per connection), quiet, with the server's deadlines."""

    server: BoundedServer

    def setup(self) -> None:
        """The connection's files, the request read against the server's deadline."""
        super().setup()
        self.rfile.close()  # the plain one: every read below goes through the deadline
        self.reader = DeadlineReader(self.connection, time.monotonic() + self.server.timeout_s)
        self.rfile = io.BufferedReader(self.reader)

    def parse_request(self) -> bool:
        """Parse the request; from here each write of the reply gets the whole timeout."""
        parsed = super().parse_request()
        self.connection.settimeout(self.server.timeout_s)
        self.reader.deadline = time.monotonic() + self.server.timeout_s
        return parsed

    def handle(self) -> None:
        """One request (wsgiref's own steps, the reply written by ``ReplyWriter``)."""
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = self.request_version = self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():  # the error is answered
            return
        if not self.server.authorized(self.headers.get("Authorization", "")):
            self.refuse_unauthorized()
            return
        stdin, stdout = cast(IO[bytes], self.rfile), cast(IO[bytes], self.wfile)
        writer = ReplyWriter(
            stdin, stdout, self.get_stderr(), self.get_environ(), multithread=False
        )
        writer.request_handler = self  # type: ignore[attr-defined]  # wsgiref's back-pointer
        writer.run(self.server.metrics_app)

    def refuse_unauthorized(self) -> None:
        """Answer ``401``, saying what is needed, and count it."""
        self.server.count_unauthorized()
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Bearer realm="memtui export"')
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(UNAUTHORIZED_TEXT)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(UNAUTHORIZED_TEXT)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (a scrape every few seconds is no news)."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A WSGI server of at most ``max_connections`` threads, ``503`` beyond them."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG

    def __init__(
        self,
        address: tuple[str, int] | str,
        app: Callable[..., Any],
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        family: socket.AddressFamily = socket.AF_INET,
        token: str = "",
    ) -> None:
        self.address_family = family
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.timeout_s = timeout_s
        self.metrics_app = app
        self.token = token.encode()
        """The bearer token a request must carry ("": none asked)."""
        self.counts = HttpCounts()
        self._per_peer: dict[str, int] = {}
        """Connections served now for each peer (``peer_of``); none kept at zero."""
        self._open_lock = threading.Lock()
        self._lingering: collections.deque[tuple[float, socket.socket]] = collections.deque()
        """Refused connections, with when to close them (only the serving thread touches it)."""
        super().__init__(address, BoundedHandler)  # type: ignore[arg-type]  # a path: AF_UNIX
        self.set_app(app)

    def server_bind(self) -> None:
        """Bind the address; a Unix socket is made 0600 as it is created (its directory is the
        user's to choose), over a stale one of the user's that nothing listens on."""
        if self.address_family != socket.AF_UNIX:
            super().server_bind()
            return
        remove_stale_socket(str(self.server_address))
        umask = os.umask(0o177)
        try:
            self.socket.bind(self.server_address)
        finally:
            os.umask(umask)
        self.server_address = self.socket.getsockname()
        self.server_name, self.server_port = "localhost", 0
        self.setup_environ()

    def authorized(self, header: str) -> bool:
        """Whether a request's ``Authorization`` header carries the token (always, without one)."""
        if not self.token:
            return True
        scheme, _space, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.token
        )

    def count_unauthorized(self) -> None:
        """Count a request answered ``401``."""
        with self._open_lock:
            self.counts.unauthorized += 1

    def peer_of(self, request: socket.socket, client_address: Any) -> str:
        """Who is at the other end: ``uid:N`` where the kernel says (a Unix socket, or a
        loopback connection), else the address; "" for a Unix peer that is neither this user
        nor root (its connection is closed)."""
        if self.address_family == socket.AF_UNIX:
            creds = request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = struct.unpack("3i", creds)[1]
            return f"uid:{uid}" if uid in (0, os.getuid()) else ""
        host, port = str(client_address[0]), int(client_address[1])
        local = request.getsockname()
        uid = peer_uid((str(local[0]), int(local[1])), (host, port))
        return f"uid:{uid}" if uid is not None else host

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own, or answer ``503`` now if the cap, or
        its peer's share of it, is reached (the serving thread never waits on a client)."""
        try:
            peer = self.peer_of(request, client_address)
        except OSError:
            peer = "?"
        if not peer:
            self.shutdown_request(request)
            return
        if self.address_family == socket.AF_UNIX:
            client_address = ("local", 0)
        with self._open_lock:
            mine = self._per_peer.get(peer, 0)
            full = self.counts.open >= self.max_connections or mine >= self.max_per_peer
            if full:
                self.counts.refused += 1
                self.counts.refused_peer += mine >= self.max_per_peer
            else:
                self.counts.open += 1
                self._per_peer[peer] = mine + 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, (client_address, peer))
        except BaseException:  # no thread: the connection is closed by the caller
            self._release(peer)
            raise

    def _release(self, peer: str) -> None:
        """Free a connection's place, and its peer's."""
        with self._open_lock:
            self.counts.open -= 1
            left = self._per_peer.get(peer, 1) - 1
            if left > 0:
                self._per_peer[peer] = left
            else:
                self._per_peer.pop(peer, None)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection to its end (quietly), then free its place."""
        address, peer = client_address
        error: Exception | None = None
        try:
            self.finish_request(request, address)
        except Exception as exc:  # a reset, a broken pipe: the client's business, not a trace
            error = exc
        finally:
            self.shutdown_request(request)
            self._release(peer)
            with self._open_lock:
                self.counts.served += error is None
                self.counts.timed_out += isinstance(error, TimeoutError)
                self.counts.failed += error is not None and not isinstance(error, TimeoutError)

    def _refuse(self, request: socket.socket) -> None:
        """Write the ``503`` without waiting, end our side, and let the connection linger."""
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(BUSY)
            request.shutdown(socket.SHUT_WR)
        if len(self._lingering) >= MAX_LINGERING:
            self._close(self._lingering.popleft()[1])
        self._lingering.append((time.monotonic() + LINGER_S, request))

    def service_actions(self) -> None:
        """Close the refused connections whose time is up (the serving loop calls it after
        every connection taken, and every half second)."""
        now = time.monotonic()
        while self._lingering and self._lingering[0][0] <= now:
            self._close(self._lingering.popleft()[1])

    @staticmethod
    def _close(request: socket.socket) -> None:
        with contextlib.suppress(OSError):
            for _chunk in range(16):  # what the client sent: read, so the close is no reset
                if not request.recv(65536):
                    break
        request.close()

    def server_close(self) -> None:
        """Stop listening (removing a Unix socket's file) and close the refused connections
        still lingering."""
        super().server_close()
        if self.address_family == socket.AF_UNIX:
            with contextlib.suppress(OSError):
                os.unlink(str(self.server_address))
        while self._lingering:
            self._close(self._lingering.popleft()[1])


def remove_stale_socket(path: str) -> None:
    """Remove a Unix socket of the user's at ``path`` that nothing listens on (a previous
    exporter's); anything else there is left, and the bind that follows says why it failed."""
    try:
        info = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid():
        return
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)
        except OSError:
            return


def address_family(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The family to listen with for ``host`` (IPv6 for ``::1``), and the address to bind."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _type, _proto, _name, address = infos[0]
    return family, str(address[0])


def start_server(
    host: str,
    port: int,
    app: Callable[..., Any],
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_per_peer: int = DEFAULT_MAX_PER_PEER,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    token: str = "",
    unix_path: str = "",
) -> tuple[BoundedServer, threading.Thread]:
    """Listen on ``host:port`` (or the Unix socket ``unix_path``) and serve ``app`` on a daemon
    thread; OSError if it cannot."""
    where: tuple[str, int] | str = unix_path
    family = socket.AF_UNIX
    if not unix_path:
        family, host = address_family(host, port)
        where = (host, port)
    server = BoundedServer(
        where,
        app,
        max_connections=max_connections,
        max_per_peer=max_per_peer,
        timeout_s=timeout_s,
        family=family,
        token=token,
    )
    thread = threading.Thread(target=server.serve_forever, name="memtui-export-http", daemon=True)
    thread.start()
    return server, thread
