"""``memtui export``'s HTTP server: prometheus-client's WSGI app behind a bounded server.

prometheus-client's own server takes every connection on a thread of its own and waits for its
request as long as the client likes: held connections cost a thread each, without end. This one
serves at most ``max_connections`` at once (one thread each) and answers any connection beyond
them with a ``503`` at once, from the accepting thread; a connection must deliver its request
(line and headers) within ``timeout_s`` of being taken, however slowly it drips in, and each
write of the reply may take ``timeout_s`` at most: a held connection is closed within that time.
"""

from __future__ import annotations

import collections
import contextlib
import io
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import IO, Any, cast
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer

DEFAULT_MAX_CONNECTIONS = 32
"""Connections served at once (threads): Prometheus takes one per scrape."""
DEFAULT_TIMEOUT_S = 5.0
"""The time a connection has to deliver its request, and each write of the reply."""
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


@dataclass
class HttpCounts:
    """What the server counted (written under the server's lock, read as they are)."""

    served: int = 0
    """Connections handled to their end (a reply sent, or an error answered)."""
    refused: int = 0
    """Connections answered ``503`` at once: ``max_connections`` were open."""
    timed_out: int = 0
    """Connections closed because the request or the reply did not pass in time."""
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
        stdin, stdout = cast(IO[bytes], self.rfile), cast(IO[bytes], self.wfile)
        writer = ReplyWriter(
            stdin, stdout, self.get_stderr(), self.get_environ(), multithread=False
        )
        writer.request_handler = self  # type: ignore[attr-defined]  # wsgiref's back-pointer
        writer.run(self.server.metrics_app)

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (a scrape every few seconds is no news)."""


class BoundedServer(ThreadingMixIn, WSGIServer):
    """A WSGI server of at most ``max_connections`` threads, ``503`` beyond them."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        app: Callable[..., Any],
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        family: socket.AddressFamily = socket.AF_INET,
    ) -> None:
        self.address_family = family
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.metrics_app = app
        self.counts = HttpCounts()
        self._open_lock = threading.Lock()
        self._lingering: collections.deque[tuple[float, socket.socket]] = collections.deque()
        """Refused connections, with when to close them (only the serving thread touches it)."""
        super().__init__(address, BoundedHandler)
        self.set_app(app)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve the connection on a thread of its own, or answer ``503`` now if the cap is
        reached (the serving thread never waits on a client)."""
        with self._open_lock:
            full = self.counts.open >= self.max_connections
            self.counts.open += not full
            self.counts.refused += full
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread: the connection is closed by the caller
            with self._open_lock:
                self.counts.open -= 1
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection to its end (quietly), then free its place."""
        error: Exception | None = None
        try:
            self.finish_request(request, client_address)
        except Exception as exc:  # a reset, a broken pipe: the client's business, not a trace
            error = exc
        finally:
            self.shutdown_request(request)
            with self._open_lock:
                self.counts.open -= 1
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
        """Stop listening and close the refused connections still lingering."""
        super().server_close()
        while self._lingering:
            self._close(self._lingering.popleft()[1])


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
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[BoundedServer, threading.Thread]:
    """Listen on ``host:port`` and serve ``app`` on a daemon thread; OSError if it cannot."""
    family, address = address_family(host, port)
    server = BoundedServer(
        (address, port), app, max_connections=max_connections, timeout_s=timeout_s, family=family
    )
    thread = threading.Thread(target=server.serve_forever, name="memtui-export-http", daemon=True)
    thread.start()
    return server, thread
