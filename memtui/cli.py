"""The ``memtui`` command: ls, status, set, cancel, autotune, demo, attach, run, export.

A public scripting interface: ``--json`` output is stable (fields are added, never renamed),
errors go to stderr, and the exit status says whether the request succeeded.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from memtui import __version__

if TYPE_CHECKING:  # the commands import what they use: `memtui --version` loads no zmq or psutil
    import subprocess
    from pathlib import Path

    from memtui import registry
    from memtui.advice.verdict import ThresholdConfig, Thresholds
    from memtui.client import ControlClient
    from memtui.wire import SetReply, Snapshot

TIMEOUT_HELP = "Seconds to wait for the run's answer."


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"memtui: {message}", err=True)
    sys.exit(code)


def _target(run: str | None, *, changes: bool = False, usage: str = "") -> registry.Target:
    """The run ``run`` names (the newest without it, unless several are live and the command
    ``changes`` one); ``usage``: the command's own form with RUN, said when a run must be named.
    A RUN that must be named or that matches several runs is a usage error (exit 2), one that
    matches none a lookup failure (exit 1)."""
    from memtui import registry

    try:
        target = registry.find_run(run, changes=changes)
    except registry.AmbiguousRun as exc:
        _fail(_name_one(usage) if usage else str(exc), 2)
        raise  # unreachable
    except registry.RunNotFound as exc:
        several = bool(run) and sum(r.run.startswith(run or "") for r in registry.list_runs()) > 1
        _fail(str(exc), 2 if several else 1)
        raise  # unreachable
    except registry.RegistryError as exc:
        _fail(str(exc))
        raise
    if target.note:
        click.echo(f"memtui: {target.note}", err=True)
    return target


def _name_one(usage: str) -> str:
    """``2 live runs: name the one to change (memtui cancel RUN ID): ...``, with each live run."""
    from memtui import registry

    runs = registry.list_runs()
    listed = "; ".join(f"{r.run} (pid {r.pid}, {r.cwd or '?'})" for r in runs)
    return f"{len(runs)} live runs: name the one to change ({usage}): {listed}"


def _client(target: registry.Target, timeout: float) -> ControlClient:
    from memtui.client import ControlClient

    return ControlClient(target.control, timeout_s=timeout)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, package_name="memtui")
def main() -> None:
    """Watch a training run starve or run out of memory, and retune it at the next checkpoint."""


# ---------------------------------------------------------------------------- ls


@main.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls_command(as_json: bool) -> None:
    """List live runs on this host."""
    import json

    from memtui import registry
    from memtui.security import exposure, tcp_endpoints
    from memtui.wire import to_builtins

    try:
        runs = registry.list_runs()
    except registry.RegistryError as exc:
        _fail(str(exc))
        return
    if as_json:
        rows = [
            {
                "run": r.run,
                "pid": r.pid,
                "host": r.host,
                "ranks": r.world_size,
                "started": r.started,
                "command": r.command,
                "cwd": r.cwd,
                "control": r.control,
                "endpoints": [to_builtins(k) for k in r.ranks],
                "state_dir": r.state_dir,
                "security": r.security,
            }
            for r in runs
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    if not runs:
        click.echo("no live runs")
        return
    click.echo(f"{'RUN':<24} {'PID':>7} {'RANKS':>5}  {'STARTED':<8}  COMMAND")
    for r in runs:
        started = time.strftime("%H:%M:%S", time.localtime(r.started))
        command = " ".join(r.command[1:] if len(r.command) > 1 else r.command)
        click.echo(f"{r.run:<24} {r.pid:>7} {r.world_size:>5}  {started:<8}  {command[:80]}")
        warning = exposure(r.security, tcp_endpoints(r.ranks))
        if warning:
            click.echo(f"  {warning}")


# ---------------------------------------------------------------------------- status


def _thresholds_in_force() -> Thresholds:
    """The verdict's thresholds from the YAML config file (problems said on stderr)."""
    return _threshold_config().thresholds


def _threshold_config() -> ThresholdConfig:
    """The YAML config's verdict: section, if any; what it got wrong is said on stderr."""
    from memtui.userconfig import load_thresholds

    config = load_thresholds()
    for problem in config.problems:
        print(f"memtui: {problem}", file=sys.stderr)
    return config


