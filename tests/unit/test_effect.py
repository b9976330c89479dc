"""The effect of a change: measured once a rebuilt loader's workers run, with an interval that
counts the run's drift, and never for a change that cannot act on the run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from memtui.advice.effect import (
    SETTLE_STEPS,
    WARMUP_LIMIT,
    describe,
    interval,
    measurable,
    speed_words,
    speedup,
    warmup,
)
from memtui.advice.measure import EFFECT_STEPS, effects_due, measuring, speed_prediction_due
from memtui.hooks.control import PINNING_IDLE, Control
from memtui.hooks.ledger import StepLedger
from memtui.wire import (
    STEP_AFTER_CHECKPOINT,
    STEP_LOADER_REBUILT,
    AppliedChange,
    KnobDiff,
    Knobs,
    SetRequest,
    StepRecord,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "effect_steps.json"
REBUILT = STEP_AFTER_CHECKPOINT | STEP_LOADER_REBUILT
RawStep = tuple[int, float, float, float, int, int, int]


def raw(step: int, seconds: float, wait: float = 0.0, samples: int = 8, flags: int = 0) -> RawStep:
    return (step, float(step), seconds, wait, samples, 1, flags)


def jittered(steps: range, seconds: float, spread: float, seed: int) -> list[RawStep]:
    """Steps of ``seconds`` each, give or take ``spread`` of it at random."""
    rng = random.Random(seed)
    return [raw(s, seconds * (1 + spread * (2 * rng.random() - 1))) for s in steps]


def workers(old: int, new: int, step: int = 60) -> AppliedChange:
    return AppliedChange(ids=[1], step=step, time=0.0, changes={"num_workers": KnobDiff(old, new)})


def rate(steps: list[RawStep], first: int, last: int) -> float:
    """Samples/s over steps (first, last]."""
    window = [s for s in steps if first < s[0] <= last]
    return sum(s[4] for s in window) / sum(s[2] for s in window)


def test_a_rebuilt_loaders_warm_up_is_left_out_and_the_effect_is_the_steady_speed_up() -> None:
    """86 -> 728 samples/s: the slow loader's first step with 2 new workers waits 2.4 s for them
    to start, and their first batches (4: 2 workers, 2 prefetched each) come slowly; compared
    from 2 steps after the change, that +743% read "no measurable change" (+-859%). The warm-up
    is left out, said, and the interval holds the speed the run keeps 200 steps later."""
    before = jittered(range(1, 61), 0.093, 0.05, seed=1)
    start = [raw(61, 2.4, 2.39, flags=REBUILT), raw(62, 0.35, 0.34), raw(63, 0.6, 0.59)]
    start += [raw(64, 0.2, 0.19)]
    steady = jittered(range(65, 460), 0.011, 0.08, seed=2)
    steps = before + start + steady
    found = effects_due([workers(0, 2)], steps, [], StepLedger.records, final=True,
                        now=Knobs(8, 1, 2, False, 2))  # fmt: skip
    (measured,) = found
    effect = measured.effect
    assert effect is not None
    assert effect.warmup_steps == 4 and effect.steps_after == EFFECT_STEPS
    assert "2 new workers starting and making their first 4 batches" in effect.warmup_why
    assert "4 steps after the change left out" in describe(effect)
    assert round(effect.samples_per_s_before) == pytest.approx(86, abs=2)
    assert round(effect.samples_per_s_after) == pytest.approx(728, abs=15)
    bounds = interval(effect)
    assert bounds is not None and measurable(effect)
    later = rate(steps, 260, 410) / rate(steps, 0, 60) - 1
    assert bounds[0] <= later <= bounds[1], f"{later:+.0%} outside {speed_words(effect)}"


def test_the_warm_up_goes_on_while_the_steps_still_get_faster_and_is_bounded() -> None:
    """After the new workers' first batches, a step slower than the median of the 5 after it by
    more than their range is still warming up; one within the spread of a run that varies is
    not; a warm-up that never ends is cut at ``WARMUP_LIMIT`` and said."""
    first = [StepRecord(11, 0.0, 1.0, 0.9, 8, 1, REBUILT), StepRecord(12, 0, 0.3, 0.2, 8, 1)]
    slowing = [StepRecord(13, 0, 0.2, 0, 8, 1), StepRecord(14, 0, 0.15, 0, 8, 1)]
    settled = [StepRecord(s, 0, 0.05 + 0.01 * (s % 2), 0, 8, 1) for s in range(15, 40)]
    warm = warmup(10, first + slowing + settled, workers=1, prefetch=2)
    assert warm is not None and warm.last == 14, warm
    assert warm.why.endswith("then 2 steps still slower than the 5 after beyond their spread")
    assert warmup(10, first + slowing[:2], workers=1, prefetch=2) is None, "cannot tell yet"
    many = first + slowing + settled + [StepRecord(s, 0, 0.05, 0, 8, 1) for s in range(40, 70)]
    assert warmup(10, many[:20], workers=8, prefetch=8) is None, "64 first batches: not yet"
    cut = warmup(10, many, workers=8, prefetch=8)
    assert cut is not None and cut.steps == WARMUP_LIMIT and "still warming up" in cut.why


def test_a_change_that_rebuilds_nothing_leaves_out_only_its_settling_steps() -> None:
    steps = [StepRecord(s, 0, 0.05, 0, 8, 1) for s in range(11, 30)]
    warm = warmup(10, steps, workers=2, prefetch=2)
    assert warm is not None and warm.steps == SETTLE_STEPS
    effect = effects_due([workers(2, 2, 10)], [raw(s, 0.05) for s in range(1, 40)], [],
                         StepLedger.records, final=True)[0].effect  # fmt: skip
    assert effect is not None and "left out" not in describe(effect)


def test_the_interval_counts_how_far_the_run_drifts_at_an_unchanged_config() -> None:
    """The machine's load comes and goes: the run's steps at its old config went 0.10 s and
    0.14 s, 60 steps each; a change that does nothing, landing as the load rose, compared 20
    steps before it with 20 after, read -29% with an interval of a few points: blamed for a
    slowdown it did not cause. The run's drift widens the interval to hold no change."""
    steps = []
    for step in range(1, 400):
        loaded = (step - 1) // 60 % 2 == 1 or step > 300
        steps.append(raw(step, 0.14 if loaded else 0.10))
    change = AppliedChange(ids=[1], step=300, time=0.0, changes={"grad_accum": KnobDiff(2, 4)})
    (measured,) = effects_due([change], steps, [], StepLedger.records, final=True)
    effect = measured.effect
    assert effect is not None and speedup(effect) == pytest.approx(-0.29, abs=0.01)
    assert effect.speed_drift is not None and effect.speed_drift > 0.3
    assert not measurable(effect), speed_words(effect)
    flat = [raw(step, 0.10 if step <= 300 else 0.14) for step in range(1, 400)]
    (steady,) = effects_due([change], flat, [], StepLedger.records, final=True)
    assert steady.effect is not None and measurable(steady.effect), "no drift: measured slower"


