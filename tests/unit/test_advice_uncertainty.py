"""How sure the advice is: predictions with intervals, a max safe batch from the high end, an OOM
ceiling that binds (and survives a restart), effects with their noise, workers within the CPUs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import yaml

from memtui.advice.effect import describe, measurable, measure, speed_words
from memtui.advice.measure import observe
from memtui.advice.predict import (
    GUESS_MULTIPLE,
    WORKER_GUESS_BYTES,
    WORKER_PRIOR_BYTES,
    Observation,
    fit,
    max_batch,
    predict_high,
    predict_peak,
    predict_range,
    safe_batch,
)
from memtui.advice.prediction import Prediction
from memtui.advice.recommend import Inputs, recommend
from memtui.core.stats import StepStats
from memtui.hooks import Options, Tuner
from memtui.hooks.control import Control
from memtui.hooks.persist import read_ceiling
from memtui.hooks.sampler import usable_cpus
from memtui.wire import (
    AppliedChange,
    Ceiling,
    DeviceSample,
    HostSample,
    KnobDiff,
    Knobs,
    MemoryModel,
    ModelPoint,
    OomEvent,
    SetRequest,
    StepRecord,
)
from tests.integration.test_tuner import Config

MIB = 2**20
GIB = 2**30


def line_model(
    points: list[int], capacity: int = 900 * MIB, steady: int = 400 * MIB, per: int = MIB
) -> MemoryModel:
    """A CPU model through ``points`` on the line ``steady + per x batch`` (noise: the floor)."""
    history = [ModelPoint(b, steady + per * b, 10) for b in points[:-1]]
    now = points[-1]
    observation = Observation("cpu", now, capacity, steady, steady + per * now, steady + per * now)
    return fit(observation, history)


# ----------------------------------------------------------------------------- intervals


def test_two_points_give_a_wide_interval_that_narrows_with_more_and_grows_with_reach() -> None:
    """Two close points alone (4 and 8) put the max safe batch at 258 with "fit error 0.0%", and 258
    ran out of memory at 2.6x the limit. The interval says how little two close points know: the
    high end at 258 is far over the danger band, so the gate wants --force."""
    two = line_model([4, 8])
    low, high = predict_range(two, 258)
    assert low < predict_peak(two, 258) < high
    assert high / two.capacity_bytes > 0.9, "258 from two points is not safe"
    assert Prediction.of(two, 258).over_danger
    # a farther batch has a wider interval; a third point narrows it
    assert predict_high(two, 200) - predict_peak(two, 200) > (
        predict_high(two, 16) - predict_peak(two, 16)
    )
    three = line_model([4, 8, 64])
    assert predict_high(three, 200) - predict_peak(three, 200) < (
        predict_high(two, 200) - predict_peak(two, 200)
    )
    # the max safe batch is the largest whose high end stays under the edge (within the guess
    # multiple of the largest point, the most two points justify)
    edge = 0.85
    tight = line_model([4, 8], capacity=500 * MIB)
    found = safe_batch(tight, edge)
    assert found is not None and not found.guess
    safe = found.size
    assert predict_high(tight, safe) <= edge * tight.capacity_bytes
    assert predict_high(tight, safe + 1) > edge * tight.capacity_bytes
    central = int((edge * tight.capacity_bytes - tight.steady_bytes) // tight.per_sample_bytes)
    assert safe < central, "the line alone would promise more"
    assert max_batch(two, edge) == GUESS_MULTIPLE * 8, "two points reach no farther"


def test_a_max_safe_batch_far_past_the_points_is_called_a_guess() -> None:
    """Past GUESS_MULTIPLE x the largest micro-batch measured the figure is a guess: only the
    floor is shown, and the words say so."""
    roomy = line_model([8, 16], capacity=64 * GIB)
    found = safe_batch(roomy, 0.85)
    assert found is not None and found.guess and found.size == GUESS_MULTIPLE * 16
    assert found.figure == f"> {GUESS_MULTIPLE * 16}" and found.describe().startswith(found.figure)
    assert "only guesses" in found.describe() and "micro-batch measured, 16" in found.describe()
    near = safe_batch(line_model([8, 16], capacity=500 * MIB), 0.85)
    assert near is not None and not near.guess and near.describe() == str(near.size)
    prediction = Prediction.of(roomy, 16)
    assert prediction.safe_words.startswith("> 64 ")


def cpu_samples(
    peaks_mib: list[int], capacity: int, in_use_mib: int | None = None
) -> list[DeviceSample]:
    """CPU device samples at steps 10, 11, ... with these peaks (and memory in use)."""
    return [
        DeviceSample(
            time=i,
            step=10 + i,
            kind="cpu",
            index=-1,
            name="cpu",
            capacity_bytes=capacity,
            allocated_bytes=(in_use_mib or peak) * MIB,
            peak_allocated_bytes=peak * MIB,
            reserved_bytes=(in_use_mib or peak) * MIB,
            peak_reserved_bytes=peak * MIB,
        )
        for i, peak in enumerate(peaks_mib)
    ]


def test_the_noise_of_the_peak_readings_is_measured() -> None:
    """The observation's noise is the spread of the readings that caught a step's peak."""
    samples = cpu_samples([500, 510, 700, 702, 690, 705, 300, 698], 2000 * MIB)
    seen = observe(samples, 8, 0, None)
    assert seen is not None
    assert seen.peak_allocated_bytes == 705 * MIB
    assert seen.noise_bytes == (705 - 702) * MIB  # the top half: 698 700 702 705


def test_a_peak_still_rising_at_its_config_is_uncertain_by_its_rise() -> None:
    """Variable-length inputs: the peak at one micro-batch rose with the time spent there (a
    transformer's 479 MiB after 5 steps, 550 MiB after 320); the rise between the window's
    halves counts as the point's noise, so the interval and the max safe batch allow for it."""
    flat = observe(cpu_samples([600, 601, 600, 602, 601, 600, 602, 601], 2000 * MIB), 8, 0, None)
    rising = observe(cpu_samples([560, 561, 560, 562, 590, 591, 640, 600], 2000 * MIB), 8, 0, None)
    assert flat is not None and rising is not None
    assert flat.noise_bytes <= 2 * MIB
    assert rising.noise_bytes >= (640 - 562) * MIB
    assert rising.peak_allocated_bytes == 640 * MIB


def test_a_micro_batch_seen_under_the_edge_stays_safe_however_wide_the_interval() -> None:
    """In benchmarks/advice_truth.py the demo's peaks rose ~8% over each stay, the interval at any
    batch crossed the edge and the max safe batch was 0, while micro-batch 8 ran at 74% of the
    limit. A batch seen under the band with its noise is safe; the one seen over it is not."""
    capacity = 640 * MIB
    wide = MemoryModel(
        kind="cpu",
        batch_size=4,
        capacity_bytes=capacity,
        steady_bytes=441 * MIB,
        per_sample_bytes=4 * MIB,
        points=[ModelPoint(8, 474 * MIB, 7, 37 * MIB), ModelPoint(16, 506 * MIB, 22, 42 * MIB)],
    )
    found = safe_batch(wide, 0.85)
    assert found is not None and found.size == 8 and not found.guess


def test_a_micro_batch_seen_under_the_edge_is_not_safe_where_the_line_puts_it_over() -> None:
    """A batch seen under the band stays safe only where the line through the points puts it
    under the band too (a reading that missed its step's peak is not evidence of safety)."""
    capacity = 680 * MIB
    seen = [(3, 440, 32, 3), (4, 453, 4, 2), (8, 497, 18, 1), (16, 565, 3, 0)]
    points = [ModelPoint(b, peak * MIB, n, noise * MIB) for b, peak, n, noise in seen]
    model = MemoryModel("cpu", 3, capacity, 411 * MIB, 10.6 * MIB, points=points)
    assert 565 * MIB * 1.01 < 0.85 * capacity < predict_peak(model, 16), "seen under, line over"
    found = safe_batch(model, 0.85)
    assert found is not None and found.size < 16


def test_a_micro_batch_seen_without_workers_is_not_safe_once_workers_take_the_room() -> None:
    """In benchmarks/advice_truth.py the transformer's 16 ran at 83% of its limit with no loader
    workers and was called safe after 2 workers had joined (8 MiB each); queued, it peaked at
    85.4-85.6%, over the edge. A batch seen safe is safe with the workers it was seen with."""
    points = [ModelPoint(b, (410 + 10 * b) * MIB, 10, 0) for b in (4, 8, 16)]
    alone = MemoryModel("cpu", 4, 680 * MIB, 410 * MIB, 10 * MIB, points=points, workers=0)
    seen = safe_batch(alone, 0.85)
    assert seen is not None and seen.size >= 16
    joined = msgspec.structs.replace(alone, workers=2, per_worker_bytes=8 * MIB)
    assert predict_peak(joined, 16) > 0.85 * 680 * MIB > predict_peak(alone, 16)
    found = safe_batch(joined, 0.85)
    assert found is not None and predict_peak(joined, found.size) <= 0.85 * 680 * MIB


def test_micro_batches_peaking_alike_still_get_a_max_safe_batch() -> None:
    """In benchmarks/advice_truth.py a parameter-heavy MLP peaked alike at 12, 16 and 32 (no slope),
    and its max safe batch was None ("no bound") though every batch ran over the edge band. Without
    a slope the interval still bounds it: none over the band, a guess past 4x the largest under."""
    points = [ModelPoint(b, 588 * MIB, 10, 0) for b in (12, 16, 32)]
    flat = MemoryModel("cpu", 12, 690 * MIB, 588 * MIB, 0.0, points=points)
    over = safe_batch(flat, 0.85)
    assert over is not None and over.size == 0, "588 MiB is 85.2% of 690 MiB at every batch"
    roomy = safe_batch(msgspec.structs.replace(flat, capacity_bytes=760 * MIB), 0.85)
    assert roomy is not None and 32 <= roomy.size <= GUESS_MULTIPLE * 32 + 1
    assert roomy.guess == (roomy.size > GUESS_MULTIPLE * 32)


@pytest.mark.parametrize(
    ("script", "before_mib", "after_mib"),
    [("mlp", 534.9, 552.2), ("cnn", 378.1, 395.4), ("transformer", 437.0, 452.7)],
)
def test_a_first_change_of_loader_workers_is_predicted_at_the_memory_workers_took(
    script: str, before_mib: float, after_mib: float
) -> None:
    """num_workers 0 -> 2 on the benchmark scripts (CPU stand-in, 1000 MiB limit, quiet): the
    peaks before and after the change as the hook measured them. Before a worker is measured the
    prediction counts WORKER_PRIOR_BYTES a worker; at 16 MiB it was 2.6-3.7% high every time."""
    before = int(before_mib * MIB)
    observation = Observation("cpu", 8, 1000 * MIB, before - 8 * MIB, before, before, workers=0)
    model = fit(observation)
    predicted = predict_peak(model, 8, 2)
    assert predicted / (after_mib * MIB) - 1 == pytest.approx(0, abs=0.01), script


def test_workers_memory_is_predicted_on_a_cpu_run() -> None:
    """Without a per-worker prior, num_workers 0 -> 64 on 2 CPUs was predicted at 371 MiB and seen
    at 899 MiB. A worker's measured memory counts per worker; before it is measured, the prediction
    counts WORKER_PRIOR_BYTES and the high end WORKER_GUESS_BYTES for each new one (so such a jump
    needs --force)."""
    base = line_model([8])
    none_yet = msgspec.structs.replace(base, workers=0, per_worker_bytes=0)
    assert predict_peak(none_yet, 8, 64) == predict_peak(none_yet, 8) + 64 * WORKER_PRIOR_BYTES
    assert predict_high(none_yet, 8, 64) >= predict_high(none_yet, 8) + 64 * WORKER_GUESS_BYTES
    assert Prediction.of(none_yet, 8, workers=64).over_danger
    measured = msgspec.structs.replace(base, workers=2, per_worker_bytes=8 * MIB)
    assert predict_peak(measured, 8, 6) - predict_peak(measured, 8, 2) == 4 * 8 * MIB
    # the observation takes the workers' memory out of the line: points at other worker
    # counts stay on it
    host = HostSample(
        time=0,
        ram_total_bytes=GIB,
        ram_available_bytes=GIB,
        ram_used_bytes=0,
        workers=2,
        workers_uss_bytes=16 * MIB,
    )
    samples = cpu_samples([424] * 4, GIB, in_use_mib=416)
    seen = observe(samples, 8, 0, None, workers=2, host=host)
    assert seen is not None and seen.per_worker_bytes == 8 * MIB
    assert seen.peak_allocated_bytes == 408 * MIB and seen.steady_bytes == 400 * MIB
    model = fit(seen)
    assert predict_peak(model, 8) == 424 * MIB, "the workers are added back"


# ----------------------------------------------------------------------------- the ceiling


def test_a_decrease_on_the_cpu_keeps_part_of_what_it_frees_and_is_never_risky() -> None:
    """On the CPU, decreases peaked 27-34% over the line's prediction (glibc kept the freed heap).
    Half the freed memory is predicted kept, the interval spans none to all of it, and a change that
    makes the run smaller never needs --force, even from over the danger band."""
    model = line_model([8, 16, 32], capacity=520 * MIB)  # at 32: 432 MiB, 83%
    line = 400 * MIB + 6 * MIB
    low, high = predict_range(model, 6)
    assert low <= line and high >= 432 * MIB
    assert predict_peak(model, 6) == pytest.approx(line + (432 * MIB - line) / 2, rel=1e-6)
    # at 32: 428 MiB, 93%, over the danger band
    hot = line_model([8, 16, 32], capacity=460 * MIB, steady=300 * MIB, per=4 * MIB)
    assert not Prediction.of(hot, 6).over_danger
    assert Prediction.of(hot, 33).over_danger
    assert 0 < (max_batch(hot, 0.85) or 0) < 32, "from the line: what a smaller batch needs"
    safe = max_batch(line_model([8, 16, 32], capacity=600 * MIB), 0.85)
    assert safe is not None and safe > 32, "the max safe batch is not lowered by what is kept"


def test_the_cpu_stand_in_keeps_nothing_on_a_decrease_and_its_point_counts() -> None:
    """With glibc's moving mmap threshold the CPU kept 0-100% of what a decrease freed (demo 8 -> 4
    +9.3%, MLP 35 -> 1 -20.4%). The stand-in fixes the threshold and gives freed blocks back: a
    decrease is predicted on the line, and the peak seen after it counts."""
    history = [ModelPoint(8, 408 * MIB, 10), ModelPoint(16, 416 * MIB, 10)]
    at_32 = Observation("cpu", 32, 520 * MIB, 400 * MIB, 432 * MIB, 432 * MIB, returns_freed=True)
    model = fit(at_32, history)
    assert model.returns_freed
    line = 400 * MIB + 6 * MIB
    assert predict_peak(model, 6) == pytest.approx(line, rel=0.001), "nothing kept"
    high = predict_high(model, 6)
    assert line < high < 432 * MIB, "no allowance for keeping 32's memory in the interval"
    after = Observation("cpu", 6, 520 * MIB, 400 * MIB, 406 * MIB, 406 * MIB, returns_freed=True)
    refit = fit(after, model.points)
    assert [p.batch_size for p in refit.points] == [6, 8, 16, 32], "the point after it counts"
    assert "left out" not in refit.basis


def test_an_oom_sets_a_ceiling_that_binds_and_survives_a_restart(tmp_path: Path) -> None:
    """Without a ceiling, after an OOM at 258 the max safe batch was still 258 and the top
    recommendation a bigger batch. The micro-batch that ran out of memory is a ceiling: the gate
    wants --force at or above it, the max safe batch stays under it, and the tuned YAML keeps it for
    the restart."""
    config = Config(grad_accum=1)
    tuner = Tuner(config, state_dir=tmp_path, options=Options(publish=False)).start()
    tuner.step()
    assert tuner.control.queue(SetRequest(changes={"batch_size": 32}, client="t")).ok
    tuner.checkpoint()
    assert config.batch_size == 32
    guard = tuner.guard()
    with guard:
        raise MemoryError("CPU out of memory (test). Tried to allocate 2.00 GiB")
    assert guard.rolled_back and config.batch_size == 16
    ceiling = tuner.control.ceiling
    assert ceiling is not None and ceiling.batch_size == 32
    assert "batch_size 16 -> 32" in ceiling.note
    refused = tuner.control.queue(SetRequest(changes={"batch_size": 40}, client="t"))
    assert not refused.ok and refused.needs_force
    assert "micro-batch 32 ran out of memory" in refused.reason
    assert tuner.control.queue(SetRequest(changes={"batch_size": 24}, client="t")).ok
    tuner.step()
    tuner.checkpoint()  # a later change rewrites the tuned YAML: the ceiling stays in it
    tuned = tuner.tuned_paths()[0]
    assert yaml.safe_load(tuned.read_text())["ceiling"]["batch_size"] == 32
    tuner.close()

    again = Config(grad_accum=1)
    restarted = Tuner(again, state_dir=tmp_path, options=Options(publish=False), resume=True)
    restarted.start()
    try:
        assert again.batch_size == 24
        assert restarted.control.ceiling == read_ceiling(tuned)
        assert restarted.control.state().ceiling is not None
        refused = restarted.control.queue(SetRequest(changes={"batch_size": 32}, client="t"))
        assert not refused.ok and refused.needs_force
        forced = restarted.control.queue(
            SetRequest(changes={"batch_size": 32}, client="t", force=True)
        )
        assert forced.ok, "--force still queues it: the operator decides"
    finally:
        restarted.close()


def test_the_ceiling_caps_workers_and_pinning_when_their_change_ran_out() -> None:
    """Workers and pinning are capped only when the change that ran out of memory raised them."""
    control = Control(lambda: Knobs(batch_size=8, grad_accum=1, num_workers=8, pin_memory=True))
    event = OomEvent(
        time=0,
        step=40,
        kind="cpu",
        message="x",
        config=Knobs(batch_size=8, grad_accum=1, num_workers=8, pin_memory=True),
    )
    control.record_oom(event, {"num_workers": KnobDiff(2, 8), "pin_memory": KnobDiff(False, True)})
    ceiling = control.ceiling
    assert ceiling == Ceiling(8, 8, True, 40, ceiling.note if ceiling else "")
    assert "num_workers 2 -> 8" in (ceiling.note if ceiling else "")
    reply = control.queue(SetRequest(changes={"num_workers": 9}, client="t", dry_run=True))
    assert reply.needs_force and "8 loader workers ran out of memory" in reply.note
    assert control.persisted()["ceiling"]["num_workers"] == 8


def test_recommendations_respect_the_ceiling_and_the_usable_cpus() -> None:
    """No option reaches what ran out of memory; more workers stop at the CPUs the run may use
    (not 2 -> 5 on a 2-CPU host)."""
    starving = Inputs(
        config=Knobs(batch_size=16, grad_accum=2, num_workers=0, pin_memory=False),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=0.12, data_wait_s=0.10, samples_per_s=266, steps_per_s=8.3
        ),
        samples_per_step=32,
        device_kind="cuda",
        cpus=8,
    )
    assert recommend(starving)[0].changes == {"num_workers": 6}
    two = recommend(dataclasses.replace(starving, cpus=2))[0]
    assert two.changes == {"num_workers": 2} and "capped by the 2 CPUs" in two.title
    at_cpus = dataclasses.replace(starving, cpus=2, config=Knobs(16, 2, 2, False))
    assert not any("more loader workers" in o.title for o in recommend(at_cpus))
    capped = dataclasses.replace(starving, ceiling=Ceiling(num_workers=4, pin_memory=True))
    options = recommend(capped)
    assert options[0].changes == {"num_workers": 3} and "out of memory" in options[0].title
    assert not any(o.changes.get("pin_memory") for o in options)
    # the micro-batch: an underused run would be told to double, not past the ceiling
    model = line_model([8, 16, 32], capacity=64 * GIB)
    roomy = Inputs(config=Knobs(32, 1, None, None), tunable=("batch_size",), model=model)
    assert recommend(roomy)[0].changes == {"batch_size": 64}
    under = recommend(dataclasses.replace(roomy, ceiling=Ceiling(batch_size=48)))
    assert under[0].changes["batch_size"] < 48


