"""The verdict: pure rules over summaries, with the thresholds in one place."""

from __future__ import annotations

import pytest

from memtui.advice.verdict import THRESHOLDS, Inputs, State, Thresholds, decide, describe_thresholds

GIB = 1 << 30


def test_no_data_until_a_timed_step() -> None:
    verdict = decide(Inputs())
    assert verdict.state is State.NO_DATA
    assert verdict.reasons == ()


@pytest.mark.parametrize(
    ("wait", "state"),
    [(0.0, State.BALANCED), (0.29, State.BALANCED), (0.30, State.STARVED), (0.9, State.STARVED)],
)
def test_starved_at_thirty_percent_data_wait(wait: float, state: State) -> None:
    assert decide(Inputs(data_wait_fraction=wait, peak_memory_fraction=0.7)).state is state


@pytest.mark.parametrize(
    ("peak", "state", "severity"),
    [
        (0.84, State.BALANCED, 0),
        (0.85, State.OOM_RISK, 1),
        (0.88, State.OOM_RISK, 1),
        (0.90, State.OOM_RISK, 2),
        (1.02, State.OOM_RISK, 2),
    ],
)
def test_peak_memory_bands_set_the_state_and_its_severity(
    peak: float, state: State, severity: int
) -> None:
    verdict = decide(Inputs(data_wait_fraction=0.05, peak_memory_fraction=peak))
    assert (verdict.state, verdict.severity) == (state, severity)


def test_memory_risk_wins_over_starvation() -> None:
    verdict = decide(Inputs(data_wait_fraction=0.6, peak_memory_fraction=0.91))
    assert verdict.state is State.OOM_RISK
    assert [r.label for r in verdict.reasons] == ["data wait", "peak memory"]
    assert [r.severity for r in verdict.reasons] == [1, 2]


def test_host_ram_and_growing_swap_are_host_pressure() -> None:
    full = decide(Inputs(data_wait_fraction=0.1, peak_memory_fraction=0.5, host_ram_fraction=0.94))
    assert full.state is State.HOST_PRESSURE and "host RAM 94%" in full.headline
    swapping = decide(
        Inputs(data_wait_fraction=0.1, host_ram_fraction=0.7, swap_used_bytes=2 * GIB,
               swap_growth_bytes=THRESHOLDS.swap_growth_bytes)
    )  # fmt: skip
    assert swapping.state is State.HOST_PRESSURE and "swap in use and growing" in swapping.headline
    steady = decide(
        Inputs(data_wait_fraction=0.1, peak_memory_fraction=0.7, host_ram_fraction=0.7, swap_used_bytes=2 * GIB,
               swap_growth_bytes=0)
    )  # fmt: skip
    assert steady.state is State.BALANCED


def test_reasons_carry_the_numbers() -> None:
    verdict = decide(
        Inputs(
            data_wait_fraction=0.62, step_time_s=0.110, data_wait_s=0.0682,
            peak_memory_fraction=0.4, peak_memory_bytes=8 * GIB, capacity_bytes=20 * GIB,
            host_ram_fraction=0.5,
        )
    )  # fmt: skip
    assert verdict.state is State.STARVED
    values = {r.label: r.value for r in verdict.reasons}
    assert values["data wait"] == "62% (68.2 ms of 110.0 ms/step)"
    assert values["peak memory"] == "40% (8.0 GiB of 20.0 GiB)"
    assert values["host RAM"] == "50%"


def test_gauge_positions_order_the_states() -> None:
    starved = decide(Inputs(data_wait_fraction=0.9, peak_memory_fraction=0.1)).position
    hungry = decide(Inputs(data_wait_fraction=0.35, peak_memory_fraction=0.1)).position
    underused = decide(Inputs(data_wait_fraction=0.05, peak_memory_fraction=0.3)).position
    balanced = decide(Inputs(data_wait_fraction=0.05, peak_memory_fraction=0.7)).position
    edge = decide(Inputs(data_wait_fraction=0.05, peak_memory_fraction=0.87)).position
    danger = decide(Inputs(data_wait_fraction=0.05, peak_memory_fraction=0.97)).position
    assert -1.0 <= starved < hungry <= -0.5 < underused < balanced < 0.5 <= edge < danger <= 1.0


def test_thresholds_are_one_documented_place() -> None:
    strict = Thresholds(starved_wait_fraction=0.1)
    assert decide(Inputs(data_wait_fraction=0.2), strict).state is State.STARVED
    text = "\n".join(describe_thresholds())
    for needle in ("30%", "85%", "90%", "host RAM >= 90%", "swap"):
        assert needle in text
