"""Running a client script under the witness: paused at chosen optimizer steps so that changes
are queued with the real ``memtui`` command line before the next checkpoint, killed, restarted
from the script's own checkpoint; and what the witness saw, step by step."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.clients.upstream import CLIENTS, Manifest, apply_patch, cached, materialise, missing
from tests.support.cli import memtui_cli
from tests.support.forkserver import ForkedDemo, ForkedJob
from tests.support.processes import launch_ranks, launch_script, wait_for

WITNESS = Path(__file__).with_name("witness.py")
INTEGRATION_PATCH = "integration.patch"
"""The patch of a client that holds memtui's documented lines (its other patches are for
compatibility: what the script needs to run here at all)."""


def client_script(name: str, workdir: Path, compat: Sequence[str] = ()) -> Path:
    """The client's upstream files, patched, in ``workdir``, then ``compat`` (more patches in the
    client's directory, written against the upstream files, for a way of running the script that
    it cannot run here without them); the test is skipped (with the command that fills the
    cache) when they are not in the cache."""
    manifest = Manifest.load(name)
    reason = missing(manifest)
    if reason:
        pytest.skip(f"the upstream files of client {name} are not cached: {reason}")
    script = materialise(manifest, workdir)
    applied = [(CLIENTS / name / patch).read_text() for patch in manifest.patches]
    for patch in compat:
        diff = (CLIENTS / name / patch).read_text()
        apply_patch(diff, workdir, after=applied)
        applied.append(diff)
    return script


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

    proc: subprocess.Popen[str] | ForkedDemo | ForkedJob
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

    def wait_paused(
        self, call: int, timeout: float = 150.0, ranks: int = 1, forward: bool = False
    ) -> dict[str, Any]:
        """Wait until the script waits before its ``call``-th optimizer step (its ``call``-th
        training forward, with ``forward``) in each of its ``ranks`` processes, all writing to
        the same witness file."""
        key, what = ("forward", "training forward") if forward else ("call", "step")

        def paused() -> dict[str, Any] | None:
            found = [r for r in self.records("paused") if r.get(key) == call]
            if len(found) < ranks and self.proc.poll() is not None:
                pytest.fail(f"the script ended before {what} {call}:\n{self.tail()}")
            return found[0] if len(found) >= ranks else None

        return dict(wait_for(paused, timeout, what=f"the script to pause at {what} {call}"))  # type: ignore[call-overload]

    def go(self, call: int, forward: bool = False) -> None:
        """Let the script paused before step ``call`` (training forward ``call``) go on."""
        (self.workdir / f"go-{'f' if forward else ''}{call}").touch()

    def kill(self) -> None:
        """Kill the script (SIGKILL: nothing of it runs after)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def kill_job(self) -> None:
        """Kill the script's launcher, then every process the witness saw start (its ranks,
        which a launcher killed alone would leave running), and wait until they are gone."""
        import psutil

        self.kill()
        ranks = []
        for record in self.records("start"):
            with contextlib.suppress(psutil.NoSuchProcess):
                process = psutil.Process(record["pid"])
                process.kill()
                ranks.append(process)
        psutil.wait_procs(ranks, timeout=30)

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
    pause_at_forward: Sequence[int] = (),
    forked: int = 0,
) -> ClientRun:
    """``python SCRIPT ARGS`` under the witness, in the script's directory; ``launcher`` before
    it (``memtui run --``), ``interpreter`` instead of ``python`` (``torchrun ...``), stderr in
    ``LABEL.err`` when ``stderr_apart``; paused before the optimizer steps ``pause_at`` and the
    training forwards ``pause_at_forward``; ``forked``: that many ranks forked from the test
    worker's fork server, which imported torch once, with the environment torchrun gives its
    ranks where there are several (``launch_ranks``; ``MEMTUI_TEST_FORK=0``: python or torchrun
    itself)."""
    workdir = script.parent
    for stale in workdir.glob("go-*"):
        stale.unlink()
    log, witness = workdir / f"{label}.log", workdir / f"{label}.witness.jsonl"
    run_env = dict(
        env,
        MEMTUI_WITNESS_OUT=str(witness),
        MEMTUI_WITNESS_PAUSE_AT=",".join(map(str, pause_at)),
        MEMTUI_WITNESS_PAUSE_AT_FORWARD=",".join(map(str, pause_at_forward)),
        MEMTUI_WITNESS_GO_DIR=str(workdir),
    )
    errors = workdir / f"{label}.err" if stderr_apart else None
    if forked:
        argv = [str(script), *args]
        if forked == 1:
            job: Any = launch_script(WITNESS, argv, run_env, workdir, log)
        else:
            job = launch_ranks(argv, run_env, workdir, log, forked, script=str(WITNESS))
        return ClientRun(job, workdir, log, witness, env, errors)
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
    last_change: list[str] = field(default_factory=list)
    """Queued before ``kill_at`` too, before the status is read (a change memtui refuses: its
    reply is ``Scenario.last_reply``)."""


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
    last_reply: subprocess.CompletedProcess[str] | None = None
    """``memtui set``'s reply to the plan's ``last_change``."""


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
        if plan.last_change:
            scenario.last_reply = first.memtui("set", run, *plan.last_change)
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
    rank: int = 0
    """The rank of the process that made it."""


