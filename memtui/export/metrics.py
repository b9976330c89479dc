"""The metric families ``/metrics`` serves: built from the fleet off the scrape, served cached.

Per rank (labels ``run``, ``rank``, ``host``, ``device``): speed (the rank's own samples/s and
what a step is made of), device memory, host memory, the loader workers' memory, the changes
applied, the out-of-memory errors and the hook's errors and CPU time; a rank of a run that does not answer is there as ``memtui_up`` 0 alone. Per run
(labels ``run``, ``host``): the verdict as a state set, the pending changes, the job's samples/s
(``memtui.runs.throughput``: the figure ``memtui status`` and the viewer show) and the time since
the run last answered. The exporter's own: the runs registered, not answering and left
unwatched for a cap, the cache's age, the HTTP connections refused (for the cap, or for their
peer's share of it), timed out and unauthorized, its threads.
Units are in the names (``_seconds``, ``_bytes``, ``_ratio``); the Prometheus guide lists them.

:meth:`FleetCollector.update` builds the families on the exporter's loop; a scrape
(:meth:`FleetCollector.collect`) takes the latest ones as they are, and waits on no run.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from memtui.advice.assess import STATE_NAMES, loader_memory
from memtui.export.fleet import Fleet, FleetReading, RankReading
from memtui.export.hookcpu import HookCpu
from memtui.export.http import HttpCounts

RANK_LABELS = ["run", "rank", "host", "device"]
RUN_LABELS = ["run", "host"]

RankValue = Callable[[RankReading], float | None]
"""One number of a rank (None: not known, the sample is left out)."""


def of_steps(field: str) -> RankValue:
    """A field of the rank's step summary."""
    return lambda r: getattr(r.steps, field) if r.steps else None


def of_data(field: str) -> RankValue:
    """A field of the rank's step summary that only a batch memtui timed measures (the data
    wait, the samples): left out where none was timed, as ``memtui status`` says "not measured"
    (its 0 says nothing)."""
    return lambda r: getattr(r.steps, field) if r.steps and r.steps.data_wait_measured else None


def of_memory(field: str) -> RankValue:
    """A field of the rank's device memory summary."""
    return lambda r: getattr(r.memory, field) if r.memory else None


def of_host(field: str) -> RankValue:
    """A field of the rank's latest host sample."""
    return lambda r: getattr(r.host_sample, field) if r.host_sample else None


GAUGES: tuple[tuple[str, str, RankValue], ...] = (
    ("memtui_up", "1 while the rank reports (a batch within 3 s), else 0.",
     lambda r: float(r.reporting)),
    ("memtui_last_step", "The newest optimizer step the rank reported.", lambda r: r.last_step),
    ("memtui_step_time_seconds", "Mean wall time of a step over the rank's recent steps.",
     of_steps("step_time_s")),
    ("memtui_data_wait_seconds", "Mean time a step waited for the data loader.",
     of_data("data_wait_s")),
    ("memtui_data_wait_ratio", "Share of step time spent waiting for data (STARVED from 0.30).",
     of_data("data_wait_fraction")),
    ("memtui_samples_per_second",
     "The rank's own samples (training batch rows) per second over its recent steps.",
     lambda r: r.steps.samples_per_s if r.steps and r.steps.samples_counted else None),
    ("memtui_micro_batches_per_step",
     "Training micro-batches one optimizer step draws on the rank (its recent steps' mean).",
     of_data("micro_batches_per_step")),
    ("memtui_device_capacity_bytes", "Device memory (CPU runs: the memory limit).",
     of_memory("capacity_bytes")),
    ("memtui_device_peak_used_bytes",
     "Peak in use: torch's peak reserve plus the memory beyond torch (OOM RISK from 85%).",
     of_memory("peak_used_bytes")),
    ("memtui_device_peak_used_ratio", "Peak in use over capacity.",
     lambda r: r.memory.peak_used_fraction if r.memory and r.memory.capacity_bytes else None),
    ("memtui_device_peak_reserved_bytes", "Peak reserved by torch's allocator (CPU: peak RSS).",
     of_memory("peak_bytes")),
    ("memtui_device_peak_allocated_bytes", "Peak allocated by torch's allocator.",
     of_memory("peak_allocated_bytes")),
    ("memtui_device_beyond_torch_bytes",
     "Device memory NVML sees used beyond torch's reserve (CUDA context, NCCL, others).",
     of_memory("beyond_torch_bytes")),
    ("memtui_host_ram_used_bytes", "Host RAM in use on the rank's node.",
     of_host("ram_used_bytes")),
    ("memtui_host_ram_total_bytes", "Host RAM of the rank's node.",
     of_host("ram_total_bytes")),
    ("memtui_host_swap_used_bytes", "Swap in use on the rank's node.",
     of_host("swap_used_bytes")),
    ("memtui_host_swap_total_bytes", "Swap of the rank's node.",
     of_host("swap_total_bytes")),
    ("memtui_loader_workers", "Live data-loader worker processes of the rank.",
     of_host("workers")),
    ("memtui_loader_workers_memory_bytes",
     "Memory the loader workers hold of their own (USS; RSS where USS is not measured).",
     lambda r: loader_memory(r.host_sample)),
)  # fmt: skip
"""Each rank's gauges: name, help, value."""

