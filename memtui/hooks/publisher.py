"""The publisher: what one rank sends, and the history a new viewer's snapshot starts from.

It drains the step ledger, the sampler and the checkpoint records into bounded histories and
into what the next telemetry batch carries; the agent thread asks it for a batch (``telemetry``)
at every flush and for a ``snapshot`` when a viewer says hello. No sockets here: the agent sends.
The ``Recorder`` writes the same frames to a recording file, bounded.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from memtui.advice.summary import SummaryBuilder
from memtui.hooks.control import Control
from memtui.hooks.errors import Report
from memtui.hooks.ledger import CHECKPOINT_RECORDS, OUTBOX_RECORDS, RawStep, StepLedger
from memtui.transport.recording import RecordingHeader, RecordingWriter
from memtui.wire import (
    CheckpointRecord,
    DeviceSample,
    HookCounters,
    HostSample,
    RankInfo,
    RunInfo,
    Snapshot,
    StepRecord,
    Telemetry,
)

if TYPE_CHECKING:
    from memtui.hooks.sampler import Sampler

log = logging.getLogger("memtui")

HISTORY_STEPS = 2048
"""Steps a new viewer's snapshot can carry."""
UNSENT_RECORDS = OUTBOX_RECORDS
"""Drained records waiting for the next flush (as many as the ledger's outbox)."""
RECORD_LIMIT = 512 << 20
"""A recording stops (and says so) at this size: the hook never grows without bound."""


