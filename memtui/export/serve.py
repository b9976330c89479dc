"""``memtui export``'s server: the fleet's loop on the main thread, ``/metrics`` on a bounded
HTTP server (:mod:`memtui.export.http`) over prometheus-client's WSGI app.

The loop reads the registry, asks the runs that have no watch for a hello, and builds the
metrics every ``BUILD_S`` (less often when that takes long) into the collector's cache; a scrape
only reads that cache (and the exporter's own counts), so it answers in the same time whatever
the runs do.

Who may read it is the listener's: ``HOST:PORT`` (``127.0.0.1:9464`` by default: this node
only) answers only requests with the user's bearer token (``auth``), unless the operator
serves without one (``token=""``); ``:PORT`` listens on every interface, which the operator has
to ask for; ``unix:PATH`` is a Unix socket only the user (and root) can open, with no token.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

from memtui.advice.verdict import ThresholdConfig
from memtui.export.fleet import DEFAULT_MAX_RUNS, Fleet
from memtui.export.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER, DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    from memtui.export.metrics import FleetCollector

DEFAULT_LISTEN = "127.0.0.1:9464"
ALL_INTERFACES = "0.0.0.0"
UNIX = "unix:"
"""The prefix of a listening address that is a Unix socket's path."""
BUILD_S = 1.0
"""How often the metrics served are built anew from the runs' states (at most)."""
BUILD_SHARE = 0.05
"""The most of its time the loop spends building them: with many runs watched, the metrics
served are built less often than every ``BUILD_S``."""
TURN_S = 0.25
"""The loop's longest wait for the runs' answers (and for a stop)."""


class ListenError(ValueError):
    """The listening address is not ``HOST:PORT``."""


def unix_path(text: str) -> str:
    """The socket's path of a ``unix:PATH`` listening address ("" for ``HOST:PORT``)."""
    if not text.startswith(UNIX):
        return ""
    if not text[len(UNIX) :]:
        raise ListenError("expected unix:PATH, a path for the socket")
    return text[len(UNIX) :]


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; ``:PORT``: every interface) -> (host, port)."""
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ListenError(f"expected HOST:PORT or :PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host or ALL_INTERFACES, int(port)


def dashboard() -> str:
    """The Grafana dashboard shipped with the package (JSON)."""
    return resources.files("memtui.export").joinpath("grafana.json").read_text()


def serve(
    host: str,
    port: int,
    thresholds: ThresholdConfig,
    say: Callable[[str], None],
    stop: threading.Event | None = None,
    *,
    max_runs: int = DEFAULT_MAX_RUNS,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_per_peer: int = DEFAULT_MAX_PER_PEER,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    token: str = "",
    token_file: str = "",
    unix: str = "",
) -> int:
    """Serve ``/metrics`` on ``host:port`` (or the Unix socket ``unix``) until SIGTERM, SIGINT
    or ``stop``, to requests with ``token`` where one is given (read from ``token_file``, named
    in what is said); the exit status."""
    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.process_collector import ProcessCollector

    from memtui.export.http import start_server
    from memtui.export.metrics import FleetCollector

    fleet = Fleet(thresholds, max_runs=max_runs)
    collector = FleetCollector(fleet)
    collector.update()  # the first scrape finds the families, empty as they are
    metrics = CollectorRegistry()
    metrics.register(collector)
    ProcessCollector(namespace="memtui_exporter", registry=metrics)
    try:
        server, thread = start_server(
            host,
            port,
            make_wsgi_app(metrics),
            max_connections=max_connections,
            max_per_peer=max_per_peer,
            timeout_s=timeout_s,
            token=token,
            unix_path=unix,
        )
    except OSError as exc:
        fleet.close()
        say(f"cannot listen on {UNIX + unix if unix else f'{host}:{port}'}: {exc}")
        return 1
    collector.http = server.counts
    if unix:
        say(f"serving {UNIX}{unix} (GET /metrics; this user and root only)")
    else:
        bound_host, bound_port = str(server.server_address[0]), server.server_address[1]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        who = (
            f"to requests with the bearer token in {token_file}"
            if token
            else "to anyone who reaches it (no token)"
        )
        say(f"serving http://{shown}:{bound_port}/metrics {who}")
    done = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_args: done.set())
    try:
        loop(fleet, collector, say, done)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        fleet.close()
    return 0


def loop(
    fleet: Fleet,
    collector: FleetCollector,
    say: Callable[[str], None],
    done: threading.Event,
) -> None:
    """Read the registry when due, ask and watch the runs, build the metrics every ``BUILD_S``,
    and say what changed, until ``done``."""
    problem = ""
    unwatched = 0
    next_build = 0.0
    while not done.is_set():
        if fleet.refresh_due():
            for run in fleet.refresh():
                say(f"{run} is gone")
            if fleet.problem != problem:
                problem = fleet.problem
                say(problem or "the runtime directory is readable again")
        started, ended = fleet.step(TURN_S, done)
        for run in started:
            say(f"watching {run}")
        for run in ended:
            say(f"{run} ended")
        if time.monotonic() >= next_build:
            began = time.monotonic()
            collector.update()
            took = time.monotonic() - began
            next_build = began + max(BUILD_S, took / BUILD_SHARE)
            if fleet.unwatched != unwatched:
                unwatched = fleet.unwatched
                if unwatched:
                    say(f"{unwatched} registered runs left unwatched (--max-runs {fleet.max_runs})")
