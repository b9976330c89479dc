"""``memtui export``: live runs served as Prometheus metrics, read back with prometheus-client's
own parsers and scraped by a real Prometheus server."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq
from click.testing import CliRunner
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from memtui.cli import main
from memtui.export.fleet import DEFAULT_MAX_RUNS
from memtui.export.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER, DEFAULT_TIMEOUT_S
from memtui.export.metrics import COUNTERS, GAUGES
from memtui.export.serve import parse_listen
from memtui.storage import registry
from memtui.wire import (
    ControlState,
    Decoder,
    Hello,
    Knobs,
    RankInfo,
    RunInfo,
    RunRecord,
    Snapshot,
    Telemetry,
    encode,
)
from tests.support.cli import memtui_here, status_json
from tests.support.clock import patience
from tests.support.other_user import OtherUser, make_other_user
from tests.support.processes import PLUMBING, ROOT, DemoRun, wait_for

pytestmark = pytest.mark.heavy

PROMETHEUS = "/usr/bin/prometheus"
"""The Debian package's server (``apt-get install prometheus``; ``.ci/run`` installs it)."""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""A scrape: (sample name, sorted labels) -> value."""

TOKEN = "test-token-" + "0123456789abcdef" * 2
"""The bearer token the exporters of these tests answer (their ``--token-file``'s)."""


def token_file() -> Path:
    """The exporters' token file (0600, made once per process)."""
    path = Path(tempfile.gettempdir()) / f"mt-export-token-{os.getpid()}"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, TOKEN.encode() + b"\n")
        os.close(fd)
    return path


