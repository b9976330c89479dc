"""The metric families ``/metrics`` serves, built at each scrape from the fleet's latest readings.

Per rank (labels ``run``, ``rank``, ``host``, ``device``): speed, device memory, host memory,
the loader workers' memory, the changes applied, the out-of-memory errors and the hook's errors
and CPU time. Per run (labels ``run``, ``host``): the verdict as a state set and the pending
changes. Units are in the names (``_seconds``, ``_bytes``, ``_ratio``); the README lists them.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    StateSetMetricFamily,
)
from prometheus_client.registry import Collector

from memtui.advice.assess import STATE_NAMES, loader_memory
from memtui.export.fleet import Fleet, RankReading, RunReading
from memtui.export.hookcpu import HookCpu

RANK_LABELS = ["run", "rank", "host", "device"]
RUN_LABELS = ["run", "host"]

RankValue = Callable[[RankReading], float | None]
"""One number of a rank (None: not known, the sample is left out)."""


def of_steps(field: str) -> RankValue:
    """A field of the rank's step summary."""
    return lambda r: getattr(r.steps, field) if r.steps else None


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
     of_steps("data_wait_s")),
    ("memtui_data_wait_ratio", "Share of step time spent waiting for data (STARVED from 0.30).",
     of_steps("data_wait_fraction")),
    ("memtui_samples_per_second", "Samples trained per second over the recent steps.",
     of_steps("samples_per_s")),
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
    """Builds every family from the fleet's readings at each scrape."""

    def __init__(self, fleet: Fleet, hook_cpu: HookCpu | None = None, node: str = "") -> None:
        self.fleet = fleet
        self.hook_cpu = hook_cpu or HookCpu()
        self.node = node or socket.gethostname()
        """This node's name: the hook's CPU is read for the ranks that run here."""

    def describe(self) -> Iterable[Metric]:
        """Nothing up front: the families depend on the runs live at the scrape."""
        return []

    def collect(self) -> Iterable[Metric]:
        """The families, from the latest state of every run watched."""
        readings = self.fleet.readings()
        self.hook_cpu.forget({rank.pid for run in readings for rank in run.ranks})
        return families(readings, self._hook_seconds)

    def _hook_seconds(self, rank: RankReading) -> float | None:
        if rank.host != self.node:
            return None
        return self.hook_cpu.seconds(rank.pid)


def families(
    readings: list[RunReading], hook_seconds: Callable[[RankReading], float | None]
) -> list[Metric]:
    """Every family for ``readings`` (``hook_seconds``: a rank's hook CPU time, if readable)."""
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
    numbers: list[GaugeMetricFamily | CounterMetricFamily] = [*gauges, *counters]
    runs = GaugeMetricFamily("memtui_runs", "Live runs the exporter watches.")
    runs.add_metric([], len(readings))
    for run in readings:
        verdict.add_metric(
            [run.run, run.host], {name: run.verdict is state for state, name in STATE_NAMES.items()}
        )
        pending.add_metric([run.run, run.host], run.pending)
        for rank in run.ranks:
            labels = [run.run, str(rank.rank), rank.host, rank.device]
            for family, (_name, _help, value) in zip(numbers, GAUGES + COUNTERS, strict=True):
                number = value(rank)
                if number is not None:
                    family.add_metric(labels, float(number))
            seconds = hook_seconds(rank)
            if seconds is not None:
                hook_cpu.add_metric(labels, seconds)
    return [runs, verdict, pending, *numbers, hook_cpu]
