"""The autopilot's policy: from a run's measurements, the next trial, a revert, or converged (pure).

A coordinate ascent over a table of knobs (``AXES``), one change per checkpoint boundary. Each
axis is an integer search (doubling, then bisecting once a value failed) or a switch, with its
own conditions (the loader's knobs while a measurable share of the step waits for data, a bigger
micro-batch only while the run is not input-bound or its workers are at the CPU cap, pinning only
with an accelerator) and its own upper bound (the workers the
CPUs and host RAM allow, the largest micro-batch predicted safe, under what ran out of memory).
The history is the run's applied changes marked as the autopilot's own: nothing else is kept, so
the same measurements always give the same decision. A trial is kept only when the run got
faster beyond the noise (the lower end of the measured effect's 95% interval above zero), or,
for a loader knob, when the data wait fell well beyond its own noise and the speed did not fall
measurably (on a busy machine the speed's interval can be wider than a worker's whole gain,
while the wait it removes still shows). A trial the run measured slower is reverted and never
tried again. One whose speed change stayed inside the noise with a gain for its point estimate is
timed longer first: once a trial measured inside the noise, every config is timed over enough
steps for a 5% gain to show beyond the spread of its steps (``RESOLVE``, at most ``LONG_STEPS`` a
side), the one a trial starts from included. Still inside the noise, it is reverted, and tried
again once a later change is measured with an interval under half as wide (the noise fell); two
such moves of different knobs that each measured a gain are tried together. A value that ran out
of memory is never tried again, one the prediction gate refused only while the gate, with the
memory model as it is now, still would.

An operator's change is the autopilot's starting point, not one of its trials: while the run still
has the values an operator set, the autopilot never moves a knob back to the value the operator
moved it from (it may move on from the operator's value), except to leave the memory edge band,
and then its reason names the operator's change it undoes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from memtui.advice.effect import interval_width, lowest_gain, measurable, speed_words, speedup
from memtui.advice.measure import EFFECT_STEPS, LONG_STEPS, per_worker_bytes
from memtui.advice.predict import max_batch, predict_peak
from memtui.advice.prediction import Prediction
from memtui.advice.recommend import Inputs, speed_noise, thresholds_of, workers_allowed
from memtui.advice.speed import SpeedEstimate, predict_speed
from memtui.core.knobs import (
    format_changes,
    format_value,
    grew,
    knobs_with,
    merge,
    new_values,
)
from memtui.wire import (
    AppliedChange,
    AutopilotState,
    Effect,
    KnobDiff,
    Knobs,
    KnobValue,
    StepRecord,
)

AUTOPILOT = "autopilot"
"""The origin of the autopilot's own changes (and its client name in the change log)."""
BUDGET = 8
"""Boundaries the autopilot may take by default (its trials and their reverts)."""

KEPT, WORSE, REVERTED, OOM, REFUSED, MEASURING, OPERATOR, UNCLEAR, UNCLEAR_REVERTED = (
    "kept",
    "worse",
    "reverted",
    "out of memory",
    "refused",
    "measuring",
    "left by an operator",
    "no measurable change",
    "reverted inside the noise",
)
CANNOT_ACT = "cannot act on this run"
"""The outcome of a change none of whose knobs can act on the run (pinning without an
accelerator): never measured, so neither kept for a speed-up nor reverted as slower."""
FAILED = frozenset({WORSE, REVERTED, OOM, REFUSED, UNCLEAR_REVERTED, CANNOT_ACT})
"""Outcomes after which a value is not tried again (a refused one: while the gate would refuse it;
one reverted inside the noise: until the noise fell)."""
LOADER_AXES = frozenset({"num_workers", "pin_memory", "prefetch_factor"})
"""The knobs whose trial the data wait's fall can keep (their purpose is to remove that wait)."""
WAIT_DROP = 0.3
"""A loader trial is kept on its data wait when the wait per step fell by at least this share
(and beyond its own interval): the benchmark's CNN under load cut its wait 13% -> 5% with one
worker while its speed change, -3% +-13%, was inside the noise."""
RETRYABLE = "to try again: the noise fell"
TOGETHER = "together"
"""The axis of two knobs' moves tried at once."""
INSIDE_NOISE = frozenset({UNCLEAR, UNCLEAR_REVERTED, RETRYABLE})
"""Outcomes of trials whose speed change stayed inside the noise."""
RETRY_NOISE = 0.5
"""A trial reverted inside the noise is tried again once a later change was measured with an
interval at most this share of its own."""
WAITS_FRACTION = 0.05
"""The share of the step waiting for data from which the loader's knobs are tried (a trial is
measured and reverted if no faster; under the STARVED threshold a worker still hid a wait of
20% on the benchmark's transformer)."""
RESOLVE = 0.05
"""Once a trial measured inside the noise, each config is timed over enough steps for a gain of
this share to show beyond the spread of its steps (at most ``LONG_STEPS`` a side): beside two CPU
hogs the benchmark's CNN varied 23% step to step, and its configs past one worker were within 6%
of each other, which 20 steps a side (+-12% to +-18%) could not tell apart."""