def rank_snapshots(snapshot: Snapshot, timeout: float = 2.0) -> list[Snapshot | None]:
    """Rank 0's snapshot and every other rank's (None where a rank did not answer)."""
    from memtui import registry
    from memtui.client import hello_many

    others = [r for r in snapshot.ranks if r.rank != snapshot.info.rank]
    answers = hello_many([registry.rank_control(r) for r in others], timeout_s=timeout)
    by_rank = {r.rank: a for r, a in zip(others, answers, strict=True)}
    by_rank[snapshot.info.rank] = snapshot
    return [by_rank.get(r.rank) for r in snapshot.ranks] if snapshot.ranks else [snapshot]


@main.command("status")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def status_command(run: str | None, as_json: bool, timeout: float) -> None:
    """Show a run's step, speed, memory, config and changes (RUN: id, prefix, pid or endpoint)."""
    from memtui.client import ClientError
    from memtui.report import build_status, render_status, status_json

    target = _target(run)
    try:
        snapshot = _client(target, timeout).hello()
    except ClientError as exc:
        _fail(str(exc))
        return
    ranks = rank_snapshots(snapshot) if len(snapshot.ranks) > 1 else None
    report = build_status(snapshot, ranks, _threshold_config())
    click.echo(status_json(report) if as_json else render_status(report))


# ---------------------------------------------------------------------------- set / cancel


@main.command("set", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, required=True)
@click.option(
    "--keep-effective-batch", is_flag=True, help="Recompute grad_accum so micro x accum stays."
)
@click.option(
    "--allow-effective-batch",
    is_flag=True,
    help="Let micro x accum x ranks change, the LR following --lr-scale.",
)
@click.option(
    "--lr-scale",
    type=click.Choice(["linear", "sqrt", "none"]),  # knobs.LR_RULES: not imported at start-up
    help="How the LR follows the effective batch (default: the run's install(lr_scale=...)).",
)
@click.option("--dry-run", is_flag=True, help="Validate and resolve only; queue nothing.")
@click.option("--force", is_flag=True, help="Queue even when the change is predicted to be risky.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as JSON.")
@click.option(
    "--quiet",
    "-q",
    is_flag=True,
    help="Print only the change id on stdout (nothing for --dry-run); notes still go to stderr.",
)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def set_command(
    args: tuple[str, ...],
    keep_effective_batch: bool,
    allow_effective_batch: bool,
    lr_scale: str | None,
    dry_run: bool,
    force: bool,
    as_json: bool,
    quiet: bool,
    timeout: float,
) -> None:
    """Queue a change for the next checkpoint: memtui set [RUN] KEY=VALUE...

    Keys: batch_size, grad_accum, num_workers, pin_memory, prefetch_factor (aliases such as
    per_device_train_batch_size or gradient_accumulation_steps work too). Prints what was queued
    with its id and predicted peak on stdout (the id alone with -q), notes on stderr.
    A change of micro x accum x ranks moves the LR by the run's rule (install(lr_scale=...),
    none unless set: the LR stays, with a warning), or by --lr-scale with --allow-effective-batch.
    """
    import json

    from memtui.client import ClientError
    from memtui.knobs import KnobError, format_changes, names_knob, parse_assignments, parse_changes
    from memtui.userconfig import load_thresholds
    from memtui.wire import to_builtins

    if keep_effective_batch and allow_effective_batch:
        _fail("rejected: --keep-effective-batch and --allow-effective-batch contradict", 2)
    if lr_scale and not allow_effective_batch:
        _fail("rejected: --lr-scale needs --allow-effective-batch", 2)
    if quiet and as_json:
        _fail("rejected: --quiet and --json contradict", 2)
    words = list(args)
    run = words.pop(0) if words and "=" not in words[0] and not names_knob(words[0]) else None
    try:
        raw = parse_assignments(words)
        parse_changes(raw)  # fail early, before contacting the run, on what is wrong anyway
    except KnobError as exc:
        _fail(f"rejected: {exc}", 2)
        return
    target = _target(run, changes=True, usage="memtui set RUN KEY=VALUE...")
    where = f" on {target.run}" if target.run else ""
    try:
        reply = _client(target, timeout).set(
            dict(raw),
            keep_effective_batch=keep_effective_batch,
            dry_run=dry_run,
            force=force,
            lr_scale=lr_scale or "",
        )
    except ClientError as exc:
        _fail(str(exc))
        return
    if as_json:
        click.echo(json.dumps(to_builtins(reply), indent=2))
        sys.exit(0 if reply.ok else 2)
    if not reply.ok:
        _fail(f"rejected: {reply.reason}", 2)
    bands = load_thresholds().thresholds  # the run reads the same config file at install
    # the answer on stdout, in the order it reads; notes (warnings among them) on stderr
    if quiet:
        if not dry_run:
            click.echo(str(reply.id))
    elif dry_run:
        click.echo(f"would queue {format_changes(reply.changes)}{where}")
        click.echo(_prediction_line(reply, bands.memory_edge_fraction))
        if reply.needs_force:
            click.echo(
                f"it would need --force: predicted over the "
                f"{bands.memory_danger_fraction:.0%} danger band"
            )
    else:
        click.echo(
            f"queued #{reply.id}{where}: {format_changes(reply.changes)} (applies at "
            f"{reply.boundary or 'the next checkpoint'})"
        )
        click.echo(_prediction_line(reply, bands.memory_edge_fraction))
    if reply.note and not (dry_run and reply.needs_force and not quiet):
        click.echo(f"note: {reply.note}", err=True)


