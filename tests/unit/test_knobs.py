"""The knobs: names, aliases, parsing, validation, keep-effective-batch arithmetic and the LR rule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from memtui.core.knobs import (
    KNOBS,
    KnobError,
    accumulation_for,
    canonical_name,
    effective_batch,
    known_config,
    lr_factor,
    lr_rule,
    lr_words,
    next_lr_scale,
    parse_assignments,
    parse_changes,
    parse_value,
    resolve,
)
from memtui.hooks.persist import read_tuned, write_tuned
from memtui.wire import Knobs

ALL = ["batch_size", "grad_accum", "num_workers", "pin_memory", "prefetch_factor"]


@pytest.mark.parametrize(
    ("alias", "knob"),
    [
        ("batch_size", "batch_size"),
        ("per_device_train_batch_size", "batch_size"),
        ("micro_batch_size", "batch_size"),
        ("batch_size_per_gpu", "batch_size"),
        ("gradient_accumulation_steps", "grad_accum"),
        ("accumulation_steps", "grad_accum"),
        ("dataloader_num_workers", "num_workers"),
        ("workers", "num_workers"),
        ("dataloader_pin_memory", "pin_memory"),
        ("prefetch_factor", "prefetch_factor"),
        ("dataloader_prefetch_factor", "prefetch_factor"),
        ("prefetch", "prefetch_factor"),
        ("Prefetch-Factor", "prefetch_factor"),
        ("Batch-Size", "batch_size"),
    ],
)
def test_knob_aliases_name_their_knob(alias: str, knob: str) -> None:
    assert canonical_name(alias) == knob


def test_an_unknown_knob_suggests_the_nearest_name() -> None:
    with pytest.raises(KnobError, match=r"unknown knob 'batch_sise' \(did you mean batch_size\?\)"):
        canonical_name("batch_sise")


@pytest.mark.parametrize(
    ("knob", "raw", "value"),
    [
        ("batch_size", "24", 24),
        ("grad_accum", 3, 3),
        ("num_workers", "0", 0),
        ("pin_memory", "true", True),
        ("pin_memory", "off", False),
        ("pin_memory", True, True),
        ("pin_memory", 0, False),
        ("prefetch_factor", "4", 4),
        ("prefetch_factor", 1, 1),
    ],
)
def test_values_are_parsed_to_the_knobs_own_type(knob: str, raw: object, value: object) -> None:
    assert parse_value(knob, raw) == value
    assert type(parse_value(knob, raw)) is type(value)


@pytest.mark.parametrize(
    ("knob", "raw", "reason"),
    [
        ("batch_size", "abc", "must be an integer"),
        ("batch_size", "0", "between 1 and"),
        ("batch_size", True, "must be an integer"),
        ("grad_accum", "-1", "between 1 and"),
        ("num_workers", "-2", "0 or more"),
        ("num_workers", "100000", "absurdly high"),
        ("pin_memory", "maybe", "true or false"),
        ("batch_size", 2.5, "must be an integer"),
        ("prefetch_factor", "0", "between 1 and 1024"),
        ("prefetch_factor", "-3", "between 1 and 1024"),
        ("prefetch_factor", "two", "must be an integer"),
        ("prefetch_factor", True, "must be an integer"),
    ],
)
def test_parse_value_rejects_with_reason(knob: str, raw: object, reason: str) -> None:
    with pytest.raises(KnobError, match=reason):
        parse_value(knob, raw)


def test_parse_changes_and_assignments() -> None:
    raw = parse_assignments(["bs=24", "grad_accum=3"])
    assert parse_changes(raw) == {"batch_size": 24, "grad_accum": 3}
    with pytest.raises(KnobError, match="given twice"):
        parse_changes({"bs": "2", "batch_size": "3"})
    with pytest.raises(KnobError, match="batch_size needs a value: batch_size=N"):
        parse_assignments(["batch_size"])
    with pytest.raises(KnobError, match="pin needs a value: pin=true"):
        parse_assignments(["pin="])
    with pytest.raises(KnobError, match="expected KEY=VALUE"):
        parse_assignments(["batchsize"])
    with pytest.raises(KnobError, match="no change given"):
        parse_changes({})


def test_keep_effective_batch_exact() -> None:
    current = Knobs(batch_size=16, grad_accum=4, num_workers=0, pin_memory=False)
    out = resolve({"batch_size": 32}, current, ALL, keep_effective_batch=True)
    assert out.changes == {"batch_size": 32, "grad_accum": 2}
    assert "kept at 64" in out.note


def test_keep_effective_batch_inexact_says_so() -> None:
    current = Knobs(batch_size=16, grad_accum=4)
    out = resolve(
        {"batch_size": 24}, current, ["batch_size", "grad_accum"], keep_effective_batch=True
    )
    assert out.changes == {"batch_size": 24, "grad_accum": 3}
    assert "does not divide 64" in out.note and "72" in out.note


def test_keep_effective_batch_counts_ranks() -> None:
    current = Knobs(batch_size=8, grad_accum=8)
    out = resolve(
        {"batch_size": 16},
        current,
        ["batch_size", "grad_accum"],
        keep_effective_batch=True,
        world_size=4,
    )
    assert out.changes["grad_accum"] == 4
    assert "256" in out.note and "4 ranks" in out.note
    assert effective_batch(16, 4, 4) == 256


def test_an_untunable_knob_a_kept_batch_without_batch_size_or_both_halves_are_refused() -> None:
    current = Knobs(batch_size=16, grad_accum=None)
    with pytest.raises(KnobError, match="not tunable"):
        resolve({"grad_accum": 2}, current, ["batch_size"])
    with pytest.raises(KnobError, match="needs a batch_size"):
        resolve({"num_workers": 2}, current, ALL, keep_effective_batch=True)
    with pytest.raises(KnobError, match="do not give both"):
        resolve(
            {"batch_size": 2, "grad_accum": 2},
            Knobs(batch_size=1, grad_accum=1),
            ALL,
            keep_effective_batch=True,
        )


@pytest.mark.parametrize(
    ("target", "batch", "expected"),
    [
        (64, 32, (2, True)),
        (64, 24, (3, False)),
        (32, 24, (1, False)),
        (8, 64, (1, False)),
        (100, 33, (3, False)),
    ],
)
def test_accumulation_nearest_the_effective_batch_and_whether_it_is_exact(
    target: int, batch: int, expected: tuple[int, bool]
) -> None:
    assert accumulation_for(target, batch) == expected


def test_a_change_to_what_the_run_has_is_refused_and_unchanged_knobs_are_left_out() -> None:
    """A no-op queued by the CLI is refused: applied, its noise was reported as an effect."""
    current = Knobs(batch_size=8, grad_accum=2, num_workers=4, pin_memory=False)
    tunable = ("batch_size", "grad_accum", "num_workers", "pin_memory")
    with pytest.raises(KnobError, match=r"num_workers is already 4 .*nothing to change"):
        resolve({"num_workers": 4}, current, tunable)
    with pytest.raises(KnobError, match="batch_size is already 8, grad_accum is already 2"):
        resolve({"batch_size": 8}, current, tunable, keep_effective_batch=True)
    partly = resolve({"batch_size": 16, "num_workers": 4}, current, tunable)
    assert partly.changes == {"batch_size": 16} and partly.note == "num_workers is already 4"
    kept = resolve({"batch_size": 16}, current, tunable, keep_effective_batch=True)
    assert kept.changes == {"batch_size": 16, "grad_accum": 1}


def test_a_prefetch_factor_needs_workers_in_the_config_it_lands_in() -> None:
    no_workers = Knobs(batch_size=8, num_workers=0, prefetch_factor=2)
    with pytest.raises(KnobError, match=r"only used with num_workers > 0 \(torch refuses it"):
        resolve({"prefetch_factor": 4}, no_workers, ALL)
    assert resolve({"prefetch_factor": 4, "num_workers": 2}, no_workers, ALL).changes == {
        "prefetch_factor": 4,
        "num_workers": 2,
    }
    with pytest.raises(KnobError, match="only used with num_workers > 0"):
        resolve({"prefetch_factor": 4, "num_workers": 0}, Knobs(batch_size=8, num_workers=2), ALL)


def test_a_worker_count_not_known_is_unknown_not_zero() -> None:
    """A loader memtui watches but did not build (its workers not a knob): prefetch_factor is
    taken, by the worker count read where there is one, refused only where it is 0."""
    unknown = Knobs(pin_memory=True, prefetch_factor=2)
    tunable = ["pin_memory", "prefetch_factor"]
    assert resolve({"prefetch_factor": 4}, unknown, tunable).changes == {"prefetch_factor": 4}
    read = resolve({"prefetch_factor": 4}, unknown, tunable, held={"num_workers": 4})
    assert read.changes == {"prefetch_factor": 4}
    with pytest.raises(KnobError, match="only used with num_workers > 0"):
        resolve({"prefetch_factor": 4}, unknown, tunable, held={"num_workers": 0})


def test_the_known_config_takes_the_run_s_values_then_what_was_read_then_what_was_measured() -> (
    None
):
    """Every knob's one figure: the tunable config's, else the value the hook read, else (the
    micro-batch, the accumulation) the steps' medians; a run without an accumulation knob whose
    steps draw one micro-batch each has an effective batch of batch x 1 x ranks."""
    steps = SimpleNamespace(micro_batch=4, micro_batches=2)
    known = known_config(
        Knobs(pin_memory=True, prefetch_factor=2),
        ["pin_memory", "prefetch_factor"],
        {"batch_size": 4, "num_workers": 4},
        steps,
        world_size=2,
    )
    assert known.values == {
        "batch_size": 4, "grad_accum": 2, "num_workers": 4, "pin_memory": True,
        "prefetch_factor": 2,
    }  # fmt: skip
    assert known.measured == ("grad_accum",) and known.tunable == ("pin_memory", "prefetch_factor")
    assert known.effective_batch() == 16 and known.effective_batch({"batch_size": 8}) == 32
    single = known_config(Knobs(batch_size=8), ["batch_size"], None, SimpleNamespace(
        micro_batch=8, micro_batches=1), world_size=3)  # fmt: skip
    assert single.effective_batch() == 24 and single.measured == ("grad_accum",)
    unmeasured = known_config(Knobs(batch_size=8), ["batch_size"])
    assert unmeasured.effective_batch() is None, "no accumulation known: not said"
    idle = known_config(Knobs(num_workers=0, prefetch_factor=2), ["num_workers"])
    assert idle.unused == {"prefetch_factor": "no loader workers"}
    assert idle.values["prefetch_factor"] == 2, "the value it takes once workers load"


def test_the_tuned_yaml_round_trips_all_five_knobs(tmp_path: Path) -> None:
    path = tmp_path / "tuned.yaml"
    values = {"batch_size": 12, "grad_accum": 3, "num_workers": 2, "pin_memory": True}
    write_tuned(path, "run", 40, {**values, "prefetch_factor": 6})
    assert read_tuned(path) == {**values, "prefetch_factor": 6}
    assert list(read_tuned(path)) == list(KNOBS)
    write_tuned(path, "run", 40, {"prefetch_factor": 0})
    with pytest.raises(ValueError, match="prefetch_factor must be between 1 and"):
        read_tuned(path)


@pytest.mark.parametrize(
    ("old", "new", "rule", "factor"),
    [
        (Knobs(batch_size=8, grad_accum=1), Knobs(batch_size=16, grad_accum=1), "linear", 2.0),
        (Knobs(batch_size=8, grad_accum=1), Knobs(batch_size=8, grad_accum=4), "sqrt", 2.0),
        (Knobs(batch_size=16, grad_accum=2), Knobs(batch_size=8, grad_accum=1), "linear", 0.25),
        (Knobs(batch_size=8, grad_accum=2), Knobs(batch_size=4, grad_accum=4), "linear", None),
        (Knobs(batch_size=8), Knobs(batch_size=32), "none", None),
        (Knobs(batch_size=8), Knobs(batch_size=32), "sqrt", 2.0),
    ],
)
def test_lr_factor_follows_the_effective_batch_by_the_rule_or_is_none(
    old: Knobs, new: Knobs, rule: str, factor: float | None
) -> None:
    assert lr_factor(old, new, rule) == factor


def test_lr_words_say_the_factor_or_warn_that_the_lr_stays() -> None:
    old, new = Knobs(batch_size=8, grad_accum=1), Knobs(batch_size=16, grad_accum=1)
    assert lr_words(old, new, "linear", optimizer_known=True) == "lr x2.0 (linear)"
    assert lr_words(old, new, "sqrt", optimizer_known=True) == "lr x1.4142 (sqrt)"
    assert lr_words(old, new, "none", optimizer_known=True, world_size=2) == (
        "warning: effective batch 16 -> 32, the LR does not follow (rule none)"
    )
    assert "no optimizer known to memtui" in lr_words(old, new, "linear", optimizer_known=False)
    assert lr_words(old, old, "linear", optimizer_known=True) == ""


def test_lr_rules_and_the_viewers_cycle() -> None:
    assert lr_rule(" Linear ") == "linear"
    with pytest.raises(KnobError, match="rules are linear, sqrt, none"):
        lr_rule("cubic")
    cycle = [""]
    for _ in range(4):
        cycle.append(next_lr_scale(cycle[-1]))
    assert cycle == ["", "linear", "sqrt", "none", ""]