def recorded() -> tuple[dict[str, object], list[RawStep]]:
    data = json.loads(DATA.read_text())
    return data, [tuple(s) for s in data["steps"]]  # type: ignore[misc]


def replayed(data: dict[str, object], steps: list[RawStep]) -> list[tuple[AppliedChange, float]]:
    """Each recorded change measured as the hook measured it live (the steps up to 80 after
    it, the earlier changes measured), with the speed its config kept 200 steps later."""
    after, window = int(data["after"]), int(data["window"])  # type: ignore[call-overload]
    applied: list[AppliedChange] = []
    out: list[tuple[AppliedChange, float]] = []
    for index, row in enumerate(data["changes"]):  # type: ignore[arg-type]
        at = row["step"]
        diffs = {k: KnobDiff(row["config_before"][k], v) for k, v in row["changes"].items()}
        applied.append(AppliedChange(ids=[index + 1], step=at, time=0.0, changes=diffs))
        now = msgspec.convert({**row["config_before"], **row["changes"]}, Knobs)
        ran = [s for s in steps if s[0] <= at + 80]
        (measured,) = effects_due(applied, ran, [], StepLedger.records, final=True, now=now)
        applied[-1] = msgspec.structs.replace(applied[-1], effect=measured.effect)
        steady = rate(steps, at + after, at + after + window) / rate(steps, at - window, at) - 1
        out.append((applied[-1], steady))
    return out


