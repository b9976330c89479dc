"""A crash never splits the audit log from the tuned config.

A real demo training is killed with SIGKILL at each point of its first applied change
(``tests/support/crash_at.py``): after the audit log's ``applying`` line, with the tuned config's
temp file written and not renamed, with the tuned config renamed and no ``applied`` line, and
after both. The restart (``--resume``) then says which of the two it trusts, runs what it says,
audits the outcome, and leaves no temp file; every line of the log parses.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import yaml

from memtui.hooks.persist import AUDIT_FILE, TUNED_FILE, read_audit
from tests.support.processes import LIGHT, ROOT, launch_demo, launch_script

CRASH_AT = ROOT / "tests" / "support" / "crash_at.py"
RUN = (*LIGHT, "--checkpoint-every", "3", "--progress-every", "0")
"""The change applies at step 3's checkpoint; a progress line every step says the batch run."""

POINTS = {
    "applying": (False, "16"),
    "before-rename": (False, "16"),
    "after-rename": (True, "4"),
    "applied": (True, "4"),
}
"""Where the training is killed: whether the tuned config then holds the change, and the
micro-batch the restart runs."""


def batches_run(log: str) -> set[str]:
    """The micro-batch sizes the demo's progress lines say it ran."""
    return set(re.findall(r"batch (\d+)x\d+", log))


@pytest.mark.parametrize("point", list(POINTS))
def test_a_kill_at_any_point_of_an_apply_is_reconciled_at_the_restart(
    point: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    crash = {**env, "CRASH_AT": point, "CRASH_CHANGE": "batch_size=4"}
    killed_log = tmp_path / "killed.log"
    killed = launch_script(
        CRASH_AT, [*RUN, "--steps", "100", "--out", str(out)], crash, ROOT, killed_log
    )
    assert killed.wait(120) == -signal.SIGKILL, killed_log.read_text()[-3000:]
    saved, batch = POINTS[point]
    events = [e["event"] for e in read_audit(out / AUDIT_FILE)]
    assert events == ["queued", "applying", *(["applied"] if point == "applied" else [])]
    if saved:
        assert yaml.safe_load((out / TUNED_FILE).read_text())["config"]["batch_size"] == 4
    else:
        assert not (out / TUNED_FILE).exists()
    temps = [p.name for p in out.iterdir() if p.name.startswith(f".{TUNED_FILE}.")]
    assert len(temps) == (point == "before-rename"), temps

    restart_log = tmp_path / "restart.log"
    restart = launch_demo([*RUN, "--steps", "5", "--resume", "--out", str(out)], env, restart_log)
    assert restart.wait(120) == 0, restart_log.read_text()[-3000:]
    said = restart_log.read_text()
    assert batches_run(said) == {batch}, said[-3000:]
    reconciled = [line for line in said.splitlines() if "change #1 at step 3" in line]
    if point == "applied":
        assert reconciled == [], "the two agree: nothing to say"
    elif saved:
        assert len(reconciled) == 1, said[-3000:]
        assert "stopped while applying change #1 at step 3 (batch_size 16 -> 4)" in reconciled[0]
        assert "this run trusts the tuned config, which holds it" in reconciled[0]
    else:
        assert len(reconciled) == 1, said[-3000:]
        assert "but its tuned config does not hold it" in reconciled[0]
        assert "this run starts from the script's config" in reconciled[0]
        assert re.search(r"to apply it again: memtui set demo-\w+ batch_size=4$", reconciled[0])
    assert "Traceback" not in said
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")], "no temp file left"
    lines = (out / AUDIT_FILE).read_text().splitlines()
    audit = [json.loads(line) for line in lines]  # every line whole
    outcome = [e for e in audit if e["event"] == "reconciled"]
    if point == "applied":
        assert outcome == []
    else:
        assert [(e["ids"], e["step"], e["saved"]) for e in outcome] == [([1], 3, saved)]
