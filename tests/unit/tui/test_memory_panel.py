"""The memory panel's numbers, the header's devices and the memory chart's title, on replays."""

from __future__ import annotations

from typing import Any

import msgspec
from textual.pilot import Pilot

from memtui.runs.state import RunState
from memtui.tui.widgets.header import devices
from memtui.tui.widgets.memory import cpu_rows
from memtui.wire import DeviceSample, HostSample
from tests.integration.tui.test_app_replay import NARROW, WIDE, text_of
from tests.support.viewer import (
    OOM,
    RANKS_8,
    STARVING,
    one_rank,
    replay_app,
    run,
    screen_text,
    settle,
)
from tests.unit.tui.test_state import GIB, T0, fold, snapshot, telemetry

MIB = 1 << 20


def test_one_gpu_shows_every_memory_number_wide() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        memory = text_of(pilot, "#memory")
        for needle in ("capacity           24.0 GiB", "peak in use        21.1 GiB  88%",
                       "peak reserved      20.0 GiB  83%", "peak allocated     17.1 GiB  71%",
                       "unallocated         2.9 GiB  12%", "beyond torch        1.1 GiB   5%",
                       "■ fragmentation 2.9 GiB 12%", "retries / OOMs"):  # fmt: skip
            assert needle in memory, needle
        assert "cuda:0 NVIDIA GeForce RTX 4090" in text_of(pilot, "#header")

    run(replay_app(one_rank(OOM)), check, WIDE)


def test_one_gpu_shows_the_numbers_compactly_in_a_side_pane() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        memory = text_of(pilot, "#memory").splitlines()
        assert memory[1].split() == ["■", "not", "known", "■", "frag.", "2.9", "GiB", "■",
                                     "beyond", "1.1", "GiB", "■", "free"]  # fmt: skip
        assert memory[2].split() == ["capacity", "24.0", "GiB", "peak", "reserved", "20.0", "GiB",
                                     "83%"]  # fmt: skip
        assert memory[3].split() == ["peak", "allocated", "17.1", "GiB", "71%", "retries", "/",
                                     "OOMs", "3", "/", "0"]  # fmt: skip
        screen = pilot.app.screen
        assert screen.max_scroll_y == 0, "the whole view fits 60x50: nothing to scroll"
        text = screen_text(pilot.app)
        assert all(len(line) <= 60 for line in text.splitlines())
        assert "peak memory 88% (21.1 GiB of 24.0 GiB)" in text, "the verdict gives the peak"

    run(replay_app(one_rank(OOM)), check, NARROW)


def test_beside_the_ranks_the_peaks_are_numbers() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        memory = text_of(pilot, "#memory")
        assert "peak reserved  20.0 GiB  83%  peak allocated 17.1 GiB  71%" in memory
        assert pilot.app.screen.max_scroll_y == 0

    run(replay_app(OOM), check, NARROW)


def test_the_memory_chart_keeps_its_bands_in_a_side_pane() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        charts = text_of(pilot, "#charts")
        assert "memory ■ alloc  ■ reserved  ■ peak  ■ beyond  85% 90%" in charts
        assert "9…" not in charts

    run(replay_app(OOM), check, NARROW)


def test_the_header_names_the_ranks_devices() -> None:
    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        header = text_of(pilot, "#header")
        assert "8× NVIDIA H100 80GB HBM3" in header and "8 ranks" in header

    run(replay_app(RANKS_8), check, WIDE)


def test_distinct_devices_are_each_counted() -> None:
    state = RunState()
    three = snapshot()  # a run of three ranks (a rank past the world size would be dropped)
    fold(
        state,
        msgspec.structs.replace(three, info=msgspec.structs.replace(three.info, world_size=3)),
    )
    assert devices(state) == "cpu", "one rank: the run's own device name"

    def sample(name: str) -> DeviceSample:
        return DeviceSample(time=T0 + 1, step=12, kind="cuda", name=name, capacity_bytes=GIB)

    fold(state, telemetry(0, 5, 11, 12, device=[sample("NVIDIA A100-SXM4-80GB")]))
    fold(state, telemetry(1, 1, 11, 12, device=[sample("NVIDIA H100 80GB HBM3")]))
    fold(state, telemetry(2, 1, 11, 12, device=[sample("NVIDIA H100 80GB HBM3")]))
    assert devices(state) == "2× NVIDIA H100 80GB HBM3, 1× NVIDIA A100-SXM4-80GB"


def cpu_state(workers_uss: int | None, counted: int) -> RunState:
    """One CPU rank with 2 loader workers whose memory the device samples count as ``counted``."""
    state = RunState()
    fold(state, snapshot())
    host = HostSample(time=T0 + 1, ram_total_bytes=16 * GIB, ram_available_bytes=8 * GIB,
                      ram_used_bytes=8 * GIB, main_rss_bytes=500 * MIB, workers=2,
                      workers_rss_bytes=900 * MIB, workers_uss_bytes=workers_uss)  # fmt: skip
    device = DeviceSample(time=T0 + 1, step=12, kind="cpu", name="cpu", capacity_bytes=2 * GIB,
                          allocated_bytes=450 * MIB + counted, reserved_bytes=500 * MIB + counted,
                          peak_reserved_bytes=600 * MIB + counted)  # fmt: skip
    fold(state, telemetry(0, 5, 11, 12, device=[device], host=host))
    return state


def test_cpu_workers_are_shown_as_the_hook_counts_them() -> None:
    state = cpu_state(workers_uss=40 * MIB, counted=40 * MIB)
    memory = state.refresh_summary().memory
    assert memory is not None
    rows = {row.label: row for row in cpu_rows(state, memory).numbers}
    assert rows["workers USS"].value == "40 MiB" and rows["workers USS"].note == "2 workers' own"
    assert rows["peak"].note == "RSS+workers USS" and rows["peak"].value == "640 MiB"
    assert rows["main RSS"].value == "500 MiB"
    # a hook before its first USS measurement (or an older hook) counts their RSS: said so
    for state in (cpu_state(None, 900 * MIB), cpu_state(40 * MIB, 900 * MIB)):
        memory = state.refresh_summary().memory
        assert memory is not None
        rows = {row.label: row for row in cpu_rows(state, memory).numbers}
        assert "workers USS" not in rows and rows["workers RSS"].value == "900 MiB"
        assert rows["peak"].note == "RSS+workers RSS"


def test_the_demo_counts_its_loader_workers_uss() -> None:
    """The starving demo (recorded by the current hook): after num_workers=4 lands, the panel
    counts the four workers' own memory (USS), not their RSS (shared pages counted again)."""

    async def check(pilot: Pilot[Any]) -> None:
        await settle(pilot)
        memory = text_of(pilot, "#memory")
        assert "workers USS          33 MiB   0% 4 workers' own" in memory
        assert "peak                408 MiB   2% RSS+workers USS" in memory
        assert "workers RSS" not in memory

    run(replay_app(STARVING), check, WIDE)
