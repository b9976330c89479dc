"""The Tuner's parts, built in one place: each part is given, when it is made, the parts it uses.

Read top to bottom, ``build_parts`` is the hook's wiring: nothing is connected afterwards. The
parts call back on the Tuner (the facade that owns the loaders, the model and the run's
registry record) only through ``TunerCalls``; the queue and the autopilot, each of which acts
on the other, meet through the ``PilotSeat`` both are given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memtui.hooks.autopilot import Autopilot
from memtui.hooks.boundary import Boundary
from memtui.hooks.control import Control, PilotSeat
from memtui.hooks.device import DeviceTracker
from memtui.hooks.errors import ErrorLog
from memtui.hooks.knobstore import KnobStore
from memtui.hooks.ledger import StepLedger
from memtui.hooks.lr import LearningRate, Lost
from memtui.hooks.oom import OomActions, OomHandler, OomRun
from memtui.hooks.persist import StateFiles, TunedConfig
from memtui.hooks.placement import Placement
from memtui.hooks.settings import HookSettings
from memtui.hooks.tracker import Tracker
from memtui.storage import registry


@dataclass(frozen=True)
class TunerCalls:
    """What the parts call back on the Tuner."""

    lr_withdrawn: Lost
    """The script set the optimizer's LR itself: say that the LR factor no longer holds."""
    ranks_changed: Callable[[], None]
    """Refresh the run's registry record with every rank's endpoints."""
    zero_grad: Callable[[], None]
    """Drop the gradients of a step an out-of-memory error ended."""
    has_loader: Callable[[], bool]
    """Whether a data loader follows the loader knobs (what an applied change's note says)."""


@dataclass(frozen=True)
class TunerParts:
    """The parts of one Tuner (``memtui.hooks.tuner`` says what each owns)."""

    errors: ErrorLog
    ledger: StepLedger
    store: KnobStore
    placement: Placement
    device: DeviceTracker
    tracker: Tracker
    lr: LearningRate
    files: StateFiles
    control: Control
    autopilot: Autopilot
    tuned: TunedConfig
    boundary: Boundary
    oom: OomHandler


def build_parts(
    settings: HookSettings,
    calls: TunerCalls,
    *,
    config: Any,
    knobs: Mapping[str, str] | None,
    name: str | None,
    where: tuple[int, int, int] | None,
    state_dir: str | os.PathLike[str] | None,
    tuned_path: str | os.PathLike[str] | None,
    lr_scale: str,
    lr_fields: Sequence[str],
) -> TunerParts:
    """Every part of a Tuner, each made with the parts it uses; touches nothing outside the
    process (the run id is made here, the job is joined at ``Tuner.start``)."""
    # the hot path's owner first: every later part reports through the error log
    errors = ErrorLog()
    report = errors.report
    ledger = StepLedger(report)
    store = KnobStore(config, knobs, report)
    placement = Placement(
        registry.new_run_id(name),
        where,
        report,
        timeout_s=settings.boundary_timeout_s,
        warn_every_s=settings.boundary_warn_s,
    )
    device = DeviceTracker(report)
    tracker = Tracker(report)
    lr = LearningRate(
        lr_scale, fields=lr_fields, config=config, report=report, on_lost=calls.lr_withdrawn
    )
    files = StateFiles(placement.current_run_id, state_dir, tuned_path)
    seat = PilotSeat()
    control = Control(
        store.current,
        world_size=placement.world_size,
        step=ledger.steps_closed,
        report=report,
        pinning=device.has_accelerator,
        lr=lr,
        why_not=store.untunable_reasons,
        seat=seat,
        read_values=store.untunable_values,
        version=lambda: store.version,
    )
    # it acts on rank 0 only: the queue is rank 0's, and only rank 0's control server answers
    # ``memtui autotune``
    autopilot = Autopilot(
        control,
        ledger.steps_closed,
        on=settings.autotune,
        budget=settings.autotune_budget,
        leader=placement.leads,
        seat=seat,
    )
    tuned = TunedConfig(files, report, sections=(control, lr))
    boundary = Boundary(
        store,
        control,
        placement,
        tuned,
        report,
        on_ranks_changed=calls.ranks_changed,
        lr=lr,
        has_loader=calls.has_loader,
    )
    oom = OomHandler(
        OomRun(ledger, store, control, placement),
        OomActions(
            boundary,
            tuned,
            zero_grad=calls.zero_grad,
            reset_peaks=device.reset_peaks,
            notify=tracker.emit,
        ),
        rollback_steps=settings.rollback_steps,
        report=report,
    )
    return TunerParts(
        errors=errors,
        ledger=ledger,
        store=store,
        placement=placement,
        device=device,
        tracker=tracker,
        lr=lr,
        files=files,
        control=control,
        autopilot=autopilot,
        tuned=tuned,
        boundary=boundary,
        oom=oom,
    )
