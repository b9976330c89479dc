"""After the run: every run leaves a summary beside its tuned config (a normal end, an
out-of-memory error it died of, ``kill -9``), ``memtui report`` says the script's own numbers,
``memtui compare`` judges two runs from their steps, and ``memtui check`` passes a run like its
reference and fails a slower, hungrier one, one line per bound. Real trainings of a plain loop
that logs its own step times and memory (``tests/support/logged_train.py``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import clock
from tests.support.cli import memtui_cli, memtui_here
from tests.support.clock import patience
from tests.support.processes import ROOT, DemoRun, launch_script, stop_all, wait_for

pytestmark = pytest.mark.heavy

SCRIPT = ROOT / "tests" / "support" / "logged_train.py"
SUMMARY = "memtui-summary.json"


@dataclass
class Trained:
    """One training of the logged loop, finished: its state dir and what it logged itself."""

    state: Path
    log: Path
    output: Path
    code: int

    def own_steps(self) -> list[float]:
        """The step times the script logged (its first steps left out, as the summary's)."""
        rows = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [r["time_s"] for r in rows if "time_s" in r][3:]

    def own_totals(self) -> dict[str, Any]:
        """The script's last line: its steps and the most resident memory it read."""
        return dict(json.loads(self.log.read_text().splitlines()[-1]))


def train(
    base: Path, name: str, *args: str, wait: bool = True, env: dict[str, str] | None = None
) -> tuple[Trained, DemoRun]:
    """Start the logged loop with ``args`` (to its end unless not ``wait``)."""
    work = base / name
    work.mkdir()
    trained = Trained(work / "state", work / "own.jsonl", work / "stdout.log", -1)
    argv = ["--state-dir", str(trained.state), "--log", str(trained.log), *args]
    environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = launch_script(SCRIPT, argv, environ, work, trained.output)
    run = DemoRun(proc, work, trained.output)
    if wait:
        trained.code = run.wait_exit(120)
    return trained, run


def report(target: Path | str) -> dict[str, Any]:
    """``memtui report TARGET --json``, in this process."""
    result = memtui_here("report", str(target), "--json")
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Trained]]:
    """A reference run, the same run again, and one slower (a sleep in every step) and hungrier
    (300 MiB more held): each about 150 steps, a sleep in each step so the time is the loop's,
    the three at once so that the machine's load weighs on each alike."""
    base = tmp_path_factory.mktemp("after")
    found: dict[str, Trained] = {}
    started: list[DemoRun] = []
    try:
        for name, extra in (
            ("reference", ["--sleep-ms", "10"]),
            ("again", ["--sleep-ms", "10"]),
            ("worse", ["--sleep-ms", "25", "--extra-mib", "300"]),
        ):
            record = {"MEMTUI_RECORD": str(base / "reference.mtrec")} if name == "reference" else {}
            trained, run = train(base, name, *extra, wait=False, env=record)
            started.append(run)
            found[name] = trained
        for trained, run in zip(found.values(), started, strict=True):
            trained.code = run.wait_exit(120)
            assert trained.code == 0, trained.output.read_text()
        yield found
    finally:
        stop_all(started)


def test_the_report_says_the_scripts_own_steps_step_time_and_peak(
    runs: dict[str, Trained],
) -> None:
    run = runs["reference"]
    assert (run.state / SUMMARY).is_file()
    assert (run.state / SUMMARY).stat().st_mode & 0o777 == 0o600
    got = report(run.state)
    own = run.own_totals()
    assert got["ended"] == "ended"
    assert got["time"]["steps"] == own["steps"] == 150
    assert got["time"]["last_step"] == 150
    own_median = statistics.median(run.own_steps())
    # the same steps timed by two clocks a few calls apart: within a millisecond, or 10%
    assert abs(got["time"]["step_time"]["median_s"] - own_median) <= max(1e-3, 0.1 * own_median)
    # the hook's peak is the process's high-water mark, the script's the most it read at a step
    assert own["peak_rss_bytes"] * 0.97 <= got["memory"]["device_peak_bytes"]
    assert got["memory"]["device_peak_bytes"] <= own["peak_rss_bytes"] * 1.15
    assert got["next"]["config"]["batch_size"] == 32
    assert got["verdict"]["state"] in ("BALANCED", "UNDERUSED")


