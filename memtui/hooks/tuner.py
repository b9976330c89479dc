"""The Tuner: the training thread's face of memtui, a thin facade over the hook's parts.

Each piece of state has one owner, reached through its public methods:

* ``ledger`` (``StepLedger``): the open step's tallies and the closed step records (hot path);
* ``store`` (``KnobStore``): the knob values, the tunable set, the config object written into;
* ``placement`` (``Placement``): rank, world size, run id, coordination with the other ranks;
* ``control`` (``Control``): rank 0's change queue and what was applied, refused and learnt;
* ``boundary`` (``Boundary``): the checkpoint boundary that applies changes;
* ``tuned`` (``TunedConfig``): the tuned config on disk; ``device`` (``DeviceTracker``);
* ``oom`` (``OomHandler``): post-mortems and rollbacks; ``errors`` (``ErrorLog``);
* ``tracker`` (``Tracker``): the user's event callbacks (``on_event``);
* ``files`` (``StateFiles``): where the audit log and the tuned config go;
* the sampler and agent threads (``Sampler``, ``Agent``), started by ``start``.

The constructor takes the options resolved once (``settings``, ``memtui.hooks.settings``), has
``memtui.hooks.parts.build_parts`` make the parts, each with the parts it uses, and touches
nothing outside the process; ``start()`` joins the job, resumes, opens the audit log, samples
and publishes. Every public method catches its own failures: they are counted, logged and
published, never raised into training.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import getpass
import inspect
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import memtui
from memtui.core.knobs import format_changes, format_diffs, format_value
from memtui.core.stats import one_line, printable
from memtui.hooks.agent import Agent, HookParts
from memtui.hooks.batches import Args, BatchT, timed_batches
from memtui.hooks.boundary import Applied
from memtui.hooks.device import allocator_settings
from memtui.hooks.knobstore import LOADER_KNOBS
from memtui.hooks.loader import TunedLoader
from memtui.hooks.lr import LR_SECTION
from memtui.hooks.oom import Guard
from memtui.hooks.parts import TunerCalls, build_parts
from memtui.hooks.persist import AuditLog, read_audit, unapplied
from memtui.hooks.restart import (
    CHECKPOINT,
    TunedState,
    differ,
    from_entry,
    from_yaml,
    unfinished,
    yaml_wins,
)
from memtui.hooks.sampler import CudaDeviceProbe, Sampler, usable_cpus
from memtui.hooks.settings import HookSettings, Options
from memtui.hooks.summary import RunSummaries, how_it_ended
from memtui.hooks.tracker import EventCallback
from memtui.storage import registry
from memtui.storage.ownfiles import UnsafeFile
from memtui.transport.security import SecurityError, TcpPlan, plan_tcp
from memtui.wire import KnobDiff, Knobs, LrWithdrawn, RankInfo, RunInfo

log = logging.getLogger("memtui")

_live_tuners: weakref.WeakSet[Tuner] = weakref.WeakSet()


def live_tuners() -> list[Tuner]:
    """The Tuners of this process that started and are not closed yet."""
    return [tuner for tuner in list(_live_tuners) if not tuner._closed]  # noqa: SLF001


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
        options: Options | HookSettings | None = None,
        placement: tuple[int, int, int] | None = None,
        lr_scale: str = "none",
        lr_fields: Sequence[str] = (),
    ) -> None:
        self.settings = (
            options if isinstance(options, HookSettings) else HookSettings.resolve(options)
        )
        """Every option of this Tuner, resolved once (``install`` resolves them first)."""
        self.model = model
        self.optimizer = optimizer
        self._measured: Callable[[], Any] = _nothing
        """The optimizer whose tensors are the memory parts where none was given (the one the
        no-code watch counts, or the one ``watch_optimizer`` was given): a weak reference, so
        that the script's optimizer is collected as without memtui."""
        self.config = config
        self.adapter: Any = None
        """The framework adapter that drives this tuner (``hooks.install(trainer)``), if any."""
        self.follows_loader = False
        """Whether a data loader memtui does not own takes the loader knobs (the no-code watch's
        training DataLoader, at its next epoch)."""
        self.loader_options: dict[str, Any] = {}
        """Extra ``TunedLoader`` arguments an adapter sets (``shard``, ``place``)."""
        self._resume_from = resume
        self._auto_step = auto_step
        self.resumed: dict[str, KnobDiff] = {}
        """What ``resume`` (or a checkpoint's ``load_state_dict``) changed in the script's config."""
        self._found: TunedState | None = None
        """The tuned YAML in the state dir (or the file ``resume`` names) as install read it."""
        self._found_resumed = False
        """Whether install started from ``_found`` (``resume``)."""
        self.tcp_plan: TcpPlan | None = None
        self.info: RunInfo | None = None
        self.sampler: Sampler | None = None
        self.agent: Agent | None = None
        self.summaries: RunSummaries | None = None
        """The run's summary (``memtui report``), kept by the agent thread once it starts."""
        self._exit_exc: BaseException | None = None
        """The exception that left the ``with`` block this Tuner closed at (None: none)."""
        self._loaders: list[weakref.ref[TunedLoader]] = []
        self._loaders_made = 0
        """Loaders made by ``loader()`` (every rank makes them in the same order)."""
        self._positions: list[tuple[Mapping[str, Any], bool]] = []
        """Data positions ``load_state_dict`` restored for loaders not made yet."""
        self._said_seed = False
        self._hook_handle: Any = None
        self._pid = os.getpid()
        self._started = False
        self._closed = False
        # the parts call back on this Tuner only through these methods (its state above)
        parts = build_parts(
            self.settings,
            TunerCalls(
                lr_withdrawn=self._lr_withdrawn,
                ranks_changed=self._register,
                zero_grad=self._zero_grad,
                has_loader=self._has_loader,
            ),
            config=config,
            knobs=knobs,
            name=name,
            where=placement,
            state_dir=state_dir,
            tuned_path=tuned_path,
            lr_scale=lr_scale,
            lr_fields=lr_fields,
        )
        self.errors = parts.errors
        self.report = parts.errors.report
        """Report a failure inside memtui (``report(exc, where)``): counted, logged, published."""
        self.ledger = parts.ledger
        # ``step()`` is the ledger's own method, bound here: one Python call per optimizer step
        # instead of two (the hot path); it never raises, and it reports what fails. The first
        # step also counts the gradients the loop keeps between steps, then binds the ledger's
        # method in its place
        self.step = self._first_step  # type: ignore[method-assign]
        self._static_learned = False
        """Whether the first step has measured the memory held between steps (``_first_step``
        runs once even where a loop kept the bound ``tuner.step`` of before its first step)."""
        self.store = parts.store
        self.placement = parts.placement
        self.device = parts.device
        self.tracker = parts.tracker
        self.lr = parts.lr
        """The LR's owner: the optimizers and schedulers that follow the effective batch."""
        self.files = parts.files
        self.control = parts.control
        self.autopilot = parts.autopilot
        """The autopilot (it acts on rank 0 only)."""
        self.tuned = parts.tuned
        self.boundary = parts.boundary
        self.oom = parts.oom

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Tuner:
        """Join the job, resume, open the audit log, then sample and publish; returns self."""
        if self._started:
            return self
        self._started = True
        watch = sys.modules.get("memtui.hooks.auto")
        if watch is not None:  # this Tuner drives the process: the no-code watch stands down
            watch.adopt(self)
        placement = self.placement
        placement.join()  # first: every rank then uses the job's run id for its state dir
        self.control.world_size = placement.world_size
        if self._resume_from:
            self._resume(self._resume_from)
        else:
            self._find_tuned()
        if placement.rank == 0:
            audit = AuditLog(self.files.audit_path, self.run_id)
            self.control.audit = self.tuned.audit = audit
            self.tuned.clear_temps()
        self.info = self._make_info()
        if self._resume_from and placement.rank == 0:
            self._say_unapplied()
        try:
            settings = self.settings
            self.tcp_plan = plan_tcp(settings.tcp, settings.insecure, settings.insecure_control)
        except SecurityError as exc:
            self.report(exc, "tcp")
        self.device.refresh(self.model)
        self.device.note_baseline()
        self._refresh_static()
        if self.optimizer is not None:
            self.lr.watch_optimizer(self.optimizer)
        if self.optimizer is not None and self._auto_step:
            self.watch_optimizer(self.optimizer)
        self.oom.install_excepthook(lambda: self._closed)
        _live_tuners.add(self)
        atexit.register(self._close_at_exit)
        if self.settings.publishes:
            self._start_threads()
        self.coordinate()
        return self

    def coordinate(self) -> bool:
        """Coordinate with the other ranks once ``torch.distributed`` is initialised.

        ``start`` does this when the process group already exists; an adapter whose framework
        starts it later (Lightning, inside ``fit``) calls this on every rank. Every rank takes
        the job's run id and posts its endpoints through the job's store (nothing waits for
        another rank). Returns whether changes are coordinated.
        """
        placement = self.placement
        if placement.coordinated:
            return True
        run_id = self.run_id
        placement.join()
        if placement.run_id != run_id:
            self._adopt_run_id()
        self.control.world_size = placement.world_size
        if self.info is not None:
            self.info.rank, self.info.world_size = placement.rank, placement.world_size
        placement.exchange(self._my_endpoints())
        if placement.error:
            self.control.disable(placement.error)
        self._register()
        if placement.coordinated:
            log.info(
                "memtui: rank %d of %d coordinated in run %s",
                placement.rank,
                placement.world_size,
                placement.run_id,
            )
        return placement.coordinated

    def _start_threads(self) -> None:
        try:
            options = self.settings
            self.sampler = Sampler(
                self.device,
                lambda: self.ledger.step,
                self.report,
                model=lambda: self.model,
                watched=lambda: self.agent is not None and self.agent.watched,
                ranks=self._ranks_here,
                memory_limit=options.memory_limit,
                stand_in_heap=options.stand_in_heap,
                reset_peaks=options.reset_peaks,
                device_period_s=options.device_period_s,
                host_period_s=options.host_period_s,
                idle_device_period_s=options.idle_device_period_s,
            )
            self.sampler.start()
            parts = HookParts(
                ledger=self.ledger,
                store=self.store,
                control=self.control,
                placement=self.placement,
                errors=self.errors,
                tuned=self.tuned,
                info=self.current_info,
                sampler=lambda: self.sampler,
                tcp_plan=self.tcp_plan,
                record_path=options.record,
                autopilot=self.autopilot,
                summaries=RunSummaries(self.files, self.placement, self.control, self.report),
            )
            self.summaries = parts.summaries
            self.agent = Agent(
                parts,
                registry.run_dir(self.run_id),
                flush_period_s=options.flush_period_s,
                idle_flush_s=options.idle_flush_s,
            )
            self.agent.start()
            self.agent.ready.wait(5.0)
            if self.agent.failed is not None:
                log.warning("memtui: not publishing (%s); training goes on", self.agent.failed)
        except Exception as exc:
            self.report(exc, "start")

    def _register(self) -> None:
        """Write (or refresh) the run's registry record with every rank's endpoints (rank 0)."""
        agent = self.agent
        if agent is not None and agent.failed is None:
            try:
                agent.register()
            except Exception as exc:
                self.report(exc, "register")

    def close(self) -> None:
        """Send the last telemetry, stop the threads and remove the run from the registry; it
        says nothing unless closing failed (never that training goes on: it is ending)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        try:
            self._say_pending_at_exit()
        except Exception as exc:
            self.report(exc, "the changes pending at exit")
        if self.summaries is not None and not self.summaries.ended:
            try:  # the agent's last summary says how the run ended
                self.summaries.ended = how_it_ended(self._exit_exc)
            except Exception as exc:
                self.report(exc, "the run's summary")
        try:
            if self._hook_handle is not None:
                self._hook_handle.remove()
            if self.sampler is not None:
                self.sampler.stop()
            if self.agent is not None:
                self.agent.stop()
                if self.rank != 0 and self.agent.run_dir.path.name != self.run_id:
                    self.agent.run_dir.remove()  # bound before this rank joined rank 0's run
        except Exception as exc:
            log.warning(
                "memtui: could not close cleanly (%s: %s)", type(exc).__name__, one_line(exc)
            )
        finally:
            atexit.unregister(self._close_at_exit)

    def _say_pending_at_exit(self) -> None:
        """The run ends with changes queued and never applied: recorded (the audit log, the last
        batch a viewer gets) and said."""
        left = self.control.close()
        if not left:
            return
        words = ", ".join(f"#{c.id} {format_changes(c.changes)}" for c in left)
        log.warning(
            "memtui: run %s ended at step %d with changes queued and never applied (%s): no "
            "boundary came after they were queued (they apply at %s)",
            self.run_id,
            self.ledger.step,
            words,
            self.control.boundary or "the next checkpoint",
        )

    def _close_at_exit(self) -> None:
        """``close`` as the interpreter exits: an interrupt while it waits for the last telemetry
        to leave (a second Ctrl-C) ends the wait without a second traceback: the program is
        ending, and the threads are daemons."""
        with contextlib.suppress(KeyboardInterrupt):
            self.close()

    def forget_threads(self) -> None:
        """In a forked child (a loader worker): never publish or sample, never close them."""
        self._closed = True
        self.sampler = None
        self.agent = None
        self.summaries = None

    def __enter__(self) -> Tuner:
        return self

    def __exit__(self, *exc: object) -> None:
        error = exc[1] if len(exc) > 1 else None
        self._exit_exc = error if isinstance(error, BaseException) else None
        self.close()

    # ------------------------------------------------------------------ where it runs

    @property
    def rank(self) -> int:
        """This process's rank in the job."""
        return self.placement.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.placement.local_rank

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.placement.world_size

    @property
    def run_id(self) -> str:
        """The run this process publishes under (rank 0's in a job of several)."""
        return self.placement.run_id

    def _ranks_here(self) -> list[int]:
        """The pids of the job's ranks on this host, as they registered (the sampler counts none
        of them as a loader worker of this rank, when a launcher made one a child of another)."""
        host = self.info.host if self.info is not None else socket.gethostname()
        return [r.pid for r in self.placement.ranks if r.host == host and r.pid > 0]

    @property
    def coordinator(self) -> Any:
        """The link to the other ranks (None: alone, or changes are off)."""
        return self.placement.coordinator

    @property
    def coordination_error(self) -> str:
        """Why this rank could not coordinate ("" when it did, or runs alone)."""
        return self.placement.error

    @property
    def ranks(self) -> list[RankInfo]:
        """Where every rank of the run publishes."""
        return self.placement.ranks

    @property
    def state_dir(self) -> Path:
        """Where the audit log and the tuned config are written."""
        return self.files.state_dir

    def tuned_paths(self) -> list[Path]:
        """Every file the tuned config is written to."""
        return self.files.tuned_paths()

    @property
    def tuned_unsaved_step(self) -> int | None:
        """The step since which the tuned config could not be written (None: it is on disk)."""
        return self.tuned.unsaved_step

    def _adopt_run_id(self) -> None:
        """Join rank 0's run (this rank's sockets stay where they were bound)."""
        info = self.info
        if info is None:
            return
        info.run = self.run_id
        info.state_dir = str(self.state_dir)
        info.audit_path = str(self.files.audit_path)
        info.tuned_path = str(self.tuned_paths()[-1])

    def _my_endpoints(self) -> RankInfo:
        """Where this rank publishes and answers."""
        agent = self.agent
        run_dir = (
            agent.run_dir
            if agent is not None
            else registry.RunDir(registry.runtime_dir(create=False) / self.run_id)
        )
        endpoint = self.placement.endpoint
        info = self.info
        return RankInfo(
            rank=self.rank,
            pub=endpoint(lambda: run_dir.pub_endpoint(self.rank)),
            control=endpoint(lambda: run_dir.control_endpoint(self.rank)),
            local_rank=self.local_rank,
            host=info.host if info is not None else socket.gethostname(),
            pid=os.getpid(),
            pub_tcp=agent.tcp_pub if agent is not None else "",
            control_tcp=agent.tcp_control if agent is not None else "",
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
            tuned_path=str(self.tuned_paths()[-1]),
            audit_path=str(self.files.audit_path),
            cpus=usable_cpus(),
        )

    def current_info(self) -> RunInfo:
        """RunInfo with the device as the sampler sees it now."""
        info = self.info or self._make_info()
        self.info = info
        agent = self.agent
        if agent is not None:
            info.security = agent.security
        probe = self.sampler.probe if self.sampler is not None else None
        if probe is None:
            return info
        if isinstance(probe, CudaDeviceProbe):
            info.device, info.capacity_bytes = f"cuda:{probe.index} {probe.name}", probe.capacity
            info.alloc_conf = allocator_settings()
        else:
            info.device, info.capacity_bytes = "cpu", probe.host.limit_bytes
        info.device_kind = probe.kind
        return info

    def _lr_withdrawn(self, why: str, undo: float) -> None:
        """The script set the optimizer's LR itself: say so everywhere the factor was said."""
        step = self.ledger.step
        event = LrWithdrawn(time=time.time(), step=step, factor=1.0 / undo, note=why)
        log.warning(
            "memtui: at step %d the LR factor x%s no longer holds: %s",
            step,
            round(1 / undo, 4),
            why,
        )
        self.control.touch()
        self.control.audit_event("lr_withdrawn", event)
        self.tracker.emit(event, step)
        if self.rank == 0:
            self.tuned.write(self.store.knobs, step)

    # ------------------------------------------------------------------ resume

    def _resume(self, resume: bool | str | os.PathLike[str]) -> None:
        """Load the tuned config (the state dir's, or the file given) into the user's config."""
        path = self.tuned_paths()[0] if resume is True else Path(resume)  # type: ignore[arg-type]
        if not path.exists():
            log.info("memtui: no tuned config at %s; starting from the script's config", path)
            return
        try:
            found = from_yaml(path)
            self.resumed = self.store.resume(found.config, path)
            factor = self.lr.resume(found.lr)
            if factor != 1.0:
                log.warning(
                    "memtui: kept the LR factor x%s from %s (the tuned batch's learning rate)",
                    round(factor, 4),
                    path,
                )
            if found.ceiling is not None:
                self.control.restore_ceiling(found.ceiling)
                log.warning(
                    "memtui: kept the out-of-memory ceiling from %s: %s",
                    path,
                    printable(found.ceiling.note),  # a file's text: never an escape sequence
                )
            self._found, self._found_resumed = found, True
        except UnsafeFile as exc:  # another account would choose this run's memory
            self.report(UnsafeFile(f"{exc}; the script's config stands"), "resume")
        except ValueError as exc:
            self.report(exc, "resume")

    def _find_tuned(self) -> None:
        """A run not told to resume: keep the state dir's tuned YAML for ``load_state_dict`` to
        weigh against the checkpoint's, and say once (rank 0) that the run does not start from
        it, before any change of this run writes over it."""
        path = self.tuned_paths()[0]
        try:
            if not path.exists():
                return
        except OSError:
            return
        held = ""
        try:
            self._found = from_yaml(path)
            held = f" ({self._found.summary()})"
        except (UnsafeFile, ValueError) as exc:
            held = f" (unusable: {one_line(exc)})"
        if self.rank == 0:
            log.warning(
                "memtui: %s keeps a tuned config%s that this run does not start from: it was not "
                "told to resume (hooks.install(..., resume=True), or tuner.load_state_dict("
                'checkpoint["memtui"]) with a checkpoint that saved tuner.state_dict()); its first '
                "change writes over that file",
                path,
                held,
            )

    def _say_unapplied(self) -> None:
        """Reconcile the audit log with the tuned config an earlier run stopped between, then
        name the changes it queued but never applied, and how to queue them."""
        try:
            events = read_audit(self.files.audit_path)
        except Exception as exc:
            self.report(exc, "reading the audit log")
            return
        try:
            self._reconcile(events)
        except Exception as exc:
            self.report(exc, "reconciling the audit log")
        run, changes = unapplied(events, self.run_id)
        if not changes or self.info is None:
            return
        words = " ".join(f"{k}={format_value(v)}" for k, v in changes.items())
        self.info.requeue = f"memtui set {self.run_id} {words}"
        log.warning(
            "memtui: run %s stopped with changes queued and never applied (%s); to queue them "
            "again: %s",
            printable(run),
            printable(words),
            self.info.requeue,
        )

    def _reconcile(self, events: list[dict[str, Any]]) -> None:
        """Say which of the audit log and the tuned config this run trusts where an earlier run
        stopped between them (or its tuned config was not written), and audit the outcome."""
        found = self._found if self._found_resumed else None
        left = unfinished(events, self.run_id, found)
        if left is None:
            return
        run, words = printable(left.run), printable(left.words)
        if left.saved:
            log.warning(
                "memtui: run %s stopped while applying %s, after its tuned config was written "
                "and before the audit log said so: this run trusts the tuned config, which "
                "holds it",
                run,
                words,
            )
        else:
            start = f"{found.where} ({found.summary()})" if found is not None else None
            requeue = printable(left.requeue(self.run_id))
            if requeue and self.info is not None:
                self.info.requeue = requeue
            log.warning(
                "memtui: run %s %s %s, but its tuned config does not hold it (%s): this run "
                "starts from %s%s",
                run,
                "stopped while applying" if left.interrupted else "applied",
                words,
                "the run stopped before it was written"
                if left.interrupted
                else "it could not be written before the run stopped",
                start or "the script's config",
                f"; to apply it again: {requeue}" if requeue else "",
            )
        self.control.audit_event(
            "reconciled",
            {
                "of_run": left.run,
                "ids": left.ids,
                "step": left.step,
                "saved": left.saved,
                "trusted": "the tuned config" if left.saved else "the tuned config, without it",
            },
        )

    # ------------------------------------------------------------------ knobs and memory

    def knobs(self) -> Knobs:
        """The current knob values."""
        return self.store.knobs

    def tunable(self) -> list[str]:
        """The knobs this run can change."""
        return self.store.tunable()

    def _refresh_static(self, between_steps: bool = False) -> None:
        """Publish parameters, gradients and optimizer state computed from the tensors (and,
        ``between_steps``, at a step's end or a boundary, the gradients held there)."""
        optimizer = self.optimizer if self.optimizer is not None else self._measured()
        static = self.device.static(self.model, optimizer, between_steps)
        if static is not None:
            self.control.set_static(static)

    def measure_optimizer(self, optimizer: Any) -> None:
        """Take the memory parts from ``optimizer``'s parameters, gradients and state where the
        Tuner was given no optimizer (the no-code watch's counted optimizer, at its first step
        and before that step ends): read at the first step's end and at every boundary, never
        on the per-step path. An optimizer found after the first step is read at once (its
        step's end)."""
        if self.optimizer is not None or optimizer is None:
            return
        try:
            self._measured = weakref.ref(optimizer)
        except TypeError:  # an optimizer without weak references is kept as it is
            self._measured = lambda: optimizer
        if self._static_learned:
            try:
                self._refresh_static(between_steps=True)
            except Exception as exc:  # never into training
                self.report(exc, "the optimizer's memory")

    def _has_loader(self) -> bool:
        """Whether a loader follows the loader knobs: memtui's loaders rebuild themselves, the HF
        adapter rebuilds the Trainer's; a loop with neither (a batch function) reads the config
        memtui writes into."""
        return bool(self.loaders) or self.adapter is not None or self.follows_loader

    def _zero_grad(self) -> None:
        try:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            elif self.model is not None:
                self.model.zero_grad(set_to_none=True)
        except Exception as exc:
            self.report(exc, "zero_grad")

    # ------------------------------------------------------------------ the public API

    def loader(self, factory: Callable[..., Any]) -> TunedLoader:
        """Wrap a DataLoader factory: batches are timed and the loader follows batch/worker changes.

        ``factory`` takes any of ``batch_size``, ``num_workers``, ``pin_memory`` and
        ``prefetch_factor`` as keyword arguments and returns a ``torch.utils.data.DataLoader``;
        one the config holds no value for gets torch's own default, said here in one line.
        """
        self._loaders_made += 1
        wrapped = TunedLoader(
            self.ledger,
            self.store,
            factory,
            on_rebuilt=self._workers_changed,
            seed=functools.partial(self._loader_seed, self._loaders_made),
            on_failed=self._loader_failed,
            report=self.report,
            **self.loader_options,
        )
        self.store.adopt({k: wrapped.knobs.get(k) for k in LOADER_KNOBS})
        # a loader built again at every epoch (a framework's reload) leaves no dead references
        self._loaders = [ref for ref in self._loaders if ref() is not None]
        self._loaders.append(weakref.ref(wrapped))
        if self._positions:  # restored before this loader was made
            position, held = self._positions.pop(0)
            wrapped.load_state_dict(position, held=held)
        try:
            self._say_loader_resumed(factory)
            self._say_defaulted(wrapped.defaulted)
        except Exception as exc:  # never into training
            self.report(exc, "naming the loader's resumed knobs")
        return wrapped

    def _say_defaulted(self, defaulted: Mapping[str, Any]) -> None:
        """Say, in one line, which factory parameters took torch's defaults for want of a value in
        the config, and how to give them the config's own."""
        if not defaulted:
            return
        binding = self.store.binding
        found = {k: names[0] for k in defaulted if (names := binding.names_like(k))}
        mapping = found or {next(iter(defaulted)): "<its name in your config>"}
        log.warning(
            "memtui: the loader factory takes %s, which your config holds under no name memtui "
            "knows: it gets torch's DataLoader defaults (%s); to take your config's own, name "
            "them: hooks.install(..., knobs=%s), or give the factory's parameters defaults",
            " and ".join(defaulted),
            ", ".join(f"{k}={v}" for k, v in defaulted.items()),
            "{" + ", ".join(f'"{k}": "{v}"' for k, v in mapping.items()) + "}",
        )

    def _loader_seed(self, ordinal: int, mine: int, nth: int) -> int:
        """The base seed of the ``ordinal``-th loader's per-epoch order under several ranks (its
        ``nth`` agreement): rank 0's, agreed through the job's store; 0 (said once) where the
        ranks cannot agree."""
        coordinator = self.placement.coordinator
        why = self.placement.error or "torch.distributed is not initialised"
        if coordinator is not None:
            try:
                value, why = coordinator.agree(f"loader{ordinal}/seed{nth}", str(mine), "0")
            except Exception as exc:
                self.report(exc, "agreeing the loader's seed")
                value, why = "0", f"{type(exc).__name__}: {one_line(exc)}"
            if not why:
                return int(value)
        if not self._said_seed:
            self._said_seed = True
            log.warning(
                "memtui: the ranks could not agree on the training loader's shuffling seed (%s): "
                "every rank shuffles each epoch with seed 0 + the epoch, as DistributedSampler "
                "does by default",
                why,
            )
        return 0

    def _loader_failed(self, exc: BaseException, kept: Mapping[str, Any]) -> None:
        """The loader factory raised at a rebuild: the loader keeps ``kept``, and the change that
        asked for other values is rolled back (said, audited, the tuned config rewritten)."""
        self.report(exc, "rebuilding the loader")
        store, step = self.store, self.ledger.step
        differs = {
            k for k in LOADER_KNOBS if store.value(k) is not None and store.value(k) != kept.get(k)
        }
        if not differs:
            return
        kept_words = ", ".join(f"{k}={format_value(kept.get(k))}" for k in sorted(differs))
        why = f"the loader factory raised {type(exc).__name__} ({one_line(exc)[:200]})"
        for applied in reversed(self.control.applied_changes()):
            if applied.rollback or not differs & set(applied.changes):
                continue
            rollback = self.boundary.revert(applied, step, f"rolled back: {why}")
            if isinstance(rollback, str):
                break
            self.tracker.emit(rollback, step)
            if self.rank == 0:
                self.tuned.write(store.knobs, step)
            log.warning(
                "memtui: rolled back change #%s at step %d: %s; the loader keeps %s",
                ",".join(map(str, applied.ids)),
                step,
                why,
                kept_words,
            )
            return
        log.warning("memtui: %s; the loader keeps %s", why, kept_words)

    def _say_loader_resumed(self, factory: Callable[..., Any]) -> None:
        """Name the factory's own values of the loader knobs a tuned config replaced (unknown
        when the config was read, before the factory was given)."""
        unnamed = [k for k, d in self.resumed.items() if d.old is None and k in LOADER_KNOBS]
        if not unnamed:
            return
        try:
            parameters = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            return
        own = {
            knob: parameters[knob].default
            for knob in unnamed
            if knob in parameters and parameters[knob].default is not inspect.Parameter.empty
        }
        words = [
            f"{knob} {format_value(own[knob])} -> {format_value(self.resumed[knob].new)}"
            for knob in unnamed
            if knob in own and own[knob] != self.resumed[knob].new
        ]
        if words:
            log.warning(
                "memtui: the training loader is built with the tuned config: %s (its own "
                "values -> the tuned ones)",
                ", ".join(words),
            )

    @property
    def loaders(self) -> list[TunedLoader]:
        """The loaders made by ``loader()`` that are still alive."""
        return [loader for ref in self._loaders if (loader := ref()) is not None]

    def timed_batches(
        self, fetch: Callable[Args, BatchT], samples: Callable[[BatchT], int] | None = None
    ) -> Callable[Args, BatchT]:
        """Wrap a batch function (a loop without a DataLoader, like nanoGPT's ``get_batch``):
        each call is timed as one micro-batch's data wait and its samples counted (the first
        dimension of the first tensor it returns, or ``samples(batch)``)."""
        return timed_batches(fetch, self.ledger, self.report, samples)

    def _workers_changed(self) -> None:
        if self.sampler is not None:
            self.sampler.workers_changed()

    def step(self, samples: int | None = None) -> None:
        """Mark the end of one optimizer step (``samples``: override the count the loader made).

        Each Tuner replaces this with its ledger's ``close_step`` (the same, one call shorter)
        once its first step has run (``_first_step``).
        """
        self.ledger.close_step(samples)

    def _first_step(self, samples: int | None = None) -> None:
        """The first step's end in this process: the ledger's, then, once, the gradients held
        between steps (none where the loop frees them before its step ends): the memory model
        learns it before the first boundary, whose change it predicts."""
        self.step = self.ledger.close_step  # type: ignore[method-assign]
        self.ledger.close_step(samples)
        if self._static_learned:  # a caller kept ``tuner.step`` from before the first step
            return
        self._static_learned = True
        self.ledger.training_thread = threading.get_ident()
        try:
            self._refresh_static(between_steps=True)
        except Exception as exc:  # never into training
            self.report(exc, "first step")

    def watch_optimizer(self, optimizer: Any) -> None:
        """Call ``step()`` automatically after every ``optimizer.step()`` (a post-step hook); its
        LR follows a change of the effective batch; its tensors are the memory parts where the
        Tuner was given no optimizer."""
        self.lr.watch_optimizer(optimizer)
        self.measure_optimizer(optimizer)
        try:
            self._hook_handle = optimizer.register_step_post_hook(lambda *_args: self.step())
        except Exception as exc:
            self.report(exc, "watch_optimizer")

    def watch_scheduler(self, scheduler: Any) -> None:
        """Make an LR scheduler's ``base_lrs`` (and its optimizer's LR) follow a change of the
        effective batch."""
        try:
            self.lr.watch_scheduler(scheduler)
        except Exception as exc:
            self.report(exc, "watch_scheduler")

    def checkpoint(self, *, apply: bool = True) -> Applied | None:
        """The checkpoint boundary: call it on every rank right after the checkpoint is saved.

        Applies the pending changes (the same set, at this step, on every rank) and returns what
        changed, or None when nothing did. ``apply=False`` records the checkpoint alone (a save
        where the run's loader cannot take its knobs: the changes wait for their own boundary).
        """
        ledger = self.ledger
        save_s = ledger.since_last()
        applied: Applied | None = None
        try:
            self.device.refresh(self.model)
            if apply:
                applied = self._apply_pending()
            taken = self.control.taken_time if self.rank == 0 and apply else time.time()
            ledger.close_checkpoint(taken, save_s)
        except Exception as exc:
            self.report(exc, "checkpoint")
            ledger.restart_clock()
        return applied

    def epoch_boundary(self) -> Applied | None:
        """A boundary where no checkpoint is saved (an epoch start, for a loop watched with no
        code): the pending changes are applied as at a checkpoint, the same set at this step on
        every rank, and no checkpoint is recorded; returns what changed, or None."""
        try:
            return self._apply_pending()
        except Exception as exc:
            self.report(exc, "epoch boundary")
            return None

    def _apply_pending(self) -> Applied | None:
        """A boundary's work at this step: take, agree on and apply the pending changes."""
        ledger = self.ledger
        step = ledger.step
        self._refresh_static(between_steps=step > 0)
        applied = self.boundary.run(step, ledger.open.micro)
        if applied is not None:  # the peak so far was the old config's
            self.device.reset_peaks()
            self.tracker.emit(applied, step)
        if self.rank == 0 and applied is None:  # an applied change has just saved it all
            self.tuned.save_again(step)
        return applied

    def loader_changed(self) -> None:
        """A data loader memtui does not own took new worker knobs: find its workers again."""
        self._workers_changed()

    def on_event(self, callback: EventCallback) -> EventCallback:
        """Call ``callback(event, step)`` on the training thread for every applied change,
        rollback (``AppliedChange``) and out-of-memory post-mortem (``OomEvent``); returns it."""
        return self.tracker.add(callback)

    def guard(self) -> Guard:
        """A context manager for the allocating part of a step: OOM post-mortem and rollback."""
        return self.oom.guard()

    @property
    def step_count(self) -> int:
        """Optimizer steps counted so far (resumed runs continue from ``load_state_dict``)."""
        return self.ledger.step

    def state_dict(self) -> dict[str, Any]:
        """memtui's part of your checkpoint: save it there (``checkpoint["memtui"] =
        tuner.state_dict()``) and give it back at a restart (``load_state_dict``).

        A dict of plain values (``torch.load(..., weights_only=True)`` loads it): ``step`` (the
        optimizer steps so far), ``loaders`` (each loader's epoch and samples consumed in it),
        ``run`` (this run's id), ``config`` (the knob values memtui set, those that are not the
        script's own, and those of the knobs only a loader holds), ``lr`` (the LR factor memtui
        applied, its anchor, rule and each optimizer's scaled start LRs; empty while the LR is
        the script's own) and, once something ran out of memory, ``ceiling``: what the tuned
        YAML keeps, kept with the weights.
        """
        state: dict[str, Any] = {
            "step": self.ledger.step,
            "loaders": [loader.state_dict() for loader in self.loaders],
        }
        try:
            tuned: dict[str, Any] = {
                "run": self.run_id,
                "config": self.store.tuned_values(),
                LR_SECTION: self.lr.persisted().get(LR_SECTION, {}),
                **self.control.persisted(),
            }
            state.update(tuned)
        except Exception as exc:  # the step and the loaders are still saved
            self.report(exc, "state_dict")
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, held: bool = False) -> None:
        """Continue from a saved ``state_dict()``: the step count, the loaders' data position and
        the tuned config (knobs written into your config, which the loaders follow from their
        next iteration; the LR factor, reconciled with the optimizer state: call it after your
        optimizer's and scheduler's ``load_state_dict``).

        A loader made later takes its position when ``loader()`` makes it; ``held``: each
        loader's samples wait for the script's ``skip_first_batches``. Where the tuned YAML is
        there too (``resume=True``, or a YAML in the state dir), the checkpoint's tuned config
        wins: its weights were trained with it. The YAML wins where it is newer knowledge of that
        same point: written at the checkpoint's step after its save (a change applied at that
        boundary), or an out-of-memory error's safe config written after it. One line says which
        was used when they differ. An entry saved before checkpoints kept the tuned config
        restores the step and the loaders only.
        """
        try:
            self.ledger.resume_at(int(state.get("step", 0)))
            loaders, positions = self.loaders, list(state.get("loaders", []))
            for loader, saved in zip(loaders, positions, strict=False):
                loader.load_state_dict(saved, held=held)
            self._positions = [(p, held) for p in positions[len(loaders) :]]
        except Exception as exc:
            self.report(exc, "load_state_dict")
        try:
            self._restore(state)
        except Exception as exc:
            self.report(exc, "restoring the checkpoint's tuned config")

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Start from the tuned config a checkpoint's entry keeps, or from the tuned YAML where
        that is newer knowledge of the same point; say what was used."""
        entry = from_entry(state)
        if entry is None:  # saved before checkpoints kept the tuned config
            return
        found, own = self._found, self.store.own
        why = yaml_wins(found, entry) if found is not None else ""
        if found is None or not differ(found, entry, own):
            why = ""
        # the checkpoint's factor first: its optimizer state carries it; then the YAML's, if it wins
        self.lr.restore(entry.lr)
        chosen = entry
        if found is not None and why:
            self.lr.restore(found.lr)
            chosen = found
        target = dict(found.config) if chosen is found else {**own, **entry.config}
        changed = self.store.resume(target, chosen.where, say=False)
        held = self.store.knobs
        self.resumed = {
            k: KnobDiff(own.get(k), v)
            for k, v in target.items()
            if own.get(k) != v and getattr(held, k) == v
        }
        for ceiling in (entry.ceiling, chosen.ceiling):  # what ran out of memory stays known
            kept = self.control.ceiling
            if ceiling is not None and (kept is None or ceiling.step >= kept.step):
                self.control.restore_ceiling(ceiling)
        self.control.touch()
        self._say_restored(entry, chosen, why, changed)

    def _say_restored(
        self, entry: TunedState, chosen: TunedState, why: str, changed: dict[str, KnobDiff]
    ) -> None:
        """One line: the tuned config the restart starts from, and the other where they differ."""
        found = self._found
        if chosen is not entry:
            log.warning(
                "memtui: resumed the tuned config from %s (%s) rather than the checkpoint's "
                "(%s): %s",
                chosen.where,
                chosen.summary(),
                entry.summary(),
                why,
            )
            return
        other = ""
        if found is not None and differ(found, entry, self.store.own):
            other = (
                f"; not {found.where}'s ({found.summary()}): the checkpoint's weights were "
                "trained with its own"
            )
        if not changed and not other and (self._found_resumed or entry.factor == 1.0):
            return  # nothing the run did not already start from
        words = [format_diffs(changed)] if changed else []
        if entry.factor != 1.0:
            words.append(f"lr x{round(entry.factor, 4)}")
        log.warning(
            "memtui: resumed the tuned config from %s (step %s): %s%s",
            CHECKPOINT,
            entry.step,
            ", ".join(words) or "the script's own",
            other,
        )


def _nothing() -> None:
    return None


def _after_fork_in_child() -> None:
    """A forked child (a loader worker) must never publish or sample: disable every tuner."""
    for tuner in list(_live_tuners):
        tuner.forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
