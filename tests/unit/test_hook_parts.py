"""The hook's parts on their own: the step ledger, the knob store, the measurement functions and
the one Prediction, each through its public methods (no threads, no sockets, no training)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from memtui.advice.effect import SETTLE_STEPS
from memtui.advice.measure import (
    EFFECT_STEPS,
    effects_due,
    measuring,
    model_moved,
    observe,
    peak_between,
)
from memtui.advice.predict import fit
from memtui.advice.prediction import Prediction
from memtui.advice.verdict import Thresholds
from memtui.core.knobs import KnobError, diff, format_diffs, knobs_with, merge
from memtui.hooks.control import Control
from memtui.hooks.device import allocator_settings
from memtui.hooks.errors import ErrorLog
from memtui.hooks.knobstore import KnobStore
from memtui.hooks.ledger import MAX_STEP_BATCHES, StepLedger
from memtui.hooks.persist import AuditLog
from memtui.wire import (
    STEP_AFTER_CHECKPOINT,
    AppliedChange,
    DeviceSample,
    KnobDiff,
    Knobs,
    SetRequest,
    StaticMemory,
)

MIB = 1 << 20


class Source:
    """A loader stand-in that takes re-queued indices (or refuses them)."""

    def __init__(self, accepts: bool = True) -> None:
        self.accepts = accepts
        self.back: list[int] = []

    def requeue(self, indices: list[int]) -> bool:
        if self.accepts:
            self.back.extend(indices)
        return self.accepts


# ---------------------------------------------------------------------- the step ledger


def test_ledger_closes_a_step_with_its_tallies() -> None:
    ledger = StepLedger()
    ledger.start_clock()
    ledger.on_batch(0.010, 8)
    ledger.on_batch(0.020, 8)
    ledger.mark(STEP_AFTER_CHECKPOINT)
    assert ledger.open_step() == (16, 2)
    ledger.close_step()
    assert ledger.step == 1
    (step, _end, dt, wait, samples, micro, flags) = ledger.drain_steps()[0]
    assert (step, samples, micro, flags) == (1, 16, 2, STEP_AFTER_CHECKPOINT)
    assert wait == pytest.approx(0.030) and dt >= 0
    assert ledger.open_step() == (0, 0) and ledger.drain_steps() == []
    ledger.close_step(samples=5)
    assert ledger.drain_steps()[0][4] == 5, "the caller's count wins"


def test_ledger_requeues_the_open_step_and_counts_what_it_cannot() -> None:
    ledger = StepLedger()
    good, bad = Source(), Source(accepts=False)
    ledger.on_batch(0.0, 3, good, [1, 2, 3])
    ledger.on_batch(0.0, 2, bad, [4, 5])
    ledger.on_batch(0.0, 4, bad)  # a loader that keeps no indices
    assert ledger.requeue() == (3, 6)
    assert good.back == [1, 2, 3]
    ledger.reset_open_step()
    assert ledger.open_step() == (0, 0) and ledger.requeue() == (0, 0)


def test_ledger_bounds_what_it_keeps() -> None:
    ledger = StepLedger()
    source = Source()
    for i in range(MAX_STEP_BATCHES + 10):
        ledger.on_batch(0.0, 1, source, [i])
    assert ledger.open_step() == (MAX_STEP_BATCHES + 10, MAX_STEP_BATCHES + 10), "all counted"
    requeued, skipped = ledger.requeue()
    assert (requeued, skipped) == (MAX_STEP_BATCHES, 10), "beyond the cap: counted as skipped"
    assert source.back == list(range(10, MAX_STEP_BATCHES + 10)), "the latest are kept"
    for _ in range(20_000):
        ledger.close_step()
    assert len(ledger.drain_steps()) == 16384, "the outbox keeps the newest records"


def test_ledger_records_are_wall_clock() -> None:
    ledger = StepLedger()
    ledger.close_step()
    ledger.close_checkpoint(123.0, 0.5)
    (record,) = ledger.records(ledger.drain_steps())
    assert abs(record.end_time - __import__("time").time()) < 5
    (checkpoint,) = ledger.drain_checkpoints()
    assert (checkpoint.step, checkpoint.time, checkpoint.save_s) == (1, 123.0, 0.5)


# ---------------------------------------------------------------------- the knob store


def test_store_reads_applies_all_or_none_and_bumps_loaders() -> None:
    config = SimpleNamespace(batch_size=8, gradient_accumulation_steps=2)
    store = KnobStore(config, None, ErrorLog().report)
    assert store.knobs == Knobs(batch_size=8, grad_accum=2)
    assert store.tunable() == ["batch_size", "grad_accum"]
    generation = store.loader_generation
    diffs = store.apply({"batch_size": 16, "grad_accum": 2}, step=40)
    assert diffs == {"batch_size": KnobDiff(8, 16)}, "an unchanged knob is no change"
    assert config.batch_size == 16 and store.memory_since_step == 40
    assert store.loader_generation == generation + 1
    with pytest.raises(KnobError, match="not tunable"):
        store.check({"num_workers": 2})
    store.adopt({"num_workers": 0, "pin_memory": False, "batch_size": 99})
    assert store.knobs == Knobs(batch_size=16, grad_accum=2, num_workers=0, pin_memory=False)


def test_a_knob_found_after_a_viewer_attached_moves_the_control_seq() -> None:
    """Under ``memtui run`` the loader's knobs are found at the first step, after the run
    registered (and a viewer may have attached): every change of the store (a knob adopted, a
    reason, a value read, a change applied) and of where changes apply moves ``seq``, so the
    next batch carries the control state; the state says the values read of the knobs memtui
    cannot change."""
    store = KnobStore(SimpleNamespace(), None, ErrorLog().report)
    control = Control(
        store.current,
        why_not=store.untunable_reasons,
        read_values=store.untunable_values,
        version=lambda: store.version,
    )
    seen = [control.seq]
    store.refuse("batch_size", "the loop's own code sets it", 4)
    seen.append(control.seq)
    store.refuse("grad_accum", "the loop's own code sets it")
    seen.append(control.seq)
    store.adopt({"num_workers": 0, "pin_memory": False, "prefetch_factor": 2})
    seen.append(control.seq)
    control.boundary = "the training DataLoader's next epoch"
    seen.append(control.seq)
    store.apply({"num_workers": 2}, step=10)
    seen.append(control.seq)
    assert seen == sorted(set(seen)), f"every change moves it, up: {seen}"
    state = control.state()
    assert state.tunable == ["num_workers", "pin_memory", "prefetch_factor"]
    assert state.untunable_values == {"batch_size": 4}
    assert set(state.untunable) == {"batch_size", "grad_accum"}
    assert state.boundary == "the training DataLoader's next epoch"


def test_a_change_pending_when_the_run_ends_is_recorded_and_audited(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.jsonl", "run")
    control = Control(lambda: Knobs(batch_size=8, num_workers=0), audit=audit, step=lambda: 42)
    assert control.queue(SetRequest(changes={"num_workers": 2})).ok
    before = control.seq
    left = control.close()
    assert [c.changes for c in left] == [{"num_workers": 2}]
    state = control.state()
    assert state.pending == [] and [c.id for c in state.unapplied] == [1]
    assert control.seq > before, "the last batch carries it"
    last = audit.read()[-1]
    assert last["event"] == "unapplied" and last["reason"] == "pending at exit"
    assert (last["ids"], last["changes"], last["step"]) == ([1], {"num_workers": 2}, 42)
    assert control.close() == [], "said once"
    late = control.queue(SetRequest(changes={"num_workers": 3}))
    assert not late.ok and "the run has ended" in late.reason


HOW = re.compile(r"; to make (it|them) tunable, \S")
"""How a reason that a knob is not tunable says what makes it tunable."""


def test_a_knob_the_config_does_not_hold_says_how_to_make_it_tunable() -> None:
    """A config without ``grad_accum`` (under a name memtui does not look for): the refusal says
    to name it with ``knobs=``, with the config's own name for it; a loader knob also names
    ``tuner.loader(factory)``; a value memtui cannot use says to give it one."""
    config = SimpleNamespace(batch_size=8, accum_steps=4, num_workers=-1)
    store = KnobStore(config, None, ErrorLog().report)
    with pytest.raises(KnobError) as refused:
        store.check({"grad_accum": 2})
    assert str(refused.value) == (
        "grad_accum is not tunable in this run: the config given to hooks.install holds no "
        "grad_accum under the names memtui looks for (gradient_accumulation_steps, grad_accum, "
        "accumulation_steps); to make it tunable, name yours: hooks.install(..., "
        'knobs={"grad_accum": "accum_steps"})'
    )
    reasons = store.untunable_reasons()
    assert set(reasons) == {"grad_accum", "num_workers", "pin_memory", "prefetch_factor"}
    assert all(HOW.search(why) for why in reasons.values()), reasons
    assert "tuner.loader(factory)" in reasons["pin_memory"]
    assert reasons["num_workers"] == (
        "num_workers=-1 in your config is not a value memtui can use (num_workers must be 0 or "
        "more, got -1); to make it tunable, give it one"
    )


def test_every_reason_a_knob_is_not_tunable_says_how_to_make_it_tunable() -> None:
    """Each reason the hook gives (the no-code watch's, Accelerate's, a loader Lightning cannot
    have rebuilt, the queue's last resort) says what makes the knob tunable; every call that
    records a reason in the hook passes one that says it, or one of those."""
    import ast
    import inspect

    import torch
    from torch.utils.data import BatchSampler, DataLoader, Sampler, TensorDataset

    from memtui.core.knobs import resolve
    from memtui.hooks import auto, rebuild
    from memtui.hooks.adapters import accelerate, lightning

    data = TensorDataset(torch.arange(10))

    class Mine(DataLoader):  # type: ignore[type-arg]
        """A loader class of the script's own."""

    class Endless(Sampler):  # type: ignore[type-arg]
        """A sampler with no length."""

        def __iter__(self) -> Any:
            return iter(range(10))

    class Pairs(BatchSampler):
        """A batch sampler of the script's own."""

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        """A dataset read as a stream."""

        def __iter__(self) -> Any:
            return iter(range(10))

    unrebuilt = [
        [torch.zeros(2)],
        Mine(data, batch_size=2),
        DataLoader(Stream(), batch_size=2),
        DataLoader(data, batch_size=None),
        DataLoader(data, batch_sampler=Pairs(range(10), 2, False)),
        DataLoader(data, batch_size=2, sampler=Endless()),
    ]
    reasons = [rebuild.why_not_rebuilt(loader) for loader in unrebuilt]
    reasons += [auto.BATCH_IN_CODE, auto.NO_LOADER, auto.ITERABLE, accelerate.OWN_COUNT]
    with pytest.raises(KnobError) as refused:
        resolve({"grad_accum": 2}, Knobs(batch_size=8), ["batch_size"])
    reasons.append(str(refused.value))
    wrong = [why for why in reasons if not HOW.search(why)]
    assert not wrong, wrong

    # every reason recorded in the hook: a literal says it, a name is one of those above
    said = {"BATCH_IN_CODE", "NO_LOADER", "ITERABLE", "OWN_COUNT", "why"}
    recorders = {"refuse": 1, "withdraw": 1, "_refuse_loader_knobs": 0}
    found = 0
    for module in (auto, accelerate, lightning, rebuild):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            where = recorders.get(node.func.attr)
            if where is None or len(node.args) <= where:
                continue  # Control.withdraw(origin): the autopilot's changes, not a knob
            reason = node.args[where]
            found += 1
            if isinstance(reason, ast.Name):
                assert reason.id in said, ast.unparse(node)
            else:
                assert HOW.search(ast.unparse(reason)), ast.unparse(node)
    assert found >= 8, found


def test_the_memory_models_window_restarts_when_the_workers_change() -> None:
    """Samples at another worker count would count the workers' memory as the peak's noise (a
    live demo's interval at its measured micro-batch went from +-2% to +-24% after 0 -> 1)."""
    config = SimpleNamespace(batch_size=8, gradient_accumulation_steps=2, num_workers=0)
    store = KnobStore(config, None, ErrorLog().report)
    store.apply({"num_workers": 1}, step=25)
    assert store.memory_since_step == 25
    store.apply({"grad_accum": 4}, step=50)
    assert store.memory_since_step == 25, "the accumulation does not move the peak"


def test_store_leaves_the_config_whole_when_a_write_fails() -> None:
    class Stubborn:
        batch_size = 8
        _accum = 2

        @property
        def gradient_accumulation_steps(self) -> int:
            return self._accum

        @gradient_accumulation_steps.setter
        def gradient_accumulation_steps(self, value: int) -> None:
            raise RuntimeError("read-only")

    config = Stubborn()
    errors = ErrorLog()
    store = KnobStore(config, None, errors.report)
    with pytest.raises(KnobError, match="could not write"):
        store.apply({"batch_size": 16, "grad_accum": 4}, step=1)
    assert config.batch_size == 8 and store.knobs == Knobs(batch_size=8, grad_accum=2)
    assert errors.count == 1 and "apply" in errors.last


def test_pending_changes_merge_and_diffs_are_worded() -> None:
    base = Knobs(batch_size=8, grad_accum=2)
    assert merge([{"batch_size": 4}, {"batch_size": 6, "grad_accum": 3}]) == {
        "batch_size": 6,
        "grad_accum": 3,
    }
    assert knobs_with(base, {"num_workers": 2}) == Knobs(8, 2, 2)
    changes = diff(base, {"batch_size": 16, "grad_accum": 2})
    assert format_diffs(changes) == "batch_size 8 -> 16"


# ---------------------------------------------------------------------- measuring


def sample(step: int, allocated: int, kind: str = "cpu", **more: int) -> DeviceSample:
    return DeviceSample(
        time=float(step),
        step=step,
        kind=kind,
        capacity_bytes=1024 * MIB,
        allocated_bytes=allocated,
        peak_allocated_bytes=more.pop("peak", allocated),
        reserved_bytes=more.pop("reserved", allocated),
        **more,  # type: ignore[arg-type]
    )


def test_observe_waits_for_settled_samples_and_takes_the_floor_and_peak() -> None:
    samples = [sample(s, (100 + s) * MIB, peak=(150 + s) * MIB) for s in range(10, 20)]
    assert observe(samples[:2], 8, since_step=0, static=None) is None, "fewer than three"
    assert observe(samples, 8, since_step=30, static=None) is None, "none after settling"
    seen = observe(samples, 8, since_step=10, static=None)
    assert seen is not None and seen.samples == 20 - (10 + SETTLE_STEPS) - 1
    assert seen.steady_bytes == (100 + 13) * MIB and seen.peak_allocated_bytes == 169 * MIB


def test_observe_on_cpu_counts_gradients_made_within_each_step_as_steady() -> None:
    """Gradients freed before every boundary are missing from the memory between steps but do
    not grow with the batch: the one-point model counts them as steady, not per sample."""
    samples = [sample(s, 500 * MIB, peak=580 * MIB) for s in range(5, 10)]
    freed = StaticMemory(kind="cpu", gradients_bytes=40 * MIB, gradients_held_bytes=0)
    kept = StaticMemory(kind="cpu", gradients_bytes=40 * MIB, gradients_held_bytes=40 * MIB)
    unseen = StaticMemory(kind="cpu", gradients_bytes=40 * MIB)
    made = observe(samples, 32, 0, freed)
    assert made is not None and made.steady_bytes == 540 * MIB
    for static in (kept, unseen, None):
        seen = observe(samples, 32, 0, static)
        assert seen is not None and seen.steady_bytes == 500 * MIB
    model = fit(made)
    assert model.per_sample_bytes == pytest.approx(40 * MIB / 32)


def test_observe_on_cuda_counts_the_exact_static_and_beyond_torch() -> None:
    static = StaticMemory(kind="cuda", parameters_bytes=300 * MIB, optimizer_bytes=100 * MIB)
    samples = [sample(s, 200 * MIB, kind="cuda", nvml_used_bytes=700 * MIB) for s in range(5, 10)]
    seen = observe(samples, 4, since_step=0, static=static)
    assert seen is not None
    assert seen.steady_bytes == 400 * MIB, "the tensors' exact size beats the sampled floor"
    assert seen.beyond_bytes == 500 * MIB


def test_model_moved_only_when_the_refit_is_news() -> None:
    samples = [sample(s, 200 * MIB, peak=300 * MIB) for s in range(5, 10)]
    seen = observe(samples, 8, 0, None)
    assert seen is not None
    model = fit(seen)
    assert model_moved(None, model, 8)
    assert not model_moved(model, model, 8)
    bigger = fit(observe([sample(s, 200 * MIB, peak=600 * MIB) for s in range(5, 10)], 8, 0, None))  # type: ignore[arg-type]
    assert model_moved(model, bigger, 8)


def test_peak_between_on_cuda_adds_memory_beyond_torch() -> None:
    samples = [
        sample(1, 100 * MIB, kind="cuda", reserved=200 * MIB, nvml_used_bytes=260 * MIB),
        sample(2, 100 * MIB, kind="cuda", reserved=250 * MIB, nvml_used_bytes=300 * MIB),
    ]
    assert peak_between(samples, 0, 2) == 300 * MIB
    assert peak_between(samples, 2, 5) is None


def raw(step: int, dt: float, samples: int = 8) -> tuple[int, float, float, float, int, int, int]:
    return (step, float(step), dt, 0.0, samples, 1, 0)


def test_effects_due_compares_before_and_after_once_enough_ran() -> None:
    ledger = StepLedger()
    change = AppliedChange(ids=[1], step=20, time=0.0, changes={"batch_size": KnobDiff(8, 16)})
    before = [raw(s, 0.10) for s in range(1, 21)]
    after = [raw(s, 0.05) for s in range(21, 21 + SETTLE_STEPS + EFFECT_STEPS)]
    samples = [sample(s, (100 if s < 20 else 180) * MIB) for s in range(1, 45)]
    assert effects_due([change], before + after[:5], samples, ledger.records) == []
    found = effects_due([change], before + after[:5], samples, ledger.records, final=True)
    assert len(found) == 1, "at the end, what ran is measured"
    (measured,) = effects_due([change], before + after, samples, ledger.records)
    assert measured.effect.samples_per_s_after == pytest.approx(
        2 * measured.effect.samples_per_s_before
    )
    assert measured.peak_after == 180 * MIB and measured.effect.peak_bytes_before == 100 * MIB
    rollback = AppliedChange(ids=[], step=20, time=0.0, changes={}, rollback=True)
    assert effects_due([rollback], before + after, samples, ledger.records) == []


def test_measuring_says_when_a_change_waits_for_its_effect_or_speed_prediction() -> None:
    """The agent's once-a-second learning skips the effect and speed measures unless this says
    that one of them may find something: exactly the changes ``effects_due`` and
    ``speed_prediction_due`` would look at."""
    ledger = StepLedger()
    change = AppliedChange(ids=[1], step=20, time=0.0, changes={"batch_size": KnobDiff(8, 16)})
    assert not measuring([]) and measuring([change])
    before = [raw(s, 0.10) for s in range(1, 21)]
    after = [raw(s, 0.05) for s in range(21, 21 + SETTLE_STEPS + EFFECT_STEPS)]
    samples = [sample(s, (100 if s < 20 else 180) * MIB) for s in range(1, 45)]
    (measured,) = effects_due([change], before + after, samples, ledger.records)
    done = msgspec.structs.replace(change, effect=measured.effect, speed_note="predicted")
    assert not measuring([done]), "measured and predicted: nothing to do"
    assert measuring([msgspec.structs.replace(done, speed_note="")]), "its speed is not predicted"
    rollback = AppliedChange(ids=[], step=30, time=0.0, changes={}, rollback=True)
    assert not measuring([done, rollback]), "a rollback is neither measured nor predicted"
    assert measuring([msgspec.structs.replace(done, effect=None), rollback]), "an effect waits"


def test_a_fast_run_s_effect_waits_for_device_samples_at_the_new_config() -> None:
    """Steps faster than the sampler: the 20 steps compared fall between two samples, so the
    peak after is taken over the samples read wholly at the new config once three have come
    (the first after the change began reading at the old one: its high-water mark is the old
    micro-batch's: in benchmarks/advice_truth.py a 16 -> 3 was "observed" at 16's peak)."""
    ledger = StepLedger()
    change = AppliedChange(ids=[1], step=200, time=0.0, changes={"batch_size": KnobDiff(8, 16)})
    steps = [raw(s, 0.02) for s in range(150, 260)]
    before = [sample(s, 100 * MIB) for s in (120, 160, 199)]
    straddling = [sample(250, 180 * MIB, peak=300 * MIB)]
    three_after = [sample(270, 180 * MIB), sample(310, 190 * MIB), sample(350, 185 * MIB)]
    samples = before + straddling + three_after
    assert effects_due([change], steps, samples[:-1], ledger.records) == [], "waits"
    (measured,) = effects_due([change], steps, samples, ledger.records)
    assert measured.peak_after == 190 * MIB, "not the straddling sample's 300 MiB"
    assert measured.effect.peak_bytes_before == 100 * MIB
    later = AppliedChange(ids=[2], step=300, time=0.0, changes={"batch_size": KnobDiff(16, 4)})
    (first,) = effects_due([change, later], steps, samples, ledger.records, final=True)
    assert first.peak_after == 180 * MIB, "the peak stops at the next change (not measured yet)"


def test_observe_leaves_out_a_sample_whose_reading_began_before_the_change() -> None:
    """The model's observation after a decrease takes no sample that began reading at the
    larger micro-batch: its peak is that batch's, and a point at it would flatten the line."""
    old = [sample(s, 500 * MIB) for s in (90, 95, 99)]
    straddling = sample(103, 200 * MIB, peak=515 * MIB)
    new = [sample(s, 200 * MIB, peak=(300 + s % 3) * MIB) for s in (110, 118, 126, 134)]
    seen = observe([*old, straddling, *new], 3, since_step=100, static=None)
    assert seen is not None and seen.samples == 4, "from 110 on: each began reading after step 102"
    assert seen.peak_allocated_bytes <= 302 * MIB


# ---------------------------------------------------------------------- one prediction


def test_prediction_against_the_bands_in_force() -> None:
    model = fit(observe([sample(s, 100 * MIB, peak=400 * MIB) for s in range(5, 10)], 8, 0, None))  # type: ignore[arg-type]
    assert not Prediction.of(None, 8).known and Prediction.of(model, None).warning == ""
    tight = Thresholds(memory_edge_fraction=0.30, memory_danger_fraction=0.35)
    prediction = Prediction.of(model, 9, tight)  # a change that grows the run
    assert prediction.known and prediction.over_danger
    assert not Prediction.of(model, 4, tight).over_danger, "one that shrinks it is never risky"
    assert "over the 35% danger band" in prediction.warning
    assert prediction.describe().startswith("predicted peak")
    assert not Prediction.of(model, 9).over_danger, "the default bands"


# ---------------------------------------------------------------------- the facade


def test_the_tuner_touches_nothing_until_started(tmp_path: object) -> None:
    import sys
    import threading
    from pathlib import Path

    from memtui.hooks import Options, Tuner

    state = Path(str(tmp_path)) / "state"
    threads, hook = threading.active_count(), sys.excepthook
    tuner = Tuner(SimpleNamespace(batch_size=4), state_dir=state, options=Options())
    assert not state.exists() and threading.active_count() == threads
    assert sys.excepthook is hook and tuner.agent is None and tuner.info is None
    tuner.step()  # the hot path works before start
    assert tuner.step_count == 1
    try:
        assert tuner.start() is tuner and tuner.start() is tuner, "start once"
        assert tuner.agent is not None and tuner.sampler is not None and sys.excepthook is not hook
        assert tuner.info is not None and tuner.info.run == tuner.run_id
    finally:
        tuner.close()
        sys.excepthook = hook


def test_raw_steps_encode_exactly_as_step_records() -> None:
    """Telemetry carries the ledger's tuples as they are: the bytes are a StepRecord's."""
    from memtui.wire import Decoder, Telemetry, encode

    ledger = StepLedger()
    ledger.on_batch(0.25, 8)
    ledger.close_step()
    raw = ledger.drain_steps()
    as_tuples = Telemetry(run="r", rank=0, seq=1, time=0.0, step=1, steps=raw)  # type: ignore[arg-type]
    as_structs = Telemetry(run="r", rank=0, seq=1, time=0.0, step=1, steps=ledger.records(raw))
    assert encode(as_tuples) == encode(as_structs)
    decoded = Decoder().decode(encode(as_tuples))
    assert isinstance(decoded, Telemetry) and decoded.steps == ledger.records(raw)


def test_accuracy_counts_a_change_that_ran_out_of_memory_as_a_miss() -> None:
    """A change that ran out of memory counts in the accuracy figure, as the miss it was."""
    from memtui.advice.measure import accuracy
    from memtui.wire import AppliedChange, KnobDiff, Knobs, OomEvent

    def applied(step: int, new: int, predicted: int | None, observed: int | None) -> AppliedChange:
        return AppliedChange(
            ids=[step], step=step, time=0.0, changes={"batch_size": KnobDiff(new // 2, new)},
            predicted_peak_bytes=predicted, observed_peak_bytes=observed,
        )  # fmt: skip

    history = [applied(10, 8, 105, 100), applied(20, 16, 190, 200), applied(30, 256, 900, None)]
    oom = OomEvent(time=0.0, step=33, kind="cpu", message="", config=Knobs(batch_size=256))
    rollback = AppliedChange(ids=[], step=33, time=0.0, changes={}, rollback=True)
    found = accuracy([*history, rollback], [oom])
    assert found.measured == 2 and found.out_of_memory == 1
    assert found.mean_abs_error is not None and abs(found.mean_abs_error - 0.05) < 1e-9
    assert "1 change ran out of memory" in found.describe()
    assert accuracy(history[:2], [oom]).out_of_memory == 0, "an OOM after no change of theirs"
    assert accuracy(history, []).out_of_memory == 0 and accuracy([], []).mean_abs_error is None


# ---------------------------------------------------------------------- the allocator settings


def test_allocator_settings_as_torch_holds_them_else_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the hook sends as ``RunInfo.alloc_conf`` (the expandable_segments advice reads it)."""
    import torch

    getter = torch._C._accelerator_getAllocatorSettings
    assert allocator_settings() == getter()
    # a torch without the getter (before 2.9) stands in: the environment, the CUDA variable first
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(_C=SimpleNamespace()))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert allocator_settings() == ""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    assert allocator_settings() == "max_split_size_mb:64"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert allocator_settings() == "expandable_segments:True"
    monkeypatch.delitem(sys.modules, "torch")
    assert allocator_settings() is None
