"""The ``memtui`` command: one group, and each command in a module of its own
(``memtui.commands``: ls, status, set, cancel, autotune, attach, replay, demo, run, export,
keygen, gpus, estimate, report, compare, check).

A public scripting interface: ``--json`` output is stable (fields are added, never renamed),
errors go to stderr, and the exit status says whether the request succeeded.
"""

from __future__ import annotations

import click

from memtui import __version__
from memtui.commands import (
    attach,
    autotune,
    cancel,
    check,
    compare,
    demo,
    estimate,
    export,
    gpus,
    keygen,
    ls,
    replay,
    report,
    run,
    status,
)
from memtui.commands import set as set_


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, package_name="memtui")
def main() -> None:
    """Watch a training run starve or run out of memory, and retune it at the next checkpoint."""


for _command in (
    ls.ls_command,
    status.status_command,
    set_.set_command,
    cancel.cancel_command,
    autotune.autotune_command,
    demo.demo_command,
    replay.replay_command,
    keygen.keygen_command,
    gpus.gpus_command,
    estimate.estimate_command,
    run.run_command,
    export.export_command,
    attach.attach_command,
    report.report_command,
    compare.compare_command,
    check.check_command,
):
    main.add_command(_command)


if __name__ == "__main__":
    main()