class Publisher:
    """Histories and unsent buffers of one rank's steps, samples and checkpoints."""

    def __init__(
        self,
        ledger: StepLedger,
        control: Control,
        sampler: Callable[[], Sampler | None],
        heartbeat_s: float = 1.0,
        summary: SummaryBuilder | None = None,
        report: Report | None = None,
    ) -> None:
        self._ledger = ledger
        self._control = control
        self._sampler = sampler
        self.heartbeat_s = heartbeat_s
        self._summary = summary
        """The run's summary, fed every step and sample drained (``hooks.summary``)."""
        self._report = report
        self._unsent: deque[RawStep] = deque(maxlen=HISTORY_STEPS)
        """Records drained (by a flush or a snapshot) and not yet published: nobody watching,
        the history's worth of them waits for a viewer (the deque's bound drops the older ones,
        in C), never converted to wire records; watched, up to ``UNSENT_RECORDS``."""
        self._unsent_device: list[DeviceSample] = []
        """Device samples drained from the sampler and not yet published (its deque's bound)."""
        self._unsent_host: HostSample | None = None
        """The newest host sample drained and not yet published."""
        self._unsent_checkpoints: list[CheckpointRecord] = []
        """Checkpoint boundaries drained and not yet published."""
        self.steps: deque[RawStep] = deque(maxlen=HISTORY_STEPS)
        """The last steps as the training thread recorded them (``records`` converts them)."""
        self.device: deque[DeviceSample] = deque(maxlen=600)
        self.host: deque[HostSample] = deque(maxlen=120)
        self.checkpoints: deque[CheckpointRecord] = deque(maxlen=128)
        self.seq = 0
        """Telemetry batches built."""
        self.records_dropped = 0
        """Step records the ledger's outbox dropped before they were drained (a stalled agent)."""
        self._last_step = 0
        self._sent_control_seq = 0
        self._sent_counters: HookCounters | None = None
        self.last_send = 0.0
        """When the last batch was built (monotonic clock)."""

    def control_changed(self) -> bool:
        """Whether the control state moved since it was last sent (a change queued or cancelled)."""
        return self._control.seq != self._sent_control_seq

    def drain(self, keep: bool = True) -> list[RawStep]:
        """Move new steps, samples and checkpoints into the history and what the next batch sends
        (the steps too where ``keep``); returns the steps taken.

        A snapshot drains too (a viewer asking between flushes sees the newest state), so what
        it took waits in the unsent buffers for the next flush.
        """
        sampler = self._sampler()
        devices: list[DeviceSample] = []
        hosts: list[HostSample] = []
        if sampler is not None:
            device = sampler.device_samples
            while device:
                sample = device.popleft()
                self.device.append(sample)
                self._unsent_device.append(sample)
                devices.append(sample)
            del self._unsent_device[: -(device.maxlen or 512)]
            host = sampler.host_samples
            while host:
                self._unsent_host = host.popleft()
                self.host.append(self._unsent_host)
                hosts.append(self._unsent_host)
        for checkpoint in self._ledger.drain_checkpoints():
            self.checkpoints.append(checkpoint)
            self._unsent_checkpoints.append(checkpoint)
        del self._unsent_checkpoints[:-CHECKPOINT_RECORDS]
        taken = self._ledger.drain_steps()
        self._summarize(taken, devices, hosts)
        if not taken:
            return taken
        # a full outbox drops its oldest records, so a gap can only open before the first
        last = self._last_step
        if last and taken[0][0] > last + 1:
            self.records_dropped += taken[0][0] - last - 1
        self._last_step = taken[-1][0]
        self.steps.extend(taken)
        if keep:
            self._unsent.extend(taken)
        return taken

    def _summarize(
        self, steps: list[RawStep], devices: list[DeviceSample], hosts: list[HostSample]
    ) -> None:
        """Fold what was drained into the run's summary (a failure is reported, never raised:
        the steps still go out)."""
        summary = self._summary
        if summary is None or not (steps or devices or hosts):
            return
        try:
            summary.add_device(devices)
            summary.add_host(hosts)
            summary.add_steps(steps)
        except Exception as exc:
            if self._report is not None:
                self._report(exc, "the run's summary")

    def telemetry(
        self, *, run: str, rank: int, counters: HookCounters, watched: bool, ended: bool = False
    ) -> Telemetry | None:
        """The next batch with everything new since the previous one, or a heartbeat; None when
        there is nothing to say yet. Call ``sent`` once it left."""
        sending = watched or ended
        bound = UNSENT_RECORDS if sending else HISTORY_STEPS
        if self._unsent.maxlen != bound:
            # nobody listens: keep what the history keeps (the same tuples), in case a viewer's
            # subscription is reported after its snapshot was taken
            self._unsent = deque(self._unsent, maxlen=bound)
        # watched, the steps taken go out as they are, unless a snapshot in between drained some
        taken = self.drain(keep=not sending or bool(self._unsent))
        records: list[StepRecord] = []
        if sending:
            # the raw tuples are StepRecords' fields in order and encode exactly as them: building
            # a Struct per step cost the agent ~21 µs per 250 steps, holding the GIL
            records = cast("list[StepRecord]", taken if not self._unsent else list(self._unsent))
            self._unsent.clear()
        device, self._unsent_device = self._unsent_device, []
        host, self._unsent_host = self._unsent_host, None
        checkpoints, self._unsent_checkpoints = self._unsent_checkpoints, []
        control_seq = self._control.seq
        control = self._control.state() if control_seq != self._sent_control_seq else None
        send_counters = counters if counters != self._sent_counters else None
        now = time.monotonic()
        quiet = not (records or device or host or checkpoints or control or send_counters)
        if quiet and not ended and now - self.last_send < self.heartbeat_s:
            return None
        self.seq += 1
        self.last_send = now
        return Telemetry(
            run=run,
            rank=rank,
            seq=self.seq,
            time=time.time(),
            step=self._ledger.step,
            steps=records,
            device=device,
            host=host,
            checkpoints=checkpoints,
            control_seq=control_seq,
            control=control,
            counters=send_counters,
            ended=ended,
        )

    def sent(self, message: Telemetry, counters: HookCounters) -> None:
        """Note that ``message`` reached the socket: its control state and counters are known."""
        self._sent_control_seq = message.control_seq
        self._sent_counters = counters

    def snapshot(
        self, info: RunInfo, ranks: list[RankInfo], counters: HookCounters, history: int = 512
    ) -> Snapshot:
        """Everything a new viewer needs, with the last ``history`` step records."""
        self.drain()
        history = max(0, min(history, HISTORY_STEPS))
        steps = self._ledger.records(list(self.steps)[-history:]) if history else []
        return Snapshot(
            info=info,
            control=self._control.state(),
            ranks=ranks,
            step=self._ledger.step,
            seq=self.seq,
            control_seq=self._control.seq,
            steps=steps,
            device=list(self.device)[-300:],
            host=list(self.host),
            checkpoints=list(self.checkpoints),
            counters=counters,
        )


class Recorder:
    """Writes the published frames to a recording file, up to ``RECORD_LIMIT`` bytes."""

    def __init__(self, path: str, header: RecordingHeader, report: Report) -> None:
        self._writer: RecordingWriter | None = RecordingWriter(path, header)
        self._started = time.monotonic()
        self._bytes = 0
        self._report = report

    @property
    def active(self) -> bool:
        """Whether frames are still written."""
        return self._writer is not None

    def write(self, rank: int, frame: bytes) -> None:
        """Append one frame (stops, and says so, at the size limit or a write error)."""
        writer = self._writer
        if writer is None:
            return
        try:
            writer.write(time.monotonic() - self._started, rank, frame)
            self._bytes += len(frame)
            if self._bytes > RECORD_LIMIT:
                self.close()
                log.warning("memtui: the recording reached %d MiB; stopped it", RECORD_LIMIT >> 20)
        except OSError as exc:
            self._report(exc, "recording")
            self._writer = None

    def close(self) -> None:
        """Flush and close the file."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError as exc:
                self._report(exc, "recording")