def steps_of(run: ClientRun) -> list[Step]:
    """The run's optimizer steps, in order, each with the micro-batches its rank trained on."""
    forwards: dict[tuple[int, int], list[int]] = {}
    for record in run.records("forward"):
        if record["training"] and record["shape"]:
            key = (record.get("rank", 0), record["step"])
            forwards.setdefault(key, []).append(record["shape"][0])
    return [
        Step(
            number=record["opt_step"] or record["call"],
            lrs=record["lrs"],
            workers=record["workers"],
            batches=forwards.get((record.get("rank", 0), record["call"]), []),
            rank=record.get("rank", 0),
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


def records_by_rank(run: ClientRun, kind: str) -> dict[int, list[dict[str, Any]]]:
    """The witness's records of ``kind`` of every process of the run, by rank, each rank's in
    the order it wrote them (the ranks of a job append to the same file)."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for record in run.records(kind):
        ranks.setdefault(int(record.get("rank", 0)), []).append(record)
    return dict(sorted(ranks.items()))


def trained_epochs(
    run: ClientRun,
    limit: int | None = None,
    until_step: int | None = None,
    sanity_check: bool = False,
) -> dict[int, list[list[str]]]:
    """The digests of the rows each rank trained on, epoch by epoch, for a loop that evaluates
    after each epoch: an epoch ends at the first evaluation forward (not in training mode) after
    its training forwards; ``limit``: only each rank's first ``limit`` training forwards (the
    loop's steps up to a checkpoint it named by them); ``until_step``: only the training
    forwards that fed the process's optimizer steps up to that one (a checkpoint saved after it);
    ``sanity_check``: the evaluation before the first training forward is the framework's check
    of its validation loop (Lightning's), not the end of an epoch."""
    epochs: dict[int, list[list[str]]] = {}
    for rank, forwards in records_by_rank(run, "forward").items():
        mine: list[list[str]] = [[]]
        taken, evaluating = 0, False
        for record in forwards:
            if not record["training"]:
                checking = sanity_check and not taken and len(mine) == 1
                if not evaluating and not checking:  # the epoch ends, even one empty
                    mine.append([])
                evaluating = True
                continue
            if limit is not None and taken == limit:
                break
            if until_step is not None and record["step"] > until_step:
                break
            taken, evaluating = taken + 1, False
            mine[-1].extend(record.get("rows") or [])
        epochs[rank] = mine if mine[-1] else mine[:-1]
    return epochs


def union_of_ranks(epochs: dict[int, list[list[str]]]) -> list[list[str]]:
    """Each epoch's rows on all ranks together."""
    count = max((len(e) for e in epochs.values()), default=0)
    return [
        [row for mine in epochs.values() if i < len(mine) for row in mine[i]] for i in range(count)
    ]


def continued(before: list[list[str]], after: list[list[str]]) -> list[list[str]]:
    """The epochs of a run killed in the middle of its last epoch (``before``, up to the
    checkpoint it restarted from) and of its restart (``after``), which finishes that epoch
    first."""
    if not before:
        return after
    if not after:
        return before
    return [*before[:-1], before[-1] + after[0], *after[1:]]


@dataclass(frozen=True)
class EpochCoverage:
    """How one epoch covered the data set: each sample trained on exactly once, or not."""

    epoch: int
    trained: int
    """Rows trained on (every rank)."""
    duplicates: int
    """Trainings beyond the first of a sample (a sample trained 3 times counts 2)."""
    twice: int
    """Samples trained on more than once."""
    missing: int
    """Samples of the data set never trained on."""
    unknown: int
    """Rows trained on that are no sample of the data set."""

    @property
    def exact(self) -> bool:
        """Every sample exactly once, nothing else."""
        return not (self.duplicates or self.missing or self.unknown)


def coverage(dataset: Collection[str], epochs: Sequence[Sequence[str]]) -> list[EpochCoverage]:
    """Each epoch's coverage of ``dataset`` (the digests of its samples, as ``row_digest``
    computes them from its own rows)."""
    samples = set(dataset)
    assert len(samples) == len(dataset), "two samples of the data set have the same digest"
    found = []
    for epoch, rows in enumerate(epochs):
        counts = Counter(rows)
        found.append(
            EpochCoverage(
                epoch=epoch,
                trained=len(rows),
                duplicates=sum(n - 1 for row, n in counts.items() if n > 1 and row in samples),
                twice=sum(1 for row, n in counts.items() if n > 1 and row in samples),
                missing=len(samples - counts.keys()),
                unknown=sum(n for row, n in counts.items() if row not in samples),
            )
        )
    return found


def torchrun(ranks: int) -> list[str]:
    """``torchrun --standalone --nproc_per_node RANKS``: the launcher of a job of ``ranks``
    processes on this machine (the script picks gloo on the CPU)."""
    launcher = str(Path(sys.executable).with_name("torchrun"))
    return [launcher, "--standalone", "--nproc_per_node", str(ranks)]


def python_or_torchrun(ranks: int) -> list[str]:
    """How a script of ``ranks`` processes is started: ``python``, or ``torchrun`` for several."""
    return [sys.executable] if ranks == 1 else torchrun(ranks)


def finished(run: ClientRun, timeout: float = 240.0) -> ClientRun:
    """``run`` once it ended well (the test fails otherwise; every rank is killed then)."""
    try:
        run.finish(timeout)
    finally:
        if run.proc.poll() is None:
            run.kill_job()
    return run


def job_run_id(run: ClientRun, ranks: int) -> str:
    """The run memtui lists with every process the witness saw start."""

    def listed() -> str | None:
        pids = sorted(r["pid"] for r in run.records("start"))
        if len(pids) < ranks:
            return None
        result = run.memtui("ls", "--json")
        for entry in json.loads(result.stdout or "[]"):
            if sorted(e["pid"] for e in entry.get("endpoints", [])) == pids:
                return str(entry["run"])
        return None

    return str(wait_for(listed, 60, what=f"the {ranks} ranks listed as one run"))


def status_json(run: ClientRun, run_id: str) -> dict[str, Any]:
    """``memtui status RUN --json``."""
    result = run.memtui("status", run_id, "--json")
    assert result.returncode == 0, result.stderr + result.stdout
    return dict(json.loads(result.stdout))


def lrs_by_rank(run: ClientRun) -> dict[int, list[tuple[int, list[float]]]]:
    """Each rank's optimizer steps: (the optimizer's own step number, the LR of each group)."""
    return {
        rank: [(r["opt_step"] or r["call"], r["lrs"]) for r in steps]
        for rank, steps in records_by_rank(run, "step").items()
    }


def steps_by_rank(run: ClientRun) -> dict[int, list[Step]]:
    """Each rank's optimizer steps with the micro-batches that fed them (``steps_of`` by rank)."""
    found: dict[int, list[Step]] = {}
    for step in steps_of(run):
        found.setdefault(step.rank, []).append(step)
    return found


def forwards_by_rank(run: ClientRun) -> dict[int, list[tuple[Any, ...]]]:
    """Each rank's forwards as the witness saw them: the step each fed, training or evaluating,
    the input's shape and its rows' digests (training forwards)."""
    return {
        rank: [(r["step"], r["training"], r["shape"], r.get("rows")) for r in forwards]
        for rank, forwards in records_by_rank(run, "forward").items()
    }


def lr_factors(status: dict[str, Any]) -> list[tuple[int, float]]:
    """(the step after which it applied, its LR factor) for each change ``memtui status --json``
    reports applied (1.0 where it reports none)."""
    return [
        (int(change["step"]), float(change.get("lr_factor") or 1.0))
        for change in status.get("applied", [])
    ]


def factor_at(factors: Sequence[tuple[int, float]], step: int) -> float:
    """The product of the LR factors of the changes applied before optimizer step ``step``."""
    product = 1.0
    for at, factor in factors:
        if step > at:
            product *= factor
    return product


@dataclass
class Job:
    """A script's run through changes queued with ``memtui set`` (every rank held before the
    step each is queued at), killed in the middle of an epoch and restarted from its own
    checkpoint (or let run to its end), as the witness and memtui's command line saw it."""

    first: ClientRun
    restart: ClientRun | None
    run_id: str = ""
    replies: dict[int, subprocess.CompletedProcess[str]] = field(default_factory=dict)
    """Each ``memtui set``'s reply, by the step before which it was queued."""
    status_before_kill: dict[str, Any] = field(default_factory=dict)
    """``memtui status --json`` read before the step ``kill_at``."""
    audit: list[dict[str, Any]] = field(default_factory=list)
    """The audit log's events, read after the first run ended."""

    def runs(self) -> list[ClientRun]:
        """The first run and its restart."""
        return [self.first] if self.restart is None else [self.first, self.restart]


def play_job(
    script: Path,
    args: Sequence[str],
    env: dict[str, str],
    changes: dict[int, list[str]],
    kill_at: int,
    restart_args: Sequence[str] | None,
    ranks: int,
    interpreter: Sequence[str] = (),
    launcher: Sequence[str] = (),
    audit: Path | None = None,
    timeout: float = 240.0,
    forked: int = 0,
) -> Job:
    """Run ``script`` on ``ranks`` processes (``interpreter``: ``torchrun ...``) under the
    witness; before each step of ``changes`` (every rank waiting there) queue its change with the
    real ``memtui set``; before step ``kill_at`` read ``memtui status --json``, then kill every
    rank and restart the script with ``restart_args`` (None: let it run to its end); ``audit``:
    the audit log to read after the first run; ``forked``: the ranks forked (``start``)."""
    pauses = [*changes, kill_at]
    first = start(script, args, env, pauses, "first", launcher, interpreter, forked=forked)
    job = Job(first, None)
    try:
        for at, change in changes.items():
            first.wait_paused(at, timeout, ranks=ranks)
            job.run_id = job.run_id or job_run_id(first, ranks)
            job.replies[at] = first.memtui("set", job.run_id, *change)
            first.go(at)
        first.wait_paused(kill_at, timeout, ranks=ranks)
        job.run_id = job.run_id or job_run_id(first, ranks)
        job.status_before_kill = status_json(first, job.run_id)
        if restart_args is None:
            first.go(kill_at)
            finished(first, timeout)
        else:
            first.kill_job()
    finally:
        if first.proc.poll() is None:
            first.kill_job()
    if audit is not None and audit.exists():
        job.audit = [json.loads(line) for line in audit.read_text().splitlines() if line]
    if restart_args is not None:
        job.restart = start(
            script, restart_args, env, [], "restart", launcher, interpreter, forked=forked
        )
        finished(job.restart, timeout)
    return job


def coverage_over(
    dataset: Collection[str], before: ClientRun, until_step: int | None, after: ClientRun | None
) -> list[EpochCoverage]:
    """Each epoch's coverage of ``dataset`` on the union of the ranks: the rows ``before``
    trained on up to its checkpoint after step ``until_step`` (None: all of them), continued by
    the rows of ``after``, its restart from that checkpoint (None: no restart)."""
    epochs = union_of_ranks(trained_epochs(before, until_step=until_step))
    if after is not None:
        epochs = continued(epochs, union_of_ranks(trained_epochs(after)))
    return coverage(dataset, epochs)


def rows_by_rank(run: ClientRun, until_step: int | None = None) -> dict[int, list[str]]:
    """The digests of the rows each rank trained on, in order (``until_step``: only those of the
    training forwards that fed the process's optimizer steps up to that one)."""
    found: dict[int, list[str]] = {}
    for rank, forwards in records_by_rank(run, "forward").items():
        mine = found.setdefault(rank, [])
        for record in forwards:
            if not record["training"]:
                continue
            if until_step is not None and record["step"] > until_step:
                break
            mine.extend(record.get("rows") or [])
    return found


def epochs_of(rows: dict[int, list[str]], per_rank: int) -> list[list[str]]:
    """The rows of every rank cut in epochs of ``per_rank`` rows each (a sharded loader gives
    each rank its share of every epoch), each epoch's on all ranks together: for a loop whose
    evaluations do not mark its epochs."""
    count = max((math.ceil(len(mine) / per_rank) for mine in rows.values()), default=0)
    return [
        [row for mine in rows.values() for row in mine[i * per_rank : (i + 1) * per_rank]]
        for i in range(count)
    ]


def joined(before: dict[int, list[str]], after: dict[int, list[str]]) -> dict[int, list[str]]:
    """Each rank's rows of a killed run (up to its checkpoint), then of its restart."""
    return {rank: before.get(rank, []) + after.get(rank, []) for rank in sorted({*before, *after})}


def saved_without_run(path: Path) -> bytes:
    """A checkpoint file saved again as it is but for memtui's entry's run id (``memtui`` at
    its top, as ``tuner.state_dict()`` saved it): the one thing in it that differs between any
    two runs of a script."""
    import io

    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and isinstance(state.get("memtui"), dict):
        state["memtui"] = {k: v for k, v in state["memtui"].items() if k != "run"}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