@dataclass
class Trial:
    """One change the autopilot made and what became of it."""

    axis: str
    changes: dict[str, KnobDiff]
    step: int
    outcome: str
    safety: bool = False
    """A move out of the memory danger band: kept unless it ran out of memory."""
    effect: Effect | None = None
    note: str = ""
    """What the change could not do on the run, as the hook said it (its ``effect_note``)."""

    def describe(self) -> str:
        """``kept num_workers=2: +45% +-6% samples/s``: the trial and its outcome in words."""
        words = f"{self.outcome} {format_diff_values(self.changes)}"
        if self.outcome == OOM:
            return f"{format_diff_values(self.changes)} ran out of memory: rolled back"
        if self.outcome == REFUSED:
            return f"{format_diff_values(self.changes)} refused by the queue"
        if self.outcome == CANNOT_ACT:
            return f"{format_diff_values(self.changes)}: {self.note or CANNOT_ACT}"
        if self.effect is None:
            return words
        words += f": {speed_words(self.effect)}"
        if self.outcome == KEPT and not self.safety and not kept_for_speed(self.effect):
            words += f", {wait_words(self.effect)}"
        return words


@dataclass(frozen=True)
class History:
    """What the autopilot has done since it was turned on, as the run recorded it."""

    trials: tuple[Trial, ...] = ()
    boundaries: int = 0
    """Boundaries its changes took (trials and reverts)."""
    operator: tuple[AppliedChange, ...] = ()
    """The operators' changes whose values the run still has, one per knob (the latest)."""

    def left_by_operator(self, knob: str) -> AppliedChange | None:
        """The operator's change that moved ``knob`` to the value the run has now (None: none)."""
        return next((c for c in self.operator if knob in c.changes), None)

    def tried(self, knob: str) -> dict[KnobValue, str]:
        """Each value tried for ``knob``, with the outcome of its last trial; a value a kept
        trial left counts as worse (it lost to the new one)."""
        values: dict[KnobValue, str] = {}
        for trial in self.trials:
            diff = trial.changes.get(knob)
            if diff is not None and trial.outcome == RETRYABLE:
                values.pop(diff.new, None)
            elif diff is not None:
                values[diff.new] = trial.outcome
                if trial.outcome == KEPT and diff.old is not None:
                    values.setdefault(diff.old, WORSE)
        return values

    @property
    def last(self) -> Trial | None:
        """The latest trial (None: none yet)."""
        return self.trials[-1] if self.trials else None


def kept(effect_applied: AppliedChange) -> bool:
    """The change made the run faster beyond the noise: the lower end of the 95% interval of
    its measured change of samples/s is above zero."""
    effect = effect_applied.effect
    return effect is not None and kept_for_speed(effect)


def kept_for_speed(effect: Effect) -> bool:
    """The run got faster beyond the noise."""
    return speedup(effect) > 0 and measurable(effect)


def waits_less(effect: Effect) -> bool:
    """The data wait per step fell by ``WAIT_DROP`` of itself or more, beyond its interval."""
    before, after = effect.data_wait_s_before, effect.data_wait_s_after
    fell = before - after
    margin = effect.data_wait_margin_s
    return before > 0 and fell >= WAIT_DROP * before and (margin is None or fell > margin)


def wait_words(effect: Effect) -> str:
    """``the data wait fell 13 ms -> 5 ms a step``."""
    return (
        f"the data wait fell {effect.data_wait_s_before * 1000:.0f} ms -> "
        f"{effect.data_wait_s_after * 1000:.0f} ms a step"
    )


def outcome_of(change: AppliedChange, axis: str) -> str:
    """A measured trial's outcome: kept (faster, or a loader knob that cut the data wait and
    was not measurably slower), worse (measurably slower), no measurable change, or, for a
    change the hook never measures because it cannot act on the run, ``CANNOT_ACT``."""
    effect = change.effect
    if effect is None:
        return CANNOT_ACT if change.effect_note else MEASURING
    if kept_for_speed(effect):
        return KEPT
    if measurable(effect):
        return WORSE  # slower beyond the noise
    if axis in LOADER_AXES and waits_less(effect):
        return KEPT
    return UNCLEAR


