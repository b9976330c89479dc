"""The README's plain-loop example runs as written, takes a change, and resumes with it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT, memtui_cli, wait_for


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- example: plain-loop -->\n```python\n(.*?)```", text, re.S)
    assert match, "the README has the plain-loop example"
    return match.group(1)


def test_plain_loop_example(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    out = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, str(script), "--steps", "4000", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        runs = wait_for(
            lambda: json.loads(memtui_cli("ls", "--json").stdout), 60, 0.1, "the example's run"
        )
        assert runs[0]["run"].startswith("train-")  # type: ignore[index]
        result = memtui_cli("set", "batch_size=64", "--keep-effective-batch")
        assert result.returncode == 0, result.stderr
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert re.search(r"applied at step \d+00: batch_size 32 -> 64, grad_accum 2 -> 1", output), (
        output
    )
    tuned = yaml.safe_load((out / "memtui-tuned.yaml").read_text())
    assert tuned["config"]["batch_size"] == 64 and tuned["config"]["grad_accum"] == 1

    resumed = subprocess.run(
        [sys.executable, str(script), "--steps", "4100", "--out", str(out), "--is_keep_training"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed the tuned config" in resumed.stderr
    assert "batch_size 32 -> 64" in resumed.stderr
