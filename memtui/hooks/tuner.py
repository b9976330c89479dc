"""The Tuner: the training thread's side of memtui (step and checkpoint calls) and its lifecycle.

The per-step work is a few ``perf_counter`` reads and one deque append: ``step()`` closes the
step's record (wall time, data wait summed by the loader wrapper, samples, micro-batches) and
appends it to a bounded outbox that the agent thread drains. Everything else (sampling,
encoding, sending, answering viewers) happens on two daemon threads. Every public method
catches its own failures: they are counted, logged and published, never raised into training.
"""

from __future__ import annotations

import atexit
import getpass
import logging
import math
import os
import socket
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

import memtui
from memtui import registry
from memtui.advice.predict import predict_peak
from memtui.hooks.binding import ConfigBinding
from memtui.hooks.control import Control
from memtui.hooks.coordinate import JOIN_WAIT_S, Coordinator
from memtui.hooks.loader import LOADER_KNOBS, TunedLoader
from memtui.hooks.memory import static_memory
from memtui.hooks.oom import Guard, install_excepthook
from memtui.hooks.persist import (
    AUDIT_FILE,
    TUNED_FILE,
    AuditLog,
    read_audit,
    read_tuned,
    unapplied,
    write_tuned,
)
from memtui.knobs import KNOBS, KnobError, check_range, format_value, parse_value
from memtui.security import SecurityError, TcpPlan, insecure_requested, plan_tcp
from memtui.stats import one_line, parse_bytes
from memtui.wire import (
    STEP_AFTER_CHECKPOINT,
    AppliedChange,
    CheckpointRecord,
    KnobDiff,
    Knobs,
    KnobValue,
    OomEvent,
    PendingChange,
    RankInfo,
    RunInfo,
    StaticMemory,
)

log = logging.getLogger("memtui")
_perf_counter = time.perf_counter
"""The step clock, bound once: ``step()`` is on the hot path."""

UNSAVED_WARN_S = 60.0
"""While the tuned config is not saved, this is said again at most this often."""
OUTBOX_RECORDS = 16384
"""Step records held for the agent; if it stalls, the oldest are dropped (and counted)."""

_live_tuners: weakref.WeakSet[Tuner] = weakref.WeakSet()

RawStep = tuple[int, float, float, float, int, int, int]
"""One step as the training thread records it: a ``StepRecord``'s fields, the end time on the
``perf_counter`` clock (the agent makes it wall-clock time when it sends the record)."""


@dataclass
class Options:
    """Rates and switches of the hook's background work."""

    flush_period_s: float = 0.25
    """How often telemetry is sent while a viewer is subscribed or a recording is written (four
    batches a second, whatever the step rate: the viewer redraws at 4 Hz)."""
    idle_flush_s: float = 1.0
    """How often telemetry is sent while nobody is subscribed (each send wakes a thread)."""
    device_period_s: float = 0.5
    """How often device memory is sampled while a viewer is subscribed or a recording is
    written (allocator peaks in between are kept)."""
    idle_device_period_s: float = 1.0
    """How often device memory is sampled while nobody watches: the peaks stay exact (they are
    the allocator's and the kernel's high-water marks), and each wake-up takes the GIL."""
    host_period_s: float = 1.0
    """How often host memory is sampled (psutil)."""
    reset_peaks: bool = True
    """Reset the torch allocator's peak counters after each read (per-interval peaks)."""
    publish: bool = True
    """Start the sampler and agent threads (False: changes and timing only, nothing sent)."""
    boundary_timeout_s: float = field(
        default_factory=lambda: float(os.environ.get("MEMTUI_BOUNDARY_TIMEOUT", "1800"))
    )
    """How long a rank waits at a checkpoint boundary for the others before changes are
    switched off (long enough for the slowest checkpoint save); capped at half the process
    group's own timeout, so the job's collectives never time out first."""
    boundary_warn_s: float = 60.0
    """How often a rank waiting at a boundary names the ranks it waits for."""
    tcp: str | None = field(default_factory=lambda: os.environ.get("MEMTUI_TCP") or None)
    """Also publish over TCP on this address (multi-node; CURVE keys from ``memtui keygen``)."""
    insecure: bool = field(default_factory=insecure_requested)
    """Allow plain TCP (loopback addresses only)."""
    memory_limit: int | None = field(default_factory=lambda: _size_env("MEMTUI_MEMORY_LIMIT"))
    """On CPU runs, the budget the device (the process tree) is held to; default: the cgroup's
    limit, else total RAM."""
    record: str | None = field(default_factory=lambda: os.environ.get("MEMTUI_RECORD") or None)
    """Also write the published stream to this file (replay it with ``memtui replay``)."""
    rollback_steps: int = field(
        default_factory=lambda: int(os.environ.get("MEMTUI_ROLLBACK_STEPS", "50"))
    )
    """An out-of-memory error inside ``tuner.guard()`` within this many steps after an applied
    change reverts that change and training goes on (0: never roll back)."""