EDGE_SLACK = 0.05
"""A smaller micro-batch was a move out of the edge band when the peak it left was within this
share of the band's bytes: the move is decided on the predicted peak, this checks the measured."""


def shrinks_batch(change: AppliedChange) -> bool:
    """A smaller micro-batch."""
    diff = change.changes.get("batch_size")
    return diff is not None and isinstance(diff.old, int) and int(diff.new) < diff.old


def leaves_edge(change: AppliedChange, edge_bytes: int | None) -> bool:
    """A smaller micro-batch that left a peak in the edge band (``edge_bytes`` and up, less
    ``EDGE_SLACK``): a safety move, kept unless it runs out of memory; a smaller one that left a
    peak well under it was a speed trial (its half), kept only if faster. Without the band's bytes
    or the peak measured before it, any smaller one counts as a safety move."""
    if not shrinks_batch(change):
        return False
    before = change.effect.peak_bytes_before if change.effect is not None else None
    return edge_bytes is None or before is None or before >= (1 - EDGE_SLACK) * edge_bytes


def undoes(change: AppliedChange, trial: Trial) -> bool:
    """``change`` sets every knob of ``trial`` back to the value it had before."""
    return bool(change.changes) and all(
        (d := change.changes.get(k)) is not None and d.new == diff.old
        for k, diff in trial.changes.items()
    )


def history(
    applied: Sequence[AppliedChange],
    refused: Sequence[Mapping[str, KnobValue]] = (),
    *,
    since_step: int = 0,
    edge_bytes: int | None = None,
    config: Knobs | None = None,
) -> History:
    """The autopilot's trials from the run's applied changes (its own, at ``since_step`` or
    later, and the out-of-memory rollbacks after them) and the requests the queue refused it;
    ``edge_bytes``: the edge band's bytes, to tell its safety moves from its speed trials;
    ``config``: the run's config now, to find the operators' changes that still stand."""
    trials: list[Trial] = []
    boundaries = 0
    for change in applied:  # a revert undoes the trial before it; a rollback one that ran out
        if change.step < since_step:
            continue
        last = trials[-1] if trials else None
        if change.rollback:
            if last is not None and last.outcome != REVERTED and undoes(change, last):
                last.outcome = OOM
            continue
        if change.origin != AUTOPILOT:
            continue
        boundaries += 1
        undone = last is not None and last.outcome in (WORSE, MEASURING, KEPT, UNCLEAR)
        if undone and last is not None and undoes(change, last):
            last.outcome = UNCLEAR_REVERTED if last.outcome == UNCLEAR else REVERTED
            continue
        is_safety = leaves_edge(change, edge_bytes)
        changes = dict(change.changes)
        axis = axis_of(changes)
        outcome = outcome_of(change, axis)
        if is_safety and outcome != MEASURING:
            outcome = KEPT
        trials.append(
            Trial(axis, changes, change.step, outcome, is_safety, change.effect, change.effect_note)
        )
    _retry_when_the_noise_fell(trials, applied)
    for request in refused:
        changes = {k: KnobDiff(None, v) for k, v in request.items()}
        trials.append(Trial(axis_of(changes), changes, -1, REFUSED))
    standing = operator_changes(applied, config) if config is not None else ()
    return History(tuple(trials), boundaries, standing)


def _retry_when_the_noise_fell(trials: list[Trial], applied: Sequence[AppliedChange]) -> None:
    """Forget the trials reverted inside the noise whose noise has fallen: a change measured
    after them with an interval at most ``RETRY_NOISE`` as wide as theirs (they may be tried
    again); the widths are those of the intervals the effects state, the run's drift counted."""
    for index, trial in enumerate(trials):
        if trial.outcome != UNCLEAR_REVERTED or trial.effect is None:
            continue
        width = interval_width(trial.effect)
        later = [
            w
            for a in applied
            if a.step > trial.step
            and a.effect is not None
            and (w := interval_width(a.effect)) is not None
        ]
        if width is not None and later and min(later) <= RETRY_NOISE * width:
            trials[index] = replace(trial, outcome=RETRYABLE)


