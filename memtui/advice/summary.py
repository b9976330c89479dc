"""What a run amounts to, in a bounded summary: its time and memory by stretches of the run, a
sample of its steps, the verdicts it went through, and the config the next run should start with.

One builder for every source: the hook feeds it its own steps and samples (the agent thread,
never the training thread) and writes the summary beside its tuned config; ``memtui report``
feeds it the frames of a recording. Bounded whatever the run's length: at most ``MAX_WINDOWS``
stretches (each twice as long once they are all used), ``KEPT_STEPS`` steps kept whole (a
uniform random sample of the run's), ``MAX_SPANS`` verdict spans. Pure: no file, no socket.
"""

from __future__ import annotations

import bisect
import math
import operator
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from memtui.advice.assess import STATE_NAMES, assess
from memtui.advice.effect import describe as describe_effect
from memtui.advice.verdict import Thresholds
from memtui.core.knobs import KNOBS, as_dict, format_value
from memtui.core.stats import median, process_tree
from memtui.wire import (
    STEP_LOADER_REBUILT,
    AppliedChange,
    ControlState,
    DeviceSample,
    HookCounters,
    HostSample,
    KeptStep,
    KnobValue,
    MemorySummary,
    RankFigures,
    RunInfo,
    RunSummary,
    Snapshot,
    StepRecord,
    SummaryOption,
    SummaryWindow,
    VerdictSpan,
)

WINDOW_S = 2.0
"""How long a stretch of the run is at first (it doubles whenever ``MAX_WINDOWS`` are used)."""
MAX_WINDOWS = 180
"""Stretches kept at most: a run of six minutes in 2 s stretches, a day in 8.5-minute ones."""
KEPT_STEPS = 2000
"""Steps kept whole at most (a uniform random sample of the run's): what ``memtui compare``
and ``memtui check`` test, about 80 kB of the summary."""
WARMUP_STEPS = 3
"""The run's first steps (allocations, compilation, the loader's start) are not kept."""
MAX_SPANS = 64
"""Verdict spans kept at most (the first and last ones; those between are counted)."""
SUMMARY_LOOK_S = 30.0
"""How often the verdict is taken for the summary (over the recent steps, as ``memtui status``
takes it)."""
MAX_OPTIONS = 3
"""Recommendations kept from the last look."""

RawStep = tuple[int, float, float, float, int, int, int]
"""A step as the hook's ledger records it: ``StepRecord``'s fields in order."""


@dataclass
class _Window:
    """One stretch's running sums and maxima."""

    steps: int = 0
    step_time_s: float = 0.0
    data_wait_s: float = 0.0
    samples: int = 0
    slowest_step_s: float = 0.0
    device_peak_bytes: int = 0
    device_used_bytes: int = 0
    host_peak_bytes: int = 0

    def merge(self, other: _Window) -> None:
        """Fold a neighbouring stretch into this one."""
        self.steps += other.steps
        self.step_time_s += other.step_time_s
        self.data_wait_s += other.data_wait_s
        self.samples += other.samples
        self.slowest_step_s = max(self.slowest_step_s, other.slowest_step_s)
        self.device_peak_bytes = max(self.device_peak_bytes, other.device_peak_bytes)
        self.device_used_bytes = max(self.device_used_bytes, other.device_used_bytes)
        self.host_peak_bytes = max(self.host_peak_bytes, other.host_peak_bytes)


def device_peak(sample: DeviceSample) -> int:
    """A device sample's peak as the memory bands weigh it: torch's peak reserve (or the CPU
    process tree's peak) plus what the device holds beyond torch (``core.stats.MemoryStats``)."""
    peak = max(sample.peak_reserved_bytes, sample.reserved_bytes)
    beyond = 0
    if sample.nvml_used_bytes is not None:
        beyond = max(0, sample.nvml_used_bytes - sample.reserved_bytes)
    return peak + beyond


def device_used(sample: DeviceSample) -> int:
    """What the device held at the sample (reserved, plus what it holds beyond torch)."""
    beyond = 0
    if sample.nvml_used_bytes is not None:
        beyond = max(0, sample.nvml_used_bytes - sample.reserved_bytes)
    return max(sample.reserved_bytes, sample.allocated_bytes) + beyond