def _size_env(name: str) -> int | None:
    text = os.environ.get(name)
    return parse_bytes(text) if text else None


@dataclass
class Applied:
    """What a checkpoint boundary changed: ``{knob: (old, new)}`` at ``step``."""

    step: int
    changes: dict[str, tuple[Any, Any]]
    ids: list[int] = field(default_factory=list)
    note: str = ""

    def __str__(self) -> str:
        parts = ", ".join(
            f"{k} {format_value(old)} -> {format_value(new)}"
            for k, (old, new) in self.changes.items()
        )
        text = f"memtui: applied at step {self.step}: {parts or 'no effective change'}"
        return f"{text} ({self.note})" if self.note else text


def _dist() -> Any:
    """``torch.distributed`` when this process is one rank of several, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    try:
        if (
            dist is not None
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
        ):
            return dist
    except Exception:
        return None
    return None


def _try(make: Callable[[], str]) -> str:
    """The endpoint ``make`` builds, or "" when the runtime directory is unusable."""
    try:
        return make()
    except Exception:
        return ""


def _rank_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torch.distributed or the launcher's environment."""
    dist = _dist()
    if dist is not None:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", "0") or 0)
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = int(os.environ.get("LOCAL_RANK", str(rank)) or 0)
    return rank, local, world


class Tuner:
    """The hook in one training process: timing, the loaders it owns, and the boundary."""

    def __init__(
        self,
        config: Any = None,
        *,
        knobs: Mapping[str, str] | None = None,
        model: Any = None,
        optimizer: Any = None,
        state_dir: str | os.PathLike[str] | None = None,
        tuned_path: str | os.PathLike[str] | None = None,
        resume: bool | str | os.PathLike[str] = False,
        name: str | None = None,
        auto_step: bool = False,
        options: Options | None = None,
        placement: tuple[int, int, int] | None = None,
    ) -> None:
        # hot-path state first, so every method works even if the rest fails
        self._step = 0
        self._t_last: float | None = None
        self._wait_acc = 0.0
        self._samples_acc = 0
        self._micro_acc = 0
        self._flags = 0
        self._step_batches: list[tuple[TunedLoader, list[int] | int]] = []
        """The micro-batches delivered in the current step (re-queued by an OOM rollback)."""
        self._empty_cache_pending = False
        self._segment_start = 0
        """The step at which the current micro-batch size began (the memory model's window)."""
        self._static_at_install: StaticMemory | None = None
        self._outbox: deque[RawStep] = deque(maxlen=OUTBOX_RECORDS)
        self._checkpoint_box: deque[CheckpointRecord] = deque(maxlen=256)
        self._wall_offset = time.time() - time.perf_counter()
        self._loader_generation = 0
        self._rebuilt_flag = False
        self._errors = 0
        self._last_error = ""
        self._error_counts: dict[str, int] = {}
        self._closed = False
        self.tuned_unsaved_step: int | None = None
        """The step since which the tuned config could not be written (None: it is on disk)."""
        self._tuned_retry: dict[str, Any] | None = None
        """What the next boundary writes again into the tuned config (None: nothing to retry)."""
        self._unsaved_warned = -math.inf
        self._unsaved_reason = ""
        """Why the tuned config or audit lines could not be written, last time (one line)."""
        self._pid = os.getpid()
        self._cuda_device: int | None = None
        self._loaders: list[weakref.ref[TunedLoader]] = []
        self._sampler: Any = None
        self._agent: Any = None
        self._hook_handle: Any = None
        self.adapter: Any = None
        """The framework adapter that drives this tuner (``hooks.install(trainer)``), if any."""
        self.loader_options: dict[str, Any] = {}
        """Extra ``TunedLoader`` arguments an adapter sets (``shard``, ``place``)."""

        self.options = options or Options()
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.binding = ConfigBinding(config, knobs)
        self.rank, self.local_rank, self.world_size = placement or _rank_env()
        """``placement``: (rank, local rank, world size) from an adapter whose framework knows them
        before the launcher's environment or ``torch.distributed`` says (Lightning)."""
        self.coordinator: Coordinator | None = None
        self.ranks: list[RankInfo] = []
        """Where every rank of the run publishes (filled at install)."""
        self.run_id = registry.new_run_id(name)
        self.coordination_error = ""
        """Why this rank could not coordinate with the others ("" when it did, or runs alone)."""
        dist = _dist()
        joining, self.run_id = self._join(dist) if dist is not None else (None, self.run_id)
        self.coordinator = joining
        self._state_dir_given = bool(state_dir)
        self.state_dir = Path(state_dir) if state_dir else registry.state_home() / self.run_id
        self.tuned_paths = [self.state_dir / TUNED_FILE]
        if tuned_path:
            self.tuned_paths.append(Path(tuned_path))
        self.values: dict[str, KnobValue | None] = {k: None for k in KNOBS}
        """The current value of each knob (None: not tunable in this run)."""
        for knob in KNOBS:
            if self.binding.has(knob):
                self.values[knob] = self._coerce(knob, self.binding.read(knob))
        self.resumed: dict[str, tuple[Any, Any]] = {}
        if resume:
            self._resume(resume)
        audit = AuditLog(self.state_dir / AUDIT_FILE, self.run_id) if self.rank == 0 else None
        self.control = Control(
            self.knobs(),
            self.tunable(),
            world_size=self.world_size,
            audit=audit,
            step=lambda: self._step,
            report=self._report,
        )
        self.info = self._make_info()
        if resume and self.rank == 0:
            self._say_unapplied()
        self.tcp_plan: TcpPlan | None = None
        try:
            self.tcp_plan = plan_tcp(self.options.tcp, self.options.insecure)
        except SecurityError as exc:
            self._report(exc, "tcp")
        self._refresh_device()
        self._baseline_bytes = self._allocated_now()
        self._refresh_static()
        if optimizer is not None and auto_step:
            self.watch_optimizer(optimizer)
        install_excepthook(self)
        _live_tuners.add(self)
        atexit.register(self.close)
        disabled = os.environ.get("MEMTUI_DISABLE", "") in ("1", "true", "yes")
        if self.options.publish and not disabled:
            self._start_threads()
        self.ranks = [self._my_endpoints()]
        self._exchange(joining)

    def coordinate(self) -> bool:
        """Start coordinating with the other ranks once ``torch.distributed`` is initialised.

        ``install`` does this itself when the process group already exists; an adapter whose
        framework starts it later (Lightning, inside ``fit``) calls this on every rank. Every rank
        then takes the job's run id and posts its endpoints, as at install (through the job's
        store: nothing here waits for another rank). Returns whether changes are coordinated.
        """
        if self.coordinator is not None:
            return True
        dist = _dist()
        if dist is None:
            return False
        coordinator, run_id = self._join(dist)
        if coordinator is None:
            return False
        if run_id != self.run_id:
            self._adopt_run_id(run_id)
        if coordinator.rank != self.rank:
            log.warning(
                "memtui: this process is rank %d, not %d as it seemed at install",
                coordinator.rank,
                self.rank,
            )
        self.rank, self.world_size = coordinator.rank, coordinator.world_size
        self.control.world_size = self.world_size
        self.info.rank, self.info.world_size = self.rank, self.world_size
        self._exchange(coordinator)
        if self.coordinator is not None:
            log.info(
                "memtui: rank %d of %d coordinated in run %s", self.rank, self.world_size, run_id
            )
        return self.coordinator is not None

    def _join(self, dist: Any) -> tuple[Coordinator | None, str]:
        """Open the side channel and take the job's run id (no coordinator: changes stay off,
        said why, and this rank's own run id)."""
        coordinator: Coordinator | None = None
        try:
            coordinator = Coordinator(
                dist,
                timeout_s=self.options.boundary_timeout_s,
                warn_every_s=self.options.boundary_warn_s,
            )
            run_id = coordinator.join(self.run_id)
        except Exception as exc:  # never apply uncoordinated: changes stay off, on every rank
            self._coordination_failed(coordinator, exc)
            return None, self.run_id
        return coordinator, run_id

    def _exchange(self, coordinator: Coordinator | None) -> None:
        """Post this rank's endpoints, read the others' (rank 0 waits a little) and register."""
        if coordinator is not None:
            try:
                coordinator.post_endpoints(self._my_endpoints())
                wait = JOIN_WAIT_S if coordinator.rank == 0 else 0.0
                self.ranks = coordinator.endpoints(wait)
                self.coordinator = coordinator
            except Exception as exc:
                self._coordination_failed(coordinator, exc)
        if self.coordination_error:
            self.control.disabled = self.coordination_error
        if self._agent is not None and self._agent.failed is None:
            try:
                self._agent.register()
            except Exception as exc:
                self._report(exc, "register")

    def _refresh_ranks(self, coordinator: Coordinator) -> None:
        """Read the endpoints of ranks that joined after install, and register them (rank 0)."""
        try:
            self.ranks = coordinator.endpoints()
            if self._agent is not None and self._agent.failed is None:
                self._agent.register()
        except Exception as exc:
            self._report(exc, "coordination")

    def _coordination_failed(self, coordinator: Coordinator | None, exc: BaseException) -> None:
        """Switch changes off here, loudly, and tell the other ranks at once (they stop too)."""
        self._report(exc, "coordination")
        self.coordination_error = (
            f"rank {self.rank} could not coordinate ({type(exc).__name__}: {exc})"[:300]
        )
        self.coordinator = None
        log.error("memtui: changes are OFF for this run: %s", self.coordination_error)
        if coordinator is not None:
            coordinator.fail(self.coordination_error)
        if getattr(self, "control", None) is not None:
            self.control.disabled = self.coordination_error

    def _adopt_run_id(self, run_id: str) -> None:
        """Join rank 0's run (this rank's sockets stay where they were bound)."""
        self.run_id = run_id
        self.info.run = run_id
        if not self._state_dir_given:
            self.state_dir = registry.state_home() / run_id
            self.tuned_paths[0] = self.state_dir / TUNED_FILE
            self.info.state_dir = str(self.state_dir)
            self.info.audit_path = str(self.state_dir / AUDIT_FILE)
            self.info.tuned_path = str(self.tuned_paths[-1])

    def _my_endpoints(self) -> RankInfo:
        """Where this rank publishes and answers."""
        agent = self._agent
        run_dir = (
            agent.run_dir
            if agent is not None
            else registry.RunDir(registry.runtime_dir(create=False) / self.run_id)
        )
        return RankInfo(
            rank=self.rank,
            pub=_try(lambda: run_dir.pub_endpoint(self.rank)),
            control=_try(lambda: run_dir.control_endpoint(self.rank)),
            local_rank=self.local_rank,
            host=self.info.host,
            pid=self.info.pid,
            pub_tcp=agent.tcp_pub if agent is not None else "",
            control_tcp=agent.tcp_control if agent is not None else "",
        )

    # ------------------------------------------------------------------ setup helpers

    @staticmethod
    def _coerce(knob: str, value: Any) -> KnobValue | None:
        try:
            return parse_value(knob, value)
        except KnobError:
            return None

    def _resume(self, resume: bool | str | os.PathLike[str]) -> None:
        """Load the tuned config (the state dir's, or the file given) into the user's config."""
        path = self.tuned_paths[0] if resume is True else Path(resume)  # type: ignore[arg-type]
        if not path.exists():
            log.info("memtui: no tuned config at %s; starting from the script's config", path)
            return
        try:
            values = read_tuned(path)
        except ValueError as exc:
            self._report(exc, "resume")
            return
        for knob, value in values.items():
            if knob == "grad_accum" and not self.binding.has(knob):
                continue
            old = self.values.get(knob)
            if self.binding.has(knob):
                self.binding.write(knob, value)
            self.values[knob] = value
            if old != value:
                self.resumed[knob] = (old, value)
        if self.resumed:
            parts = ", ".join(
                f"{k} {format_value(o)} -> {format_value(n)}" for k, (o, n) in self.resumed.items()
            )
            log.warning("memtui: resumed the tuned config from %s: %s", path, parts)

    def _say_unapplied(self) -> None:
        """Name the changes the resumed run queued but never applied, and how to queue them."""
        try:
            run, changes = unapplied(read_audit(self.state_dir / AUDIT_FILE), self.run_id)
        except Exception as exc:
            self._report(exc, "reading the audit log")
            return
        if not changes:
            return
        words = " ".join(f"{k}={format_value(v)}" for k, v in changes.items())
        self.info.requeue = f"memtui set {self.run_id} {words}"
        log.warning(
            "memtui: run %s stopped with changes queued and never applied (%s); to queue them "
            "again: %s",
            run,
            words,
            self.info.requeue,
        )

    def _make_info(self) -> RunInfo:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = str(os.getuid())
        torch = sys.modules.get("torch")
        return RunInfo(
            run=self.run_id,
            pid=os.getpid(),
            host=socket.gethostname(),
            started=time.time(),
            command=[sys.executable, *sys.argv],
            cwd=os.getcwd(),
            user=user,
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            torch_version=str(getattr(torch, "__version__", "")) if torch else "",
            hook_version=memtui.__version__,
            state_dir=str(self.state_dir),
            tuned_path=str(self.tuned_paths[-1]),
            audit_path=str(self.state_dir / AUDIT_FILE),
        )

    def current_info(self) -> RunInfo:
        """RunInfo with the device as the sampler sees it now."""
        probe = getattr(self._sampler, "probe", None)
        if probe is None:
            return self.info
        if probe.kind == "cuda":
            device, capacity = f"cuda:{probe.index} {probe.name}", probe.capacity
        else:
            device, capacity = "cpu", probe.host.limit_bytes
        self.info.device, self.info.device_kind, self.info.capacity_bytes = (
            device,
            probe.kind,
            capacity,
        )
        return self.info

    def _start_threads(self) -> None:
        from memtui.hooks.agent import Agent
        from memtui.hooks.sampler import Sampler

        try:
            self._sampler = Sampler(
                self,
                self.options.device_period_s,
                self.options.host_period_s,
                idle_device_period_s=self.options.idle_device_period_s,
            )
            self._sampler.start()
            self._agent = Agent(
                self,
                registry.run_dir(self.run_id),
                flush_period_s=self.options.flush_period_s,
                idle_flush_s=self.options.idle_flush_s,
            )
            self._agent.start()
            self._agent.ready.wait(5.0)
            if self._agent.failed is not None:
                log.warning("memtui: not publishing (%s); training goes on", self._agent.failed)
        except Exception as exc:
            self._report(exc, "start")

    def _refresh_device(self) -> None:
        """Note which CUDA device the training thread uses (none until CUDA is initialised)."""
        torch = sys.modules.get("torch")
        try:
            if torch is None or not torch.cuda.is_initialized():
                return
            index = None
            if self.model is not None:
                for param in self.model.parameters():
                    if param.device.type == "cuda":
                        index = param.device.index
                    break
            self._cuda_device = torch.cuda.current_device() if index is None else index
        except Exception as exc:
            self._report(exc, "device")

    def _detect_cuda_late(self) -> None:
        """From the sampler thread: notice CUDA initialised after install (model moved later)."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        index = None
        if self.model is not None:
            for param in self.model.parameters():
                if param.device.type == "cuda":
                    index = param.device.index
                break
        if index is None:
            count = max(1, torch.cuda.device_count())
            index = int(os.environ.get("LOCAL_RANK", "0") or 0) % count
        self._cuda_device = index

    def _report(self, exc: BaseException, where: str) -> None:
        """Count a failure inside memtui, log it (rate-limited) and publish it; never raise."""
        try:
            self._errors += 1
            text = one_line(exc)
            self._last_error = one_line(f"{where}: {type(exc).__name__}: {text}")
            count = self._error_counts.get(where, 0) + 1
            self._error_counts[where] = count
            if count <= 3 or count % 1000 == 0:
                log.warning(
                    "memtui: %s failed (%s: %s); training goes on", where, type(exc).__name__, text
                )
        except Exception:
            pass

    # ------------------------------------------------------------------ knobs

    def knobs(self) -> Knobs:
        """The current knob values."""
        return Knobs(**{k: v for k, v in self.values.items()})  # type: ignore[arg-type]

    def tunable(self) -> list[str]:
        """The knobs this run can change."""
        return [k for k in KNOBS if self.values[k] is not None]

    def _current_knob(self, knob: str) -> Any:
        return self.values.get(knob)

    def _sync_control(self) -> None:
        if self.control is not None:
            with self.control._lock:
                self.control.current = self.knobs()
                self.control.tunable = self.tunable()
                self.control.seq += 1

    # ------------------------------------------------------------------ the public API

    def loader(self, factory: Callable[..., Any]) -> TunedLoader:
        """Wrap a DataLoader factory: batches are timed and the loader follows batch/worker changes.

        ``factory`` takes any of ``batch_size``, ``num_workers`` and ``pin_memory`` as keyword
        arguments and returns a ``torch.utils.data.DataLoader``.
        """
        wrapped = TunedLoader(self, factory, **self.loader_options)
        for knob in LOADER_KNOBS:
            if self.values[knob] is None and wrapped.knobs.get(knob) is not None:
                self.values[knob] = wrapped.knobs[knob]
        self._loaders.append(weakref.ref(wrapped))
        self._sync_control()
        return wrapped

    def step(self, samples: int | None = None) -> None:
        """Mark the end of one optimizer step (``samples``: override the count the loader made)."""
        now = _perf_counter()
        try:
            step = self._step + 1
            self._step = step
            self._outbox.append(
                (
                    step,
                    now,
                    now - (self._t_last or now),
                    self._wait_acc,
                    self._samples_acc if samples is None else samples,
                    self._micro_acc,
                    self._flags,
                )
            )
            self._t_last = now
            self._wait_acc = 0.0
            self._samples_acc = 0
            self._micro_acc = 0
            self._flags = 0
            self._step_batches.clear()
        except Exception as exc:
            self._report(exc, "step")

    def watch_optimizer(self, optimizer: Any) -> None:
        """Call ``step()`` automatically after every ``optimizer.step()`` (a post-step hook)."""
        try:
            self._hook_handle = optimizer.register_step_post_hook(lambda *_args: self.step())
        except Exception as exc:
            self._report(exc, "watch_optimizer")

    def checkpoint(self) -> Applied | None:
        """The checkpoint boundary: call it on every rank right after the checkpoint is saved.

        Applies the pending changes (the same set, at this step, on every rank) and returns what
        changed, or None when nothing did.
        """
        now = time.perf_counter()
        result: Applied | None = None
        try:
            save_s = now - self._t_last if self._t_last is not None else 0.0
            self._refresh_device()
            self._refresh_static()
            result = self._boundary()
            if self.rank == 0 and result is None:  # an applied change has just tried
                self._save_again()
            taken = self.control.taken_time if self.rank == 0 else time.time()
            self._checkpoint_box.append(CheckpointRecord(self._step, taken, save_s))
        except Exception as exc:
            self._report(exc, "checkpoint")
        self._t_last = time.perf_counter()
        self._flags |= STEP_AFTER_CHECKPOINT
        return result

    def _boundary(self) -> Applied | None:
        """Decide (rank 0), broadcast, validate and apply the pending changes."""
        taken: list[PendingChange] = self.control.take_pending() if self.rank == 0 else []
        pending = taken
        if self.coordinator is None and self.world_size > 1 and taken:
            # one rank of several with no agreement: applying here alone would split the job
            self.control.record_rejected(
                taken,
                f"rank {self.rank} of {self.world_size} is not coordinated with the others "
                "(torch.distributed was not initialised at install; call tuner.coordinate() on "
                "every rank once it is)",
                self._step,
            )
            return None
        if self.coordinator is not None:
            agreed, abort = self.coordinator.boundary(self._step, taken)
            if abort:
                if taken:
                    self.control.record_rejected(
                        taken, f"changes are off for this run: {abort}", self._step
                    )
                self.control.disabled = abort
                return None
            pending = agreed or []
            if not self.coordinator.complete:
                self._refresh_ranks(self.coordinator)
        if not pending:
            return None
        merged: dict[str, KnobValue] = {}
        for change in pending:
            merged.update(change.changes)
        step = self._step
        try:
            for knob, value in merged.items():
                if self.values.get(knob) is None:
                    raise KnobError(f"{knob} is not tunable in this run")
                if not isinstance(value, bool):
                    check_range(knob, int(value))
        except KnobError as exc:
            self.control.record_rejected(pending, str(exc), step)
            return None
        diffs = {
            k: KnobDiff(self.values.get(k), v) for k, v in merged.items() if self.values.get(k) != v
        }
        error = self._write_knobs(diffs)
        if error:
            self.control.record_rejected(pending, error, step)
            return None
        rebuilds = any(k in LOADER_KNOBS for k in diffs)
        note = "the data loader is rebuilt at the next batch" if rebuilds else ""
        model = self.control.model
        batch = self.values.get("batch_size")
        predicted = predict_peak(model, int(batch)) if model is not None and batch else None
        applied = AppliedChange(
            ids=[c.id for c in pending],
            step=step,
            time=time.time(),
            changes=diffs,
            note=note,
            predicted_peak_bytes=predicted,
        )
        self.control.record_applied(applied, self.knobs())
        if self.rank == 0:
            self._write_tuned()
        result = Applied(step, {k: (d.old, d.new) for k, d in diffs.items()}, applied.ids, note)
        log.info("%s", result)
        return result

    def _write_knobs(self, diffs: dict[str, KnobDiff]) -> str:
        """Write new values into the config (all or none) and the loaders; "" or why it failed."""
        written: list[str] = []
        failing = ""
        try:
            for failing, diff in diffs.items():
                if self.binding.has(failing):
                    self.binding.write(failing, diff.new)
                    written.append(failing)
        except Exception as exc:
            for knob in written:
                self.binding.write(knob, diffs[knob].old)
            self._report(exc, "apply")
            return f"could not write {failing} into the config: {exc}"
        for knob, diff in diffs.items():
            self.values[knob] = diff.new
        if "batch_size" in diffs:
            self._segment_start = self._step
        if any(k in LOADER_KNOBS for k in diffs):
            self._loader_generation += 1
        return ""

    def _write_tuned(
        self, extra: dict[str, Any] | None = None, values: Mapping[str, Any] | None = None
    ) -> None:
        """Write the tuned config (``values``, else the current ones) to every tuned path; one
        that fails is written again at every boundary until it is, and said (once a minute)."""
        config = {k: v for k, v in (values or self.values).items() if v is not None}
        failed = False
        for path in self.tuned_paths:
            try:
                write_tuned(path, self.run_id, self._step, config, extra)
            except OSError as exc:
                failed = True
                self._unsaved_reason = f"{path}: {one_line(exc)}"
                self._report(exc, f"writing {path}")
        if failed:
            self._tuned_retry = extra or {}
            if self.tuned_unsaved_step is None:
                self.tuned_unsaved_step = self._step
        else:
            self.tuned_unsaved_step, self._tuned_retry, self._unsaved_reason = None, None, ""
        self._say_unsaved()

    def _save_again(self) -> None:
        """At a boundary: write again the tuned config and the audit lines not written yet, and
        warn (once a minute) while they are not."""
        audit = self.control.audit
        if self._tuned_retry is not None:
            self._write_tuned(self._tuned_retry)
        if audit is not None and audit.unwritten:
            try:
                audit.flush()
            except OSError as exc:
                self._report(exc, "audit log")
        self._say_unsaved()

    def _say_unsaved(self) -> None:
        """Warn once a minute while the tuned config or audit lines are not written, and once
        when they are again."""
        control = getattr(self, "control", None)
        audit = control.audit if control is not None else None
        lines = len(audit.unwritten) if audit is not None else 0
        parts = []
        if self.tuned_unsaved_step is not None:
            parts.append(f"the tuned config is not saved since step {self.tuned_unsaved_step}")
        if audit is not None and lines:
            lost = f", {audit.dropped} more lost" if audit.dropped else ""
            parts.append(f"{lines} audit log lines are not written{lost}")
        now = time.monotonic()
        if not parts:
            if self._unsaved_warned > -math.inf:
                self._unsaved_warned = -math.inf
                log.warning(
                    "memtui: the tuned config and audit log are saved again at step %d", self._step
                )
        elif now - self._unsaved_warned >= UNSAVED_WARN_S:
            self._unsaved_warned = now
            log.warning(
                "memtui: %s (%s); a restart would not keep the changes since; retried at every "
                "checkpoint",
                " and ".join(parts),
                self._unsaved_reason or (audit.error if audit is not None else ""),
            )

    # ------------------------------------------------------------------ memory

    def _allocated_now(self) -> int:
        """Device allocated (CUDA) or the main process's RSS (CPU), for the install baseline."""
        try:
            torch = sys.modules.get("torch")
            if self._cuda_device is not None and torch is not None:
                return int(torch.cuda.memory_allocated(self._cuda_device))
            return int(psutil.Process().memory_info().rss)
        except Exception:
            return 0

    def _refresh_static(self) -> None:
        """Recompute parameters, gradients and optimizer state from the tensors (training thread)."""
        if self.model is None and self.optimizer is None:
            return
        try:
            kind = "cuda" if self._cuda_device is not None else "cpu"
            static = static_memory(self.model, self.optimizer, kind, self._baseline_bytes)
        except Exception as exc:
            self._report(exc, "static memory")
            return
        if self._static_at_install is None:
            self._static_at_install = static
        with self.control._lock:
            if self.control.static != static:
                self.control.static = static
                self.control.seq += 1

    def guard(self) -> Guard:
        """A context manager for the allocating part of a step: OOM post-mortem and rollback."""
        return Guard(self)

    def _requeue_step_batches(self) -> tuple[int, int]:
        """Give the step's micro-batches back to their loaders: (re-queued, skipped) samples."""
        requeued = skipped = 0
        for loader, batch in self._step_batches:
            if isinstance(batch, list) and loader.requeue(batch):
                requeued += len(batch)
            else:
                skipped += len(batch) if isinstance(batch, list) else batch
        # beyond MAX_STEP_BATCHES micro-batches (a loop that never calls step()) nothing was
        # kept: those samples are counted as skipped, never lost silently
        skipped += max(0, self._samples_acc - requeued - skipped)
        self._step_batches.clear()
        return requeued, skipped

    def _revert(self, target: AppliedChange, report_text: str) -> str:
        """Undo an applied change now (an OOM rollback); return what changed, in words."""
        diffs = {
            k: KnobDiff(self.values.get(k), d.old)
            for k, d in target.changes.items()
            if d.old is not None and self.values.get(k) != d.old
        }
        error = self._write_knobs(diffs)
        if error:
            return error
        rollback = AppliedChange(
            ids=[],
            step=self._step,
            time=time.time(),
            changes=diffs,
            note=report_text,
            rollback=True,
        )
        self.control.record_applied(rollback, self.knobs())
        return ", ".join(
            f"{k} {format_value(d.old)} -> {format_value(d.new)}" for k, d in diffs.items()
        )

    def _zero_grad(self) -> None:
        try:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            elif self.model is not None:
                self.model.zero_grad(set_to_none=True)
        except Exception as exc:
            self._report(exc, "zero_grad")

    def _reset_partial_step(self) -> None:
        """Forget the failed step's partial timing; it starts over."""
        self._wait_acc = 0.0
        self._samples_acc = 0
        self._micro_acc = 0
        self._t_last = time.perf_counter()

    def _record_oom(self, event: OomEvent, values: dict[str, Any], why: str) -> None:
        """Publish an OOM, audit it, and write the post-mortem and safe config into the YAML."""
        with self.control._lock:
            self.control.ooms.append(event)
            self.control.seq += 1
        self.control._audit("oom", event)
        postmortem = {
            "step": event.step,
            "kind": event.kind,
            "message": event.message,
            "tried_bytes": event.tried_bytes,
            "capacity_bytes": event.capacity_bytes,
            "free_bytes": event.free_bytes,
            "process_in_use_bytes": event.process_in_use_bytes,
            "allocated_bytes": event.allocated_bytes,
            "reserved_unallocated_bytes": event.reserved_unallocated_bytes,
            "config_at_oom": {k: getattr(event.config, k) for k in KNOBS},
            "rolled_back": event.rolled_back,
            "batch": event.batch,
        }
        self._write_tuned({"safe_config_reason": why, "oom": postmortem}, {**self.values, **values})

    def _loader_rebuilt(self) -> None:
        """Tell the sampler to look for the new loader workers now."""
        self._rebuilt_flag = True

    # ------------------------------------------------------------------ state and lifecycle

    @property
    def step_count(self) -> int:
        """Optimizer steps counted so far (resumed runs continue from ``load_state_dict``)."""
        return self._step

    def state_dict(self) -> dict[str, Any]:
        """The tuner's place in training: save it in your checkpoint to resume exactly."""
        loaders = [ref() for ref in self._loaders]
        return {
            "step": self._step,
            "loaders": [loader.state_dict() for loader in loaders if loader is not None],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved ``state_dict()``: the step count and the loaders' data position."""
        try:
            self._step = int(state.get("step", 0))
            loaders = [ref() for ref in self._loaders]
            for loader, saved in zip(
                [loader for loader in loaders if loader is not None],
                state.get("loaders", []),
                strict=False,
            ):
                loader.load_state_dict(saved)
        except Exception as exc:
            self._report(exc, "load_state_dict")

    def close(self) -> None:
        """Send the last telemetry, stop the threads and remove the run from the registry."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            if self._hook_handle is not None:
                self._hook_handle.remove()
            if self._sampler is not None:
                self._sampler.stop()
            if self._agent is not None:
                self._agent.stop()
                if self.rank != 0 and self._agent.run_dir.path.name != self.run_id:
                    self._agent.run_dir.remove()  # bound before this rank joined rank 0's run
        except Exception as exc:
            self._report(exc, "close")
        finally:
            atexit.unregister(self.close)

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _after_fork_in_child() -> None:
    """A forked child (a loader worker) must never publish or sample: disable every tuner."""
    for tuner in list(_live_tuners):
        tuner._closed = True
        tuner._sampler = None
        tuner._agent = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
