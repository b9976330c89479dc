"""What every command shares: failing with a message, finding the run, its control client, the
thresholds in force."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # each command imports what it uses: `memtui --version` loads no zmq or psutil
    from memtui.advice.verdict import ThresholdConfig, Thresholds
    from memtui.storage import registry
    from memtui.transport.client import ControlClient


TIMEOUT_HELP = "Seconds to wait for the run's answer."


def fail(message: str, code: int = 1) -> None:
    """Say ``message`` on stderr as memtui's and exit with ``code``."""
    click.echo(f"memtui: {message}", err=True)
    sys.exit(code)


def find_target(run: str | None, *, changes: bool = False, usage: str = "") -> registry.Target:
    """The run ``run`` names (the newest without it, unless several are live and the command
    ``changes`` one); ``usage``: the command's own form with RUN, said when a run must be named.
    A RUN that must be named or that matches several runs is a usage error (exit 2), one that
    matches none a lookup failure (exit 1)."""
    from memtui.storage import registry

    try:
        target = registry.find_run(run, changes=changes)
    except registry.AmbiguousRun as exc:
        fail(name_one(usage) if usage else str(exc), 2)
        raise  # unreachable
    except registry.RunNotFound as exc:
        several = bool(run) and sum(r.run.startswith(run or "") for r in registry.list_runs()) > 1
        fail(str(exc), 2 if several else 1)
        raise  # unreachable
    except registry.RegistryError as exc:
        fail(str(exc))
        raise
    if target.note:
        click.echo(f"memtui: {target.note}", err=True)
    return target


def name_one(usage: str) -> str:
    """``2 live runs: name the one to change (memtui cancel RUN ID): ...``, with each live run."""
    from memtui.storage import registry

    runs = registry.list_runs()
    listed = "; ".join(f"{r.run} (pid {r.pid}, {r.cwd or '?'})" for r in runs)
    return f"{len(runs)} live runs: name the one to change ({usage}): {listed}"


def client_for(target: registry.Target, timeout: float) -> ControlClient:
    """A control client for the run ``target`` names."""
    from memtui.transport.client import ControlClient

    return ControlClient(target.control, timeout_s=timeout)


def thresholds_in_force() -> Thresholds:
    """The verdict's thresholds from the YAML config file (problems said on stderr)."""
    return threshold_config().thresholds


def threshold_config() -> ThresholdConfig:
    """The YAML config's verdict: section, if any; what it got wrong is said on stderr."""
    from memtui.core.stats import printable
    from memtui.storage.userconfig import load_thresholds

    config = load_thresholds()
    for problem in config.problems:  # a file's text: its control characters made visible
        print(f"memtui: {printable(problem)}", file=sys.stderr)
    return config