def test_a_recording_of_the_run_says_what_its_summary_says(runs: dict[str, Trained]) -> None:
    """The summary the hook wrote and the one ``memtui report`` builds from the run's recording
    come from one builder over the same steps and samples."""
    written = report(runs["reference"].state)
    replayed = report(runs["reference"].state.parent.parent / "reference.mtrec")
    for key in ("steps", "first_step", "last_step"):
        assert replayed["time"][key] == written["time"][key]
    assert replayed["time"]["training_s"] == pytest.approx(written["time"]["training_s"])
    assert replayed["time"]["step_time"] == written["time"]["step_time"]
    assert replayed["memory"]["device_peak_bytes"] == written["memory"]["device_peak_bytes"]
    assert replayed["next"]["config"] == written["next"]["config"]


def test_the_report_text_fits_a_screen_and_names_what_to_start_with(
    runs: dict[str, Trained],
) -> None:
    result = memtui_cli("report", str(runs["reference"].state / SUMMARY))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) <= 40, result.stdout
    assert lines[0].startswith("run ") and " ended " in lines[0]
    assert any(line.startswith("verdict over the run: ") for line in lines)
    assert any(line.startswith("start the next run with: batch_size=32") for line in lines)


def test_the_page_is_one_file_with_its_charts_inline(
    runs: dict[str, Trained], tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    page = tmp_path / "report.html"
    result = memtui_here("report", str(runs["reference"].state), "--html", str(page))
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.count("<svg") == 3  # step time, data wait, memory
    assert not re.search(r"(src|href)=\"(https?:)?//", text)  # nothing fetched to show it
    assert "<script" not in text


def test_compare_calls_the_same_run_within_the_noise_and_the_worse_one_slower(
    runs: dict[str, Trained],
) -> None:
    result = memtui_here(
        "compare", str(runs["reference"].state), str(runs["worse"].state), "--json"
    )
    assert result.exit_code == 0, result.output
    figures = {f["key"]: f for f in json.loads(result.stdout)["figures"]}
    assert figures["step_time_s"]["verdict"] == "slower"
    assert figures["step_time_s"]["p_value"] < 1e-6
    assert figures["step_time_s"]["change"] > 0.5
    assert figures["device_peak_bytes"]["verdict"] == "more"
    text = memtui_here("compare", str(runs["reference"].state), str(runs["again"].state)).stdout
    assert "step time" in text and "[" in text  # each side with its spread


def test_check_passes_a_run_like_its_reference(runs: dict[str, Trained]) -> None:
    result = memtui_cli(
        "check",
        str(runs["again"].state),
        "--against",
        str(runs["reference"].state / SUMMARY),
        "--max-step-time-regression",
        "50",
        "--max-peak-memory-regression",
        "20",
        "--max-data-wait",
        "50",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


def test_check_fails_a_slower_hungrier_run_with_one_line_per_bound(
    runs: dict[str, Trained],
) -> None:
    result = memtui_cli(
        "check",
        str(runs["worse"].state),
        "--against",
        str(runs["reference"].state),
        "--max-step-time-regression",
        "50",
        "--max-peak-memory-regression",
        "20",
        "--max-data-wait",
        "50",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("FAIL ")]
    assert len(failed) == 2, result.stdout
    assert failed[0].startswith("FAIL step time: ") and "over the +50% allowed" in failed[0]
    assert failed[1].startswith("FAIL peak memory: ") and "over the +20% allowed" in failed[1]
    assert any(line.startswith("ok data wait: ") for line in result.stdout.splitlines())


def test_a_run_that_dies_out_of_memory_says_so_and_starts_the_next_from_its_safe_config(
    tmp_path: Path,
) -> None:
    trained, _run = train(tmp_path, "oom", "--oom-at", "40")
    assert trained.code != 0
    got = report(trained.state)
    assert got["ended"] == "out of memory"
    assert got["ooms"] and not got["ooms"][-1].get("rolled_back", False)
    assert got["time"]["last_step"] == 39
    assert "safe config" in got["next"]["source"]


def test_a_run_killed_hard_keeps_its_last_periodic_summary(tmp_path: Path) -> None:
    trained, run = train(tmp_path, "killed", "--steps", "100000", wait=False)
    summary = trained.state / SUMMARY
    try:
        wait_for(summary.is_file, 60, 0.2, "the first periodic summary")
        live = report(run.run_id or _run_id(trained))
        assert live["live"] and live["ended"] == "" and live["time"]["steps"] > 0
        os.kill(run.proc.pid, signal.SIGKILL)
        run.wait_exit(30)
    finally:
        stop_all([run])
    got = report(trained.state)
    assert got["ended"] == ""
    assert "stopped without its last summary" in got["note"]
    assert got["time"]["steps"] > 0


def _run_id(trained: Trained) -> str:
    """The run id the logged loop printed."""

    def found() -> str | None:
        for line in trained.output.read_text().splitlines():
            if line.startswith("run "):
                return line.split()[1]
        return None

    return str(wait_for(found, 60, 0.1, "the run id"))


# ---------------------------------------------------------------------------- the CI step

GUIDE = "docs/guides/after-the-run.md"
CI_TRAIN = ROOT / "tests" / "support" / "ci_train.py"


def documented_ci_step() -> list[str]:
    """The command lines of the guide's GitHub Actions step that gates on ``memtui check``
    (a line continued with a backslash joined to the next)."""
    from tests.integration.test_docs import blocks

    for block in blocks():
        if block.page != GUIDE or block.lang != "yaml":
            continue
        for step in yaml.safe_load(block.body):
            script = step.get("run", "")
            if "memtui check" in script:
                return [line.strip() for line in script.replace("\\\n", " ").splitlines()]
    pytest.fail(f"{GUIDE} has no GitHub Actions step that runs memtui check")


def option(line: str, name: str) -> str:
    """The value of option ``name`` on a command line."""
    words = shlex.split(line)
    return words[words.index(name) + 1]


def test_the_documented_ci_step_passes_a_run_like_its_reference_and_fails_a_slower_one(
    tmp_path: Path,
) -> None:
    """The guide's step, as written, on a short plain loop with no line of memtui's: its
    ``memtui run`` line in three checkouts at once (the reference, the same code, and code whose
    steps sleep twice as long and which holds 300 MiB more), the reference's summary kept where
    the step reads it, then its ``memtui check`` line: exit 0 for the same code, 1 for the worse,
    one ``FAIL`` line for each bound it broke."""
    train_line, gate_line = documented_ci_step()
    assert train_line.startswith("memtui run ") and gate_line.startswith("memtui check ")
    state, reference = option(train_line, "--state-dir"), option(gate_line, "--against")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    worse = {"CI_TRAIN_SLEEP_MS": "40", "CI_TRAIN_EXTRA_MIB": "300"}
    checkouts: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, extra in (("reference", {}), ("same", {}), ("worse", worse)):
            (tmp_path / name).mkdir()
            shutil.copyfile(CI_TRAIN, tmp_path / name / "train.py")
            checkouts[name] = subprocess.Popen(
                ["bash", "-e", "-c", train_line],
                cwd=tmp_path / name,
                env={**env, **extra},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        for name, proc in checkouts.items():
            out, _ = proc.communicate(timeout=patience(120))
            assert proc.returncode == 0, f"{name}: {out}"
    finally:
        for proc in checkouts.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    kept = tmp_path / "reference" / state / SUMMARY
    gates = {}
    for name in ("same", "worse"):
        (tmp_path / name / reference).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(kept, tmp_path / name / reference)
        gates[name] = clock.run(
            ["bash", "-e", "-c", gate_line],
            cwd=tmp_path / name,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    same, slower = gates["same"], gates["worse"]
    assert same.returncode == 0, same.stdout + same.stderr
    assert "FAIL" not in same.stdout
    assert slower.returncode == 1, slower.stdout + slower.stderr
    failed = [line for line in slower.stdout.splitlines() if line.startswith("FAIL ")]
    assert [line.split(":")[0] for line in failed] == ["FAIL step time", "FAIL peak memory"]
    assert any(line.startswith("ok data wait: ") for line in slower.stdout.splitlines())
