"""Running a client script under the witness: paused at chosen optimizer steps so that changes
are queued with the real ``memtui`` command line before the next checkpoint, killed, restarted
from the script's own checkpoint; and what the witness saw, step by step."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.clients.upstream import CLIENTS, Manifest, apply_patch, cached, materialise, missing
from tests.support.cli import memtui_cli
from tests.support.processes import wait_for

WITNESS = Path(__file__).with_name("witness.py")
INTEGRATION_PATCH = "integration.patch"
"""The patch of a client that holds memtui's documented lines (its other patches are for
compatibility: what the script needs to run here at all)."""


def client_script(name: str, workdir: Path) -> Path:
    """The client's upstream files, patched, in ``workdir``; the test is skipped (with the
    command that fills the cache) when they are not in the cache."""
    manifest = Manifest.load(name)
    reason = missing(manifest)
    if reason:
        pytest.skip(f"the upstream files of client {name} are not cached: {reason}")
    return materialise(manifest, workdir)


def unchanged_client_script(name: str, workdir: Path, compat: Sequence[str] = ()) -> Path:
    """The client's upstream files in ``workdir`` without memtui's lines: only the manifest's
    compatibility patches applied, then ``compat`` (more patches in the client's directory, for
    a way of running the script that it cannot run here without them); skipped as
    ``client_script`` is when the files are not in the cache."""
    manifest = Manifest.load(name)
    reason = missing(manifest)
    if reason:
        pytest.skip(f"the upstream files of client {name} are not cached: {reason}")
    workdir.mkdir(parents=True, exist_ok=True)
    for file in manifest.files:
        shutil.copyfile(cached(manifest, file), workdir / Path(file.path).name)
    for patch in [p for p in manifest.patches if p != INTEGRATION_PATCH] + list(compat):
        apply_patch((CLIENTS / name / patch).read_text(), workdir)
    return workdir / manifest.entry


def memtui_run(name: str) -> list[str]:
    """The real ``memtui run --name NAME --`` command line, to put before a command."""
    return [sys.executable, "-m", "memtui", "run", "--name", name, "--"]


@contextmanager
def client_home() -> Iterator[tuple[Path, dict[str, str]]]:
    """A directory for one client's runs and the environment they run in: memtui's runtime and
    state of their own, the Hugging Face caches inside it and every hub offline."""
    base = Path(tempfile.mkdtemp(prefix="mtc", dir="/tmp"))  # ipc paths must stay short
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        MEMTUI_RUNTIME_DIR=str(base / "rt"),
        XDG_STATE_HOME=str(base / "state"),
        HF_HOME=str(base / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_EVALUATE_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    try:
        yield base, env
    finally:
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class ClientRun:
    """One process of a client script under the witness."""

    proc: subprocess.Popen[str]
    workdir: Path
    log: Path
    witness: Path
    env: dict[str, str]
    errors: Path | None = None
    """Where its stderr goes when it is kept apart from stdout (None: both in ``log``)."""

    def output(self) -> str:
        """What the script printed so far (stdout, and stderr unless it is kept apart)."""
        return self.log.read_text(errors="replace")

    def records(self, kind: str) -> list[dict[str, Any]]:
        """The witness's records of ``kind`` so far."""
        if not self.witness.exists():
            return []
        lines = self.witness.read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]

    def wait_paused(self, call: int, timeout: float = 150.0, ranks: int = 1) -> dict[str, Any]:
        """Wait until the script waits before its ``call``-th optimizer step (in each of its
        ``ranks`` processes, all writing to the same witness file)."""

        def paused() -> dict[str, Any] | None:
            found = [r for r in self.records("paused") if r["call"] == call]
            if len(found) < ranks and self.proc.poll() is not None:
                pytest.fail(f"the script ended before step {call}:\n{self.tail()}")
            return found[0] if len(found) >= ranks else None

        return dict(wait_for(paused, timeout, what=f"the script to pause at step {call}"))  # type: ignore[call-overload]

    def go(self, call: int) -> None:
        """Let the script paused before step ``call`` go on."""
        (self.workdir / f"go-{call}").touch()

    def kill(self) -> None:
        """Kill the script (SIGKILL: nothing of it runs after)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def finish(self, timeout: float = 150.0) -> None:
        """Wait for the script to end; fail the test unless it ended well."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the script did not end in {timeout:.0f} s:\n{self.tail()}")
        assert code == 0, f"the script exited with {code}:\n{self.tail()}"

    def tail(self, lines: int = 60) -> str:
        """The last lines the script printed."""
        return "\n".join(self.output().splitlines()[-lines:])

    def memtui(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real ``memtui`` command line, in this run's environment."""
        return memtui_cli(*args, env=self.env, timeout=60)

    def listed(self) -> dict[str, Any]:
        """This process's entry in ``memtui ls --json`` (fails the test if it is not there)."""
        result = self.memtui("ls", "--json")
        assert result.returncode == 0, result.stderr
        runs = [run for run in json.loads(result.stdout) if run["pid"] == self.proc.pid]
        assert runs, f"pid {self.proc.pid} is not among the live runs: {result.stdout}"
        return dict(runs[0])

    def status(self) -> dict[str, Any]:
        """``memtui status RUN --json``."""
        result = self.memtui("status", str(self.proc.pid), "--json")
        assert result.returncode == 0, result.stderr + result.stdout
        return dict(json.loads(result.stdout))


def start(
    script: Path,
    args: Sequence[str],
    env: dict[str, str],
    pause_at: Sequence[int],
    label: str,
    launcher: Sequence[str] = (),
    interpreter: Sequence[str] = (),
    stderr_apart: bool = False,
) -> ClientRun:
    """``python SCRIPT ARGS`` under the witness, in the script's directory; ``launcher`` before
    it (``memtui run --``), ``interpreter`` instead of ``python`` (``torchrun ...``), stderr in
    ``LABEL.err`` when ``stderr_apart``."""
    workdir = script.parent
    for stale in workdir.glob("go-*"):
        stale.unlink()
    log, witness = workdir / f"{label}.log", workdir / f"{label}.witness.jsonl"
    run_env = dict(
        env,
        MEMTUI_WITNESS_OUT=str(witness),
        MEMTUI_WITNESS_PAUSE_AT=",".join(map(str, pause_at)),
        MEMTUI_WITNESS_GO_DIR=str(workdir),
    )
    errors = workdir / f"{label}.err" if stderr_apart else None
    command = [*launcher, *(interpreter or [sys.executable]), str(WITNESS), str(script), *args]
    with open(log, "w") as handle, open(errors or os.devnull, "w") as error_handle:
        proc = subprocess.Popen(
            command,
            stdout=handle,
            stderr=error_handle if errors else subprocess.STDOUT,
            text=True,
            cwd=workdir,
            env=run_env,
        )
    return ClientRun(proc, workdir, log, witness, env, errors)


@dataclass
class Plan:
    """What a client's scenario does: two changes at two checkpoints, then a kill after a third
    and a restart from the script's own checkpoint (or a run to its end, for a script that
    cannot resume)."""

    args: list[str]
    every: int
    """Optimizer steps between the script's checkpoints (the first is at this step)."""
    first_change: list[str]
    second_change: list[str]
    restart_args: list[str] | None
    """The script's own arguments for a restart from its checkpoint at step 3 x ``every``
    (None: the script has no resume; the first run goes on to its end)."""
    kill_at: int = 0
    """The step before which memtui's status is read, and the first run killed when it restarts
    (after its third checkpoint)."""


@dataclass
class Scenario:
    """What happened in a client's scenario, as the witness and memtui's command line saw it."""

    first: ClientRun
    restart: ClientRun | None
    listed: dict[str, Any]
    replies: list[subprocess.CompletedProcess[str]]
    status_before_kill: dict[str, Any] = field(default_factory=dict)
    status_after_restart: dict[str, Any] = field(default_factory=dict)
    restart_paused: dict[str, Any] = field(default_factory=dict)


def play(script: Path, env: dict[str, str], plan: Plan, launcher: Sequence[str] = ()) -> Scenario:
    """Run ``plan``: queue its first change before checkpoint 1, its second before checkpoint 2;
    read memtui's status at ``kill_at``, then kill the run there and restart it from its
    checkpoint 3 (pausing it once to read memtui's step), or let it run to its end; each process
    started with ``launcher`` before it (``memtui run --``)."""
    every = plan.every
    first = start(script, plan.args, env, [every, 2 * every, plan.kill_at], "first", launcher)
    scenario = Scenario(first, None, {}, [])
    try:
        first.wait_paused(every)
        scenario.listed = first.listed()
        run = scenario.listed["run"]
        scenario.replies.append(first.memtui("set", run, *plan.first_change))
        first.go(every)
        first.wait_paused(2 * every)
        scenario.replies.append(first.memtui("set", run, *plan.second_change))
        first.go(2 * every)
        first.wait_paused(plan.kill_at)
        scenario.status_before_kill = first.status()
        if plan.restart_args is None:
            first.go(plan.kill_at)
            first.finish()
            return scenario
        first.kill()
    finally:
        if first.proc.poll() is None:
            first.kill()
    restart = start(script, plan.restart_args, env, [2], "restart", launcher)
    scenario.restart = restart
    try:
        scenario.restart_paused = restart.wait_paused(2)
        scenario.status_after_restart = restart.status()
        restart.go(2)
        restart.finish()
    finally:
        if restart.proc.poll() is None:
            restart.kill()
    return scenario


@dataclass
class Step:
    """One optimizer step as the witness saw it, with the training forwards that fed it."""

    number: int
    """The optimizer's own step number (Adam's count; the process's count for SGD)."""
    lrs: list[float]
    workers: int
    batches: list[int]
    """The first dimension of each training forward's input."""


def steps_of(run: ClientRun) -> list[Step]:
    """The run's optimizer steps, in order, each with the micro-batches it trained on."""
    forwards: dict[int, list[int]] = {}
    for record in run.records("forward"):
        if record["training"] and record["shape"]:
            forwards.setdefault(record["step"], []).append(record["shape"][0])
    return [
        Step(
            number=record["opt_step"] or record["call"],
            lrs=record["lrs"],
            workers=record["workers"],
            batches=forwards.get(record["call"], []),
        )
        for record in run.records("step")
    ]


def applied_changes(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The applied changes ``memtui status --json`` reports, oldest first."""
    return list(status.get("applied", []))


def lr_mismatches(
    steps: Sequence[Step], expected: Callable[[int], float], rel: float = 1e-5
) -> list[tuple[int, list[float], float]]:
    """The steps whose param groups do not all use the ``expected(step)`` LR."""
    return [
        (s.number, s.lrs, expected(s.number))
        for s in steps
        if any(abs(lr - expected(s.number)) > rel * abs(expected(s.number)) for lr in s.lrs)
    ]


@dataclass
class Pair:
    """The same script and arguments run twice in the same directory, as its users run it and
    under ``memtui run``, each under the witness; the first run's outputs set aside."""

    plain: ClientRun
    watched: ClientRun
    aside: dict[Path, Path]
    """Where each output of the plain run was moved (its path: the set-aside path)."""
    registered: list[dict[str, Any]]
    """``memtui ls --json``'s entries of the watched run's name, read while it was paused."""
    status: dict[str, Any]
    """``memtui status RUN --json`` of the watched run, read while it was paused."""
    status_text: str
    """``memtui status RUN``, read then too."""


def registered_runs(run: ClientRun, name: str) -> list[dict[str, Any]]:
    """The live runs ``memtui ls --json`` lists under ``name`` (``memtui run --name NAME``)."""
    result = run.memtui("ls", "--json")
    assert result.returncode == 0, result.stderr
    return [
        r for r in json.loads(result.stdout) if r["run"] == name or r["run"].startswith(f"{name}-")
    ]


def run_pair(
    script: Path,
    args: Sequence[str],
    env: dict[str, str],
    outputs: Sequence[Path],
    name: str,
    pause_at: int,
    interpreter: Sequence[str] = (),
    ranks: int = 1,
) -> Pair:
    """Run the script to its end as its users run it, move its ``outputs`` aside, then run it
    again under ``memtui run --name NAME``, paused before step ``pause_at`` in each of its
    ``ranks`` processes until memtui's command line lists all of them, to its end; stderr kept
    apart from stdout in both."""
    plain = start(script, args, env, [], "plain", interpreter=interpreter, stderr_apart=True)
    try:
        plain.finish()
    finally:
        if plain.proc.poll() is None:
            plain.kill()
    aside = {}
    for output in outputs:
        if output.exists():
            aside[output] = output.with_name(output.name + ".plain")
            output.rename(aside[output])
    watched = start(
        script, args, env, [pause_at], "watched", memtui_run(name), interpreter, stderr_apart=True
    )
    try:
        watched.wait_paused(pause_at, ranks=ranks)

        def all_ranks() -> list[dict[str, Any]] | None:
            runs = registered_runs(watched, name)
            return runs if runs and all(r["ranks"] >= ranks for r in runs) else None

        registered = list(wait_for(all_ranks, 30, what=f"{ranks} ranks of {name} listed"))  # type: ignore[call-overload]
        run = registered[0]["run"]
        status = watched.memtui("status", run, "--json")
        assert status.returncode == 0, status.stderr + status.stdout
        text = watched.memtui("status", run)
        watched.go(pause_at)
        watched.finish()
    finally:
        watched.go(pause_at)  # ranks a launcher's kill would orphan run on to their end
        if watched.proc.poll() is None:
            watched.kill()
    return Pair(plain, watched, aside, registered, json.loads(status.stdout), text.stdout)
