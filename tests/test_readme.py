"""The README's examples run as written: the plain loop takes a change and resumes with it, the
loop without a DataLoader times its batches and follows a change."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import msgspec
import pytest
import yaml

from memtui.report import StatusReport
from tests.conftest import (
    PLUMBING,
    ROOT,
    DemoRun,
    launch_memtui,
    launch_script,
    memtui_cli,
    memtui_here,
    wait_for,
)


def readme_example(name: str = "plain-loop") -> str:
    """The README's code block marked ``<!-- example: NAME -->``."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- example: {name} -->\n```python\n(.*?)```", text, re.S)
    assert match, f"the README has the {name} example"
    return match.group(1)


def test_plain_loop_example(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    out = tmp_path / "ckpt"
    log = tmp_path / "train.log"
    env = dict(os.environ)
    proc = launch_script(script, ["--steps", "1000", "--out", str(out)], env, tmp_path, log)
    try:
        runs = wait_for(  # asked by click in this process (a subprocess per look: 0.3 CPU-s)
            lambda: json.loads(memtui_here("ls", "--json").stdout), 60, 0.1, "the example's run"
        )
        assert runs[0]["run"].startswith("train-")  # type: ignore[index]
        result = memtui_cli("set", "batch_size=64", "--keep-effective-batch")
        assert result.returncode == 0, result.stderr
        proc.wait(180)
    finally:
        proc.kill()
    output = log.read_text()
    assert proc.returncode == 0, output
    assert re.search(r"applied at step \d+00: batch_size 32 -> 64, grad_accum 2 -> 1", output), (
        output
    )
    tuned = yaml.safe_load((out / "memtui-tuned.yaml").read_text())
    assert tuned["config"]["batch_size"] == 64 and tuned["config"]["grad_accum"] == 1

    log = tmp_path / "resumed.log"
    resumed = launch_script(
        script, ["--steps", "1100", "--out", str(out), "--is_keep_training"], env, tmp_path, log
    )
    try:
        code = resumed.wait(180)
    finally:
        resumed.kill()
    assert code == 0, log.read_text()
    assert "resumed the tuned config" in log.read_text()
    assert "batch_size 32 -> 64" in log.read_text()


def live_status() -> StatusReport | None:
    """``memtui status --json`` of the only live run, typed (None while it does not answer)."""
    result = memtui_here("status", "--json")
    return msgspec.json.decode(result.stdout, type=StatusReport) if result.exit_code == 0 else None


def test_no_dataloader_example_times_batches_and_follows_a_batch_change(tmp_path: Path) -> None:
    """The README's nanoGPT-shaped loop (module globals, ``get_batch`` over a tensor, no
    DataLoader) publishes samples/s and the data wait, and ``memtui set batch_size=4`` lands at a
    checkpoint: the global changes and every step's samples follow."""
    script = tmp_path / "train_gpt.py"
    script.write_text(readme_example("no-dataloader"))
    out, log = tmp_path / "out", tmp_path / "train.log"
    argv = ["--max_iters=1000000", "--eval_interval=10", "--eval_iters=2", f"--out_dir={out}"]
    proc = launch_script(script, argv, dict(os.environ, PYTHONUNBUFFERED="1"), tmp_path, log)
    try:

        def timed() -> StatusReport | None:
            status = live_status()
            assert proc.poll() is None, log.read_text()
            metrics = status.metrics if status else None
            if not status or not metrics or status.step < 2:  # step 1 also counts the batch
                return None  # fetched before the loop
            return status if metrics.samples_per_s > 0 and metrics.data_wait_s > 0 else None

        before = cast(StatusReport, wait_for(timed, 90, 0.5, "samples/s and the data wait"))
        assert {"batch_size", "grad_accum"} <= set(before.tunable), before.tunable
        assert before.config["batch_size"] == 8
        assert before.last_step and before.last_step.samples == 8 * 4, before.last_step
        assert before.last_step.micro_batches == 4
        result = memtui_cli("set", "batch_size=4")
        assert result.returncode == 0, result.stdout + result.stderr

        def followed() -> StatusReport | None:
            status = live_status()
            if not status or not status.applied:
                return None
            # a whole step after the boundary: every batch of it fetched at the new size
            return status if status.step > status.applied[0].step + 1 else None

        after = cast(StatusReport, wait_for(followed, 90, 0.5, "the change and a step after it"))
        printed = r"step \d+: train loss [\d.]+, val loss [\d.]+, batch_size 4"
        wait_for(lambda: re.search(printed, log.read_text()), 60, 0.2, "the script's own line")
    finally:
        proc.terminate()
        proc.wait(30)
    assert after.config["batch_size"] == 4
    assert after.last_step and after.last_step.samples == 4 * 4, after.last_step
    assert after.metrics and after.metrics.samples_per_s > 0 and after.metrics.data_wait_s > 0
    output = log.read_text()
    assert re.search(r"applied at step \d*0: batch_size 8 -> 4", output), output


def readme_demo_commands() -> list[str]:
    """Every ``memtui demo ...`` in the README: inline code, and lines of code blocks."""
    text = (ROOT / "README.md").read_text()
    found = [m.group(1).strip() for m in re.finditer(r"`(memtui demo[^`]*)`", text)]
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.strip().startswith("memtui demo"):
                found.append(line.split("#", 1)[0].strip())
    return found


def demo_option_names() -> set[str]:
    """The options ``memtui demo`` accepts: its own and the training's (passed through)."""
    from memtui.cli import demo_command
    from memtui.demo.options import build_parser

    names = {o for p in demo_command.params for o in (*p.opts, *p.secondary_opts)}
    return names | {o for a in build_parser()._actions for o in a.option_strings}


def test_every_memtui_demo_command_in_the_readme_is_accepted() -> None:
    from click.testing import CliRunner

    from memtui.cli import main

    commands = readme_demo_commands()
    assert any("--vocab 8192" in c for c in commands), commands  # the seed-004 re-creation
    known = demo_option_names()
    for command in commands:
        words = command.split()[2:]
        if "[" in command or any(w.isupper() for w in words):  # a synopsis: its options exist
            for option in re.findall(r"--[a-z][a-z-]*", command):
                assert option in known, f"{command}: {option} is not an option of memtui demo"
            continue
        result = CliRunner().invoke(main, ["demo", *words, "--dry-run"])
        assert result.exit_code == 0, f"{command}: {result.output}"
        if "--help" not in words:  # the training command, with the options passed through
            passed = [w for w in words if w != "--no-tui"]
            ran = shlex.split(result.output)
            assert ran[ran.index("memtui.demo") + 1 :] == passed, result.output


def test_readme_seed_004_command_runs(tmp_path: Path) -> None:
    """The README's seed-004 line really trains through ``memtui demo`` (a few steps; the
    command forked from the fork server, with torch imported: it trains in its own process)."""
    line = next(c for c in readme_demo_commands() if "--memory-limit" in c and "[" not in c)
    log = tmp_path / "demo.log"
    argv = [*line.split()[1:], "--no-tui", "--steps", "3", "--slow-data-ms", "0"]
    proc = launch_memtui([*argv, "--out", str(tmp_path)], dict(os.environ), log)
    try:
        code = proc.wait(120)
    finally:
        proc.kill()
    assert code == 0, log.read_text()
    assert "done: 3 steps" in log.read_text(), log.read_text()
    assert (tmp_path / "checkpoint.pt").exists()


def readme_section(title: str) -> str:
    """The README's section under ``## title``, up to the next ``##`` heading."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def shell_lines(section: str) -> list[str]:
    """The ``memtui`` lines of a section's code blocks, as typed (``$ `` dropped, comments off)."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", section, re.S):
        for line in block.splitlines():
            command = line.removeprefix("$ ").split("  #", 1)[0].strip()
            if command.startswith("memtui ") or "$(memtui " in command:
                found.append(command)
    return found


def inline_commands(section: str) -> list[str]:
    """The complete ``memtui`` commands written inline in a section (no ``...``, no demo)."""
    spans = re.findall(r"`(memtui [^`]*)`", section)
    return [s for s in spans if "..." not in s and not s.startswith("memtui demo")]


def test_readme_command_line_runs_against_a_demo(start_demo: Callable[..., DemoRun]) -> None:
    """Every ``memtui`` line of the README's CLI section, then the commands the 'Two commands'
    section names, run as written (in that order, by click in this process) against one live
    demo run: each exits 0, the confirmations in the comments come true, and ``memtui status``
    prints the example's lines."""
    demo = start_demo("--steps", "1000000", "--checkpoint-every", "1000000", *PLUMBING)
    section = readme_section("The command line")
    lines = [line for line in shell_lines(section) if "[" not in line]
    comments = {
        line.removeprefix("$ ").split("  #", 1)[0].strip(): line.split("  #", 1)[1].strip()
        for block in re.findall(r"```sh\n(.*?)```", section, re.S)
        for line in block.splitlines()
        if "  #" in line
    }
    assert {"memtui ls", "memtui status --json", "memtui cancel all"} <= set(lines), lines
    two_commands = inline_commands(readme_section("Two commands"))
    assert two_commands == ["memtui status", "memtui set num_workers=4"], two_commands
    outputs = {}
    for line in [*lines, *two_commands]:  # by click in this process (memtui_here)
        result = memtui_here(*shlex.split(line)[1:])
        assert result.exit_code == 0, f"{line}: {result.output}"
        outputs[line] = result.stdout + result.stderr
        said = comments.get(line, "").replace("demo-...", demo.run_id)
        if said.startswith(("queued #", "cancelled #")):
            assert said in outputs[line], (line, outputs[line])
    assert json.loads(outputs["memtui status --json"].strip())["run"] == demo.run_id
    example = re.search(r"\$ memtui status\n(.*?)```", section, re.S)
    assert example, "the CLI section shows what memtui status prints"
    shown = outputs["memtui status"].splitlines()
    for head in [line.split()[0] for line in example.group(1).splitlines()[:5]]:
        assert any(line.startswith(head) for line in shown), (head, shown)


def test_readme_gpu_pick_line_stops_where_no_gpu_is_picked(tmp_path: Path) -> None:
    """The README's ``gpus --pick`` form, run by bash as written: without a GPU to pick it
    stops with the reason and never starts ``python train.py`` with an empty device list."""
    from memtui.gpus import NoDriver, load_nvml

    try:
        load_nvml()
        pytest.skip("this host has an NVIDIA driver: the pick would succeed")
    except NoDriver:
        pass
    line = next(
        c for c in shell_lines(readme_section("Before the run: gpus and estimate")) if "--pick" in c
    )
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    result = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("memtui: no NVIDIA driver") and "train.py" not in result.stderr


def test_readme_names_a_recording_that_replays() -> None:
    """The viewer section's ``memtui replay`` line names a recording of this repository that the
    replay source opens whole (the viewer's replay tests play the same files)."""
    from memtui.sources import ReplaySource

    line = next(
        c for c in shell_lines(readme_section("The viewer: `memtui attach`")) if "replay" in c
    )
    path = ROOT / shlex.split(line)[2]
    source = ReplaySource(str(path))
    assert source.recording.frames and not source.recording.cut_note, line