def operator_changes(applied: Sequence[AppliedChange], config: Knobs) -> tuple[AppliedChange, ...]:
    """The latest operator's change of each knob, where the run still has the value it set
    (a later change of the knob by anyone, a rollback included, ends it)."""
    latest: dict[str, AppliedChange] = {}
    for change in applied:
        for knob in change.changes:
            latest[knob] = change
    standing: list[AppliedChange] = []
    for knob, change in latest.items():
        diff = change.changes[knob]
        ours = change.origin == AUTOPILOT or change.rollback
        if ours or diff.old is None or getattr(config, knob, None) != diff.new:
            continue
        if change not in standing:
            standing.append(change)
    return tuple(standing)


def axis_of(changes: Mapping[str, object]) -> str:
    """The axis a change belongs to: the one of ``AXES`` whose knob it sets (``together``
    where it sets two)."""
    knobs = [axis.knob for axis in AXES if axis.knob in changes]
    if len(knobs) > 1:
        return TOGETHER
    return knobs[0] if knobs else next(iter(changes), "")


# ----------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Decision:
    """What to do now: wait, try a change, revert the last one, or stop (converged)."""

    action: str
    """wait, time (the last trial, over more steps), try, revert or converged."""
    why: str
    changes: dict[str, KnobValue] = field(default_factory=dict)
    safety: bool = False
    """A move out of the memory danger band (kept unless it runs out of memory)."""
    steps: int = 0
    """To time: the steps a side wanted."""


@dataclass(frozen=True)
class Timing:
    """The steps timed at the run's current config: how many, and how much their speed varies."""

    steps: int
    """Steps timed since the current config settled."""
    spread: float
    """The relative standard deviation of their samples/s, step to step."""


def timing_of(records: Sequence[StepRecord], settled: int) -> Timing:
    """The timing of the steps after ``settled`` (the last step the current config's warm-up
    left out), over the latest ``LONG_STEPS`` of them."""
    timed = [r for r in records if r.step > settled and r.step_time_s > 0]
    rates = [r.samples / r.step_time_s for r in timed[-LONG_STEPS:]]
    mean = statistics.fmean(rates) if rates else 0.0
    spread = statistics.stdev(rates) / mean if len(rates) > 1 and mean > 0 else 0.0
    return Timing(len(timed), spread)


@dataclass(frozen=True)
class Situation:
    """Everything the policy decides from: the run's live numbers and the autopilot's history."""

    inputs: Inputs
    """The recommendations' inputs: config, timed steps (since the last change settled), memory
    model, host sample, CPUs, ceiling, thresholds and the applied changes."""
    history: History
    pending: bool = False
    """Some change (anyone's) waits for the next boundary."""
    budget: int = BUDGET
    allow_effective_batch: bool = False
    """Left to the learning-rate rule: without it, micro x accumulation x ranks stays."""
    timing: Timing | None = None
    """The steps timed at the current config (None: as many as the steps measured say)."""

    @property
    def wanted_steps(self) -> int:
        """Steps a side to time a config over: ``EFFECT_STEPS``, or once one of the autopilot's
        trials measured inside the noise, enough for a gain of ``RESOLVE`` to show past the
        spread of the steps (up to ``LONG_STEPS``)."""
        noisy = any(t.outcome in INSIDE_NOISE for t in self.history.trials)
        if self.timing is None or not noisy:
            return EFFECT_STEPS
        wanted = math.ceil(2 * (1.96 * self.timing.spread / RESOLVE) ** 2)
        return min(max(wanted, EFFECT_STEPS), LONG_STEPS)

    @property
    def input_bound(self) -> bool:
        """The run waits for data past the verdict's STARVED threshold."""
        steps = self.inputs.steps
        return steps is not None and steps.data_wait_fraction >= self.inputs.starved_wait_fraction

    @property
    def waits_for_data(self) -> bool:
        """A measurable share of the step (``WAITS_FRACTION``) waits for data."""
        steps = self.inputs.steps
        return steps is not None and steps.data_wait_fraction >= WAITS_FRACTION

    def gate_refuses(self, changes: Mapping[str, KnobValue]) -> bool:
        """The queue's prediction gate would refuse ``changes`` now: the high end of the peak
        predicted by the memory model as it is now over the danger band, or an OOM region."""
        inputs = self.inputs
        config = knobs_with(inputs.config, changes)
        thresholds = thresholds_of(inputs)
        return Prediction.of_config(inputs.model, config, thresholds, inputs.ceiling).over_danger

    def tried(self, knob: str, *, operator: bool = True) -> dict[KnobValue, str]:
        """Each value tried for ``knob`` and its outcome, less the values the gate refused that
        it would take now (the memory model has more points, or a narrower interval); with
        ``operator``, the value an operator moved it from too (``OPERATOR``: not gone back to)."""
        values = self.history.tried(knob)
        for trial in self.history.trials:
            diff = trial.changes.get(knob)
            if trial.outcome != REFUSED or diff is None or values.get(diff.new) != REFUSED:
                continue
            if not self.gate_refuses(new_values(trial.changes)):
                del values[diff.new]
        theirs = self.history.left_by_operator(knob) if operator else None
        if theirs is not None:
            old = theirs.changes[knob].old
            if old is not None:
                values.setdefault(old, OPERATOR)
        return values

    def operator_words(self, knob: str) -> str:
        """`` (32 is what an operator set, #8: not moved back)`` where an operator's change set
        ``knob`` and still stands ('' otherwise)."""
        theirs = self.history.left_by_operator(knob)
        if theirs is None:
            return ""
        value = format_value(theirs.changes[knob].new)
        ids = ",".join(f"#{i}" for i in theirs.ids)
        return f" ({value} is what an operator set, {ids}: not moved back)"