COUNTERS: tuple[tuple[str, str, RankValue], ...] = (
    ("memtui_applied_changes", "Config changes (rollbacks included) the rank applied.",
     lambda r: r.applied),
    ("memtui_ooms", "Out-of-memory errors the rank's hook caught.", lambda r: r.ooms),
    ("memtui_hook_errors", "Exceptions caught inside the rank's hook (training went on).",
     lambda r: r.hook_errors),
)  # fmt: skip
"""Each rank's counters (exposed with ``_total``): name, help, value."""


class FleetCollector(Collector):
    """The families of the fleet's runs, built by ``update`` and served from that cache."""

    def __init__(
        self,
        fleet: Fleet,
        hook_cpu: HookCpu | None = None,
        node: str = "",
        http: HttpCounts | None = None,
    ) -> None:
        self.fleet = fleet
        self.hook_cpu = hook_cpu or HookCpu()
        self.node = node or socket.gethostname()
        """This node's name: the hook's CPU is read for the ranks that run here."""
        self.http = http
        """The HTTP server's counts (None: not serving)."""
        self._cache: tuple[float, list[Metric]] = (time.monotonic(), [])
        """When the families were built (``time.monotonic``), and they: replaced whole, so a
        scrape reads one build or the next, never half of one."""

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: the families depend on the runs live at the scrape."""
        return []

    def update(self) -> None:
        """Build the families from the latest state of every run tracked (the exporter's loop)."""
        reading = self.fleet.collect()
        self.hook_cpu.forget({rank.pid for run in reading.runs for rank in run.ranks})
        self._cache = (time.monotonic(), families(reading, self._hook_seconds))

    def collect(self) -> Iterable[Metric]:
        """The families of the latest build, and the exporter's own state now (a scrape)."""
        built, cached = self._cache
        return [*cached, *exporter_families(time.monotonic() - built, self.http)]

    def _hook_seconds(self, rank: RankReading) -> float | None:
        if rank.host != self.node:
            return None
        return self.hook_cpu.seconds(rank.pid)


def families(
    reading: FleetReading, hook_seconds: Callable[[RankReading], float | None]
) -> list[Metric]:
    """Every family for ``reading`` (``hook_seconds``: a rank's hook CPU time, if readable)."""
    gauges = [GaugeMetricFamily(n, h, labels=RANK_LABELS) for n, h, _v in GAUGES]
    counters = [CounterMetricFamily(n, h, labels=RANK_LABELS) for n, h, _v in COUNTERS]
    hook_cpu = CounterMetricFamily(
        "memtui_hook_cpu_seconds",
        "CPU time of the hook's threads (memtui's and ZeroMQ's), ranks on the exporter's node.",
        labels=RANK_LABELS,
    )
    verdict = StateSetMetricFamily(
        "memtui_verdict",
        "The run's verdict (the worst rank's numbers, as memtui status decides it).",
        labels=RUN_LABELS,
    )
    pending = GaugeMetricFamily(
        "memtui_pending_changes", "Changes queued for the next checkpoint.", labels=RUN_LABELS
    )
    job_samples = GaugeMetricFamily(
        "memtui_job_samples_per_second",
        "The job's samples per second: its reporting ranks' memtui_samples_per_second summed "
        "(the figure memtui status and the viewer show).",
        labels=RUN_LABELS,
    )
    job_ranks = GaugeMetricFamily(
        "memtui_job_samples_ranks",
        "The ranks memtui_job_samples_per_second sums (fewer than the job's: some are silent).",
        labels=RUN_LABELS,
    )
    knobs = GaugeMetricFamily(
        "memtui_knob",
        "The run's knob values as memtui status gives them (pin_memory 1 or 0; a value memtui "
        "does not know is left out).",
        labels=[*RUN_LABELS, "knob", "tunable"],
    )
    effective = GaugeMetricFamily(
        "memtui_effective_batch",
        "Samples per optimizer step across the job: micro-batch x accumulation x ranks.",
        labels=RUN_LABELS,
    )
    last_seen = GaugeMetricFamily(
        "memtui_last_seen_age_seconds",
        "Seconds since the run last answered the exporter (never answered: since it started).",
        labels=RUN_LABELS,
    )
    numbers: list[GaugeMetricFamily | CounterMetricFamily] = [*gauges, *counters]
    runs = GaugeMetricFamily("memtui_runs", "Live runs the exporter watches.")
    runs.add_metric([], len(reading.runs))
    for run in reading.runs:
        verdict.add_metric(
            [run.run, run.host], {name: run.verdict is state for state, name in STATE_NAMES.items()}
        )
        pending.add_metric([run.run, run.host], run.pending)
        if run.throughput is not None and run.throughput.counted:
            job_samples.add_metric([run.run, run.host], run.throughput.samples_per_s)
            job_ranks.add_metric([run.run, run.host], run.throughput.ranks)
        for knob, setting in run.config.items():
            if setting is not None:
                tunable = "true" if knob in run.tunable else "false"
                knobs.add_metric([run.run, run.host, knob, tunable], float(setting))
        if run.effective_batch is not None:
            effective.add_metric([run.run, run.host], run.effective_batch)
        for rank in run.ranks:
            labels = [run.run, str(rank.rank), rank.host, rank.device]
            for family, (_name, _help, value) in zip(numbers, GAUGES + COUNTERS, strict=True):
                number = value(rank)
                if number is not None:
                    family.add_metric(labels, float(number))
            seconds = hook_seconds(rank)
            if seconds is not None:
                hook_cpu.add_metric(labels, seconds)
    up = gauges[[name for name, _h, _v in GAUGES].index("memtui_up")]
    for silent in reading.silent:
        for listed in silent.ranks:
            up.add_metric([silent.run, str(listed.rank), listed.host, listed.device], 0.0)
    for (run_id, host), age in reading.last_seen_age_s.items():
        last_seen.add_metric([run_id, host], age)
    fleet: list[Metric] = [
        GaugeMetricFamily(
            "memtui_exporter_runs_registered",
            "Live runs the registry listed at its last read.",
            value=reading.registered,
        ),
        GaugeMetricFamily(
            "memtui_exporter_runs_unanswered",
            "Registered runs that do not answer now (their ranks: memtui_up 0).",
            value=len(reading.silent),
        ),
        GaugeMetricFamily(
            "memtui_exporter_runs_unwatched",
            "Registered runs not followed now: --max-runs watched already, or too many listed.",
            value=reading.unwatched,
        ),
        CounterMetricFamily(
            "memtui_exporter_runs_dropped",
            "Runs left unwatched for a cap (--max-runs, or too many listed), each counted once.",
            value=reading.dropped,
        ),
        GaugeMetricFamily(
            "memtui_exporter_registry_read_seconds",
            "How long the last read of the registry took.",
            value=reading.registry_read_s,
        ),
    ]
    return [
        runs,
        verdict,
        pending,
        job_samples,
        job_ranks,
        knobs,
        effective,
        last_seen,
        *numbers,
        hook_cpu,
        *fleet,
    ]


def exporter_families(cache_age_s: float, http: HttpCounts | None) -> list[Metric]:
    """The exporter's own state at the scrape: the cache's age, its connections, its threads."""
    found: list[Metric] = [
        GaugeMetricFamily(
            "memtui_exporter_cache_age_seconds",
            "Seconds since the runs' metrics served were built (every second, off the scrape).",
            value=cache_age_s,
        ),
        GaugeMetricFamily(
            "memtui_exporter_threads", "Threads of the exporter's process.", value=thread_count()
        ),
    ]
    if http is not None:
        found += [
            GaugeMetricFamily(
                "memtui_exporter_http_connections",
                "HTTP connections being served now (at most --max-connections).",
                value=http.open,
            ),
            CounterMetricFamily(
                "memtui_exporter_http_refused",
                "HTTP connections answered 503 at once: --max-connections were open, or "
                "--max-per-peer of their peer's.",
                value=http.refused,
            ),
            CounterMetricFamily(
                "memtui_exporter_http_peer_refused",
                "HTTP connections answered 503 at once because their peer (an account, or an "
                "address) had --max-per-peer open (among the refused).",
                value=http.refused_peer,
            ),
            CounterMetricFamily(
                "memtui_exporter_http_unauthorized",
                "HTTP requests answered 401: without the exporter's bearer token.",
                value=http.unauthorized,
            ),
            CounterMetricFamily(
                "memtui_exporter_http_timeouts",
                "HTTP connections closed: the request or the reply took over --http-timeout.",
                value=http.timed_out,
            ),
        ]
    return found


def thread_count() -> int:
    """The threads of this process, as the kernel counts them (libzmq's included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()