@dataclass
class SummaryBuilder:
    """Folds one rank's steps, samples and verdicts into a bounded ``RunSummary``."""

    seed: str = ""
    """Seeds the choice of the steps kept (the run id: the same run keeps the same steps)."""
    window_s: float = WINDOW_S
    origin: float | None = None
    """Wall time of the first stretch's start (the first step's or sample's)."""
    first_step: int = 0
    last_step: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    data_wait_s: float = 0.0
    samples: int = 0
    data_wait_measured: bool = False
    kept_of: int = 0
    memory: MemorySummary = field(default_factory=MemorySummary)
    sampled_device: bool = False
    spans: list[VerdictSpan] = field(default_factory=list)
    spans_dropped: int = 0
    verdict_seconds: dict[str, float] = field(default_factory=dict)
    options: list[SummaryOption] = field(default_factory=list)
    started_config: ControlState | None = None
    _windows: dict[int, _Window] = field(default_factory=dict)
    _kept: list[RawStep] = field(default_factory=list)
    """The steps kept, as the ledger recorded them (converted when the summary is written)."""
    _next_kept: int | None = None
    """The count of eligible steps at which the next one is kept (once the sample is full)."""
    _weight: float = 0.0
    _rng: random.Random = field(default_factory=random.Random)
    _last_look: float | None = None

    def __post_init__(self) -> None:
        self._rng.seed(self.seed or "memtui")

    # ------------------------------------------------------------------ feeding

    def _window(self, at: float) -> _Window:
        """The stretch that holds wall time ``at`` (a new one as needed; coarser when full)."""
        if self.origin is None:
            self.origin = at
        index = max(0, int((at - self.origin) // self.window_s))
        window = self._windows.get(index)
        if window is None:
            if len(self._windows) >= MAX_WINDOWS:
                self._coarsen()
                return self._window(at)
            window = self._windows[index] = _Window()
        return window

    def _coarsen(self) -> None:
        """Double the stretches' length, merging each pair."""
        merged: dict[int, _Window] = {}
        for index in sorted(self._windows):
            into = merged.get(index // 2)
            if into is None:
                merged[index // 2] = self._windows[index]
            else:
                into.merge(self._windows[index])
        self._windows = merged
        self.window_s *= 2

    def add_steps(self, steps: Sequence[RawStep]) -> None:
        """Fold steps in (the ledger's tuples, oldest first, as one drain hands them over).

        The agent thread folds every step the training runs, holding the GIL the training
        thread wants: the sums are taken over the whole batch with built-ins, a batch is split
        only where it crosses a stretch, and the sample of kept steps draws random numbers only
        for the steps it keeps (about 0.3 us of CPU a step; a loop over the steps took 2.7 us)."""
        if not steps:
            return
        columns = list(zip(*steps, strict=True))
        times: Sequence[float] = columns[2]
        if min(times) <= 0:  # a step with no measured time says nothing of speed
            steps = [s for s in steps if s[2] > 0]
            if not steps:
                return
            columns = list(zip(*steps, strict=True))
            times = columns[2]
        numbers, ends, _times, waits, samples, micros, flags = columns
        if max(waits) > min(times) and any(map(operator.gt, waits, times)):
            # a wait is part of its step (one the loop drew before its save: cut to the step)
            waits = tuple(map(min, waits, times))
        if not self.steps:
            self.first_step = numbers[0]
            if self.origin is None:
                self.origin = ends[0] - times[0]
        before = self.steps
        self.steps += len(steps)
        self.last_step = numbers[-1]
        self.step_time_s += math.fsum(times)
        self.data_wait_s += math.fsum(waits)
        self.samples += sum(samples)
        self.data_wait_measured = self.data_wait_measured or any(micros)
        self._fold_windows(ends, times, waits, samples)
        skip = max(0, WARMUP_STEPS - before)
        if any(flags) and any(flag & STEP_LOADER_REBUILT for flag in flags):
            eligible = [
                s for s in steps[skip:] if not s[6] & STEP_LOADER_REBUILT
            ]  # the loader's start-up is not a step's speed
        else:
            eligible = list(steps[skip:])
        self._keep(eligible)

    def _fold_windows(
        self,
        ends: Sequence[float],
        times: Sequence[float],
        waits: Sequence[float],
        samples: Sequence[int],
    ) -> None:
        """Add steps (ends ascending) to their stretches, one slice per stretch they cross."""
        start = 0
        count = len(ends)
        while start < count:
            window = self._window(ends[start])
            assert self.origin is not None
            index = max(0, int((ends[start] - self.origin) // self.window_s))
            limit = self.origin + (index + 1) * self.window_s
            stop = bisect.bisect_left(ends, limit, start, count) if ends[-1] >= limit else count
            stop = max(stop, start + 1)
            window.steps += stop - start
            window.step_time_s += math.fsum(times[start:stop])
            window.data_wait_s += math.fsum(waits[start:stop])
            window.samples += sum(samples[start:stop])
            window.slowest_step_s = max(window.slowest_step_s, max(times[start:stop]))
            start = stop

    def add_records(self, records: Iterable[StepRecord]) -> None:
        """Fold step records in (a recording's, oldest first)."""
        self.add_steps(
            [
                (r.step, r.end_time, r.step_time_s, r.data_wait_s, r.samples, r.micro_batches,
                 r.flags)
                for r in records
            ]
        )  # fmt: skip

    def _keep(self, eligible: list[RawStep]) -> None:
        """Keep steps in the uniform sample: reservoir sampling (Li's algorithm L), each step of
        the run with the same chance to be kept whatever the run's length, a random draw only
        for the steps it keeps."""
        room = KEPT_STEPS - len(self._kept)
        if room > 0:
            self._kept.extend(eligible[:room])
            self.kept_of += min(room, len(eligible))
            eligible = eligible[room:]
            if len(self._kept) == KEPT_STEPS:
                self._weight = math.exp(math.log(self._random()) / KEPT_STEPS)
                self._next_kept = self.kept_of + self._skip()
        base = self.kept_of
        self.kept_of += len(eligible)
        while self._next_kept is not None and self._next_kept <= self.kept_of:
            self._kept[self._rng.randrange(KEPT_STEPS)] = eligible[self._next_kept - base - 1]
            self._weight *= math.exp(math.log(self._random()) / KEPT_STEPS)
            self._next_kept += self._skip()

    def _random(self) -> float:
        """A uniform draw in (0, 1)."""
        return self._rng.random() or 1e-300

    def _skip(self) -> int:
        """How many steps on the next one kept is (algorithm L's geometric jump)."""
        return math.floor(math.log(self._random()) / math.log(1 - self._weight)) + 1

    def add_device(self, samples: Iterable[DeviceSample]) -> None:
        """Fold device samples in."""
        memory = self.memory
        for sample in samples:
            peak, used = device_peak(sample), device_used(sample)
            window = self._window(sample.time)
            window.device_peak_bytes = max(window.device_peak_bytes, peak)
            window.device_used_bytes = max(window.device_used_bytes, used)
            self.sampled_device = True
            memory.kind = sample.kind
            memory.capacity_bytes = sample.capacity_bytes or memory.capacity_bytes
            if peak > memory.device_peak_bytes:
                memory.device_peak_bytes = peak
                memory.device_peak_step = sample.step
                memory.device_peak_time = sample.time
            memory.alloc_retries = max(memory.alloc_retries, sample.alloc_retries)
            memory.allocator_ooms = max(memory.allocator_ooms, sample.ooms)

    def add_host(self, samples: Iterable[HostSample]) -> None:
        """Fold host samples in."""
        memory = self.memory
        for sample in samples:
            tree = process_tree(sample).total_bytes
            window = self._window(sample.time)
            window.host_peak_bytes = max(window.host_peak_bytes, tree)
            memory.host_peak_bytes = max(memory.host_peak_bytes, tree)
            memory.host_limit_bytes = sample.limit_bytes or sample.ram_total_bytes
            memory.ram_used_peak_bytes = max(memory.ram_used_peak_bytes, sample.ram_used_bytes)
            memory.swap_peak_bytes = max(memory.swap_peak_bytes, sample.swap_used_bytes)

    def note_control(self, control: ControlState) -> None:
        """Remember the config the summary began with (the first control state seen)."""
        if self.started_config is None:
            self.started_config = control

    # ------------------------------------------------------------------ the verdict

    def look_due(self, now: float) -> bool:
        """Whether the verdict is due a look (every ``SUMMARY_LOOK_S`` of the run's time)."""
        return self._last_look is None or now - self._last_look >= SUMMARY_LOOK_S

    def look(self, snapshot: Snapshot, thresholds: Thresholds | None, now: float) -> None:
        """Take the verdict and the recommendations over ``snapshot``'s recent steps (as
        ``memtui status`` takes them) and fold the verdict into the spans."""
        self.note_control(snapshot.control)
        if not snapshot.steps:
            return
        found = assess(snapshot, None, thresholds)
        state = STATE_NAMES[found.verdict.state]
        since = self._last_look if self._last_look is not None else self.origin
        since = now if since is None else since
        self._last_look = now
        self.verdict_seconds[state] = self.verdict_seconds.get(state, 0.0) + max(0.0, now - since)
        step = snapshot.steps[-1].step
        last = self.spans[-1] if self.spans else None
        if last is not None and last.state == state:
            last.last_step, last.end, last.looks = step, now, last.looks + 1
        else:
            self.spans.append(
                VerdictSpan(state, step, step, now, now, headline=found.verdict.headline)
            )
            if len(self.spans) > MAX_SPANS:  # the start and the end of the run stay
                del self.spans[MAX_SPANS // 2]
                self.spans_dropped += 1
        self.options = [
            SummaryOption(
                title=r.title,
                changes=dict(r.changes),
                applicable=r.applicable,
                why=r.why,
                speed_delta=r.speed_delta,
                predicted_peak_bytes=r.predicted_peak_bytes,
            )
            for r in found.recommendations[:MAX_OPTIONS]
        ]

    # ------------------------------------------------------------------ the summary

    def windows(self) -> list[SummaryWindow]:
        """The stretches, oldest first."""
        origin = self.origin or 0.0
        return [
            SummaryWindow(
                start=round(origin + index * self.window_s, 3),
                seconds=self.window_s,
                steps=w.steps,
                step_time_s=round(w.step_time_s, 6),
                data_wait_s=round(w.data_wait_s, 6),
                samples=w.samples,
                slowest_step_s=round(w.slowest_step_s, 6),
                device_peak_bytes=w.device_peak_bytes,
                device_used_bytes=w.device_used_bytes,
                host_peak_bytes=w.host_peak_bytes,
            )
            for index, w in sorted(self._windows.items())
        ]

    def kept(self) -> list[KeptStep]:
        """The steps kept, in step order."""
        return [
            KeptStep(s[0], round(s[2], 6), round(min(s[3], s[2]), 6), s[4])
            for s in sorted(self._kept)
        ]

    def figures(self, rank: int, host: str, now: float, ooms: int = 0) -> RankFigures:
        """This rank's figures over the run, as rank 0's summary lists them."""
        memory = self.memory
        return RankFigures(
            rank=rank,
            host=host,
            time=now,
            steps=self.steps,
            step_time_s=median([s[2] for s in self._kept]),
            data_wait_fraction=self.data_wait_s / self.step_time_s if self.step_time_s else 0.0,
            data_wait_measured=self.data_wait_measured,
            samples_per_s=self.samples / self.step_time_s if self.step_time_s else 0.0,
            device_peak_bytes=memory.device_peak_bytes,
            capacity_bytes=memory.capacity_bytes,
            host_peak_bytes=memory.host_peak_bytes,
            ooms=ooms,
        )

    def summary(
        self,
        info: RunInfo,
        control: ControlState | None,
        now: float,
        *,
        ended: str = "",
        ranks: Sequence[RankFigures] = (),
        counters: HookCounters | None = None,
        records_dropped: int = 0,
    ) -> RunSummary:
        """The summary as it stands (``ended``: how the run ended, "" while it runs)."""
        started = self.started_config or control
        return RunSummary(
            run=info.run,
            written=now,
            info=info,
            ended=ended,
            first_step=self.first_step,
            last_step=self.last_step,
            steps=self.steps,
            step_time_s=round(self.step_time_s, 6),
            data_wait_s=round(self.data_wait_s, 6),
            samples=self.samples,
            data_wait_measured=self.data_wait_measured,
            window_s=self.window_s,
            windows=self.windows(),
            kept=self.kept(),
            kept_of=self.kept_of,
            memory=self.memory if (self.sampled_device or self.memory.host_peak_bytes) else None,
            verdicts=list(self.spans),
            verdicts_dropped=self.spans_dropped,
            verdict_seconds={k: round(v, 1) for k, v in self.verdict_seconds.items()},
            options=list(self.options),
            started_config=started.config if started is not None else None,
            control=control,
            ranks=list(ranks),
            counters=counters,
            records_dropped=records_dropped,
        )


# ---------------------------------------------------------------------------- the next run


@dataclass(frozen=True)
class StartWith:
    """The config the next run should start with, and why."""

    config: dict[str, KnobValue]
    """Every knob memtui could change, at the value the next run should start with."""
    changed: dict[str, tuple[KnobValue | None, KnobValue]]
    """The knobs whose value differs from what this run started with: (then, now)."""
    reasons: list[str]
    """Why, one line per knob changed (the change that set it and what it bought)."""
    source: str
    """Where the values come from, in words."""
    untested: list[SummaryOption]
    """Changes the run's last look recommended and nobody tried: not measured here."""


def start_with(summary: RunSummary) -> StartWith | None:
    """The config the next run should start with: the values the run ended on (the changes that
    held, a rollback's safe config after an out-of-memory error), under what ran out of memory;
    None when the run told no config."""
    control = summary.control
    if control is None:
        return None
    config = {k: v for k, v in as_dict(control.config).items() if v is not None}
    source = "the config the run ended with"
    fatal = [o for o in control.ooms if not o.rolled_back and o.safe_config is not None]
    if fatal and summary.ended == "out of memory":
        safe = fatal[-1].safe_config
        assert safe is not None
        config.update({k: v for k, v in as_dict(safe).items() if v is not None})
        source = f"the safe config written after the out-of-memory error at step {fatal[-1].step}"
    ceiling = control.ceiling
    if ceiling is not None and ceiling.batch_size is not None:
        batch = config.get("batch_size")
        if isinstance(batch, int) and not isinstance(batch, bool) and batch >= ceiling.batch_size:
            config["batch_size"] = max(1, ceiling.batch_size - 1)
            source += f", under the micro-batch that ran out of memory ({ceiling.batch_size})"
    started = started_values(summary)
    changed = {
        k: (started.get(k), v) for k, v in config.items() if k in started and started[k] != v
    }
    reasons = [_reason(knob, old, new, control.applied) for knob, (old, new) in changed.items()]
    untested = [
        o
        for o in summary.options
        if o.applicable and o.changes and any(config.get(k) != v for k, v in o.changes.items())
    ]
    ordered = {k: config[k] for k in KNOBS if k in config}
    return StartWith(ordered, changed, reasons, source, untested)


def started_values(summary: RunSummary) -> dict[str, KnobValue]:
    """The knobs the run started with: its config now with every change it applied undone,
    newest first (else the config the summary began with)."""
    control = summary.control
    if control is None:
        return {}
    applied = [a for a in control.applied if a.step >= summary.first_step - 1]
    if not applied and summary.started_config is not None:
        return {k: v for k, v in as_dict(summary.started_config).items() if v is not None}
    values = {k: v for k, v in as_dict(control.config).items() if v is not None}
    for change in reversed(applied):
        for knob, diff in change.changes.items():
            if diff.old is None:
                values.pop(knob, None)
            else:
                values[knob] = diff.old
    return values


def _who(change: AppliedChange) -> str:
    if change.rollback:
        return "a rollback after an out-of-memory error"
    return f"the {change.origin}" if change.origin else "an operator"


def _reason(
    knob: str, old: KnobValue | None, new: KnobValue, applied: Sequence[AppliedChange]
) -> str:
    """``num_workers 0 -> 4: applied at step 120 by an operator: +180% samples/s ...``: the
    last change that set the value (a rollback that returned to it said after)."""
    words = f"{knob} {format_value(old) if old is not None else 'default'} -> {format_value(new)}"
    setting = [a for a in applied if knob in a.changes and a.changes[knob].new == new]
    chosen = [a for a in setting if not a.rollback] or setting
    if not chosen:
        return words
    change = chosen[-1]
    words += f": applied at step {change.step} by {_who(change)}"
    if change.effect is not None:
        words += f": {describe_effect(change.effect)}"
    returned = [a for a in setting if a.rollback and a.step >= change.step and a is not change]
    if returned:
        words += (
            f"; back to it at step {returned[-1].step} by a rollback after an out-of-memory error"
        )
    return words


def yaml_of(config: Mapping[str, KnobValue]) -> str:
    """The config as a tuned YAML's ``config:`` section (what ``install(resume=PATH)`` reads)."""
    lines = ["config:"]
    for knob, value in config.items():
        shown = ("true" if value else "false") if isinstance(value, bool) else str(value)
        lines.append(f"  {knob}: {shown}")
    return "\n".join(lines)