@dataclass(frozen=True)
class Axis:
    """One knob of the search: when it applies and the next value to try."""

    knob: str
    candidate: Callable[[Situation], tuple[dict[str, KnobValue], str]]
    """The change to try next and why; or ``{}`` and why nothing (the axis is done)."""


def decide(situation: Situation) -> Decision:
    """The autopilot's next move, from the run's measurements and its own history."""
    history, inputs = situation.history, situation.inputs
    last = history.last
    if last is not None and last.outcome == MEASURING:
        return Decision("wait", f"measuring {format_diff_values(last.changes)}")
    if situation.pending:
        return Decision("wait", "a change is pending: it lands at the next checkpoint")
    timing_longer = _timing_longer(situation, last)
    if timing_longer is not None:
        return timing_longer
    if last is not None and last.outcome in (WORSE, UNCLEAR):
        back = {k: d.old for k, d in last.changes.items() if d.old is not None}
        why = f"{format_diff_values(last.changes)} was not faster beyond the noise"
        if last.outcome == UNCLEAR:
            why += " (tried again if a later change is measured with less noise)"
        return Decision("revert", why, back)
    if inputs.steps is None:
        return Decision("wait", "timing the steps at the current config")
    safer = _out_of_danger(situation)
    if last is not None and last.outcome == KEPT and safer:
        back = {k: d.old for k, d in last.changes.items() if d.old is not None}
        grown = any(grew(k, d) for k, d in last.changes.items())
        if grown and not _worth_its_memory(situation, last, safer):
            # its own change took the run into the edge band: undo it, not the micro-batch
            why = f"{format_diff_values(last.changes)} took the peak into the edge band"
            return Decision("revert", why, back)
    if history.boundaries + 2 > situation.budget:
        return Decision("converged", f"the budget of {situation.budget} boundaries is spent")
    if safer:
        why = "peak memory in the edge band: a smaller micro-batch"
        theirs = history.left_by_operator("batch_size")
        if theirs is not None:  # the one case it undoes an operator's change: it says so
            ids = ",".join(f"#{i}" for i in theirs.ids)
            set_to = format_value(theirs.changes["batch_size"].new)
            why += f" than the {set_to} an operator set ({ids}), which took the peak there"
        return Decision("try", why, safer, True)
    reasons: list[str] = []
    for axis in AXES:
        changes, why = axis.candidate(situation)
        if changes:
            timing, wanted = situation.timing, situation.wanted_steps
            if timing is not None and timing.steps < wanted:
                return Decision(
                    "wait", f"timing the current config: {_steps_words(timing, wanted)}"
                )
            return Decision("try", why, changes)
        if why:
            reasons.append(why)
    return Decision("converged", "; ".join(reasons) or "nothing left to try")


def _timing_longer(situation: Situation, last: Trial | None) -> Decision | None:
    """Time the last trial over more steps (None: not needed): its speed change stayed inside
    the noise with a gain for its point estimate, and its config has fewer steps timed than
    wanted; "no measurable change" is not "slower" until the steps say so."""
    if last is None or last.outcome != UNCLEAR or last.effect is None or last.safety:
        return None
    wanted = situation.wanted_steps
    if speedup(last.effect) <= 0 or last.effect.steps_after >= wanted:
        return None
    why = f"{speed_words(last.effect)} over {last.effect.steps_after} of {wanted} steps a side"
    return Decision("time", why, new_values(last.changes), steps=wanted)


