"""The autopilot on live CPU demo runs: it ends starvation by itself, an operator pauses it, it
leaves an operator's change alone, and it never goes back into a region that ran out of memory."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.integration.test_advice_live import until
from tests.support.cli import memtui_cli, memtui_here, status_json
from tests.support.processes import DemoRun, SharedDemo, shared_demo

pytestmark = pytest.mark.heavy

LOGITS_HEAVY = ("--seq-len", "256", "--width", "64", "--vocab", "8192", "--layers", "1")
"""A demo whose logits fill the memory: the micro-batch's memory grows fast (test_advice_live)."""


@pytest.fixture(scope="module")
def starving() -> Iterator[SharedDemo]:
    """The default demo, starving (no loader workers, its loader sleeping 2 ms a sample: about as
    long as a step's compute) with the autopilot on from the start; a checkpoint every 25 steps,
    the fewest that leave room for a change's measured effect (2 settling steps and 20 timed);
    a budget of 4 boundaries (the workers take two: the rest is tests/unit/test_autopilot.py's)."""
    with shared_demo(
        "--steps", "100000", "--checkpoint-every", "25", "--workers", "0", "--autotune",
        extra_env={"MEMTUI_AUTOTUNE_BUDGET": "4"},
    ) as job:  # fmt: skip
        yield job


def test_a_starving_run_waits_far_less_with_no_operator_action(
    starving: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the workers the CPUs allow end the starvation depends on how busy the machine is
    (with two workers on two idle cores this loader still leaves the demo STARVED, where a busy
    machine's slower steps read BALANCED): the autopilot's part is to add the workers and keep
    them, and the share of each step waiting for data falls by a third or more (with two workers
    78% -> 46% on an idle machine, 73% -> 38% on a busy one)."""
    run = starving.adopt(monkeypatch).run_id
    first = until(run, lambda s: s["metrics"] is not None, 60, "the first timed steps")
    assert first["config"]["num_workers"] == 0

    def settled(s: dict[str, Any]) -> bool:
        """Converged, and the speed it reports is all the settled config's (50 steps)."""
        last = max((a["step"] for a in s["applied"]), default=0)
        converged = s["autopilot"]["phase"] == "converged" and not s["pending"]
        return converged and s["step"] >= last + 52

    done = until(run, settled, 240, "the autopilot to converge")
    assert done["config"]["num_workers"] >= 1
    waits = first["metrics"]["data_wait_fraction"], done["metrics"]["data_wait_fraction"]
    assert waits[1] <= waits[0] * 2 / 3, waits
    own = [a for a in done["applied"] if not a["rollback"]]
    assert own and all(a["origin"] == "autopilot" for a in own)
    assert done["autopilot"]["boundaries"] <= done["autopilot"]["budget"]
    assert done["effective_batch"] == first["effective_batch"]  # never changed unasked
    text = memtui_here("status", run).stdout
    assert "autopilot on: converged" in text and "by the autopilot" in text


def test_an_operator_change_pauses_it_at_once(
    starving: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = starving.adopt(monkeypatch).run_id
    on = memtui_cli("autotune", "on", run)
    assert on.returncode == 0 and on.stdout.startswith("autopilot on"), on.stderr
    assert status_json(run)["config"]["num_workers"] >= 1  # the test above's
    # fewer workers: never the autopilot's next trial (one it may queue at once, before this set)
    queued = memtui_here("set", run, "num_workers=0")
    assert queued.exit_code == 0, queued.output
    paused = status_json(run)["autopilot"]  # no wait: the queue paused it before answering
    assert paused["mode"] == "paused" and "queued" in paused["why"], paused
    assert not [p for p in status_json(run)["pending"] if p.get("origin") == "autopilot"]
    off = memtui_here("autotune", "off", run)
    assert off.exit_code == 0 and "autopilot off" in off.stdout


def test_turned_on_after_an_operators_change_it_leaves_that_change_alone() -> None:
    """A demo fed by two workers (the CPU cap): the operator applies micro-batch 32 (grad_accum 1),
    then turns the autopilot on; it never queues the micro-batch back to 16, and once converged
    its reason says the 32 is the operator's."""
    with shared_demo(
        "--steps", "100000", "--checkpoint-every", "25", "--workers", "2"
    ) as job, pytest.MonkeyPatch.context() as monkeypatch:  # fmt: skip
        demo = job.adopt(monkeypatch)
        run = demo.run_id
        until(run, lambda s: s["metrics"] is not None, 60, "the first timed steps")
        queued = memtui_here("set", run, "batch_size=32", "grad_accum=1", "-q")
        assert queued.exit_code == 0, queued.output
        mine = f"#{queued.stdout.strip()}"
        landed = until(
            run, lambda s: s["config"]["batch_size"] == 32, 120, "the operator's change to land"
        )
        assert memtui_here("autotune", "on", run).exit_code == 0
        done = until(
            run, lambda s: s["autopilot"]["phase"] == "converged", 240, "the autopilot to converge"
        )
        since = landed["step"]
        own = [a for a in done["applied"] if a["origin"] == "autopilot" and a["step"] >= since]
        assert not [a for a in own if "batch_size" in a["changes"]], own
        assert f"32 is what an operator set, {mine}: not moved back" in done["autopilot"]["why"]
        audit = (demo.out / "memtui-audit.jsonl").read_text().splitlines()
        queued_by_it = [
            event
            for event in map(json.loads, audit)
            if event["event"] == "queued" and event.get("origin") == "autopilot"
        ]
        assert not [e for e in queued_by_it if "batch_size" in e["changes"]], queued_by_it


@pytest.mark.slow  # ~60 CPU-s under load; tests/unit/test_autopilot.py checks the policy's ceiling
def test_a_region_that_ran_out_of_memory_is_never_retried(
    start_demo: Callable[..., DemoRun],
) -> None:
    """An operator forces batch 16 past a 720 MiB limit: it runs out of memory and is rolled back;
    the autopilot, turned on then, converges without trying batch 16 or more again."""
    demo = start_demo(
        "--steps", "100000", "--checkpoint-every", "5", "--slow-data-ms", "0", "--batch-size", "8",
        "--grad-accum", "2", "--memory-limit", "720MiB", *LOGITS_HEAVY, fork=False,
    )  # fmt: skip
    run = demo.run_id
    until(run, lambda s: s["model"] is not None, 60, "the memory model")
    forced = memtui_cli("set", run, "batch_size=16", "--force")
    assert forced.returncode == 0, forced.stderr
    until(run, lambda s: s["ooms"] and s["ceiling"], 90, "the out-of-memory rollback")
    assert memtui_here("autotune", "on", run).exit_code == 0
    done = until(
        run, lambda s: s["autopilot"]["phase"] == "converged", 480, "the autopilot to converge"
    )
    tried = [a for a in done["applied"] if a["origin"] == "autopilot"]
    assert all(a["changes"].get("batch_size", {"new": 0})["new"] < 16 for a in tried), tried
    assert len(done["ooms"]) == 1, "no second out-of-memory error"
    audit = [
        json.loads(line) for line in (demo.out / "memtui-audit.jsonl").read_text().splitlines()
    ]
    queued = [e for e in audit if e["event"] == "queued" and e.get("origin") == "autopilot"]
    assert all(e["changes"].get("batch_size", 0) < 16 for e in queued), queued
