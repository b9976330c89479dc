"""How long the ``memtui`` command takes, start to exit: ``--version`` and ``status --json``.

``status --json`` asks a live run (a light demo training started here, in a runtime directory
of its own) and prints its report, so it times the imports, the request and the report. The
commands run interleaved, ``--runs`` times each, with Python's own start (``python -c pass``)
beside them as the floor; it prints the median, min-max and quartiles of each, of the wall time
and of the CPU time (which a busy machine does not stretch), and the load average before and
after. Bytecode is cached as in an install (``PYTHONDONTWRITEBYTECODE`` is
dropped and one warm-up run writes it). ``--source DIR`` times another checkout's code (its
directory first on ``PYTHONPATH``), e.g. a worktree of main, interleaved with this checkout's.

    python benchmarks/cli_startup.py [--runs 20] [--source DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ("--seq-len", "16", "--width", "32", "--layers", "1", "--vocab", "64")
"""A light demo training (the tests' plumbing model): a live run that takes little CPU."""


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(command: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Seconds from start to exit of ``command``, and the CPU seconds it used (user + system:
    what the load cannot stretch); fails loudly if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}): {result.stderr}")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return elapsed, cpu


def start_demo(env: dict[str, str], out: Path) -> subprocess.Popen[str]:
    """The live run ``status`` asks, once it has printed its run id."""
    log = out / "demo.log"
    with open(log, "w") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memtui.demo", "--out", str(out), "--steps", "1000000", *DEMO],
            stdout=handle,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=out,
        )
    deadline = time.monotonic() + 120
    while not log.read_text().startswith("run "):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the demo did not start: {log.read_text()}")
        time.sleep(0.2)
    return proc


def summary(times: list[float]) -> str:
    """Median, min-max and the quartiles, in milliseconds."""
    ms = sorted(t * 1000 for t in times)
    q1, _, q3 = statistics.quantiles(ms, n=4)
    return (
        f"median {statistics.median(ms):4.0f} ms [{ms[0]:.0f}-{ms[-1]:.0f}, quartiles "
        f"{q1:.0f}-{q3:.0f}]"
    )


def which_memtui(env: dict[str, str], cwd: Path) -> str:
    """The checkout whose ``memtui`` package ``env`` imports."""
    code = subprocess.run(
        [sys.executable, "-c", "import memtui.cli; print(memtui.cli.__file__)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return str(Path(code.stdout.strip()).parent.parent)


def main() -> None:
    """Time the commands against a live run and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each command")
    parser.add_argument(
        "--source", type=Path, help="also time this checkout's memtui, interleaved with this one"
    )
    args = parser.parse_args()
    memtui = str(Path(sys.executable).parent / "memtui")
    base = Path(tempfile.mkdtemp(prefix="mtcli", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env |= {"MEMTUI_RUNTIME_DIR": str(base / "rt"), "XDG_STATE_HOME": str(base / "state")}
    envs = {which_memtui(env, base): env}
    if args.source:
        other = env | {"PYTHONPATH": str(args.source.resolve())}
        envs[which_memtui(other, base)] = other
    commands = {("python", "python -c pass"): ([sys.executable, "-c", "pass"], env)}
    for source, source_env in envs.items():
        for words in (["--version"], ["status", "--json"]):
            commands[(source, " ".join(["memtui", *words]))] = ([memtui, *words], source_env)
    print(f"python {sys.version.split()[0]}; load average before: {load()}")
    (base / "out").mkdir()
    demo = start_demo(env, base / "out")
    try:
        times: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in commands}
        for command, command_env in commands.values():  # warm-up: bytecode, page cache
            timed(command, command_env, base)
        for _ in range(args.runs):
            for key, (command, command_env) in commands.items():
                times[key].append(timed(command, command_env, base))
    finally:
        demo.terminate()
        demo.wait(30)
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.runs} runs each, interleaved; wall time from start to exit, then CPU time")
    for (source, name), values in times.items():
        wall, cpu = summary([w for w, _ in values]), summary([c for _, c in values])
        print(f"{source}: {name:<20} wall {wall}  cpu {cpu}")
    print(f"load average after: {load()}  ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