def _steps_words(timing: Timing, wanted: int) -> str:
    """``45 of 163 steps (their speed varies +-23% step to step)``."""
    spread = f"+-{timing.spread:.0%} step to step"
    return f"{timing.steps} of {wanted} steps (their speed varies {spread})"


SHRINK_COST_GUESS = 0.2
"""What a smaller micro-batch is taken to cost where the steps timed cannot say (one size timed):
halving it seldom costs that much on the runs measured (the benchmark's demo: micro-batch 4 and 8
within 2% with 2 workers)."""


def _worth_its_memory(situation: Situation, trial: Trial, safer: Mapping[str, KnobValue]) -> bool:
    """``trial`` sped the run up, beyond its noise, by more than the smaller micro-batch ``safer``
    is predicted to cost (``SHRINK_COST_GUESS`` where the estimate cannot say): then it stays and
    the micro-batch shrinks under it, rather than the gain being given back for good (the
    starving demo's worker, +25% +-3% into the edge band, was reverted and never tried again)."""
    effect = trial.effect
    if effect is None:
        return False
    estimate = _estimate(situation, safer)
    delta = estimate.delta if estimate is not None else None
    cost = SHRINK_COST_GUESS if delta is None else max(0.0, -delta)
    return lowest_gain(effect) > cost


def format_diff_values(changes: Mapping[str, KnobDiff]) -> str:
    """``num_workers=2 batch_size=8``: the new values of a change."""
    return format_changes(new_values(changes))


def doubling(
    now: int, upper: int, tried: Mapping[KnobValue, str], floor: int = 1, *, bisect: bool = True
) -> int | None:
    """The next integer to try above ``now``: double it (from ``floor`` at 0) up to ``upper``;
    once a value above failed, halfway to it (unless not ``bisect``: then nothing); None when
    nothing untried is left."""
    failed = [v for v, o in tried.items() if o in FAILED and isinstance(v, int) and v > now]
    if failed and not bisect:
        return None
    if failed:
        mid = (now + min(failed)) // 2
        return mid if mid > now and mid not in tried else None
    want = min(max(now * 2, floor), upper)
    return want if want > now and want not in tried else None


def _estimate(situation: Situation, changes: Mapping[str, KnobValue]) -> SpeedEstimate | None:
    """The speed estimate of ``changes`` (None without timed steps)."""
    basis = situation.inputs.speed_basis()
    return predict_speed(basis, changes) if basis is not None else None


def _predicted_no_help(situation: Situation, changes: Mapping[str, KnobValue]) -> str:
    """Why ``changes`` is predicted not to help ('' if it may: predicted slower only within the
    estimate's noise (``speed_noise``), faster, or unknown)."""
    estimate = _estimate(situation, changes)
    noise = speed_noise(situation.inputs)
    if estimate is None or estimate.delta is None or estimate.delta >= -noise:
        return ""
    return f"{format_changes(changes)} predicted slower ({estimate.delta:+.0%}: {estimate.note})"


def _workers(situation: Situation) -> tuple[dict[str, KnobValue], str]:
    """More loader workers while the run waits for data, within CPUs, host RAM and the ceiling."""
    inputs = situation.inputs
    now = inputs.config.num_workers
    if now is None or "num_workers" not in inputs.tunable:
        return {}, ""
    if not situation.waits_for_data:
        return {}, "num_workers: the run does not wait for data"
    if inputs.host_pressure:
        return {}, "num_workers: host memory is under pressure"
    upper, note = _worker_cap(inputs, max(now * 2, 1))
    tried = situation.tried("num_workers")
    value = doubling(now, upper, tried)
    if value is None:
        value, note = _past_the_noise(inputs, now, tried, note)
    if value is None:
        words = situation.operator_words("num_workers")
        return {}, f"num_workers: nothing left to try above {now}{note}{words}"
    changes: dict[str, KnobValue] = {"num_workers": value}
    no_help = _predicted_no_help(situation, changes) or _gated(situation, changes)
    if no_help:
        return {}, no_help
    return changes, f"{_wait_words(situation)}: num_workers {now} -> {value}{note}"


def _past_the_noise(
    inputs: Inputs, now: int, tried: Mapping[KnobValue, str], note: str
) -> tuple[int | None, str]:
    """Twice the one worker count tried above ``now`` when its trial stayed inside the noise (no
    slower, no clearer faster: one more worker on a loaded machine can hide in it) and nothing
    lies between to bisect, within the caps; None otherwise."""
    above = [v for v in tried if isinstance(v, int) and not isinstance(v, bool) and v > now]
    if len(above) != 1 or tried[above[0]] != UNCLEAR_REVERTED:
        return None, note
    want = above[0] * 2
    allowed, why = _worker_cap(inputs, want)
    return (want, why) if allowed == want else (None, note)


