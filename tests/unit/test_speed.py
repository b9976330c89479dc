"""The speed estimate of a change, the hook's prediction of each applied change's speed, and its
check against the measured effect (speed predictions are checked as memory ones are)."""

from __future__ import annotations

import pytest

from memtui.advice.effect import SETTLE_STEPS
from memtui.advice.measure import EFFECT_STEPS, effects_due, speed_prediction_due
from memtui.advice.speed import (
    SpeedBasis,
    describe_speed,
    predict_speed,
    speed_accuracy,
    speed_error,
)
from memtui.core.stats import StepStats
from memtui.hooks.ledger import StepLedger
from memtui.wire import AppliedChange, Effect, KnobDiff, Knobs


def stats(step_s: float, wait_s: float, samples: float) -> StepStats:
    return StepStats(
        steps=20,
        step_time_s=step_s,
        data_wait_s=wait_s,
        samples_per_s=samples / step_s,
        steps_per_s=1 / step_s,
    )


def effect(before: float, after: float, margin: float = 0.05) -> Effect:
    """An effect from ``before`` to ``after`` samples/s (compute only: no wait)."""
    return Effect(
        steps_before=20,
        steps_after=20,
        samples_per_s_before=before,
        samples_per_s_after=after,
        step_time_s_before=8 / before,
        step_time_s_after=16 / after,
        data_wait_s_before=0.0,
        data_wait_s_after=0.0,
        speedup_margin=margin,
    )


def test_workers_from_none_overlap_the_measured_load() -> None:
    # 60 ms of compute and 40 ms of loading per step in the main process: two workers
    # overlap the loading, so the step is the compute alone (100 -> 60 ms, +67%)
    basis = SpeedBasis(Knobs(batch_size=8, num_workers=0), stats(0.100, 0.040, 8), 8)
    estimate = predict_speed(basis, {"num_workers": 2})
    assert estimate.delta == pytest.approx(0.100 / 0.060 - 1)
    assert "ms per sample" in estimate.note


def test_workers_that_keep_up_give_no_number_for_fewer_and_none_faster_for_more() -> None:
    basis = SpeedBasis(Knobs(batch_size=8, num_workers=4), stats(0.100, 0.001, 8), 8)
    fewer = predict_speed(basis, {"num_workers": 2})
    assert fewer.delta is None and "not measured" in fewer.note
    more = predict_speed(basis, {"num_workers": 8})
    assert more.delta == 0.0 and "keep up" in more.note


def test_a_micro_batch_change_needs_two_timed_sizes() -> None:
    knobs = Knobs(batch_size=16, grad_accum=1, num_workers=0)
    alone = SpeedBasis(knobs, stats(0.160, 0.0, 16), 16)
    unknown = predict_speed(alone, {"batch_size": 32})
    assert unknown.delta is None and "one size cannot tell" in unknown.note
    # measured before: micro-batch 8 at 50 ms of compute, 16 at 160 ms
    earlier = AppliedChange(
        ids=[1], step=40, time=0.0, changes={"batch_size": KnobDiff(8, 16)},
        effect=effect(8 / 0.050, 16 / 0.160),
    )  # fmt: skip
    basis = SpeedBasis(knobs, stats(0.160, 0.0, 16), 16, (earlier,))
    estimate = predict_speed(basis, {"batch_size": 32})
    # slope (160 - 50) / 8 = 13.75 ms per sample, fixed -60 ms: no negative fixed cost, so the
    # line goes through the origin and samples/s stays what it is
    assert estimate.delta == pytest.approx(0.0, abs=0.02)
    assert "micro-batches 8, 16" in estimate.note


def test_no_change_and_mixed_changes() -> None:
    basis = SpeedBasis(Knobs(batch_size=8, num_workers=0), stats(0.1, 0.04, 8), 8)
    assert predict_speed(basis, {"num_workers": 0}).delta == 0.0
    mixed = predict_speed(basis, {"num_workers": 2, "batch_size": 16})
    assert mixed.delta is None and "batch_size, num_workers together" in mixed.note
    pinned = predict_speed(basis, {"pin_memory": True})
    assert pinned.delta is None and "no estimate for a pin_memory change" in pinned.note


