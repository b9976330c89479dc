"""Running a framework training script that pauses at a step (2 unless told) for a change to be queued."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from memtui.transport.recording import read_recording
from memtui.wire import Decoder, StepRecord, Telemetry
from tests.support.cli import memtui_cli
from tests.support.processes import ROOT, wait_for

PYTHON = [sys.executable]
"""Run the script in one process (or let the framework launch its own ranks)."""


def torchrun(ranks: int) -> list[str]:
    """The launcher prefix for ``ranks`` CPU processes under torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
    ]


def accelerate_launch(ranks: int) -> list[str]:
    """``accelerate launch`` with ``ranks`` CPU processes (with ``ACCELERATE_CPU`` in the env).

    ``--cpu`` alone runs one process (several CPU processes go through mpirun); the multi-GPU
    launcher (torchrun's, inside) with ``ACCELERATE_USE_CPU=true`` gives MULTI_CPU over gloo.
    """
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(ranks),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    ]


ACCELERATE_CPU = {"ACCELERATE_USE_CPU": "true"}
"""The environment that makes Accelerate (and the Trainer) run several CPU processes over gloo."""


@dataclass
class PausedRun:
    """A training script (all its ranks) waiting at a step until the ``go`` file exists."""

    proc: subprocess.Popen[str]
    log: Path
    go: Path
    report: Path
    """Where the script writes its report (ranks add their own suffix)."""

    def output(self) -> str:
        """What the script printed so far."""
        return self.log.read_text()

    def run_id(self) -> str:
        """The run id rank 0 printed (``run <id> ...``)."""
        lines = [x.split() for x in self.output().splitlines() if x.startswith("run ")]
        zero = [x for x in lines if "rank" in x and x[x.index("rank") + 1] == "0"] or lines
        return zero[0][1]

    def queue_and_go(self, *changes: str) -> None:
        """Queue ``changes`` with ``memtui set`` (a real client), then let the loop go on."""
        setting = memtui_cli("set", self.run_id(), *changes)
        assert setting.returncode == 0, setting.stderr + setting.stdout
        self.go.touch()

    def finish(self, timeout: float = 240.0) -> None:
        """Wait for the script to end well."""
        assert self.proc.wait(timeout) == 0, self.output()


@contextmanager
def paused_run(
    tmp_path: Path,
    launcher: list[str],
    script: Path,
    *args: str,
    ranks: int = 1,
    report: str = "report.json",
    env: dict[str, str] | None = None,
    wait_at: int = 2,
) -> Iterator[PausedRun]:
    """Start ``script`` under ``launcher`` and yield once every rank waits at step ``wait_at``."""
    run = PausedRun(None, tmp_path / "train.log", tmp_path / "go", tmp_path / report)  # type: ignore[arg-type]
    command = [*launcher, str(script), "--out", str(tmp_path / "out"), "--report", str(run.report)]
    command += ["--go", str(run.go), "--wait-at", str(wait_at), *args]
    with open(run.log, "w") as handle:
        run.proc = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        )
    try:
        wait_for(
            lambda: (
                run.output().count(f"waiting at step {wait_at}") >= ranks
                or run.proc.poll() is not None
            ),
            180,
            what=f"{ranks} rank(s) to reach step {wait_at}",
        )
        assert run.proc.poll() is None, run.output()
        yield run
    finally:
        if run.proc.poll() is None:
            run.proc.kill()


def recorded_steps(path: Path) -> dict[int, list[StepRecord]]:
    """Every step record a run published, by rank, from its recording (``MEMTUI_RECORD=path``:
    ``path`` itself for one process, ``path.rank<r>`` for each of several)."""
    files = sorted(path.parent.glob(path.name + ".rank*")) or [path]
    decoder = Decoder()
    steps: dict[int, list[StepRecord]] = {}
    for file in files:
        for frame in read_recording(file).frames:
            message = decoder.decode(frame.frame)
            if isinstance(message, Telemetry):
                steps.setdefault(message.rank, []).extend(message.steps)
    return steps