def _wait_words(situation: Situation) -> str:
    steps = situation.inputs.steps
    return f"{steps.data_wait_fraction:.0%} of each step waits for data" if steps else "waits"


def _pinning(situation: Situation) -> tuple[dict[str, KnobValue], str]:
    """Pinned batches, once, where there is an accelerator and the run waits for data."""
    inputs = situation.inputs
    if inputs.config.pin_memory is not False or "pin_memory" not in inputs.tunable:
        return {}, ""
    if inputs.device_kind != "cuda":
        return {}, ""  # pinning speeds copies to an accelerator only: nothing to say on a CPU
    if inputs.ceiling is not None and inputs.ceiling.pin_memory:
        return {}, "pin_memory: it ran out of memory pinned"
    if not situation.input_bound or True in situation.tried("pin_memory"):
        return {}, ""
    return {"pin_memory": True}, f"{_wait_words(situation)}: pin_memory on"


def _micro_batch(situation: Situation) -> tuple[dict[str, KnobValue], str]:
    """A bigger micro-batch with the accumulation recomputed (the effective batch kept), within
    the largest predicted safe and under what ran out of memory; once nothing is left above, a
    smaller one (half); never while input-bound."""
    inputs = situation.inputs
    batch, accum, model = inputs.config.batch_size, inputs.config.grad_accum, inputs.model
    if batch is None or "batch_size" not in inputs.tunable:
        return {}, ""
    if situation.input_bound and _more_workers_allowed(situation):
        return {}, "batch_size: never bigger while the run waits for data"
    if accum is None or "grad_accum" not in inputs.tunable:
        return {}, "batch_size: no grad_accum to keep the effective batch with"
    if model is None:
        return {}, "batch_size: no memory model yet"
    target = batch * accum
    safe = max_batch(model, inputs.memory_edge_fraction, inputs.ceiling) or 0
    upper = _divisor_at_most(target, min(target, safe))
    tried = situation.tried("batch_size")
    value = doubling(batch, upper, tried)
    value = _divisor_at_most(target, value) if value is not None else None
    if value is None or value <= batch or value in tried:
        value = _divisor_at_most(target, batch // 2)
        if value < 1 or value in tried:
            words = situation.operator_words("batch_size")
            return {}, (
                f"batch_size: nothing left to try around {batch} keeping the effective batch{words}"
            )
    changes: dict[str, KnobValue] = {"batch_size": value, "grad_accum": target // value}
    no_help = _predicted_no_help(situation, changes) or _gated(situation, changes)
    if no_help:
        return {}, no_help
    return changes, f"batch_size {batch} -> {value}, grad_accum {accum} -> {target // value}"


def _more_workers_allowed(situation: Situation) -> bool:
    """The run may take more loader workers (under the CPUs it may use, host RAM, the ceiling)."""
    inputs = situation.inputs
    now = inputs.config.num_workers
    if now is None or "num_workers" not in inputs.tunable:
        return False
    return _worker_cap(inputs, now + 1)[0] > now


def _worker_cap(inputs: Inputs, wanted: int) -> tuple[int, str]:
    """The most of ``wanted`` loader workers the CPUs, host RAM and the ceiling allow, and why."""
    return workers_allowed(inputs, wanted, per_worker_bytes(inputs.host) or None)


def _gated(situation: Situation, changes: Mapping[str, KnobValue]) -> str:
    """Why the queue's gate would refuse ``changes`` now ('' if it would take them): the autopilot
    waits for the memory model to say otherwise instead of queuing a refusal."""
    if not situation.gate_refuses(changes):
        return ""
    return f"{format_changes(changes)}: predicted over the danger band for now"


def _divisor_at_most(target: int, value: int) -> int:
    """The largest divisor of ``target`` no greater than ``value`` (0 under 1)."""
    for candidate in range(min(value, target), 0, -1):
        if target % candidate == 0:
            return candidate
    return 0


def _out_of_danger(situation: Situation) -> dict[str, KnobValue]:
    """A smaller micro-batch (the effective batch kept) when the predicted peak is in the edge
    band: the largest predicted safe, and it is not a speed trial ({}: not needed)."""
    inputs = situation.inputs
    batch, accum, model = inputs.config.batch_size, inputs.config.grad_accum, inputs.model
    if batch is None or accum is None or model is None or model.capacity_bytes <= 0:
        return {}
    peak = predict_peak(model, batch, inputs.config.num_workers)  # the workers there are now
    if peak < inputs.memory_edge_fraction * model.capacity_bytes:
        return {}
    if {"batch_size", "grad_accum"} - set(inputs.tunable):
        return {}
    target = batch * accum
    safe = max_batch(model, inputs.memory_edge_fraction, inputs.ceiling) or 1
    value = _divisor_at_most(target, min(safe, batch - 1))
    if value < 1 or value >= batch or value in situation.tried("batch_size", operator=False):
        return {}
    return {"batch_size": value, "grad_accum": target // value}


PREFETCH_LIMIT = 8
"""The most batches per worker the autopilot asks for (each one is held in host memory)."""


def _prefetch(situation: Situation) -> tuple[dict[str, KnobValue], str]:
    """More batches prefetched per worker while the run waits for data with workers (torch
    uses it only with workers), doubled up to ``PREFETCH_LIMIT`` and not bisected once a doubling
    failed (its gains are small, and each trial with its revert costs two boundaries of the
    budget); not under host pressure."""
    inputs = situation.inputs
    now, workers = inputs.config.prefetch_factor, inputs.config.num_workers
    if now is None or "prefetch_factor" not in inputs.tunable or not workers:
        return {}, ""
    if not situation.waits_for_data or inputs.host_pressure:
        return {}, ""
    value = doubling(now, PREFETCH_LIMIT, situation.tried("prefetch_factor"), bisect=False)
    if value is None:
        words = situation.operator_words("prefetch_factor")
        return {}, f"prefetch_factor: nothing left to try above {now}{words}"
    return {"prefetch_factor": value}, f"{_wait_words(situation)}: prefetch_factor {now} -> {value}"


def _together(situation: Situation) -> tuple[dict[str, KnobValue], str]:
    """The latest two moves of different knobs that each measured faster inside the noise and
    were reverted, tried at once from the config they both started from: their gains add up
    where neither alone showed (beside two CPU hogs the benchmark's CNN, timed over 380 steps a
    config, gained 1% with a second worker, 4% with micro-batch 16 and 6% with both)."""
    latest: dict[str, Trial] = {}
    for trial in situation.history.trials:
        inside = trial.outcome in (UNCLEAR_REVERTED, RETRYABLE) and trial.axis != TOGETHER
        if inside and trial.effect is not None and speedup(trial.effect) > 0 and not trial.safety:
            latest.pop(trial.axis, None)  # the latest of each axis, in the order they ran
            latest[trial.axis] = trial
    if len(latest) < 2:
        return {}, ""
    pair = list(latest.values())[-2:]
    config = situation.inputs.config
    if any(getattr(config, k, None) != d.old for t in pair for k, d in t.changes.items()):
        return {}, ""
    changes = merge(new_values(t.changes) for t in pair)
    done = [new_values(t.changes) for t in situation.history.trials]
    if changes in done or situation.gate_refuses(changes):
        return {}, ""
    words = " and ".join(format_diff_values(t.changes) for t in pair)
    return changes, f"{words} each measured faster inside the noise: both at once"


AXES: tuple[Axis, ...] = (
    Axis("num_workers", _workers),
    Axis("pin_memory", _pinning),
    Axis("batch_size", _micro_batch),
    Axis(TOGETHER, _together),
    Axis("prefetch_factor", _prefetch),
)
"""The knobs the autopilot tunes, in the order it tries them (the likeliest gains first: the
budget of boundaries ran out on prefetch trials before the micro-batch was tried on the
benchmark's transformer): a knob is one more entry; ``together`` pairs two of them."""


def describe_state(state: AutopilotState) -> str:
    """``autopilot on: trying num_workers=2 (62% of each step waits for data); 2/8 boundaries``."""
    if state.mode == "off":
        return "autopilot off" + (f" ({state.why})" if state.why else "")
    if state.mode == "paused":
        return f"autopilot {state.why or 'paused'}"
    doing = state.phase or "waiting"
    if state.trying and state.phase in ("trying", "reverting", "measuring", "timing"):
        doing += " " + format_changes(state.trying)
    words = f"autopilot on: {doing}"
    if state.why and not state.why.startswith("measuring"):
        words += f" ({state.why})"
    if state.last and not state.last.startswith(MEASURING) and state.phase != "timing":
        words += f"; last: {state.last}"
    return words + f"; {state.boundaries}/{state.budget} boundaries"