def authorized(headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` with the exporters' bearer token."""
    return {**(headers or {}), "Authorization": f"Bearer {TOKEN}"}


@contextlib.contextmanager
def exporter(*args: str) -> Iterator[str]:
    """``memtui export`` in a subprocess on a free port; yields its ``/metrics`` URL."""
    with exporter_process(*args) as (url, _proc):
        yield url


@contextlib.contextmanager
def exporter_process(*args: str) -> Iterator[tuple[str, psutil.Process]]:
    """``memtui export`` in a subprocess on a free port; yields its ``/metrics`` URL and its
    process."""
    command = [sys.executable, "-m", "memtui.cli", "export", "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(
        [*command, "--token-file", str(token_file()), *args],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines: list[str] = []
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or ()), daemon=True)
    reader.start()

    def serving() -> str | None:
        found = [m.group(1) for line in lines if (m := re.search(r"serving (http\S+)", line))]
        assert proc.poll() is None, "".join(lines)
        return found[0] if found else None

    try:
        url = str(wait_for(serving, 30, what="the exporter to listen"))
        yield url, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        assert proc.wait(patience(15)) == 0, "".join(lines)
        reader.join(patience(5))


def fetch(url: str, openmetrics: bool = False) -> str:
    """One scrape's text (OpenMetrics when asked, as Prometheus asks; else the plain format)."""
    headers = {"Accept": "application/openmetrics-text; version=1.0.0"} if openmetrics else {}
    request = urllib.request.Request(url, headers=authorized(headers))
    with urllib.request.urlopen(request, timeout=10) as reply:
        return str(reply.read().decode())


def scrape(url: str) -> Samples:
    """Every sample of one scrape, parsed by prometheus-client's own parser."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(fetch(url))
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample ``name`` whose labels include ``labels`` (None: no such sample)."""
    found = [
        v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()
    ]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def rank_labels(samples: Samples, run: str, rank: int) -> dict[str, str]:
    """The labels of ``rank`` of ``run`` (from its ``memtui_up`` sample)."""
    return next(
        dict(ls)
        for (n, ls), _v in samples.items()
        if n == "memtui_up" and dict(ls)["run"] == run and dict(ls)["rank"] == str(rank)
    )


def scraped_with(url: str, run: str, ranks: int = 1) -> Callable[[], Samples | None]:
    """A poll: the scrape once every rank of ``run`` reports its speed and memory."""

    def ready() -> Samples | None:
        samples = scrape(url)
        names = ("memtui_data_wait_ratio", "memtui_device_capacity_bytes", "memtui_up")
        if all(
            value(samples, n, run=run, rank=str(r)) for n in names for r in range(ranks)
        ) and value(samples, "memtui_host_ram_total_bytes", run=run, rank="0"):
            return samples
        return None

    return ready


def check_rank_against_status(
    samples: Samples, run: str, rank: int, status: dict[str, Any], entry: dict[str, Any]
) -> None:
    """One rank's samples against ``memtui status --json`` (``entry``: the rank's part of it)."""
    labels = rank_labels(samples, run, rank)
    assert labels["host"] == entry["host"] and labels["device"] == "cpu", labels
    memory, host = entry["memory"], entry["host_memory"]
    assert value(samples, "memtui_device_capacity_bytes", **labels) == memory["capacity_bytes"]
    assert value(samples, "memtui_host_ram_total_bytes", **labels) == host["ram_total_bytes"]
    assert value(samples, "memtui_host_swap_total_bytes", **labels) == host.get(
        "swap_total_bytes", 0
    )
    assert value(samples, "memtui_loader_workers", **labels) == host.get("workers", 0)
    wait = value(samples, "memtui_data_wait_ratio", **labels)
    assert wait is not None and abs(wait - entry["metrics"]["data_wait_fraction"]) < 0.2
    step = value(samples, "memtui_step_time_seconds", **labels)
    assert step is not None and 0.5 < step / entry["metrics"]["step_time_s"] < 2
    applied = value(samples, "memtui_applied_changes_total", **labels)
    assert applied == len(entry["applied"]) == len(status["applied"])
    assert value(samples, "memtui_hook_errors_total", **labels) == entry["counters"]["errors"]
    assert value(samples, "memtui_up", **labels) == 1
    # the hook's threads, read from /proc: the training's process is on this node
    hook = value(samples, "memtui_hook_cpu_seconds_total", **labels)
    assert hook is not None and 0 < hook < 60


def check_run_against_status(samples: Samples, run: str, status: dict[str, Any]) -> None:
    """The run's verdict and pending changes against ``memtui status --json``."""
    states = {
        labels["memtui_verdict"]: on
        for (name, pairs), on in samples.items()
        if name == "memtui_verdict" and (labels := dict(pairs))["run"] == run
    }
    assert [s for s, on in states.items() if on] == [status["verdict"]["state"]], states
    assert set(states) >= {"STARVED", "OOM_RISK", "BALANCED", "NO_DATA"}
    assert value(samples, "memtui_pending_changes", run=run) == len(status["pending"])


def agrees(url: str, run: str, ranks: int = 1, timeout: float = 30.0) -> Samples:
    """Scrape and ask ``memtui status --json`` until the two agree (the numbers move between the
    two looks: under load a window of steps may differ); the last disagreement fails the test."""
    deadline = time.monotonic() + patience(timeout)
    while True:
        samples, status = scrape(url), status_json(run)
        try:
            check_run_against_status(samples, run, status)
            for entry in status["ranks"][:ranks]:
                check_rank_against_status(samples, run, entry["rank"], status, entry)
            return samples
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_run_is_picked_up_matches_status_and_is_dropped_when_it_exits(
    start_demo: Callable[..., DemoRun],
) -> None:
    """One rank: the exporter starts before the run, finds it, serves what ``memtui status``
    says (a change applied included), and drops it once its process is gone."""
    with exporter() as url:
        assert value(scrape(url), "memtui_runs") == 0
        demo = start_demo("--steps", "100000", "--checkpoint-every", "20", *PLUMBING)
        wait_for(scraped_with(url, demo.run_id), 60, 0.3, "the run's metrics")
        samples = agrees(url, demo.run_id)
        assert value(samples, "memtui_verdict", run=demo.run_id, memtui_verdict="STARVED") == 1

        result = memtui_here("set", demo.run_id, "num_workers=2")
        assert result.exit_code == 0, result.output

        def landed() -> Samples | None:
            scraped = scrape(url)
            applied = value(scraped, "memtui_applied_changes_total", run=demo.run_id)
            workers = value(scraped, "memtui_loader_workers", run=demo.run_id)
            return scraped if applied == 1 and workers == 2 else None

        samples = wait_for(landed, 60, 0.3, "the change in the metrics")  # type: ignore[assignment]
        status = status_json(demo.run_id)
        assert [a["changes"]["num_workers"]["new"] for a in status["applied"]] == [2]
        labels = rank_labels(samples, demo.run_id, 0)
        assert value(samples, "memtui_loader_workers_memory_bytes", **labels), "the workers' USS"

        text = fetch(url, openmetrics=True)  # what Prometheus asks for
        assert text.endswith("# EOF\n")
        kinds = {f.name: f.type for f in openmetrics_families(text)}
        assert kinds["memtui_verdict"] == "stateset" and kinds["memtui_ooms"] == "counter"

        demo.stop()
        wait_for(lambda: value(scrape(url), "memtui_runs") == 0, 30, 0.3, "the run dropped")
        assert value(scrape(url), "memtui_up", run=demo.run_id) is None


def test_the_format_follows_the_scrapers_accept_header() -> None:
    """``curl /metrics`` (``Accept: */*``) gets Prometheus' text format 0.0.4; a scraper that asks
    for OpenMetrics (``Accept: application/openmetrics-text``, as Prometheus does) gets
    OpenMetrics 1.0.0, ended by ``# EOF``."""
    with exporter() as url:
        for accept, kind, version in (
            ("*/*", "text/plain", "0.0.4"),
            ("application/openmetrics-text; version=1.0.0", "application/openmetrics-text", "1.0.0"),
            ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
             "application/openmetrics-text", "1.0.0"),
        ):  # fmt: skip
            request = urllib.request.Request(url, headers=authorized({"Accept": accept}))
            with urllib.request.urlopen(request, timeout=10) as reply:
                media = reply.headers["Content-Type"]
                text = reply.read().decode()
            assert media.startswith(f"{kind}; version={version}"), (accept, media)
            assert text.endswith("# EOF\n") == (kind != "text/plain"), text[-80:]
            assert "memtui_runs 0" in text


def free_port() -> int:
    """A TCP port nobody listens on now (Prometheus takes no port 0)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def prometheus(target: str, directory: Path) -> Iterator[str]:
    """A real Prometheus server scraping ``target`` every second; yields its API's base URL."""
    config = directory / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: memtui\n"
        f"    authorization:\n      credentials_file: {token_file()}\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    address = f"127.0.0.1:{free_port()}"
    log = directory / "prometheus.log"
    with open(log, "w") as output:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address={address}",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        yield f"http://{address}"
    finally:
        proc.kill()  # its storage is the test's temporary directory: nothing to save
        proc.wait(patience(10))


def query(api: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result vector ([] while Prometheus is not up yet or has no data)."""
    url = f"{api}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            answer = json.loads(reply.read())
    except OSError:
        return []
    assert answer["status"] == "success", answer
    return list(answer["data"]["result"])


@pytest.mark.skipif(
    not shutil.which(PROMETHEUS),
    reason=f"no Prometheus server at {PROMETHEUS} (Debian's package: apt-get install prometheus)",
)
def test_prometheus_scrapes_the_exporter_and_answers_a_query(
    start_demo: Callable[..., DemoRun], tmp_path: Path
) -> None:
    demo = start_demo("--steps", "100000", *PLUMBING)
    with exporter() as url:
        target = urllib.parse.urlsplit(url).netloc
        samples = wait_for(scraped_with(url, demo.run_id), 60, 0.3, "the run's metrics")
        exported = value(samples, "memtui_data_wait_ratio", run=demo.run_id)  # type: ignore[arg-type]
        with prometheus(target, tmp_path) as api:
            promql = f'memtui_data_wait_ratio{{run="{demo.run_id}",rank="0"}}'
            result = wait_for(lambda: query(api, promql), 90, 0.5, "Prometheus to have the run")
            (series,) = result  # type: ignore[misc]
            assert series["metric"]["job"] == "memtui"
            assert series["metric"]["device"] == "cpu"
            answered = float(series["value"][1])
            assert exported is not None and abs(answered - exported) < 0.2
            assert answered > 0.3, "the demo's slow loader starves it"
            states = query(api, f'memtui_verdict{{run="{demo.run_id}"}} == 1')
            assert [s["metric"]["memtui_verdict"] for s in states] == ["STARVED"]


# --------------------------------------------------------------------------- the command


def test_export_listens_on_loopback_unless_told_and_refuses_a_bad_address() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen(":9464") == ("0.0.0.0", 9464), "every interface only when asked"
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    result = CliRunner().invoke(main, ["export", "--listen", "9464"])
    assert result.exit_code == 2 and "HOST:PORT" in result.stderr
    shown = CliRunner().invoke(main, ["export", "--help"]).output
    assert "127.0.0.1:9464" in shown
    flat = " ".join(shown.split())  # the command's defaults are the package's
    defaults = re.findall(r"\[default: ([\d.]+);", flat)
    assert defaults == [
        str(DEFAULT_MAX_RUNS),
        str(DEFAULT_MAX_CONNECTIONS),
        str(DEFAULT_MAX_PER_PEER),
        str(DEFAULT_TIMEOUT_S),
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = CliRunner().invoke(
            main, ["export", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file())]
        )
    assert busy.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr


def test_the_dashboard_queries_only_metrics_the_exporter_serves() -> None:
    result = CliRunner().invoke(main, ["export", "--dashboard"])
    assert result.exit_code == 0
    dashboard = json.loads(result.output)
    served = {n for n, _h, _v in GAUGES} | {f"{n}_total" for n, _h, _v in COUNTERS}
    served |= {"memtui_verdict", "memtui_pending_changes", "memtui_hook_cpu_seconds_total"}
    served |= {"memtui_job_samples_per_second", "memtui_job_samples_ranks"}
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    annotations = dashboard["annotations"]["list"]
    exprs += [a["expr"] for a in annotations]
    used = {name for expr in exprs for name in re.findall(r"memtui_\w+", expr)}
    assert used <= served, used - served
    assert {"memtui_data_wait_ratio", "memtui_device_peak_used_ratio"} <= used
    assert "memtui_applied_changes_total" in " ".join(a["expr"] for a in annotations)


def test_the_exporter_loads_no_viewer_ui_and_the_cli_no_prometheus() -> None:
    code = (
        "import sys, json\nimport memtui.cli\nbefore = set(sys.modules)\n"
        "import memtui.export.serve, memtui.export.metrics\n"
        "print(json.dumps([sorted(before), sorted(sys.modules)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        env=dict(os.environ),
    )
    before, after = (set(m.split(".")[0] for m in names) for names in json.loads(out.stdout))
    assert "prometheus_client" not in before, "memtui --version stays fast"
    assert not after & {"textual", "rich", "torch"}, after & {"textual", "rich", "torch"}


# --------------------------------------------------------------------------- a busy node


def register_silent_runs(count: int, hung: int = 0) -> tuple[list[str], list[socket.socket]]:
    """``count`` runs registered as a hook registers one, by a live process (this one), that
    never answer: the first ``hung`` have sockets that take connections and never read them (a
    stopped or wedged training's), the others none at all. Returns the runs and those sockets."""
    pid, host = os.getpid(), socket.gethostname()
    created = registry.process_create_time(pid)
    runs, held = [], []
    for index in range(count):
        run = f"silent-{index:04d}"
        rundir = registry.run_dir(run)
        rundir.create()
        listed = RankInfo(rank=0, pub=rundir.pub_endpoint(0), control=rundir.control_endpoint(0),
                          host=host, pid=pid)  # fmt: skip
        for endpoint in (listed.control, listed.pub) if index < hung else ():
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(endpoint.removeprefix("ipc://"))
            sock.listen(8)
            held.append(sock)
        rundir.write(RunRecord(run=run, pid=pid, create_time=created, started=time.time(),
                               host=host, control=listed.control, ranks=[listed]))  # fmt: skip
        runs.append(run)
    return runs, held


class AnsweringRuns:
    """Runs that answer as a hook does, all served by one thread of this process: each a PUB
    socket sending a heartbeat batch every ``beat_s`` and a ROUTER socket answering every hello
    with a snapshot, registered as a hook registers its run."""

    def __init__(self, count: int, beat_s: float = 0.2) -> None:
        self.beat_s = beat_s
        self.host = socket.gethostname()
        self.runs = [registry.new_run_id("answering") for _ in range(count)]
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def rank(self, run: str) -> RankInfo:
        """The run's one rank, as its record and snapshot list it."""
        rundir = registry.run_dir(run)
        return RankInfo(rank=0, pub=rundir.pub_endpoint(0), control=rundir.control_endpoint(0),
                        host=self.host, pid=os.getpid())  # fmt: skip

    def _snapshot(self, run: str, seq: int) -> Snapshot:
        info = RunInfo(run, os.getpid(), self.host, time.time())
        control = ControlState(config=Knobs(batch_size=8), tunable=["batch_size"])
        return Snapshot(info=info, control=control, ranks=[self.rank(run)], step=seq, seq=seq)

    def _serve(self) -> None:
        context = zmq.Context()
        sockets: list[tuple[str, zmq.Socket, zmq.Socket]] = []
        poller = zmq.Poller()
        for run in self.runs:
            pub, router = context.socket(zmq.PUB), context.socket(zmq.ROUTER)
            for sock in (pub, router):
                sock.setsockopt(zmq.LINGER, 0)
            pub.bind(self.rank(run).pub)
            router.bind(self.rank(run).control)
            poller.register(router, zmq.POLLIN)
            sockets.append((run, pub, router))
        self._bound.set()
        decoder, seq, next_beat = Decoder(), 0, 0.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(20))
                for run, _pub, router in sockets:
                    if router in ready:
                        frames = router.recv_multipart()
                        if isinstance(decoder.decode(frames[-1]), Hello):
                            router.send_multipart([*frames[:-1], encode(self._snapshot(run, seq))])
                if time.monotonic() >= next_beat:
                    next_beat, seq = time.monotonic() + self.beat_s, seq + 1
                    for run, pub, _router in sockets:
                        pub.send(encode(Telemetry(run=run, rank=0, seq=seq, time=time.time(),
                                                  step=seq)))  # fmt: skip
        finally:
            for _run, pub, router in sockets:
                pub.close(0)
                router.close(0)
            context.term()

    def __enter__(self) -> AnsweringRuns:
        for run in self.runs:
            registry.run_dir(run).create()
        self._thread.start()
        assert self._bound.wait(patience(10))
        pid = os.getpid()
        created = registry.process_create_time(pid)
        for run in self.runs:
            listed = self.rank(run)
            record = RunRecord(run=run, pid=pid, create_time=created, started=time.time(),
                               host=self.host, control=listed.control, ranks=[listed])  # fmt: skip
            registry.run_dir(run).write(record)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(patience(10))


class TimedScrapes:
    """Scrapes of one exporter, each timed, with the exporter's threads counted at each."""

    def __init__(self, url: str, process: psutil.Process) -> None:
        self.url = url
        self.process = process
        self.seconds: list[float] = []
        self.threads: list[int] = []

    def __call__(self) -> Samples:
        """One scrape (its time and the exporter's threads noted)."""
        started = time.monotonic()
        samples = scrape(self.url)
        self.seconds.append(time.monotonic() - started)
        self.threads.append(self.process.num_threads())
        return samples


def up_count(samples: Samples, up: float) -> int:
    """How many ranks ``memtui_up`` shows at ``up``."""
    return sum(1 for (name, _labels), v in samples.items() if name == "memtui_up" and v == up)


def test_runs_that_do_not_answer_never_hold_a_scrape() -> None:
    """1,000 registered runs of a live process that do not answer (most without sockets, ten
    with sockets nobody reads): every scrape answers at once from the cache, each such run
    shows ``memtui_up`` 0 with its last-seen age, the runs that answer among them are served,
    and the threads stay few."""
    silent, held = register_silent_runs(1000, hung=10)
    with contextlib.ExitStack() as stack:
        for sock in held:
            stack.enter_context(sock)
        answering = stack.enter_context(AnsweringRuns(2))
        url, process = stack.enter_context(exporter_process())
        scraped = TimedScrapes(url, process)

        def settled() -> Samples | None:
            samples = scraped()
            ups = [value(samples, "memtui_up", run=run) for run in answering.runs]
            return samples if ups == [1, 1] and up_count(samples, 0) == 1000 else None

        samples: Samples = wait_for(settled, 60, 0.2, "every run shown")  # type: ignore[assignment]
        for _ in range(10):
            samples = scraped()
            time.sleep(0.2)
        assert value(samples, "memtui_runs") == 2
        assert value(samples, "memtui_exporter_runs_registered") == 1002
        assert value(samples, "memtui_exporter_runs_unanswered") == 1000
        assert value(samples, "memtui_up", run=silent[0]) == 0
        age = value(samples, "memtui_last_seen_age_seconds", run=silent[-1])
        assert age is not None and 0 <= age < 120
        fresh = value(samples, "memtui_last_seen_age_seconds", run=answering.runs[0])
        assert fresh is not None and fresh < patience(5), "an answering run was heard a moment ago"
        cache_age = value(samples, "memtui_exporter_cache_age_seconds")
        assert cache_age is not None and cache_age < patience(5)
    assert max(scraped.seconds) < patience(1.0), sorted(scraped.seconds)[-5:]
    # the loop, the HTTP server, libzmq's two and one receiver per answering run, give or take
    assert max(scraped.threads) <= 16, scraped.threads


def test_runs_past_the_cap_are_counted_and_left_unwatched() -> None:
    with AnsweringRuns(3) as answering, exporter_process("--max-runs", "2") as (url, process):
        scraped = TimedScrapes(url, process)

        def capped() -> Samples | None:
            samples = scraped()
            dropped = value(samples, "memtui_exporter_runs_dropped_total")
            return samples if dropped == 1 and value(samples, "memtui_runs") == 2 else None

        samples: Samples = wait_for(capped, 30, 0.2, "two runs watched, one dropped")  # type: ignore[assignment]
        shown = [run for run in answering.runs if value(samples, "memtui_up", run=run) == 1]
        assert len(shown) == 2
        assert value(samples, "memtui_exporter_runs_unwatched") == 1
        assert value(samples, "memtui_exporter_runs_unanswered") == 0
        time.sleep(2.5)  # asked again: still no place, and counted once
        samples = scraped()
        assert value(samples, "memtui_exporter_runs_dropped_total") == 1
        assert value(samples, "memtui_runs") == 2
    assert max(scraped.threads) <= 14, scraped.threads


def busy_answer(sock: socket.socket, timeout: float = 2.0) -> bytes:
    """What the server sent on ``sock`` before closing it (read to the end)."""
    sock.settimeout(timeout)
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            received += chunk
    return received


def test_held_connections_are_bounded_and_closed_and_the_rest_answered_503() -> None:
    """Four connections held (three idle, one dripping its request a byte at a time) fill the
    cap: a scrape gets a 503 at once, so do 40 more at the same time, none waits; the held ones
    are closed within the timeout, and then scrapes are served again."""
    timeout = patience(1.0)  # held longer on a busy machine: the burst must find all four held
    args = ("--max-connections", "4", "--http-timeout", f"{timeout:.2f}")
    with exporter_process(*args) as (url, process):
        address = urllib.parse.urlsplit(url)
        target = (address.hostname or "", address.port or 0)
        threads_before = process.num_threads()
        held = [socket.create_connection(target) for _ in range(3)]
        dripper = socket.create_connection(target)
        dripped: list[float] = []

        def drip() -> None:
            started = time.monotonic()
            with contextlib.suppress(OSError):
                for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000:
                    dripper.send(bytes([byte]))
                    time.sleep(0.1)
            dripped.append(time.monotonic() - started)

        dripping = threading.Thread(target=drip, daemon=True)
        dripping.start()
        opened = time.monotonic()
        time.sleep(0.3)  # the server has taken all four
        threads_held = process.num_threads()

        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            fetch(url)
        assert refused.value.code == 503 and time.monotonic() - started < timeout / 2

        answers: list[tuple[int | str, float]] = []

        def one_scrape() -> None:
            began = time.monotonic()
            try:
                fetch(url)
                answers.append((200, time.monotonic() - began))
            except urllib.error.HTTPError as exc:
                answers.append((exc.code, time.monotonic() - began))
            except OSError as exc:
                answers.append((str(exc), time.monotonic() - began))

        burst = [threading.Thread(target=one_scrape) for _ in range(40)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(patience(15))
        assert {code for code, _s in answers} == {503}, answers
        assert max(s for _code, s in answers) < 2 * timeout, answers

        for sock in held:  # closed by the server within the timeout (EOF, nothing sent)
            assert busy_answer(sock, timeout + patience(2)) == b""
            sock.close()
        assert time.monotonic() - opened < timeout + patience(2)
        dripping.join(timeout + patience(2))
        assert dripped and dripped[0] < timeout + patience(1.5), dripped
        dripper.close()

        samples = wait_for(lambda: scrape(url), 5, 0.1, "a scrape served again")
        assert isinstance(samples, dict)
        assert value(samples, "memtui_exporter_http_refused_total") == 41
        assert value(samples, "memtui_exporter_http_timeouts_total") == 4
        assert value(samples, "memtui_exporter_http_connections") == 1, "this scrape's"
    assert threads_held <= threads_before + 4, (threads_before, threads_held)


# --------------------------------------------------------------------------- who may read it


@pytest.fixture(scope="module")
def other_user() -> Iterator[OtherUser]:
    """A second real user on this host (skipped, saying why, where none can be made)."""
    yield from make_other_user()


def answer_of(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """A request's status and body (an error's too)."""
    try:
        request = urllib.request.Request(url, headers=headers or {})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status), reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_over_tcp_only_a_request_with_the_token_is_answered(tmp_path: Path) -> None:
    """A scrape without the bearer token, or with another, gets 401 (counted) and no metric; the
    token file is made 0600 on first use; ``--no-token`` serves anyone, and says so."""
    with exporter() as url:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            code, body = answer_of(url, headers)
            assert code == 401 and "memtui_" not in body and "bearer token" in body, (code, body)
        assert answer_of(url, authorized())[0] == 200
        assert value(scrape(url), "memtui_exporter_http_unauthorized_total") == 3
    made = tmp_path / "config" / "token"
    result = subprocess.run(
        [sys.executable, "-m", "memtui.cli", "export", "--listen", "127.0.0.1:1", "--token-file", str(made)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "No such file or directory" in result.stderr, result.stderr
    made.parent.mkdir()
    with exporter_process("--token-file", str(made)) as (url, _process):
        assert made.stat().st_mode & 0o777 == 0o600 and len(made.read_text().strip()) >= 32
        assert answer_of(url)[0] == 401
        bearer = {"Authorization": f"Bearer {made.read_text().strip()}"}
        assert answer_of(url, bearer)[0] == 200
    made.chmod(0o644)
    refused = CliRunner().invoke(
        main, ["export", "--listen", "127.0.0.1:0", "--token-file", str(made)]
    )
    assert refused.exit_code == 2 and "can be read by other accounts" in refused.stderr
    open_to_all = subprocess.Popen(
        [sys.executable, "-m", "memtui.cli", "export", "--listen", "127.0.0.1:0", "--no-token"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )  # fmt: skip
    try:
        assert open_to_all.stderr is not None
        line = open_to_all.stderr.readline()
        assert "to anyone who reaches it (no token)" in line, line
        found = re.search(r"serving (http\S+)", line)
        assert found and answer_of(found.group(1))[0] == 200
    finally:
        open_to_all.terminate()
        open_to_all.wait(15)


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection over a Unix socket."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.path = path

    def connect(self) -> None:
        """Connect to the socket's path."""
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(10)
        self.sock.connect(self.path)


def test_a_unix_socket_serves_its_user_and_no_other_account(
    tmp_path: Path, other_user: OtherUser
) -> None:
    """``--listen unix:PATH`` serves this user without a token, through a socket made 0600,
    which another account cannot open even in a directory open to all."""
    shared = Path(tempfile.mkdtemp(prefix="mtx", dir="/tmp"))
    shared.chmod(0o755)
    path = shared / "export.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "memtui.cli", "export", "--listen", f"unix:{path}"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert f"serving unix:{path}" in line and "this user and root only" in line, line
        assert path.stat().st_mode & 0o777 == 0o600
        connection = UnixHTTPConnection(str(path))
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        assert reply.status == 200 and "memtui_runs 0" in reply.read().decode()
        probe = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1]); print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__)\n"
        )
        seen = other_user.run("-c", probe, str(path))
        assert seen.stdout.strip() == "PermissionError", seen.stdout + seen.stderr
    finally:
        proc.terminate()
        assert proc.wait(15) == 0
        shutil.rmtree(shared, ignore_errors=True)
    assert not path.exists(), "the socket's file is removed at the end"


def test_another_accounts_slowloris_never_starves_a_scraper(other_user: OtherUser) -> None:
    """Another account holds 40 connections dripping their headers, opening new ones as they
    are closed: it gets 4 at once (its share) and 503s beyond, while a real scrape with the
    token keeps getting 200 and its metrics, every time."""
    with exporter_process() as (url, process):
        address = urllib.parse.urlsplit(url)
        answers: list[str] = []

        def loris() -> None:
            done = other_user.run(
                "-m", "tests.support.flood", "slowloris", address.hostname or "", str(address.port), "12",
                timeout=60,
            )  # fmt: skip
            answers.append(done.stdout + done.stderr)

        thread = threading.Thread(target=loris)
        thread.start()
        time.sleep(2.0)  # its connections are held
        codes = []
        while thread.is_alive():
            code, body = answer_of(url, authorized())
            codes.append(code)
            assert code != 200 or "memtui_exporter_http_connections" in body
            time.sleep(0.25)
        thread.join()
        seen = json.loads(answers[0].strip().splitlines()[-1])
        assert set(codes) == {200} and len(codes) >= 20, codes
        assert seen["connections"] >= 40 and seen.get("HTTP/1.1 503 Service Unavailable", 0) >= 36
        samples = scrape(url)
        assert (value(samples, "memtui_exporter_http_peer_refused_total") or 0) >= 36
        assert process.num_threads() < 20
