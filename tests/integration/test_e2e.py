"""End to end: the demo training in a subprocess, driven by the real `memtui` command line."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from memtui.storage import registry
from memtui.transport.client import ControlClient
from tests.support.cli import memtui_cli, status_json
from tests.support.processes import (
    LIGHT,
    PLUMBING,
    DemoRun,
    demo_run_id,
    launch_demo,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.heavy


def status(run: str) -> dict[str, Any]:
    return status_json(run)


def audit(demo: DemoRun) -> list[dict[str, Any]]:
    path = demo.out / "memtui-audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def workers_of(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def wait_applied(run: str, count: int) -> list[dict[str, Any]]:
    def applied() -> list[dict[str, Any]] | None:
        got = status(run)["applied"]
        return got if len(got) >= count else None

    return wait_for(applied, 60, 0.2, f"{count} applied changes")  # type: ignore[return-value]


def test_queue_apply_rebuild_persist_and_resume(start_demo: Callable[..., DemoRun]) -> None:
    every = 10
    demo = start_demo(
        "--steps",
        "160",
        "--checkpoint-every",
        str(every),
        "--batch-size",
        "8",
        "--grad-accum",
        "2",
        "--slow-data-ms",
        "1",
        *LIGHT,
    )
    run = demo.run_id

    listed = json.loads(memtui_cli("ls", "--json").stdout)
    assert [r["run"] for r in listed] == [run]
    assert {"run", "pid", "ranks", "started", "command"} <= set(listed[0])
    assert listed[0]["pid"] == demo.proc.pid and listed[0]["ranks"] == 1

    wait_for(lambda: status(run)["step"] >= 3, 30, 0.2, "steps")
    before = status(run)
    assert before["config"] == {
        "batch_size": 8,
        "grad_accum": 2,
        "num_workers": 0,
        "pin_memory": False,
        "prefetch_factor": 2,
    }
    assert before["metrics"]["step_time_s"] > 0 and before["metrics"]["data_wait_s"] > 0
    assert before["memory"]["kind"] == "cpu" and before["memory"]["capacity_bytes"] > 0
    assert before["host_memory"]["ram_total_bytes"] > 0
    assert workers_of(demo.proc.pid) == set()

    result = memtui_cli("set", "batch_size=12", "grad_accum=3", "num_workers=2", "-q")
    assert result.returncode == 0, result.stderr
    change_id = int(result.stdout.strip())  # -q: the id alone

    applied = wait_applied(run, 1)[0]
    queued = next(e for e in audit(demo) if e["event"] == "queued")
    assert queued["id"] == change_id and applied["ids"] == [change_id]
    client = ControlClient(registry.find_run(run).control)
    boundaries = wait_for(  # the boundary's record lands after its changes are applied
        lambda: [c for c in client.hello().checkpoints if c.time > queued["queued_time"]] or None,
        30,
        what="the boundary's record",
    )
    assert applied["step"] == boundaries[0].step, "the first checkpoint boundary after the queue"
    assert applied["step"] % every == 0 and 0 <= applied["step"] - queued["queued_step"] <= every
    assert applied["changes"] == {
        "batch_size": {"old": 8, "new": 12},
        "grad_accum": {"old": 2, "new": 3},
        "num_workers": {"old": 0, "new": 2},
    }

    first_workers = wait_for(
        lambda: workers_of(demo.proc.pid) if len(workers_of(demo.proc.pid)) == 2 else None,
        30,
        what="2 workers",
    )
    after = wait_for(
        lambda: [r for r in client.hello().steps if r.step > applied["step"]],
        30,
        what="steps after the change",
    )
    assert {(r.samples, r.micro_batches) for r in after} == {(36, 3)}  # type: ignore[attr-defined]

    assert memtui_cli("set", "num_workers=3").returncode == 0
    wait_applied(run, 2)
    second_workers = wait_for(
        lambda: workers_of(demo.proc.pid) if len(workers_of(demo.proc.pid)) == 3 else None,
        30,
        what="3 workers",
    )
    assert not (first_workers & second_workers), "the old workers were replaced"  # type: ignore[operator]
    assert not any(psutil.pid_exists(p) for p in first_workers), "no leaked workers"  # type: ignore[union-attr]

    tuned = yaml.safe_load((demo.out / "memtui-tuned.yaml").read_text())
    assert tuned["config"] == {
        "batch_size": 12,
        "grad_accum": 3,
        "num_workers": 3,
        "pin_memory": False,
        "prefetch_factor": 2,
    }

    assert demo.wait_exit(120) == 0, demo.output()
    assert "applied at step" in demo.output()
    wait_for(
        lambda: not json.loads(memtui_cli("ls", "--json").stdout),
        10,
        what="the run to leave the registry",
    )

    resumed = start_demo(
        "--steps",
        "170",
        "--checkpoint-every",
        str(every),
        "--resume",
        "--batch-size",
        "8",
        *LIGHT,
        out=demo.out,
    )
    assert "resumed tuned config" in resumed.output()
    assert "resumed from step 160" in resumed.output()
    again = wait_for(
        lambda: (s := status(resumed.run_id))["step"] > 160 and s, 60, 0.2, "resumed steps"
    )
    assert again["config"] == {
        "batch_size": 12,
        "grad_accum": 3,
        "num_workers": 3,
        "pin_memory": False,
        "prefetch_factor": 2,
    }  # type: ignore[index]
    assert resumed.wait_exit(120) == 0, resumed.output()


def test_rejections_exit_nonzero_with_a_reason_and_the_run_goes_on(
    start_demo: Callable[..., DemoRun],
) -> None:
    # Many steps: the run must still be live for the dry run at the end, however slow the CLI is.
    demo = start_demo("--steps", "100000", "--checkpoint-every", "5", *PLUMBING)
    cases = {
        "bogus=1": "unknown knob 'bogus'",
        "batch_size=0": "batch_size must be between 1 and",
        "num_workers=many": "num_workers must be an integer",
        "pin_memory=sometimes": "pin_memory must be true or false",
        "batch_size": "batch_size needs a value: batch_size=N",
    }
    for arg, reason in cases.items():
        result = memtui_cli("set", demo.run_id, arg)
        assert result.returncode == 2, (arg, result.stdout, result.stderr)
        assert reason in result.stderr, (arg, result.stderr)
    bare = memtui_cli("set", "batch_size")  # a knob, not a run: it asks for the value
    assert bare.returncode == 2 and "batch_size needs a value: batch_size=N" in bare.stderr
    result = memtui_cli("set", demo.run_id, "grad_accum=2", "--keep-effective-batch")
    assert result.returncode == 2 and "needs a batch_size change" in result.stderr
    # a change to what the run already has is refused, as the viewer refuses it
    noop = memtui_cli("set", demo.run_id, "pin_memory=false", "num_workers=0")
    assert noop.returncode == 2, noop.stdout + noop.stderr
    assert "pin_memory is already false, num_workers is already 0" in noop.stderr
    dry = memtui_cli("set", "batch_size=32", "--keep-effective-batch", "--dry-run")
    assert dry.returncode == 0 and "would queue batch_size=32 grad_accum=1" in dry.stdout
    assert demo.proc.poll() is None, "the run goes on after the rejections"
    demo.stop()
    assert demo.proc.returncode == 143, demo.output()
    assert not [e for e in audit(demo) if e["event"] in ("queued", "applied")]
    rejected = [e for e in audit(demo) if e["event"] == "rejected"]
    assert len(rejected) == 2 and "needs a batch_size change" in rejected[0]["reason"]
    assert "nothing to change" in rejected[1]["reason"]


def test_cli_without_a_run_and_with_several(start_demo: Callable[..., DemoRun]) -> None:
    none = memtui_cli("status")
    assert none.returncode == 1 and "no live memtui run" in none.stderr
    assert memtui_cli("ls").stdout.strip() == "no live runs"
    first = start_demo("--steps", "100000", "--checkpoint-every", "100000", *PLUMBING)
    second = start_demo("--steps", "100000", *PLUMBING)
    result = memtui_cli("status", "--json")
    assert result.returncode == 0
    assert json.loads(result.stdout)["run"] == second.run_id
    assert f"picked the newest, {second.run_id}" in result.stderr
    by_pid = memtui_cli("status", str(first.proc.pid), "--json")
    assert json.loads(by_pid.stdout)["run"] == first.run_id
    human = memtui_cli("status", first.run_id[:-2])
    assert (
        human.returncode == 0
        and f"run {first.run_id}" in human.stdout
        and "config: batch_size=16" in human.stdout
    )
    cancel = memtui_cli("cancel", first.run_id, "7")
    assert cancel.returncode == 2 and "no pending change #7" in cancel.stderr
    queued = memtui_cli("set", first.run_id, "pin_memory=true", "--quiet")
    assert "note: pin_memory=true has no effect on this run: torch sees no accelerator" in (
        queued.stderr
    ), "a CPU run queues pinning but says it does nothing there"
    assert memtui_cli("cancel", first.run_id, queued.stdout.strip()).stdout.startswith(
        "cancelled #1"
    )


def test_a_second_demo_in_a_live_runs_directory_is_refused(
    start_demo: Callable[..., DemoRun], tmp_path: Path
) -> None:
    """Two demos in one state directory would overwrite each other's checkpoint, tuned config and
    audit log: the second is refused, by ``memtui demo`` and by ``python -m memtui.demo``."""
    shared = tmp_path / "shared"
    first = start_demo("--steps", "1000000", *PLUMBING, out=shared)
    second = memtui_cli("demo", "--no-tui", "--out", str(shared), *PLUMBING)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"state directory of the live run {first.run_id}" in second.stderr
    module = start_demo(*PLUMBING, out=shared, wait=False)  # the training's own command line
    assert module.wait_exit(60) == 2, module.output()
    assert "give this demo its own --out DIR, or stop that run first" in module.output()
    assert first.proc.poll() is None, "the first demo trains on"


def test_demos_of_two_runtime_directories_keep_their_files_apart(tmp_path: Path) -> None:
    """Two demos of one account, each under a ``MEMTUI_RUNTIME_DIR`` of its own and neither given
    ``--out``: each keeps its checkpoint, audit log and tuned config in a directory of its own
    (the one its first line names, beside the runs' state); a third given the first's directory
    is refused, although its runtime directory lists no run: the first holds it."""
    state = tmp_path / "state"
    runtimes = [Path(tempfile.mkdtemp(prefix="mt", dir="/tmp")) for _ in range(3)]
    demos: list[DemoRun] = []

    def start(runtime: Path, *args: str) -> DemoRun:
        env = dict(os.environ, PYTHONUNBUFFERED="1", MEMTUI_RUNTIME_DIR=str(runtime))
        env["XDG_STATE_HOME"] = str(state)
        log = tmp_path / f"demo{len(demos)}.log"
        demo = DemoRun(
            launch_demo([*args, "--progress-every", "1", *PLUMBING], env, log), Path(), log
        )
        demos.append(demo)
        return demo

    try:
        for runtime in runtimes[:2]:
            demo = start(runtime, "--steps", "1000000", "--checkpoint-every", "5")
            demo.run_id = demo_run_id(demo.log, demo.proc)
            first = next(line for line in demo.output().splitlines() if line.startswith("run "))
            demo.out = Path(first.rsplit(" out ", 1)[1])
        outs = [demo.out for demo in demos]
        assert outs[0] != outs[1], outs
        assert all(out.parent == state / "memtui" and out.name.startswith("demo-") for out in outs)
        for demo in demos:
            wait_for(lambda d=demo: (d.out / "checkpoint.pt").is_file(), 60, what="a checkpoint")
            runtime = {"MEMTUI_RUNTIME_DIR": str(runtimes[demos.index(demo)])}
            queued = memtui_cli(
                "set", demo.run_id, "num_workers=1", env=dict(os.environ, **runtime)
            )
            assert queued.returncode == 0, queued.stderr
        for demo in demos:
            wait_for(lambda d=demo: (d.out / "memtui-tuned.yaml").is_file(), 60, what="tuned")
            audit = (demo.out / "memtui-audit.jsonl").read_text()
            assert demo.run_id in audit and all(
                other.run_id not in audit for other in demos if other is not demo
            ), audit
        third = start(runtimes[2], "--out", str(outs[0]))
        assert third.wait_exit(60) == 2, third.output()
        assert f"{outs[0]} is the state directory of another live demo (pid " in third.output()
        assert all(demo.proc.poll() is None for demo in demos[:2]), "the first two train on"
    finally:
        stop_all(demos)
        for runtime in runtimes:
            shutil.rmtree(runtime, ignore_errors=True)
