"""``memtui export``'s server: prometheus-client's own HTTP server over the fleet's collector.

The listening address is ``HOST:PORT`` (``127.0.0.1:9464`` by default: this node only);
``:PORT`` listens on every interface, which the operator has to ask for.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from importlib import resources

from memtui.advice.verdict import ThresholdConfig
from memtui.export.fleet import Fleet

DEFAULT_LISTEN = "127.0.0.1:9464"
ALL_INTERFACES = "0.0.0.0"


class ListenError(ValueError):
    """The listening address is not ``HOST:PORT``."""


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
) -> int:
    """Serve ``/metrics`` on ``host:port`` until SIGTERM, SIGINT or ``stop``; the exit status."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.process_collector import ProcessCollector

    from memtui.export.metrics import FleetCollector

    fleet = Fleet(thresholds)
    metrics = CollectorRegistry()
    metrics.register(FleetCollector(fleet))
    ProcessCollector(namespace="memtui_exporter", registry=metrics)
    try:
        server, thread = start_http_server(port, addr=host, registry=metrics)
    except OSError as exc:
        fleet.close()
        say(f"cannot listen on {host}:{port}: {exc}")
        return 1
    bound_host, bound_port = str(server.server_address[0]), server.server_address[1]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    say(f"serving http://{shown}:{bound_port}/metrics")
    done = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_args: done.set())
    problem = ""
    try:
        while not done.is_set():
            started, stopped = fleet.refresh()
            for run in started:
                say(f"watching {run}")
            for run in stopped:
                say(f"{run} is gone")
            if fleet.problem != problem:
                problem = fleet.problem
                say(problem or "the runtime directory is readable again")
            done.wait(fleet.refresh_s)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
        fleet.close()
    return 0
