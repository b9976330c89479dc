"""The advice models alone: OOM parsing, memory prediction, effects, breakdown, recommendations."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec
import pytest

from memtui.advice.breakdown import breakdown
from memtui.advice.effect import describe, measure, speedup
from memtui.advice.oom import is_oom, parse_oom
from memtui.advice.predict import (
    Observation,
    confidence,
    fit,
    max_batch,
    predict_allocated,
    predict_high,
    predict_peak,
)
from memtui.advice.recommend import Inputs, expandable_segments_on, recommend
from memtui.advice.verdict import (
    THRESHOLDS,
    State,
    VerdictTracker,
    decide,
    describe_thresholds,
)
from memtui.advice.verdict import Inputs as VerdictInputs
from memtui.core.stats import MemoryStats, StepStats
from memtui.storage.paths import config_file as config_path
from memtui.storage.userconfig import load_thresholds
from memtui.wire import Ceiling, HostSample, Knobs, ModelPoint, StaticMemory, StepRecord

GIB = 1 << 30
MIB = 1 << 20

DOUBLED_BATCH_OOM = """torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.23 GiB.
GPU 0 has a total capacity of 19.58 GiB of which 1.06 GiB is free.
Including non-PyTorch memory, this process has 18.50 GiB memory in use.
Of the allocated memory 14.94 GiB is allocated by PyTorch, and 3.18 GiB is reserved by PyTorch but unallocated."""


def test_parse_the_oom_of_a_doubled_batch() -> None:
    report = parse_oom(DOUBLED_BATCH_OOM)
    assert report.kind == "cuda" and report.device_index == 0
    assert report.tried_bytes == pytest.approx(1.23 * GIB, rel=1e-6)
    assert report.capacity_bytes == pytest.approx(19.58 * GIB, rel=1e-6)
    assert report.free_bytes == pytest.approx(1.06 * GIB, rel=1e-6)
    assert report.process_in_use_bytes == pytest.approx(18.5 * GIB, rel=1e-6)
    assert report.allocated_bytes == pytest.approx(14.94 * GIB, rel=1e-6)
    assert report.reserved_unallocated_bytes == pytest.approx(3.18 * GIB, rel=1e-6)
    assert report.non_pytorch_bytes == pytest.approx(0.38 * GIB, rel=1e-3)
    assert report.fragmentation_fraction == pytest.approx(3.18 / 18.12, rel=1e-3)


def test_parse_older_and_other_processes() -> None:
    old = parse_oom(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
        "14.56 GiB already allocated; 3.88 MiB free; 14.69 GiB reserved in total by PyTorch)"
    )
    assert old.tried_bytes == 20 * MIB and old.allocated_bytes == pytest.approx(14.56 * GIB)
    assert old.reserved_unallocated_bytes == pytest.approx(0.13 * GIB, rel=1e-3)
    crowded = parse_oom(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of "
        "which 10.81 MiB is free. Process 2939 has 18.42 GiB memory in use. Including non-PyTorch "
        "memory, this process has 60.71 GiB memory in use."
    )
    assert crowded.other_processes == {2939: int(18.42 * GIB)}
    assert (
        is_oom(MemoryError())
        and is_oom(RuntimeError("CUDA out of memory."))
        and not is_oom(ValueError("x"))
    )
    assert parse_oom(MemoryError("CPU out of memory. Tried to allocate 1 GiB.")).kind == "cpu"


@pytest.mark.parametrize(
    "message",
    [
        # torch >= 2.3, as a real GPU test run raises it (tests/gpu: the huge micro-batch)
        "CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 41.56 GiB is free. Including non-PyTorch memory, this process has 37.62 GiB "
        "memory in use. Of the allocated memory 36.25 GiB is allocated by PyTorch, and 870.00 MiB "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)",
        # torch 2.1-2.2: "capacty", and the hint names max_split_size_mb
        "CUDA out of memory. Tried to allocate 36.00 GiB. GPU 0 has a total capacty of 79.19 GiB "
        "of which 41.56 GiB is free. Including non-PyTorch memory, this process has 37.62 GiB "
        "memory in use. Of the allocated memory 36.25 GiB is allocated by PyTorch, and 870.00 MiB "
        "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
        "setting max_split_size_mb to avoid fragmentation.",
    ],
)
def test_parse_recorded_cuda_messages(message: str) -> None:
    """Messages in the forms torch raises (numbers of a huge micro-batch on an 80 GB card)."""
    report = parse_oom(message)
    assert report.kind == "cuda" and report.device_index == 0
    assert report.tried_bytes == 36 * GIB
    assert report.capacity_bytes == pytest.approx(79.19 * GIB, rel=1e-6)
    assert report.free_bytes == pytest.approx(41.56 * GIB, rel=1e-6)
    assert report.process_in_use_bytes == pytest.approx(37.62 * GIB, rel=1e-6)
    assert report.allocated_bytes == pytest.approx(36.25 * GIB, rel=1e-6)
    assert report.reserved_unallocated_bytes == 870 * MIB
    assert report.reserved_bytes == pytest.approx(36.25 * GIB + 870 * MIB, rel=1e-6)


def test_parse_a_container_message_and_no_free_bytes() -> None:
    """In a container torch cannot tell its own process from others: every one is "Process N"."""
    report = parse_oom(
        "CUDA out of memory. Tried to allocate 204.00 MiB. GPU 1 has a total capacity of 47.53 GiB "
        "of which 0 bytes is free. Process 4711 has 47.43 GiB memory in use. Of the allocated "
        "memory 47.03 GiB is allocated by PyTorch, and 83.38 MiB is reserved by PyTorch but "
        "unallocated."
    )
    assert report.device_index == 1 and report.free_bytes == 0
    assert report.other_processes == {4711: int(47.43 * GIB)}
    assert report.process_in_use_bytes is None and report.tried_bytes == 204 * MIB


def test_one_point_model_flags_the_doubled_batch_a_hand_made_guess_let_through() -> None:
    """A hand-made guess put batch 32 at 12-16 GB and it ran out of memory at 18.5 GB; counting
    fragmentation and the context says more."""
    observation = Observation(
        kind="cuda",
        batch_size=16,
        capacity_bytes=int(19.58 * GIB),
        steady_bytes=int(4.0 * GIB),
        peak_allocated_bytes=int(9.6 * GIB),
        peak_reserved_bytes=int(11.0 * GIB),
        beyond_bytes=int(0.4 * GIB),
        samples=20,
    )
    model = fit(observation)
    assert model.per_sample_bytes == pytest.approx(5.6 * GIB / 16)
    assert confidence(model) == "low: one micro-batch seen, +-2% at 16"
    at_32 = predict_peak(model, 32)
    assert at_32 == pytest.approx((4.0 + 0.35 * 32) * 11.0 / 9.6 * GIB + 0.4 * GIB, rel=1e-6)
    assert at_32 > 0.9 * observation.capacity_bytes, "doubling would be flagged before apply"
    safe = max_batch(model, 0.85)  # from the interval's high end
    assert safe is not None and predict_high(
        model, safe
    ) <= 0.85 * model.capacity_bytes < predict_high(model, safe + 1)


def test_model_fits_a_line_through_observed_batches() -> None:
    history = [ModelPoint(8, 459 * MIB, 10), ModelPoint(16, 615 * MIB, 10)]
    observation = Observation("cpu", 32, 24 * GIB, 400 * MIB, 899 * MIB, 899 * MIB, 0, 10)
    model = fit(observation, history)
    assert [p.batch_size for p in model.points] == [8, 16, 32]
    assert model.fit_error is not None and model.fit_error < 0.05
    assert "3 micro-batches" in confidence(model)
    assert predict_allocated(model, 24) == pytest.approx(757 * MIB, rel=0.05)
    # a CPU run going down to 24 keeps half of what it frees at first (RETAINED_ON_DECREASE)
    line, now = predict_allocated(model, 24), 899 * MIB
    assert predict_peak(model, 24) == pytest.approx(line + (now - line) / 2, rel=1e-6)


def test_a_cpu_peak_seen_after_a_decrease_does_not_flatten_the_line() -> None:
    """32 -> 6 on the CPU kept most of 32's memory; taken as a point, it flattened the line and
    the max safe batch overshot. On CUDA the allocated bytes come down: the point counts."""
    history = [ModelPoint(8, 459 * MIB, 10), ModelPoint(32, 899 * MIB, 10)]
    retained = Observation("cpu", 6, 24 * GIB, 400 * MIB, 880 * MIB, 880 * MIB, 0, 10)
    model = fit(retained, history)
    assert [p.batch_size for p in model.points] == [8, 32], "the point at 6 is left out"
    assert model.per_sample_bytes == pytest.approx((899 - 459) * MIB / 24)
    assert "micro-batch 6 left out" in model.basis
    only = fit(retained, history[1:])  # one earlier point: the slope is that point's
    assert [p.batch_size for p in only.points] == [32]
    assert only.per_sample_bytes == pytest.approx((899 - 400) * MIB / 32)
    cuda = Observation("cuda", 6, 24 * GIB, 400 * MIB, 420 * MIB, 880 * MIB, 0, 10)
    assert [p.batch_size for p in fit(cuda, history).points] == [6, 8, 32]
    back_up = Observation("cpu", 64, 24 * GIB, 400 * MIB, 1779 * MIB, 1779 * MIB, 0, 10)
    assert [p.batch_size for p in fit(back_up, history).points] == [8, 32, 64]


def _steps(first: int, count: int, step_time: float, wait: float, samples: int) -> list[StepRecord]:
    return [StepRecord(first + i, 100.0 + i, step_time, wait, samples, 2) for i in range(count)]


def test_effect() -> None:
    before = _steps(1, 20, 0.12, 0.08, 32)
    after = _steps(21, 20, 0.05, 0.005, 32)
    effect = measure(before, after, int(9.6 * GIB), int(15.2 * GIB))
    assert effect is not None and speedup(effect) == pytest.approx(1.4, rel=1e-6)
    assert (
        describe(effect)
        == "+140% samples/s, step 120.0 ms -> 50.0 ms, data wait 67% -> 10%, peak 9.6 GiB -> 15.2 GiB"
    ), "steps all alike: a margin of 0, not shown"
    assert describe(
        measure(_steps(1, 3, 0.12, 0.08, 32), _steps(21, 3, 0.05, 0.005, 32))
    ).startswith("+140% samples/s")
    assert measure([], after) is None


def test_breakdown_adds_up_to_capacity() -> None:
    memory = MemoryStats(
        kind="cuda",
        capacity_bytes=24 * GIB,
        current_bytes=12 * GIB,
        reserved_bytes=18 * GIB,
        peak_bytes=19 * GIB,
        peak_allocated_bytes=16 * GIB,
        fragmentation_bytes=3 * GIB,
        nvml_used_bytes=20 * GIB,
        ooms=0,
        alloc_retries=0,
    )
    static = StaticMemory(
        kind="cuda",
        parameters_bytes=2 * GIB,
        gradients_bytes=2 * GIB,
        optimizer_bytes=4 * GIB,
        gradients_held_bytes=2 * GIB,
        between_steps_bytes=8 * GIB,
    )
    split = breakdown(memory, static)
    parts = split.as_dict()
    assert parts["parameters"] == 2 * GIB and parts["optimizer"] == 4 * GIB
    assert parts["activations"] == 8 * GIB and parts["fragmentation"] == 3 * GIB
    assert parts["beyond torch"] == 2 * GIB
    assert sum(parts.values()) == 24 * GIB


def _model(batch: int, peak_fraction: float) -> object:
    capacity = 24 * GIB
    return fit(
        Observation(
            "cuda",
            batch,
            capacity,
            4 * GIB,
            int(peak_fraction * capacity),
            int(peak_fraction * capacity),
        )
    )


def test_starving_recommends_more_workers_first() -> None:
    inputs = Inputs(
        config=Knobs(batch_size=16, grad_accum=2, num_workers=0, pin_memory=False),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=0.12, data_wait_s=0.08, samples_per_s=266, steps_per_s=8.3
        ),
        samples_per_step=32,
        host=HostSample(
            time=0, ram_total_bytes=32 * GIB, ram_available_bytes=20 * GIB, ram_used_bytes=12 * GIB
        ),
        device_kind="cuda",
        cpus=8,
    )
    options = recommend(inputs)
    assert options[0].changes == {"num_workers": 3} and options[0].applicable
    assert options[0].speed_delta == pytest.approx(0.12 / 0.04 - 1)
    assert any(o.changes == {"pin_memory": True} for o in options)


def test_a_change_measured_slower_is_followed_by_its_revert_not_more_of_the_same() -> None:
    """After num_workers 0 -> 2 was measured at -52% samples/s, the top recommendation is its
    revert, not num_workers 2 -> 5."""
    from memtui.wire import AppliedChange, Effect, KnobDiff

    slower = Effect(steps_before=20, steps_after=20, samples_per_s_before=266,
                    samples_per_s_after=128, step_time_s_before=0.12, step_time_s_after=0.25,
                    data_wait_s_before=0.08, data_wait_s_after=0.2)  # fmt: skip
    change = AppliedChange(ids=[1], step=50, time=0.0, changes={"num_workers": KnobDiff(0, 2)},
                           effect=slower)  # fmt: skip
    inputs = Inputs(
        config=Knobs(batch_size=16, grad_accum=2, num_workers=2, pin_memory=False),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=0.25, data_wait_s=0.2, samples_per_s=128, steps_per_s=4
        ),
        samples_per_step=32,
        applied=(change,),
    )
    options = recommend(inputs)
    assert options[0].changes == {"num_workers": 0} and options[0].title.startswith("revert #1")
    assert "52% slower" in options[0].why and options[0].speed_delta == pytest.approx(266 / 128 - 1)
    assert not [o for o in options if (o.changes.get("num_workers") or 0) > 2], options
    # the revert quotes the measured interval, and what undoing the change is expected to give
    ranged = msgspec.structs.replace(slower, speedup_low=-0.7, speedup_high=-0.2)
    undone = dataclasses.replace(inputs, applied=(msgspec.structs.replace(change, effect=ranged),))
    revert = recommend(undone)[0]
    assert "52% slower (-70% to -20%)" in revert.why, revert.why
    assert revert.speed_note.endswith("(+25% to +233%)"), revert.speed_note
    # an interval that holds zero (the run's drift counted) is no measured harm, whatever the
    # point estimate, and neither is a change that could not act on the run (never measured)
    unsure = msgspec.structs.replace(slower, speedup_low=-0.7, speedup_high=0.05)
    spans = dataclasses.replace(inputs, applied=(msgspec.structs.replace(change, effect=unsure),))
    assert not any(o.title.startswith("revert") for o in recommend(spans)), "inside the noise"
    idle = AppliedChange(ids=[1], step=50, time=0.0, changes={"pin_memory": KnobDiff(False, True)},
                         effect_note="pin_memory does nothing without an accelerator")  # fmt: skip
    pinned = dataclasses.replace(inputs, applied=(idle,), config=Knobs(16, 2, 2, True))
    assert not any(o.title.startswith("revert") for o in recommend(pinned)), "never measured"
    faster = dataclasses.replace(inputs, applied=(msgspec.structs.replace(
        change, effect=msgspec.structs.replace(slower, samples_per_s_after=255)),))  # fmt: skip
    assert not any(o.title.startswith("revert") for o in recommend(faster)), "-4%: not worth it"
    moved = dataclasses.replace(inputs, config=Knobs(batch_size=16, grad_accum=2, num_workers=3))
    assert not any(o.title.startswith("revert") for o in recommend(moved)), "since changed again"


def test_underused_recommends_a_bigger_micro_batch_keeping_the_effective_batch() -> None:
    inputs = Inputs(
        config=Knobs(batch_size=16, grad_accum=8, num_workers=4, pin_memory=True),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=1.0, data_wait_s=0.02, samples_per_s=128, steps_per_s=1
        ),
        samples_per_step=128,
        model=_model(16, 0.45),  # type: ignore[arg-type]
        device_kind="cuda",
    )
    top = recommend(inputs)[0]
    assert top.changes == {"batch_size": 32, "grad_accum": 4}, (
        "an underused card's 16x8 -> 32x4, effective 128 kept"
    )
    assert top.effective_batch == 128 and top.predicted_peak_bytes is not None
    assert top.memory_delta_bytes and top.memory_delta_bytes > 0


def _underused_at_accumulation_one(ceiling: Ceiling | None = None) -> Inputs:
    """A card at 45% with micro-batch 16 x 1 (and what ran out of memory, if anything)."""
    return Inputs(
        config=Knobs(batch_size=16, grad_accum=1, num_workers=4, pin_memory=True),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=1.0, data_wait_s=0.02, samples_per_s=16, steps_per_s=1
        ),
        samples_per_step=16,
        model=_model(16, 0.45),  # type: ignore[arg-type]
        device_kind="cuda",
        ceiling=ceiling,
    )


def test_underused_at_accumulation_one_grows_the_micro_batch_and_says_so() -> None:
    top = recommend(_underused_at_accumulation_one())[0]
    assert top.changes == {"batch_size": 32}, "never a no-op like 16 -> 16"
    assert "effective batch grows" in top.title and top.effective_batch == 32


def test_a_bigger_micro_batch_after_an_out_of_memory_error_says_it_stays_under_the_one_that_failed() -> (
    None
):
    failed = Ceiling(batch_size=40, step=90, note="out of memory at step 90")
    top = recommend(_underused_at_accumulation_one(failed))[0]
    assert top.changes == {"batch_size": 32}
    assert top.why.endswith("; under 40, the micro-batch that ran out of memory"), top.why


def test_near_oom_recommends_a_smaller_micro_batch_and_expandable_segments() -> None:
    model = _model(32, 0.92)
    memory = MemoryStats(
        "cuda", 24 * GIB, 18 * GIB, 20 * GIB, int(22 * GIB), int(19 * GIB), 3 * GIB, 22 * GIB, 0, 1
    )
    inputs = Inputs(
        config=Knobs(batch_size=32, grad_accum=2, num_workers=4, pin_memory=True),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=1.0, data_wait_s=0.0, samples_per_s=64, steps_per_s=1
        ),
        samples_per_step=64,
        memory=memory,
        model=model,  # type: ignore[arg-type]
        device_kind="cuda",
    )
    options = recommend(inputs)
    top = options[0]
    assert top.changes["batch_size"] < 32 and top.effective_batch is not None
    assert top.predicted_peak_bytes is not None and top.predicted_peak_bytes < 0.9 * 24 * GIB
    titles = [o.title for o in options]
    assert any("expandable_segments" in t and "restart" in t for t in titles)
    assert any("gradient checkpointing" in t for t in titles)
    assert all(not o.applicable for o in options if o.needs_restart)


@pytest.mark.parametrize(
    ("conf", "on"),
    [
        (None, False),
        ("", False),
        ("max_split_size_mb:128", False),
        ("expandable_segments:True", True),
        (" max_split_size_mb:128 , expandable_segments : True ", True),
        ("expandable_segments:False", False),
        ("expandable_segments:True,expandable_segments:False", False),
        ("backend:native,expandable_segments:True,garbage_collection_threshold:0.6", True),
    ],
)
def test_expandable_segments_read_from_the_allocator_settings(conf: str | None, on: bool) -> None:
    assert expandable_segments_on(conf) is on


@pytest.mark.parametrize(
    ("conf", "recommended"),
    [
        (None, True),  # an older hook that does not say: recommended, as before
        ("max_split_size_mb:128", True),
        ("expandable_segments:True", False),
        ("max_split_size_mb:128,expandable_segments:True", False),
    ],
)
def test_expandable_segments_recommended_only_where_not_already_set(
    conf: str | None, recommended: bool
) -> None:
    memory = MemoryStats(
        "cuda", 24 * GIB, 18 * GIB, 20 * GIB, int(22 * GIB), int(19 * GIB), 3 * GIB, 22 * GIB, 0, 1
    )
    inputs = Inputs(
        config=Knobs(batch_size=32, grad_accum=2, num_workers=4, pin_memory=True),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        memory=memory,
        model=_model(32, 0.92),  # type: ignore[arg-type]
        device_kind="cuda",
        alloc_conf=conf,
    )
    titles = [o.title for o in recommend(inputs)]
    assert any("expandable_segments" in t for t in titles) is recommended


def test_host_pressure_recommends_fewer_workers_and_no_pinning() -> None:
    inputs = Inputs(
        config=Knobs(batch_size=16, grad_accum=8, num_workers=8, pin_memory=True),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=1.0, data_wait_s=0.05, samples_per_s=128, steps_per_s=1
        ),
        samples_per_step=128,
        host=HostSample(
            time=0,
            ram_total_bytes=32 * GIB,
            ram_available_bytes=GIB,
            ram_used_bytes=31 * GIB,
            workers=8,
            workers_rss_bytes=16 * GIB,
            workers_uss_bytes=8 * GIB,
        ),
        host_pressure=True,
        device_kind="cuda",
    )
    options = recommend(inputs)
    assert options[0].changes == {"num_workers": 4}
    assert options[0].host_delta_bytes == -4 * GIB
    assert any(o.changes == {"pin_memory": False} for o in options)
    on_cpu = recommend(dataclasses.replace(inputs, device_kind="cpu"))
    assert not any("pin_memory" in o.changes for o in on_cpu), "torch pins nothing on a CPU run"
    assert not any("prefetch_factor" in o.changes for o in options), "not tunable here"

    ahead = dataclasses.replace(
        inputs,
        config=Knobs(batch_size=16, grad_accum=8, num_workers=8, prefetch_factor=6),
        tunable=("batch_size", "grad_accum", "num_workers", "prefetch_factor"),
    )
    less = [o for o in recommend(ahead) if "prefetch_factor" in o.changes]
    assert [(o.title, o.changes) for o in less] == [
        ("less prefetch: prefetch_factor 6 -> 2", {"prefetch_factor": 2})
    ]
    assert "each of the 8 workers holds 6 batches in host memory" in less[0].why


# ----------------------------------------------------------------------------- verdict v2


def test_verdict_underused_only_under_a_real_memory_bound() -> None:
    low = VerdictInputs(
        data_wait_fraction=0.05, peak_memory_fraction=0.4, peak_memory_bytes=8 * GIB,
        capacity_bytes=20 * GIB,
    )  # fmt: skip
    verdict = decide(low)
    assert verdict.state is State.UNDERUSED and verdict.severity == 0
    assert "room for a bigger micro-batch" in verdict.headline
    assert {r.label: r.value for r in verdict.reasons}["peak memory"] == "40% (8.0 GiB of 20.0 GiB)"
    # a CPU run measured against the host's whole RAM: no limit, so no "room" claimed
    host_only = dataclasses.replace(low, device_kind="cpu", capacity_is_limit=False)
    balanced = decide(host_only)
    assert balanced.state is State.BALANCED and "no memory limit known" in balanced.headline
    # starving wins over underused (more data first, then a bigger batch)
    assert decide(dataclasses.replace(low, data_wait_fraction=0.5)).state is State.STARVED
    assert decide(dataclasses.replace(low, peak_memory_fraction=0.6)).state is State.BALANCED


def test_verdict_host_pressure_names_workers_and_pinning() -> None:
    verdict = decide(
        VerdictInputs(
            data_wait_fraction=0.05, peak_memory_fraction=0.7, host_ram_fraction=0.93,
            workers=8, workers_bytes=12 * GIB, pin_memory=True,
        )
    )  # fmt: skip
    assert verdict.state is State.HOST_PRESSURE and verdict.severity == 1
    assert verdict.headline == "host RAM 93% used: loader workers / pin_memory"
    values = {r.label: r.value for r in verdict.reasons}
    assert values["loader workers"] == "8 holding 12.0 GiB"
    assert values["pin_memory"].startswith("on")
    # device memory risk is worse than host pressure
    both = decide(VerdictInputs(peak_memory_fraction=0.91, host_ram_fraction=0.95))
    assert both.state is State.OOM_RISK and both.severity == 2


@pytest.mark.parametrize(
    ("previous", "field", "value", "held", "released"),
    [
        (State.OOM_RISK, "peak_memory_fraction", 0.83, State.OOM_RISK, State.BALANCED),
        (State.STARVED, "data_wait_fraction", 0.28, State.STARVED, State.BALANCED),
        (State.UNDERUSED, "peak_memory_fraction", 0.61, State.UNDERUSED, State.BALANCED),
        (State.HOST_PRESSURE, "host_ram_fraction", 0.885, State.HOST_PRESSURE, State.BALANCED),
    ],
)
def test_verdict_hysteresis_holds_a_state_near_its_threshold(
    previous: State, field: str, value: float, held: State, released: State
) -> None:
    base = VerdictInputs(data_wait_fraction=0.1, peak_memory_fraction=0.7, host_ram_fraction=0.5)
    near = dataclasses.replace(base, **{field: value})
    assert decide(near).state is released  # one-shot: the plain thresholds
    kept = decide(near, previous=previous)
    assert kept.state is held and kept.held
    # what "held" means, in words: which state stays, and the number that would end it
    way = "rises over 63%" if held is State.UNDERUSED else "falls under"
    assert f"(still {held.value} until it {way}" in kept.headline, kept.headline
    assert "(held)" not in kept.headline
    # crossing back by more than the margin releases it
    far = {"peak_memory_fraction": 0.7, "data_wait_fraction": 0.1, "host_ram_fraction": 0.5}
    assert (
        decide(dataclasses.replace(base, **{field: far[field]}), previous=previous).state
        is released
    )


def test_verdict_tracker_does_not_flicker() -> None:
    tracker = VerdictTracker()
    seen = [
        tracker.update(VerdictInputs(data_wait_fraction=0.1, peak_memory_fraction=peak)).state
        for peak in (0.80, 0.86, 0.84, 0.86, 0.835, 0.81, 0.86)
    ]
    assert seen == [State.BALANCED] + [State.OOM_RISK] * 4 + [State.BALANCED, State.OOM_RISK]


def test_thresholds_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("verdict:\n  starved_wait_fraction: 0.2\n  memory_edge_fraction: 0.8\n")
    config = load_thresholds(env={"MEMTUI_CONFIG": str(path)})
    assert config.source == str(path) and config.problems == ()
    assert config.thresholds.starved_wait_fraction == 0.2
    assert config.thresholds.memory_edge_fraction == 0.8
    assert config.thresholds.memory_danger_fraction == THRESHOLDS.memory_danger_fraction
    assert decide(VerdictInputs(data_wait_fraction=0.25), config.thresholds).state is State.STARVED
    assert any("20%" in line for line in describe_thresholds(config.thresholds))


def test_thresholds_file_location_follows_xdg(tmp_path: Path) -> None:
    assert config_path({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "memtui/config.yaml"
    assert config_path({"MEMTUI_CONFIG": "/x/y.yaml", "XDG_CONFIG_HOME": "/z"}) == Path("/x/y.yaml")
    (tmp_path / "memtui").mkdir()
    (tmp_path / "memtui/config.yaml").write_text("verdict:\n  hysteresis: 0.05\n")
    config = load_thresholds(env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert config.thresholds.hysteresis == 0.05
    absent = load_thresholds(env={"XDG_CONFIG_HOME": str(tmp_path / "none")})
    assert absent.source == "built-in defaults" and absent.problems == ()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            "verdict:\n  starved: 0.2\n",
            "unknown key verdict.starved ignored (nearest known key: verdict.starved_wait_fraction)",
        ),
        (
            "verdikt:\n  starved_wait_fraction: 0.2\n",
            "unknown key verdikt ignored, with the key under it (starved_wait_fraction) "
            "(nearest known key: verdict:)",
        ),
        (
            "starved_wait_fraction: 0.2\n",
            "starved_wait_fraction is at the top level, where memtui reads nothing: it belongs "
            "under verdict: (verdict.starved_wait_fraction); ignored",
        ),
        (
            "memory_edge_fractoin: 0.8\nverdict: {}\n",
            "unknown key memory_edge_fractoin ignored (nearest known key: "
            "verdict.memory_edge_fraction)",
        ),
        (
            "verdict:\n  memory:\n    edge: 0.8\n",
            "unknown key verdict.memory ignored, with the key under it (edge) (nearest known key: "
            "verdict.memory_edge_fraction)",
        ),
        ("verdict:\n  starved_wait_fraction: lots\n", "'lots' is not a number"),
        ("verdict:\n  memory_edge_fraction: 85\n", "not a share in (0, 1]"),
        ("verdict:\n  memory_edge_fraction: 0.95\n", "must be under memory_danger_fraction"),
        ("verdict: [1, 2]\n", "verdict: is not a mapping"),
        ("verdict:\n  starved_wait_fraction: [0.2\n", "not valid YAML"),
        ("- a list\n", "not a mapping of sections"),
    ],
)
def test_bad_threshold_files_warn_in_one_line_and_keep_defaults(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    config = load_thresholds(path)
    assert len(config.problems) == 1 and "\n" not in config.problems[0]
    assert problem in config.problems[0], config.problems
    assert config.thresholds.memory_edge_fraction == THRESHOLDS.memory_edge_fraction
    assert config.thresholds.starved_wait_fraction == THRESHOLDS.starved_wait_fraction


def test_every_key_memtui_does_not_use_is_said_with_the_nearest_known_one(tmp_path: Path) -> None:
    """A file with keys at every level that memtui does not read: one line for each, naming the
    nearest known key; the keys it reads are used."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "verdikt:\n  hysteresis: 0.05\n  starved_wait_fraction: 0.2\n"
        "host_ram_fraction: 0.8\n"
        "colours: dark\n"
        "verdict:\n  starved_wait_fraction: 0.25\n  swap_growth: 1\n"
        "  thresholds:\n    edge: 0.8\n"
    )
    config = load_thresholds(path)
    assert config.thresholds.starved_wait_fraction == 0.25
    assert [line.removeprefix(f"{path}: ") for line in config.problems] == [
        "unknown key verdikt ignored, with the 2 keys under it (hysteresis, "
        "starved_wait_fraction) (nearest known key: verdict:)",
        "host_ram_fraction is at the top level, where memtui reads nothing: it belongs under "
        "verdict: (verdict.host_ram_fraction); ignored",
        "unknown key colours ignored (nearest known key: verdict:)",
        "unknown key verdict.swap_growth ignored (nearest known key: verdict.swap_growth_bytes)",
        "unknown key verdict.thresholds ignored, with the key under it (edge) (nearest known "
        "key: verdict.hysteresis)",
    ]