def test_usable_cpus_is_within_the_affinity() -> None:
    import os

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------- effects


def _steps(first: int, times: list[float], samples: int = 32) -> list[StepRecord]:
    return [
        StepRecord(first + i, float(first + i), t, t / 4, samples, 1) for i, t in enumerate(times)
    ]


def test_an_effect_inside_its_noise_says_no_measurable_change() -> None:
    """Without its interval, a no-op change was reported as -44% samples/s. An effect carries
    its 95% interval; inside it, it says "no measurable change"."""
    noisy = [0.10, 0.30, 0.12, 0.28, 0.11, 0.31, 0.09, 0.29, 0.10, 0.30]
    effect = measure(_steps(1, noisy), _steps(20, noisy[1:] + noisy[:1]))
    assert effect is not None and effect.speedup_margin is not None
    assert not measurable(effect)
    assert speed_words(effect).startswith("no measurable change")
    assert describe(effect).startswith("no measurable change")
    steady = [0.100, 0.101, 0.099, 0.100, 0.102, 0.098, 0.100, 0.101, 0.099, 0.100]
    faster = measure(_steps(1, steady), _steps(20, [t / 2 for t in steady]))
    assert faster is not None and measurable(faster)
    assert speed_words(faster).startswith("+100% +-")


def test_a_change_slower_only_within_the_noise_gets_no_revert() -> None:
    """The revert recommendation needs a slowdown outside the noise."""
    noisy = [0.10, 0.30, 0.12, 0.28, 0.11, 0.31, 0.09, 0.29, 0.10, 0.30]
    effect = measure(_steps(1, noisy), _steps(20, [t * 1.15 for t in noisy]))
    assert effect is not None and not measurable(effect)
    change = AppliedChange(
        ids=[1], step=50, time=0.0, changes={"num_workers": KnobDiff(0, 2)}, effect=effect
    )
    inputs = Inputs(
        config=Knobs(batch_size=16, grad_accum=2, num_workers=2, pin_memory=False),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        applied=(change,),
    )
    assert not any(o.title.startswith("revert") for o in recommend(inputs))


@pytest.mark.parametrize("margin", [None, 0.01])
def test_an_older_hooks_effect_without_a_margin_is_taken_as_measured(
    margin: float | None,
) -> None:
    effect = measure(_steps(1, [0.1] * 5), _steps(20, [0.2] * 5))
    assert effect is not None
    assert measurable(msgspec.structs.replace(effect, speedup_margin=margin))
