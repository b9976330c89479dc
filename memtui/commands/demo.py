"""`memtui demo`: the bundled demo training, with the viewer on it."""

from __future__ import annotations

import os
import sys

import click

from memtui.commands.common import fail

DEMO_USAGE = "memtui demo [--no-tui] [--ranks N] [--dry-run] [TRAINING OPTIONS] (see --help)"
TRAINING_OPTIONS = "Training options (passed to python -m memtui.demo)"
"""The heading of the training's options in ``--help`` (and in the command line reference)."""


class _DemoCommand(click.Command):
    """``memtui demo``: its own options, then every option of the demo training, passed through
    (its ``--help`` lists both; the training's come from :mod:`memtui.demo.options`)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_options(ctx, formatter)
        from memtui.demo.options import option_rows

        with formatter.section(TRAINING_OPTIONS):
            formatter.write_dl(option_rows())


@click.command(
    "demo",
    cls=_DemoCommand,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option(
    "--no-tui", is_flag=True, help="Run the training in the foreground, without the viewer."
)
@click.option(
    "--ranks",
    default=1,
    show_default=True,
    help="Processes under torchrun (gloo on CPU, nccl on GPUs).",
)
@click.option(
    "--dry-run", is_flag=True, help="Check the options, print the training command, run nothing."
)
@click.option(
    "--tcp",
    metavar="ADDRESS",
    help="Also publish over TCP on ADDRESS (CURVE keys from `memtui keygen` required).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="With --tcp: plain TCP, no keys (loopback only): ANY local user can read the "
    "telemetry; changes are not served over it.",
)
@click.option(
    "--insecure-control",
    is_flag=True,
    help="With --insecure: plain TCP serves changes too (ANY local user can queue them).",
)
@click.pass_context
def demo_command(
    ctx: click.Context,
    no_tui: bool,
    ranks: int,
    dry_run: bool,
    tcp: str | None,
    insecure: bool,
    insecure_control: bool,
) -> None:
    """Run the bundled demo training (slow data: it starves until you add workers).

    Every option of the training (python -m memtui.demo) is accepted too, as listed below.
    """
    import shlex

    from memtui.demo.launcher import (
        DemoFailed,
        demo_command_line,
        demo_environment,
        quiet_numpy_warning,
        run_forwarding_signals,
        run_with_viewer,
    )
    from memtui.demo.options import default_out, out_in_use, parse_args

    argv = list(ctx.args)
    # a wrong training option: argparse's message and exit status 2, before anything starts
    args = parse_args(argv, "memtui demo", DEMO_USAGE)
    if ranks < 1:
        fail("--ranks must be 1 or more", 2)
    command = demo_command_line(argv, ranks)
    # the training's processes keep the working directory off their module search path
    env = {**_tcp_env(tcp, insecure, insecure_control), **demo_environment()}
    if dry_run:  # says what would run, and changes nothing (this process's environment included)
        click.echo(shlex.join([*(f"{k}={v}" for k, v in env.items()), *command]))
        return
    os.environ.update(env)  # the training (in this process or a child) reads them
    busy = out_in_use(args.out or default_out())
    if busy:
        fail(busy, 2)
    os.environ["PYTHONWARNINGS"] = quiet_numpy_warning(os.environ.get("PYTHONWARNINGS", ""))
    if no_tui:
        if ranks == 1:
            from memtui.demo.train import main as demo_main

            sys.exit(demo_main(argv))
        sys.exit(run_forwarding_signals(command))
    try:
        sys.exit(run_with_viewer(command, args.out or default_out()))
    except DemoFailed as exc:
        fail(str(exc))


def _tcp_env(tcp: str | None, insecure: bool, insecure_control: bool = False) -> dict[str, str]:
    """The environment that makes the training publish over TCP; refuse (exit 2) what the run
    would refuse: TCP without keys, or ``--insecure`` on an address other than loopback."""
    from memtui.transport.security import SecurityError, plan_tcp

    if insecure_control and not insecure:
        fail("--insecure-control goes with --insecure (control over plain TCP is asked twice)", 2)
    if insecure and not tcp:
        fail("--insecure goes with --tcp ADDRESS (a loopback address)", 2)
    if not tcp:
        return {}
    try:
        plan_tcp(tcp, insecure, insecure_control)
    except SecurityError as exc:
        fail(str(exc), 2)
    env = {"MEMTUI_TCP": tcp, **({"MEMTUI_INSECURE": "1"} if insecure else {})}
    return {**env, **({"MEMTUI_INSECURE_CONTROL": "1"} if insecure_control else {})}