def test_a_named_config_file_that_is_missing_is_reported(tmp_path: Path) -> None:
    config = load_thresholds(env={"MEMTUI_CONFIG": str(tmp_path / "nope.yaml")})
    assert config.thresholds == THRESHOLDS and "no such file" in config.problems[0]


def test_verdicts_on_the_recorded_advice_stream() -> None:
    """The real CPU demo recording (tests/data/make_advice_stream.py): underused at batch 4 under
    its 900 MiB limit, balanced at batch 8; ``memtui status --json`` names the states."""
    from memtui.advice.assess import STATE_NAMES, assess
    from memtui.runs.report import build_status, status_json
    from memtui.transport.recording import read_recording
    from memtui.wire import Decoder, Snapshot, Telemetry

    recording = read_recording(Path(__file__).parents[1] / "data" / "demo_advice.mtrec")
    decoder = Decoder()
    snapshot: Snapshot | None = None
    for frame in recording.frames:  # the snapshot, brought up to 0.9 s (before any change)
        message = decoder.decode(frame.frame)
        if isinstance(message, Snapshot):
            snapshot = message
        elif isinstance(message, Telemetry) and snapshot is not None and frame.offset_s < 0.9:
            snapshot = msgspec.structs.replace(
                snapshot,
                control=message.control or snapshot.control,
                steps=[*snapshot.steps, *message.steps],
                device=[*snapshot.device, *message.device],
                host=[*snapshot.host, *([message.host] if message.host else [])],
            )
    assert snapshot is not None and snapshot.control.model is not None
    found = assess(snapshot)
    assert found.verdict.state is State.UNDERUSED and STATE_NAMES[State.UNDERUSED] == "UNDERUSED"
    assert found.breakdown is not None and found.breakdown.as_dict()["optimizer"] > 0
    assert found.max_safe_batch_size is not None and found.max_safe_batch_size > 4
    report = build_status(snapshot)
    data = json.loads(status_json(report))
    assert report.verdict.state == data["verdict"]["state"] == "UNDERUSED"
    assert data["verdict"]["thresholds_from"]
    assert data["recommendations"][0]["title"].startswith("bigger micro-batch")