def raw(step: int, dt: float, wait: float, samples: int = 8) -> tuple[int, float, float, float, int, int, int]:  # fmt: skip
    return (step, float(step), dt, wait, samples, 1, 0)


def test_the_hook_predicts_from_the_steps_before_and_checks_against_the_effect() -> None:
    ledger = StepLedger()
    change = AppliedChange(ids=[1], step=20, time=0.0, changes={"num_workers": KnobDiff(0, 2)})
    before = [raw(s, 0.100, 0.040) for s in range(1, 21)]
    after = [raw(s, 0.070, 0.0) for s in range(21, 21 + SETTLE_STEPS + EFFECT_STEPS)]
    now = Knobs(batch_size=8, num_workers=2)  # the config the change left
    # the after steps do not enter the prediction: the same with or without them
    due = speed_prediction_due([change], before, ledger.records, now, 0.3)
    assert due is not None and due[0] is change
    assert due[1].delta == pytest.approx(0.100 / 0.060 - 1)
    again = speed_prediction_due([change], before + after, ledger.records, now, 0.3)
    assert again is not None and again[1] == due[1]
    change.predicted_speed_delta, change.speed_note = due[1].delta, due[1].note
    assert speed_prediction_due([change], before + after, ledger.records, now, 0.3) is None
    (measured,) = effects_due([change], before + after, [], ledger.records, final=True)
    change.effect = measured.effect
    # predicted +67%, measured 100 -> 70 ms: +43%; 24 points over
    error = speed_error(change)
    assert error == pytest.approx((0.100 / 0.060) - (0.100 / 0.070), abs=1e-6)
    scored = speed_accuracy([change])
    assert scored.measured == 1 and scored.mean_abs_error == pytest.approx(abs(error))  # type: ignore[arg-type]
    assert scored.within_noise == 0, "a 24-point miss is outside a steady run's noise"
    said = describe_speed(scored)
    assert "the predicted change of samples/s was 24 points from the measured one" in said


def test_rollbacks_and_unpredicted_changes_are_not_scored() -> None:
    ledger = StepLedger()
    rollback = AppliedChange(ids=[], step=20, time=0.0, changes={}, rollback=True)
    assert speed_prediction_due([rollback], [], ledger.records, Knobs(), 0.3) is None
    blind = AppliedChange(
        ids=[2], step=20, time=0.0, changes={"pin_memory": KnobDiff(False, True)},
        effect=effect(100, 101), speed_note="speed unknown until measured: no estimate",
    )  # fmt: skip
    scored = speed_accuracy([rollback, blind])
    assert scored.measured == 0 and scored.unknown == 1
    assert describe_speed(scored) == "1 change(s) with no estimate"


def test_the_change_log_shows_the_predicted_speed_beside_the_measured_one() -> None:
    """The viewer's change log: ``+43% +-5% samples/s (predicted +67%)``, the prediction in
    yellow where it misses outside the measured noise; before the effect is measured,
    ``predicted +67% samples/s``. No "pts" a reader must decode, no sign to read backwards."""
    from memtui.tui.widgets.changelog import effect_chips

    change = AppliedChange(
        ids=[1], step=20, time=0.0, changes={"num_workers": KnobDiff(0, 2)},
        predicted_speed_delta=0.67, speed_note="loading ...",
    )  # fmt: skip
    before = effect_chips(change, 21)
    assert before is not None
    assert [c.text.plain for c in before] == ["measuring the effect…", "predicted +67% samples/s"]
    change.effect = effect(100, 143, margin=0.05)
    chips = effect_chips(change, 60)
    assert chips is not None
    shown = chips[0].text
    assert shown.plain == "+43% +-5% samples/s (predicted +67%)"
    assert "pts" not in "".join(c.text.plain for c in chips)
    assert any(str(span.style) == "yellow" for span in shown.spans), "a miss outside the noise"
