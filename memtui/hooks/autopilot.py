"""Rank 0's autopilot: on, off or paused, and the loop that queues its trials like an operator.

The agent thread calls ``tick`` once a second, after the effects of applied changes are measured;
the decision is the pure policy's (``memtui.advice.autopilot.decide``), and a change goes through
``Control.queue`` marked as the autopilot's own, so every rule of the queue holds (the prediction
gate, the ceiling, the audit log, rank consistency at the boundary, rollback). Any operator
change or cancel pauses it at once (``operator_acted``, called by ``Control``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import msgspec

from memtui.advice.autopilot import (
    AUTOPILOT,
    BUDGET,
    MEASURING,
    Decision,
    Situation,
    decide,
    history,
    timing_of,
)
from memtui.advice.measure import EFFECT_STEPS, Periods, timed_longer
from memtui.advice.recommend import Inputs, bands
from memtui.core.knobs import format_changes, knobs_with, new_values, parse_value
from memtui.core.stats import summarize_steps
from memtui.hooks.control import Control, PilotSeat, clip
from memtui.wire import (
    AutopilotState,
    AutotuneReply,
    AutotuneRequest,
    HostSample,
    KnobValue,
    RunInfo,
    SetRequest,
    StepRecord,
)


class Autopilot:
    """The autopilot's state (the one copy) and its loop; thread-safe."""

    def __init__(
        self,
        control: Control,
        step: Callable[[], int],
        *,
        on: bool = False,
        budget: int = BUDGET,
        leader: Callable[[], bool] = lambda: True,
        seat: PilotSeat | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._control = control
        self._step = step
        self._leader = leader
        """Whether this process is rank 0 (it may change when the job coordinates late): only
        rank 0's queue takes changes, so only there does the autopilot act."""
        self._state = AutopilotState(budget=budget)
        if on:
            self._state = AutopilotState(mode="on", phase="waiting", budget=budget)
        if seat is not None:  # the seat the queue was made with: it publishes and pauses this
            seat.take(self)

    def state(self) -> AutopilotState:
        """A copy of the state as published."""
        with self._lock:
            return msgspec.structs.replace(self._state)

    def _set(self, **fields: object) -> None:
        """Change the state and tell viewers (the control state's ``seq``)."""
        with self._lock:
            new = msgspec.structs.replace(self._state, **fields)
            if new == self._state:
                return
            self._state = new
        self._control.touch()

    def turn(self, request: AutotuneRequest, rate_limited_before: int = 0) -> AutotuneReply:
        """Turn it on (from the current step, its history fresh) or off; ``rate_limited_before``:
        the toggles refused over their rate since the last one taken, said in its audit line."""
        client = clip(request.client)
        if request.on:
            self._set(
                mode="on", phase="waiting", why="", trying={}, since_step=self._step(), boundaries=0
            )
        else:
            self._set(mode="off", phase="", why=f"turned off by {client or 'a client'}")
            self._control.withdraw(AUTOPILOT)
        audited: dict[str, object] = {"on": request.on, "client": client}
        if rate_limited_before:
            audited["rate_limited_before"] = rate_limited_before
        self._control.audit_event("autotune", audited)
        return AutotuneReply(ok=True, state=self.state())

    def operator_acted(self, what: str) -> None:
        """Pause at once: an operator changed the config or the queue (``what`` says how)."""
        if self.state().mode != "on":
            return
        self._set(mode="paused", phase="", why=f"paused: {what}", trying={})
        self._control.audit_event("autotune", {"paused": what})
        self._control.withdraw(AUTOPILOT)

    def acting(self) -> bool:
        """Whether a tick decides anything now: on, on rank 0 (else its inputs need no making)."""
        with self._lock:
            on = self._state.mode == "on"
        return on and self._leader()

    def tick(self, steps: Sequence[StepRecord], host: HostSample | None, info: RunInfo) -> None:
        """Decide and act once (rank 0, the agent thread): queue a trial or a revert, or say why
        not; nothing while off or paused, or on a rank other than 0."""
        if not self.acting():
            return
        situation = self._situation(steps, host, info)
        done = situation.history
        last = done.last
        self._set(boundaries=done.boundaries, last=last.describe() if last is not None else "")
        decision = decide(situation)
        if decision.action in ("try", "revert"):
            self._queue(decision)
        elif decision.action == "time":
            self._time_longer(steps, decision.steps)
            self._set(phase="timing", why=decision.why, trying=dict(decision.changes))
        elif decision.action == "converged":
            self._set(phase="converged", why=decision.why, trying={})
        elif last is not None and last.outcome == MEASURING:
            self._set(phase="measuring", why=decision.why, trying=new_values(last.changes))
        else:
            self._set(phase="waiting", why=decision.why, trying=self.state().trying)

    def _time_longer(self, steps: Sequence[StepRecord], wanted: int) -> None:
        """Measure the latest change (the trial being timed) again over every step on each side,
        once the steps after it doubled since its effect was measured or reached ``wanted``."""
        applied = self._control.applied_changes()
        change = applied[-1] if applied else None
        if change is None or change.effect is None:
            return
        measured = timed_longer(applied, steps, self._control.current)
        recorded = change.effect.steps_after
        if measured is None or measured.effect is None:
            return
        if measured.effect.steps_after >= min(2 * recorded, wanted):
            self._control.record_effect(measured)

    def _situation(
        self, steps: Sequence[StepRecord], host: HostSample | None, info: RunInfo
    ) -> Situation:
        """The policy's inputs: the steps since the last change settled, and the history."""
        control, state = self._control, self.state()
        applied = control.applied_changes()
        # the steps since the latest change's warm-up ended (its loader's new workers running)
        periods = Periods.of(applied, list(steps), control.current)
        since = periods.settled(applied, len(applied) - 1)
        recent = [r for r in steps if r.step > since][-EFFECT_STEPS:]
        stats = (
            summarize_steps(recent, window=EFFECT_STEPS) if len(recent) >= EFFECT_STEPS else None
        )
        thresholds = control.thresholds
        pressure = (
            host is not None
            and host.ram_total_bytes > 0
            and (
                1 - host.ram_available_bytes / host.ram_total_bytes >= thresholds.host_ram_fraction
            )
        )
        own = control.state()
        inputs = Inputs(
            # the knobs it cannot change count with their values (a stream's own workers)
            config=knobs_with(own.config, own.untunable_values),
            tunable=tuple(own.tunable),
            world_size=own.world_size,
            steps=stats,
            samples_per_step=stats.samples_per_s * stats.step_time_s if stats else None,
            model=own.model,
            host=host,
            host_pressure=pressure,
            device_kind=info.device_kind,
            cpus=info.cpus,
            ceiling=own.ceiling,
            applied=tuple(applied),
            **bands(thresholds),
        )
        refused = [
            {k: v for k, raw in r.requested.items() if (v := _value(k, raw)) is not None}
            for r in own.rejected
            if r.client == AUTOPILOT and r.step >= state.since_step
        ]
        capacity = own.model.capacity_bytes if own.model else 0
        edge = int(capacity * thresholds.memory_edge_fraction) if capacity > 0 else None
        return Situation(
            inputs,
            history(
                applied, refused, since_step=state.since_step, edge_bytes=edge, config=own.config
            ),
            pending=bool(own.pending),
            budget=state.budget,
            timing=timing_of(steps, since),
        )

    def _queue(self, decision: Decision) -> None:
        """Queue the decision's change as the autopilot's own (never forced)."""
        request = SetRequest(changes=dict(decision.changes), client=AUTOPILOT)
        reply = self._control.queue(request, origin=AUTOPILOT)
        words = format_changes(decision.changes)
        if not reply.ok:  # recorded as refused: the policy never tries it again
            self._set(phase="refused", why=f"{words} refused: {reply.reason}", trying={})
            return
        phase = "reverting" if decision.action == "revert" else "trying"
        self._set(phase=phase, why=decision.why, trying=dict(decision.changes))


def _value(knob: str, raw: object) -> KnobValue | None:
    """A refused request's value as a knob value (None: not one)."""
    try:
        return parse_value(knob, raw)
    except ValueError:
        return None