def test_recommendations_follow_the_configured_thresholds() -> None:
    base = dict(
        config=Knobs(batch_size=16, grad_accum=8, num_workers=4, pin_memory=True),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20, step_time_s=1.0, data_wait_s=0.02, samples_per_s=128, steps_per_s=1
        ),
        samples_per_step=128,
        model=_model(16, 0.45),
        device_kind="cuda",
    )
    assert recommend(Inputs(**base))[0].title.startswith("bigger micro-batch")  # type: ignore[arg-type]
    stricter = Inputs(**base, underused_memory_fraction=0.40)  # type: ignore[arg-type]
    assert not any(r.title.startswith("bigger") for r in recommend(stricter))


BANDS = """verdict:
  underused_memory_fraction: 0.5
  memory_edge_fraction: 0.75
  memory_danger_fraction: 0.8
"""


def test_the_danger_gate_and_the_safe_batch_follow_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memtui.advice.assess import advise
    from memtui.hooks.control import Control
    from memtui.runs.state import RunState
    from memtui.tui.screens.edit import check_change, predict_change
    from memtui.wire import ControlState, MemoryModel, SetRequest

    path = tmp_path / "config.yaml"
    path.write_text(BANDS)
    monkeypatch.setenv("MEMTUI_CONFIG", str(path))
    bands = load_thresholds()
    # 24 GiB, 4 GiB steady, 0.8 GiB per sample: batch 20 is 83%, its interval's high end 89%
    # (under 90%, over 80%)
    model = _model(16, 0.70)
    assert isinstance(model, MemoryModel) and round(predict_peak(model, 20) / GIB, 1) == 20.0
    config = Knobs(batch_size=16, grad_accum=4, num_workers=2, pin_memory=False)
    tunable = ["batch_size", "grad_accum", "num_workers", "pin_memory"]
    by_default = Control(lambda: config, thresholds=THRESHOLDS)
    from_file = Control(lambda: config)  # the hook's: reads the config file like the viewer
    assert from_file.thresholds == bands.thresholds
    by_default.model = from_file.model = model
    bigger = SetRequest(changes={"batch_size": 20})
    assert by_default.queue(bigger).ok
    refused = from_file.queue(bigger)
    assert not refused.ok and refused.needs_force, refused
    assert "over the 80% danger band" in refused.reason
    assert "largest micro-batch predicted under 75% is 16" in refused.reason
    assert refused.max_safe_batch_size == 16 and by_default.queue(bigger).max_safe_batch_size == 19
    assert "queue it with --force" in refused.reason
    forced = from_file.queue(SetRequest(changes={"batch_size": 20}, force=True))
    assert forced.ok and "over the 80% danger band" in forced.note
    assert "--force" not in forced.note, "a forced change is not told to use --force"

    # the viewer's editor asks for the confirmation at the same bands
    state = RunState(thresholds=bands)
    state.control = ControlState(config=config, tunable=tunable, model=model)
    _value, resolved = check_change("batch_size", "20", state, False)
    prediction = predict_change(resolved, state)
    assert prediction is not None and prediction.over_danger
    assert prediction.max_safe_batch_size == 16 and (prediction.edge, prediction.danger) == (
        0.75,
        0.8,
    )
    assert not predict_change(resolved, RunState(control=state.control)).over_danger  # type: ignore[union-attr]

    # the recommendations: at 78% the file's edge (75%) calls for a smaller micro-batch
    near = ControlState(config=config, tunable=tunable, model=_model(16, 0.78))  # type: ignore[arg-type]
    verdict = decide(VerdictInputs())
    options = advise(near, None, None, None, None, verdict, bands.thresholds)
    assert options.max_safe_batch_size == 14
    smaller = options.recommendations[0]
    assert smaller.title.startswith("smaller micro-batch: batch_size 16 -> ")
    assert "edge band (largest under 75%: 14)" in smaller.why
    assert not advise(near, None, None, None, None, verdict).recommendations


