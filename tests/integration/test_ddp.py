"""Many ranks, one decision: two processes over gloo on the CPU.

The ranks are forked with torchrun's environment (``launch_ranks``: a job costs its training, not a
launcher and an import of torch per rank; ``MEMTUI_TEST_FORK=0`` runs them under torchrun), but for
``memtui demo --ranks 2``, which starts torchrun itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from memtui.storage import registry
from memtui.transport.client import ControlClient, hello_many
from memtui.wire import Decoder, Snapshot, Telemetry
from tests.integration.test_export import agrees, exporter, rank_labels, scraped_with
from tests.support.cli import memtui_cli, memtui_here, status_json
from tests.support.clock import patience
from tests.support.forkserver import ForkedJob
from tests.support.processes import (
    LIGHT,
    ROOT,
    DemoRun,
    SharedDemo,
    run_ranks,
    shared_demo,
    wait_for,
)

pytestmark = pytest.mark.heavy

EVERY = 4
CHANGES = [
    {"grad_accum": 3},
    {"batch_size": 12},
    {"grad_accum": 1, "batch_size": 8},
    {"grad_accum": 2},
    {"batch_size": 16, "num_workers": 0},
]


def snapshots(run: str) -> list[Snapshot]:
    target = registry.find_run(run)
    answers = hello_many([r.control for r in target.ranks], timeout_s=patience(5), history=2048)
    assert all(a is not None for a in answers), "every rank answers"
    return [a for a in answers if a is not None]


def rank0_step_near_boundary(sub: zmq.Socket, decoder: Decoder, deadline: float) -> None:
    """Return as soon as rank 0 reports a step just before a checkpoint boundary."""
    while time.monotonic() < deadline:
        if sub.poll(200):
            message = decoder.decode(sub.recv())
            if isinstance(message, Telemetry) and message.step % EVERY == EVERY - 1:
                return


def run_trials(demo: DemoRun, trials: int, seed: int, lr_scale: str = "") -> None:
    """Queue changes at random moments (half of them right before a boundary); check each lands
    (``lr_scale``: the LR rule they follow)."""
    rng = random.Random(seed)
    target = registry.find_run(demo.run_id)
    client = ControlClient(target.control, timeout_s=patience(5))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(target.ranks[0].pub)
    decoder = Decoder()
    try:
        for trial in range(trials):
            applied_before = len(client.hello(history=0).control.applied)
            if trial % 2:
                rank0_step_near_boundary(sub, decoder, time.monotonic() + 10)
            else:
                time.sleep(rng.uniform(0, 0.4))
            reply = client.set(CHANGES[trial % len(CHANGES)], lr_scale=lr_scale)  # type: ignore[arg-type]
            assert reply.ok, reply.reason

            def landed(count: int = applied_before + 1) -> bool:
                return len(client.hello(history=0).control.applied) >= count

            wait_for(landed, 60, 0.05, f"trial {trial} to land (a hang?)")
    finally:
        sub.close()


def check_one_decision(demo: DemoRun) -> list[Any]:
    """Every rank applied the same changes at the same steps, and ran them."""

    def caught_up() -> list[Snapshot] | None:
        # rank 0 posts the decision and trains on; rank 1 reads it within milliseconds
        answers = snapshots(demo.run_id)
        counts = {len(s.control.applied) for s in answers}
        return answers if len(counts) == 1 else None

    ranks: list[Snapshot] = wait_for(caught_up, 10, 0.1, "rank 1 to take the last decision")  # type: ignore[assignment]
    assert [s.info.rank for s in ranks] == [0, 1]
    applied = [[(a.ids, a.step, a.changes, a.lr_factor) for a in s.control.applied] for s in ranks]
    assert applied[0] == applied[1], "0 mismatched steps, the same LR factor on every rank"
    for snap in ranks:
        accum = {s.step: s.micro_batches for s in snap.steps}
        for change in snap.control.applied:
            if "grad_accum" in change.changes:
                following = change.step + 1
                if following in accum:
                    assert accum[following] == change.changes["grad_accum"].new, (
                        snap.info.rank,
                        change,
                    )
    return applied[0]


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[SharedDemo]:
    """One two-rank job for the module's tests (the last one to use it kills a rank): a light
    model whose loader sleeps (about the default demo's pace, not two cores flat out)."""
    with shared_demo(
        "--steps", "100000", "--checkpoint-every", str(EVERY), "--slow-data-ms", "6",
        "--batch-size", "8", *LIGHT, ranks=2,
    ) as job:  # fmt: skip
        yield job


def test_two_ranks_one_view_one_decision(
    two_ranks: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = two_ranks.adopt(monkeypatch)
    listed = json.loads(memtui_here("ls", "--json").stdout)
    assert len(listed) == 1 and listed[0]["ranks"] == 2
    assert [e["rank"] for e in listed[0]["endpoints"]] == [0, 1]

    status = status_json()
    assert status["world_size"] == 2
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    for entry in status["ranks"]:
        assert entry["reachable"] and entry["host"] and entry["pid"] and "step" in entry
        assert entry["config"] == {
            "batch_size": 8,
            "grad_accum": 2,
            "num_workers": 0,
            "pin_memory": False,
            "prefetch_factor": 2,
        }
    assert status["effective_batch"] == 8 * 2 * 2

    keep = memtui_here("set", "batch_size=16", "--keep-effective-batch")
    assert keep.exit_code == 0 and "effective batch kept at 32 (16 x 1 x 2 ranks)" in keep.stderr
    wait_for(lambda: status_json()["applied"], 60, 0.2, "the change")
    run_trials(demo, 5, seed=1, lr_scale="linear")
    applied = check_one_decision(demo)
    assert len(applied) == 6
    factors = [factor for *_, factor in applied]
    # 16 x 1 (kept) -> 16 x 3 -> 12 x 3 -> 8 x 1 -> 8 x 2 -> 16 x 2 samples per rank and step
    assert factors == [None, 3.0, 36 / 48, 8 / 36, 2.0, 2.0]
    human = memtui_here("status").stdout
    assert "rank  host" in human and "   1  " in human


def test_the_autopilot_takes_both_ranks_to_the_same_config_at_the_same_steps(
    two_ranks: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's autopilot queues its trials like an operator: every rank applies each one at
    the same step, and they end on the same config."""
    demo = two_ranks.adopt(monkeypatch)
    before = len(status_json()["applied"])
    on = memtui_here("autotune", "on")
    assert on.exit_code == 0, on.stderr

    def settled() -> dict[str, Any] | None:
        status = status_json()
        own = [a for a in status["applied"][before:] if a["origin"] == "autopilot"]
        done = status["autopilot"]["phase"] == "converged" or len(own) >= 2
        return status if own and done and not status["pending"] else None

    wait_for(settled, 180, 0.3, "the autopilot's trials to land")
    assert memtui_here("autotune", "off").exit_code == 0
    check_one_decision(demo)
    configs = [s.control.config for s in snapshots(demo.run_id)]
    assert configs[0] == configs[1]


def test_the_exporter_serves_every_rank_as_status_sees_it(
    two_ranks: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memtui export`` on the module's job: both ranks, their numbers, the changes applied."""
    demo = two_ranks.adopt(monkeypatch)
    with exporter() as url:
        wait_for(scraped_with(url, demo.run_id, ranks=2), 60, 0.3, "both ranks' metrics")
        samples = agrees(url, demo.run_id, ranks=2)
        hosts = {rank_labels(samples, demo.run_id, r)["host"] for r in (0, 1)}
        assert hosts == {status_json(demo.run_id)["host"]}


def test_the_report_of_a_live_job_lists_each_ranks_own_figures(
    two_ranks: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``memtui report --json`` on the module's job: rank 0's summary holds both ranks' figures,
    rank 1's as it posted them through the job's store, each its own steps and memory."""
    demo = two_ranks.adopt(monkeypatch)

    def both_ranks() -> list[dict[str, Any]] | None:
        result = memtui_here("report", demo.run_id, "--json")
        assert result.exit_code == 0, result.output
        ranks = json.loads(result.stdout)["ranks"]
        return ranks if len(ranks) == 2 and all(r["steps"] for r in ranks) else None

    ranks = wait_for(both_ranks, 60, 0.5, "both ranks' figures in the run's summary")
    assert [r["rank"] for r in ranks] == [0, 1]
    for figures in ranks:
        assert figures["step_time_s"] > 0 and figures["device_peak_bytes"] > 0, figures


@pytest.mark.slow
def test_twenty_trials_no_hang_no_mismatch(start_demo: Callable[..., DemoRun]) -> None:
    demo = start_demo(
        "--steps",
        "100000",
        "--checkpoint-every",
        str(EVERY),
        "--slow-data-ms",
        "0",
        "--batch-size",
        "8",
        *LIGHT,
        ranks=2,
    )
    run_trials(demo, 20, seed=7)
    assert len(check_one_decision(demo)) == 20
    assert demo.proc.poll() is None, "the job still runs"


def test_a_dead_rank_does_not_hang_the_viewer(
    two_ranks: SharedDemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module's shared job (its last user: rank 1 is killed)."""
    demo = two_ranks.adopt(monkeypatch)
    status = json.loads(memtui_cli("status", "--json").stdout)
    rank1 = next(r for r in status["ranks"] if r["rank"] == 1)
    psutil.Process(rank1["pid"]).send_signal(signal.SIGKILL)
    started = time.monotonic()
    result = memtui_cli("status", demo.run_id, "--json", timeout=30)
    assert time.monotonic() - started < patience(15)
    if result.returncode == 0:  # rank 0 may still answer while torchrun tears the job down
        ranks = {r["rank"]: r["reachable"] for r in json.loads(result.stdout)["ranks"]}
        assert ranks.get(1) is False
    else:
        assert "memtui:" in result.stderr
    if isinstance(demo.proc, ForkedJob):  # no launcher ends the job: rank 0 may wait for rank 1
        demo.stop()
    else:
        assert demo.proc.wait(patience(60)) != 0, "torchrun ends the job when a rank dies"


MISMATCH = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from datetime import timedelta
    from types import SimpleNamespace
    from memtui import hooks
    from memtui.wire import SetRequest

    timeout = os.environ.get("GROUP_TIMEOUT_S")  # the job's collective timeout, if not gloo's 30 min
    dist.init_process_group("gloo", **({"timeout": timedelta(seconds=float(timeout))} if timeout else {}))
    rank = dist.get_rank()
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = hooks.install(config, name="mismatch")
    if rank == 0:
        print("run", tuner.run_id, flush=True)
        assert tuner.control.queue(SetRequest(changes={"grad_accum": 2})).ok
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 31):
        # a metric averaged over the ranks, as loggers do: a collective outside the backward
        # pass, where rank 1 waits after it skipped the boundary and its progress says nothing
        dist.all_reduce(torch.ones(1))
        model(torch.ones(config.batch_size, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        tuner.step()
        if step % 10 == 0 and not (rank == 1 and step == 10):  # rank 1 misses one boundary
            tuner.checkpoint()
    state = tuner.control.state()
    print(f"rank {rank} accum {config.grad_accum} disabled {state.disabled!r}", flush=True)
    if rank == 0:
        print("rejected", state.rejected[-1].reason, flush=True)
    tuner.close()
    dist.destroy_process_group()
    """
)


def run_mismatch(tmp_path: Path, env: dict[str, str]) -> tuple[str, float]:
    """Run the job whose rank 1 misses one boundary; its output and how long it took."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    started = time.monotonic()
    code, output = run_ranks(script, env, ROOT, tmp_path / "mismatch.log")
    assert code == 0, output
    assert "rank 0 accum 1 disabled" in output and "rank 1 accum 1 disabled" in output, (
        "nothing applied anywhere\n" + output
    )
    assert "changes are OFF for this run" in output, output
    assert (
        "rejected changes are off for this run: rank(s) 1 did not reach checkpoint #1" in output
    ), output
    # said while waiting, not only at the end: the missing rank by number, and where it was
    assert (
        "memtui: rank 0 has waited" in output
        and "at checkpoint #1 (step 10) for rank(s) 1 (rank 1 last seen at step" in (output)
    ), output
    assert "went past" not in output, "blocked outside a backward pass: progress says nothing"
    return output, time.monotonic() - started


@pytest.mark.slow  # the same job and checks as the next test, with the wait set by the variable
def test_a_boundary_missed_on_one_rank_is_loud_not_a_hang(tmp_path: Path) -> None:
    env = {**os.environ, "MEMTUI_BOUNDARY_TIMEOUT": "3"}
    output, took = run_mismatch(tmp_path, env)
    assert "did not reach checkpoint #1 (rank 0 at step 10) within 3 s" in output
    assert took < patience(90)


def test_the_boundary_gives_up_before_the_jobs_own_collectives_time_out(tmp_path: Path) -> None:
    """The default wait (1800 s) is cut to half the process group's timeout (here 12 s).

    Rank 1, which skipped the boundary, is meanwhile blocked in the next step's first
    collective (outside a backward pass, so its progress does not say it went past), which gloo
    gives up on after 12 s and kills the job: rank 0 must be back in training before that (6 s
    after its wait gave up: a step of a 4-weight model, under any load).
    """
    env = {k: v for k, v in os.environ.items() if k != "MEMTUI_BOUNDARY_TIMEOUT"}
    output, took = run_mismatch(tmp_path, {**env, "GROUP_TIMEOUT_S": "12"})
    assert "within 6 s, half the job's 12 s collective timeout" in output
    assert took < patience(90)


def test_stopping_memtui_demo_stops_every_rank(tmp_path: Path) -> None:
    """SIGTERM to ``memtui demo --ranks 2 --no-tui`` reaches torchrun and its ranks."""
    log = tmp_path / "demo.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memtui.cli", "demo", "--ranks", "2", "--no-tui",
             "--steps", "100000", "--out", str(tmp_path / "out"), *LIGHT, "--slow-data-ms", "20"],
            stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
        )  # fmt: skip
    family: list[psutil.Process] = []
    try:
        wait_for(lambda: "run " in log.read_text() or proc.poll() is not None, 90, what="the run")
        assert proc.poll() is None, log.read_text()
        family += psutil.Process(proc.pid).children(recursive=True)
        assert len(family) >= 3, family  # torchrun and its two ranks
        proc.send_signal(signal.SIGTERM)
        proc.wait(patience(60))
        _gone, alive = psutil.wait_procs(family, timeout=patience(60))
        assert not alive, f"still running after SIGTERM: {alive}\n{log.read_text()}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in family:
            with contextlib.suppress(psutil.Error):
                child.kill()
