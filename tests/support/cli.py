"""The ``memtui`` command line as the tests run it: in a subprocess, or by click in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support import clock
from tests.support.processes import ROOT


def memtui_cli(
    *args: str, timeout: float = 30.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the ``memtui`` command line in a subprocess (``env``: instead of this process's);
    ``timeout``: seconds of an idle machine, stretched by the load while it runs."""
    return clock.run(
        [sys.executable, "-m", "memtui.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def memtui_here(*args: str) -> Any:
    """``memtui ARGS`` run by click in this process (its ``Result``): the command's own code,
    for tests that poll it (a subprocess per poll cost ~0.27 CPU seconds, 100 times this; the
    suite's ``memtui_cli`` calls keep the real command line covered)."""
    from click.testing import CliRunner

    from memtui.cli import main

    return CliRunner().invoke(main, list(args))


def status_json(run: str | None = None) -> dict[str, Any]:
    """``memtui status [RUN] --json``, run in this process (``memtui_here``), waiting for the
    run's answer as long as the command's 3 s on an idle machine, stretched by the load."""
    wait = f"{clock.patience(3.0):.1f}"
    result = memtui_here("status", *([run] if run else []), "--json", "--timeout", wait)
    assert result.exit_code == 0, result.stderr or result.output
    return dict(json.loads(result.stdout))