def test_an_option_for_speed_predicted_inside_its_noise_is_not_offered() -> None:
    """Micro-batches 8 and 16 timed at the same cost per sample: a bigger one is predicted at
    +0% samples/s, which is no recommendation (the viewer offered it at "speed +0%" right after
    the autopilot undid it); with a fixed cost per micro-batch it gains and is offered."""
    from memtui.advice.recommend import NOISE_FLOOR, speed_noise
    from memtui.wire import AppliedChange, Effect, KnobDiff

    def offered(fixed_s: float, margin: float | None = None) -> list[str]:
        def step_s(batch: int) -> float:
            return 128 // batch * (fixed_s + 0.001 * batch)

        doubled = AppliedChange(
            [1], 100, 0.0, {"batch_size": KnobDiff(8, 16), "grad_accum": KnobDiff(16, 8)},
            effect=Effect(20, 20, 128 / step_s(8), 128 / step_s(16), step_s(8), step_s(16), 0.0,
                          0.0, speedup_margin=margin),
        )  # fmt: skip
        inputs = Inputs(
            config=Knobs(batch_size=16, grad_accum=8, num_workers=2, pin_memory=False),
            tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
            steps=StepStats(20, step_s(16), 0.0, 128 / step_s(16), 1 / step_s(16)),
            samples_per_step=128,
            model=_model(16, 0.45),  # type: ignore[arg-type]
            device_kind="cuda",
            applied=(doubled,),
        )
        return [o.title for o in recommend(inputs)]

    assert not [t for t in offered(0.0) if t.startswith("bigger micro-batch")], "+0%: not offered"
    assert not [t for t in offered(0.0005, margin=0.2) if t.startswith("bigger")], "+3% +-20%"
    assert offered(0.020)[0].startswith("bigger micro-batch"), "+38%: offered"
    quiet = Inputs(config=Knobs(batch_size=16), tunable=("batch_size",))
    assert speed_noise(quiet) == NOISE_FLOOR