def test_recorded_loader_changes_state_intervals_that_hold_the_steady_state() -> None:
    """The demo's slow loader, 0 -> 2 -> 0 workers, recorded beside other programs' tests (load
    average 3.9-4.2 on 2 CPUs): 20 steps a side, the 2 -> 0 read -45% +-5%, and the run kept
    -36% 200 steps later. With the warm-up left out and the run's drift counted, each interval
    holds the steady state."""
    data, steps = recorded()
    results = replayed(data, steps)
    assert len(results) == 2
    for change, steady in results:
        assert change.effect is not None
        bounds = interval(change.effect)
        assert bounds is not None and bounds[0] <= steady <= bounds[1], (
            f"step {change.step}: {speed_words(change.effect)}, steady {steady:+.0%}"
        )
    first = results[0][0].effect
    assert first is not None and first.warmup_steps == 4 and measurable(first)


def test_pinning_without_an_accelerator_is_never_measured_nor_credited() -> None:
    """On a CPU run pinning does nothing (no accelerator to pin for): its change gets no effect,
    whatever the machine's load did meanwhile, and says why; a change with another knob is
    measured, and says the effect is the other knob's."""
    steps = [raw(s, 0.10 if s <= 60 else 0.06) for s in range(1, 100)]
    pin = AppliedChange(ids=[1], step=60, time=0.0, changes={"pin_memory": KnobDiff(True, False)})
    idle = {"pin_memory": PINNING_IDLE}
    (measured,) = effects_due([pin], steps, [], StepLedger.records, final=True, cannot_act=idle)
    assert measured.effect is None
    assert (
        measured.note
        == "pin_memory does nothing without an accelerator: its effect is not measured"
    )
    control = Control(lambda: Knobs(8, 1, 0, False), pinning=lambda: False)
    assert control.cannot_act() == idle
    assert Control(lambda: Knobs(8, 1, 0, False)).cannot_act() == {}, "with an accelerator"
    control.applied.append(pin)
    control.record_effect(measured)
    assert pin.effect is None and pin.effect_note == measured.note
    assert not measuring([msgspec.structs.replace(pin, speed_note="x")]), "nothing left to do"
    assert effects_due([pin], steps, [], StepLedger.records, final=True, cannot_act=idle) == []
    due = speed_prediction_due([pin], steps, StepLedger.records, Knobs(8, 1, 0, False), 0.3, idle)
    assert due is not None and due[1].delta is None and due[1].note.startswith(PINNING_IDLE)
    both = AppliedChange(ids=[2], step=60, time=0.0, changes={
        "pin_memory": KnobDiff(False, True), "num_workers": KnobDiff(0, 2)})  # fmt: skip
    (mixed,) = effects_due([both], steps, [], StepLedger.records, final=True, cannot_act=idle)
    assert mixed.effect is not None and mixed.note.endswith("the effect measured is num_workers's")
    pinned = Control(lambda: Knobs(8, 1, 0, True), pinning=lambda: False)
    reply = pinned.queue(SetRequest(changes={"pin_memory": False}))
    assert reply.ok and "pin_memory=false has no effect on this run" in reply.note