def _prediction_line(reply: SetReply, edge: float) -> str:
    """The memory prediction in a reply, in one line (``edge``: the top of the safe band)."""
    from memtui.stats import format_bytes

    if reply.predicted_peak_bytes is None or not reply.capacity_bytes:
        return "predicted peak: no memory model yet (it needs a few steps of samples)"
    share = reply.predicted_peak_bytes / reply.capacity_bytes
    high = reply.predicted_high_bytes
    upto = (
        f", up to {format_bytes(high)} = {high / reply.capacity_bytes:.0%}"
        if high is not None and high > reply.predicted_peak_bytes
        else ""
    )
    line = (
        f"predicted peak {format_bytes(reply.predicted_peak_bytes)} = {share:.0%}{upto} of "
        f"{format_bytes(reply.capacity_bytes)} ({reply.confidence})"
    )
    if reply.max_safe_batch_size is not None:
        safe = reply.max_safe or str(reply.max_safe_batch_size)
        line += f"; largest micro-batch under {edge:.0%}: {safe}"
    return line


NOTHING_PENDING = "no change is pending"
"""The hook's answer to cancelling every pending change when none is."""


@main.command("cancel")
@click.argument("args", nargs=-1)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def cancel_command(args: tuple[str, ...], timeout: float) -> None:
    """Cancel a pending change: memtui cancel [RUN] ID (or 'all')."""
    from memtui.client import ClientError

    words = list(args)
    if not words:
        _fail("give the change id to cancel, or 'all'", 2)
    which = words.pop()
    run = words[0] if words else None
    if which != "all" and not which.lstrip("#").isdigit():
        _fail(f"expected a change id or 'all', got {which!r}", 2)
    change_id = 0 if which == "all" else int(which.lstrip("#"))
    target = _target(run, changes=True, usage=f"memtui cancel RUN {which}")
    try:
        reply = _client(target, timeout).cancel(change_id)
    except ClientError as exc:
        _fail(str(exc))
        return
    where = f" on {target.run}" if target.run else ""
    if not reply.ok and change_id == 0 and reply.reason == NOTHING_PENDING:
        click.echo(f"nothing pending{where}")  # all of nothing is cancelled: not an error
        return
    if not reply.ok:
        _fail(reply.reason, 2)
    click.echo("cancelled " + " ".join(f"#{i}" for i in reply.cancelled) + where)


@main.command("autotune")
@click.argument("switch", type=click.Choice(["on", "off"]))
@click.argument("run", required=False)
@click.option("--timeout", default=3.0, show_default=True, help=TIMEOUT_HELP)
def autotune_command(switch: str, run: str | None, timeout: float) -> None:
    """Turn the autopilot on or off: memtui autotune on|off [RUN]."""
    from memtui.advice.autopilot import describe_state
    from memtui.client import ClientError

    target = _target(run, changes=True, usage=f"memtui autotune {switch} RUN")
    try:
        reply = _client(target, timeout).autotune(switch == "on")
    except ClientError as exc:
        _fail(str(exc))
        return
    if not reply.ok or reply.state is None:
        _fail(reply.reason or "the run did not say", 2)
        return
    click.echo(describe_state(reply.state) + (f" on {target.run}" if target.run else ""))