def test_a_micro_batch_option_estimates_its_speed_from_two_timed_sizes() -> None:
    from memtui.wire import AppliedChange, Effect, KnobDiff

    # one micro-batch costs 20 ms + 1 ms per sample; the effective batch is 128, no data wait
    def step_s(batch: int) -> float:
        return 128 // batch * (0.020 + 0.001 * batch)

    base = dict(
        config=Knobs(batch_size=16, grad_accum=8, num_workers=2, pin_memory=False),
        tunable=("batch_size", "grad_accum", "num_workers", "pin_memory"),
        steps=StepStats(
            steps=20,
            step_time_s=step_s(16),
            data_wait_s=0.0,
            samples_per_s=128 / step_s(16),
            steps_per_s=1 / step_s(16),
        ),
        samples_per_step=128,
        model=_model(16, 0.45),
        device_kind="cuda",
    )
    once = recommend(Inputs(**base))[0]  # type: ignore[arg-type]
    assert once.title == "bigger micro-batch: batch_size 16 -> 32, grad_accum 8 -> 4"
    assert once.speed_delta is None
    assert once.speed_note.startswith("speed unknown until measured: only micro-batch 16 has")

    doubled = AppliedChange(
        ids=[1],
        step=100,
        time=0.0,
        changes={"batch_size": KnobDiff(8, 16), "grad_accum": KnobDiff(16, 8)},
        effect=Effect(
            steps_before=20,
            steps_after=20,
            samples_per_s_before=128 / step_s(8),
            samples_per_s_after=128 / step_s(16),
            step_time_s_before=step_s(8),
            step_time_s_after=step_s(16),
            data_wait_s_before=0.0,
            data_wait_s_after=0.0,
        ),
    )
    timed = recommend(Inputs(**base, applied=(doubled,)))[0]  # type: ignore[arg-type]
    assert timed.speed_delta == pytest.approx(step_s(16) / step_s(32) - 1)  # +38%
    assert "micro-batches 8, 16: 20.0 ms per micro-batch + 1.00 ms per sample" in timed.speed_note
    # a loader that starves with its workers bounds the step: a bigger micro-batch gains nothing
    starving = StepStats(
        steps=20, step_time_s=0.5, data_wait_s=0.5 - step_s(16), samples_per_s=256, steps_per_s=2
    )
    near = {**base, "steps": starving, "model": _model(16, 0.88), "applied": (doubled,)}
    smaller = next(o for o in recommend(Inputs(**near)) if o.title.startswith("smaller"))  # type: ignore[arg-type]
    assert smaller.speed_delta == pytest.approx(0.0)


def test_a_loop_whose_batches_memtui_never_timed_has_its_data_wait_unknown() -> None:
    """Steps that drew no batch memtui timed (a loop without a DataLoader, watched with no code)
    leave the data wait unknown: never STARVED, and the verdict and status say it is not
    measured rather than that the loader keeps up."""
    from memtui.advice.verdict import Inputs, decide
    from memtui.core.stats import summarize_steps

    untimed = [StepRecord(i, float(i), 0.1, 0.0, 32, 0) for i in range(1, 21)]
    steps = summarize_steps(untimed)
    assert steps is not None and not steps.data_wait_measured
    verdict = decide(
        Inputs(
            data_wait_fraction=steps.data_wait_fraction,
            step_time_s=steps.step_time_s,
            data_wait_s=steps.data_wait_s,
            data_wait_measured=steps.data_wait_measured,
        )
    )
    assert verdict.state.name == "BALANCED" and verdict.headline == "data wait not measured"
    assert any(r.value == "not measured (no DataLoader seen)" for r in verdict.reasons)
    timed = [StepRecord(i, float(i), 0.1, 0.05, 32, 1) for i in range(1, 21)]
    measured = summarize_steps(timed)
    assert measured is not None and measured.data_wait_measured