# ---------------------------------------------------------------------------- demo


DEMO_USAGE = "memtui demo [--no-tui] [--ranks N] [--dry-run] [TRAINING OPTIONS] (see --help)"


class _DemoCommand(click.Command):
    """``memtui demo``: its own options, then every option of the demo training, passed through
    (its ``--help`` lists both; the training's come from :mod:`memtui.demo.options`)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_options(ctx, formatter)
        from memtui.demo.options import build_parser

        rows = []
        # argparse lists a parser's actions only through _actions (no public accessor)
        for action in build_parser()._actions:  # noqa: SLF001
            if not action.option_strings or action.dest == "help":
                continue
            names = "/".join(action.option_strings)
            if action.nargs != 0:
                names += f" {action.metavar or action.dest.upper()}"
            rows.append((names, action.help or ""))
        with formatter.section("Training options (passed to python -m memtui.demo)"):
            formatter.write_dl(rows)


@main.command(
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

    from memtui.demo.options import default_out, out_in_use, parse_args

    argv = list(ctx.args)
    # a wrong training option: argparse's message and exit status 2, before anything starts
    args = parse_args(argv, "memtui demo", DEMO_USAGE)
    if ranks < 1:
        _fail("--ranks must be 1 or more", 2)
    command = demo_command_line(argv, ranks)
    tcp_env = _tcp_env(tcp, insecure, insecure_control)
    if dry_run:  # says what would run, and changes nothing (this process's environment included)
        click.echo(shlex.join([*(f"{k}={v}" for k, v in tcp_env.items()), *command]))
        return
    os.environ.update(tcp_env)  # the training (in this process or a child) reads them
    busy = out_in_use(args.out or default_out())
    if busy:
        _fail(busy, 2)
    os.environ["PYTHONWARNINGS"] = _quiet_numpy_warning(os.environ.get("PYTHONWARNINGS", ""))
    if no_tui:
        if ranks == 1:
            from memtui.demo.train import main as demo_main

            sys.exit(demo_main(argv))
        sys.exit(_run_forwarding_signals(command))
    _demo_with_tui(command, args.out)


NO_NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"
"""A ``PYTHONWARNINGS`` filter for torch's warning at import where NumPy is not installed: the
demo's processes (torchrun's launcher too) need no NumPy, and it was the demo's first line."""


def _quiet_numpy_warning(filters: str) -> str:
    """``PYTHONWARNINGS`` for the demo's processes: the user's filters, and torch's NumPy warning
    left out (the user's own filters come last and win: a later filter takes precedence)."""
    return ",".join(f for f in (NO_NUMPY_WARNING, filters) if f)


def _tcp_env(tcp: str | None, insecure: bool, insecure_control: bool = False) -> dict[str, str]:
    """The environment that makes the training publish over TCP; refuse (exit 2) what the run
    would refuse: TCP without keys, or ``--insecure`` on an address other than loopback."""
    from memtui.security import SecurityError, plan_tcp

    if insecure_control and not insecure:
        _fail("--insecure-control goes with --insecure (control over plain TCP is asked twice)", 2)
    if insecure and not tcp:
        _fail("--insecure goes with --tcp ADDRESS (a loopback address)", 2)
    if not tcp:
        return {}
    try:
        plan_tcp(tcp, insecure, insecure_control)
    except SecurityError as exc:
        _fail(str(exc), 2)
    env = {"MEMTUI_TCP": tcp, **({"MEMTUI_INSECURE": "1"} if insecure else {})}
    return {**env, **({"MEMTUI_INSECURE_CONTROL": "1"} if insecure_control else {})}


def _run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` in the foreground; SIGTERM and SIGHUP sent to us reach it too.

    torchrun passes them on to its ranks, so stopping ``memtui demo --ranks N --no-tui`` stops
    the whole job instead of leaving the ranks running.
    """
    import signal
    import subprocess

    proc = subprocess.Popen(command)

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to the child too: wait for it
            continue


def demo_command_line(argv: list[str], ranks: int = 1) -> list[str]:
    """The command that runs the demo training, under torchrun when ``ranks`` > 1."""
    if ranks == 1:
        return [sys.executable, "-m", "memtui.demo", *argv]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc_per_node={ranks}", "-m", "memtui.demo", *argv]


def _demo_with_tui(command: list[str], out: Path | None = None) -> None:
    """Start the demo training in a subprocess and attach the viewer to it (its output goes to
    ``demo.log`` in ``out``, the demo's own default directory without it), saying on stderr what
    happens before the viewer shows and after it closes; exit non-zero if the training died."""
    import subprocess

    try:
        from memtui.tui.app import run_app
    except ImportError:
        _fail("the viewer is not available in this build; use --no-tui")
        return
    from memtui.demo.options import default_out

    out_dir = out or default_out()
    log_path = out_dir / "demo.log"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    _say_demo(f"starting the demo training (its output: {log_path})...")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _say_demo("waiting for the run to register (the training imports torch first)...")
        run_id = _wait_for_run_id(log_path, proc)
        _say_demo(f"attaching to run {run_id}...")
        try:
            code = run_app(run_id, demo_process=proc)
            died = f"exit status {code}" if code else ""
        except Exception as exc:  # the viewer's failure, not the training's: it goes on
            code, died = 1, f"{type(exc).__name__}: {exc}"
        if died and proc.poll() is None:  # only a normal quit (q) stops the demo's training
            _viewer_died(died, run_id, log_path)
            proc.wait()  # until the training ends; Ctrl-C stops it (below), as before
        training = proc.poll()
        if training:  # it ended on its own, with an error or killed: the demo failed
            _say_demo(f"the demo training died ({_exit_words(training)}); see {log_path}")
            code = code or (training if training > 0 else 128 - training)  # as a shell says it
    finally:
        if proc.poll() is None:
            _say_demo("stopping the demo training...")
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    sys.exit(code)


def _say_demo(message: str) -> None:
    """One line on stderr about what ``memtui demo`` is doing."""
    print(f"memtui demo: {message}", file=sys.stderr, flush=True)


def _exit_words(status: int) -> str:
    """A child's ``returncode`` in words: ``exit status 1``, ``killed by SIGKILL``."""
    import signal

    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def _viewer_died(why: str, run_id: str, log_path: Path) -> None:
    """Tell the operator that the demo's viewer died and that its training goes on."""
    from memtui.runs.text import clean

    print(f"memtui demo: the viewer died ({clean(why, 300)})", file=sys.stderr)
    print(f"memtui demo: the training goes on; its output: {log_path}", file=sys.stderr)
    print(
        f"memtui demo: reattach with `memtui attach {run_id}`; Ctrl-C stops the training",
        file=sys.stderr,
        flush=True,
    )


def _wait_for_run_id(log_path: Any, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if line.startswith("run "):
                return str(line.split()[1])
        if proc.poll() is not None:
            _fail(f"the demo training exited early; see {log_path}")
        time.sleep(0.1)
    _fail(f"the demo training did not start within {timeout:.0f} s; see {log_path}")
    return ""


# ---------------------------------------------------------------------------- replay


@main.command("replay")
@click.argument("path", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--speed",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Playback speed (x real time, above 0).",
)
def replay_command(path: str, speed: float) -> None:
    """Show a recorded stream (.mtrec) in the viewer, with pause and speed controls."""
    from memtui.tui.app import run_replay

    sys.exit(run_replay(path, speed=speed))


# ---------------------------------------------------------------------------- keygen


@main.command("keygen")
@click.option("--force", is_flag=True, help="Replace existing keys.")
def keygen_command(force: bool) -> None:
    """Make the CURVE keys for multi-node runs over TCP (files 0600 in ~/.config/memtui/curve)."""
    from memtui.security import SecurityError, keygen

    try:
        root = keygen(force=force)
    except SecurityError as exc:
        _fail(str(exc))
        return
    click.echo(f"keys written to {root}")
    click.echo("copy this directory to every node of the job (or share the home directory)")


# ---------------------------------------------------------------------------- gpus


@main.command("gpus")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, freest first.")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, help="Seconds between refreshes.")
@click.option(
    "--pick",
    "pick_count",
    type=int,
    default=None,
    is_flag=False,
    flag_value=1,
    help="Print the ids of the N freest GPUs for CUDA_VISIBLE_DEVICES (default 1).",
)
@click.option("--uuid", is_flag=True, help="With --pick: print GPU UUIDs instead of indices.")
def gpus_command(
    as_json: bool, watch: bool, interval: float, pick_count: int | None, uuid: bool
) -> None:
    """Every GPU on this host: free / used / total memory, utilisation, processes; freest first.

    Without an NVIDIA driver it says so on stderr and exits 1 (with or without --pick).
    """
    import json

    from memtui.gpus import NoDriver, format_gpus, host_gpus, pick
    from memtui.stats import format_bytes

    def read() -> list[Any]:
        try:
            return host_gpus()
        except NoDriver as exc:
            _fail(str(exc))
            raise

    if pick_count is not None:
        found = read()
        if pick_count < 1 or pick_count > len(found):
            _fail(f"asked for {pick_count} GPU(s), this host has {len(found)}")
        click.echo(pick(found, pick_count, uuid))
        return
    while True:
        found = read()
        if as_json:
            click.echo(json.dumps([g.as_dict() for g in found], indent=2))
        else:
            if watch:
                click.clear()
            click.echo(format_gpus(found, format_bytes))
        if not watch:
            return
        try:
            time.sleep(interval)
        except KeyboardInterrupt:
            return


# ---------------------------------------------------------------------------- estimate


@main.command("estimate")
@click.option("--params", default=None, help="A parameter count: 7B, 110M, 1.3e9.")
@click.option("--model", default=None, help="module:factory (or class) building the model.")
@click.option("--hf-config", default=None, help="A Hugging Face config.json on disk.")
@click.option("--dtype", default=None, help="Parameter dtype: float32, bfloat16, float16.")
@click.option(
    "--mixed-precision",
    type=click.Choice(["none", "amp", "master"]),
    default="none",
    show_default=True,
    help="amp: torch.autocast, fp32 params; master: 16-bit params + fp32 master copy.",
)
@click.option(
    "--optimizer",
    type=click.Choice(["sgd", "sgd-momentum", "adam", "adamw", "adam8bit"]),
    default="adamw",
    show_default=True,
    help="The optimizer whose state is counted.",
)
@click.option("--freeze", multiple=True, help="Freeze parameters matching a glob or prefix.")
@click.option("--lora-rank", default=0, show_default=True, help="LoRA rank r (0: no LoRA).")
@click.option(
    "--lora-modules",
    default="q_proj,v_proj",
    show_default=True,
    help="With --lora-rank: the modules that get adapters, comma-separated.",
)
@click.option(
    "--zero-stage",
    type=click.IntRange(0, 3),
    default=0,
    show_default=True,
    help="ZeRO stage: 1 shards the optimizer state over --world-size ranks, 2 the gradients "
    "too, 3 the parameters too.",
)
@click.option(
    "--world-size",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="Ranks ZeRO shards over.",
)
@click.option("--batch-size", default=1, show_default=True, help="Micro-batch per GPU.")
@click.option("--seq-len", type=int, default=None, help="Tokens per sample.")
@click.option("--gpu-memory", default=None, help="Card size for the fit, e.g. 24GiB.")
@click.option("--layers", type=int, default=None, help="Formula only: transformer layers.")
@click.option("--hidden", type=int, default=None, help="Formula only: hidden size.")
@click.option("--heads", type=int, default=None, help="Formula only: attention heads.")
@click.option("--no-measure", is_flag=True, help="Use the formula even when the model runs.")
@click.option(
    "--attention",
    type=click.Choice(["sdpa", "flash", "eager"]),
    default="sdpa",
    show_default=True,
    help="How the run computes attention: sdpa (torch's default; CUDA's flash or "
    "memory-efficient kernel), flash (flash-attention), eager (the scores kept).",
)
@click.option(
    "--grad-dtype",
    default=None,
    help="Gradient dtype, e.g. float32 for fp32 gradient accumulation (default: the params').",
)
@click.option(
    "--zero-count",
    type=click.Choice(["deepspeed", "paper"]),
    default="deepspeed",
    show_default=True,
    help="ZeRO per rank as DeepSpeed's estimator counts it, or as the ZeRO paper does.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def estimate_command(**kwargs: Any) -> None:
    """The memory a training job needs per GPU, by part, and the largest micro-batch that fits."""
    import json

    from memtui.estimate import EstimateError, Options, as_dict, estimate, format_table
    from memtui.stats import parse_bytes

    as_json = kwargs.pop("as_json")
    gpu_memory = kwargs.pop("gpu_memory")
    try:
        card = parse_bytes(gpu_memory) if gpu_memory else None
    except ValueError as exc:
        _fail(str(exc), 2)
        return
    options = Options(
        **{k: v for k, v in kwargs.items() if k not in {"freeze", "lora_modules", "no_measure"}},
        freeze=tuple(kwargs["freeze"]),
        lora_modules=tuple(m.strip() for m in kwargs["lora_modules"].split(",") if m.strip()),
        gpu_memory=card,
        measure=not kwargs["no_measure"],
        thresholds=_thresholds_in_force(),
    )
    try:
        result = estimate(options)
    except EstimateError as exc:
        _fail(str(exc), 2)
        return
    if as_json:
        click.echo(json.dumps(as_dict(result), indent=2))
    else:
        click.echo(format_table(result))


# ---------------------------------------------------------------------------- run


@main.command(
    "run",
    short_help="Run a command with memtui in its Python processes.",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--name", help="The run's name, as install(name=...) gives it.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    help="Where the run keeps its audit log and tuned config, as install(state_dir=...).",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="-- COMMAND [ARGS]...")
def run_command(name: str | None, state_dir: str | None, command: tuple[str, ...]) -> None:
    """Run a command with memtui in every Python process it starts (no code change)."""
    from memtui.launch.run import exec_command

    if not command:
        raise click.UsageError("name the command to run: memtui run -- python train.py")
    sys.exit(exec_command(command, name=name, state_dir=state_dir))


# ---------------------------------------------------------------------------- export


@main.command("export")
@click.option(
    "--listen",
    default="127.0.0.1:9464",
    show_default=True,
    metavar="HOST:PORT",
    help="Where to serve /metrics; :PORT listens on every interface (see the security model).",
)
@click.option(
    "--max-runs",
    type=click.IntRange(min=1),
    metavar="N",
    default=64,
    show_default=True,
    help="Runs watched at once (a thread each); runs beyond are counted, not watched.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    metavar="N",
    default=32,
    show_default=True,
    help="HTTP connections served at once; those beyond are answered 503 at once.",
)
@click.option(
    "--http-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Time a connection has to send its request (and to take each write of the reply).",
)
@click.option("--dashboard", is_flag=True, help="Print the Grafana dashboard (JSON) and exit.")
def export_command(
    listen: str, max_runs: int, max_connections: int, http_timeout: float, dashboard: bool
) -> None:
    """Serve every live run on this node as Prometheus metrics (OpenMetrics at /metrics)."""
    from memtui.export.serve import ListenError, parse_listen, serve
    from memtui.export.serve import dashboard as dashboard_json

    if dashboard:
        click.echo(dashboard_json(), nl=False)
        return
    try:
        host, port = parse_listen(listen)
    except ListenError as exc:
        _fail(str(exc), 2)
        return

    def say(line: str) -> None:
        click.echo(f"memtui export: {line}", err=True)

    sys.exit(
        serve(
            host,
            port,
            _threshold_config(),
            say,
            max_runs=max_runs,
            max_connections=max_connections,
            timeout_s=http_timeout,
        )
    )


# ---------------------------------------------------------------------------- attach


@main.command("attach")
@click.argument("run", required=False)
@click.option("--readonly", is_flag=True, help="Show everything, send nothing (for shared panes).")
@click.option(
    "--insecure",
    is_flag=True,
    help="Reach plain (keyless) TCP endpoints, on loopback only (read-only unless the run "
    "was started with --insecure-control).",
)
@click.option(
    "--wait/--no-wait",
    default=None,
    help="Wait for a run if none matches (default: wait without RUN on a terminal).",
)
def attach_command(run: str | None, readonly: bool, insecure: bool, wait: bool | None) -> None:
    """Open the viewer on a run (RUN: id, prefix, pid or endpoint; default: the newest) and stay
    on it; without RUN, f follows another run once this one is gone."""
    from memtui.tui.app import run_app

    if insecure:
        os.environ["MEMTUI_INSECURE"] = "1"  # read by every client socket the viewer makes
    if wait is None:
        wait = run is None and sys.stdout.isatty()
    sys.exit(run_app(run, readonly=readonly, wait=wait))


if __name__ == "__main__":
    main()
