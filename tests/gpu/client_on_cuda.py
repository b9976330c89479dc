"""One real training on CUDA driven by the command line, as a user drives it:
``python -m tests.gpu.client_on_cuda OUT_DIR`` (``run_on_device.sh`` runs it after the gpu tests).

The training runs in its own process; this one is the user in another shell: it finds the run in
``memtui ls``, waits for steps timed and memory read from the CUDA device (``memtui status``),
queues a bigger micro-batch with ``memtui set``, and waits for it to land at a checkpoint and for
the steps after it to train on it. It writes to OUT_DIR ``client.json`` (every check, passed or
not, with the numbers seen), ``client.log`` (the training's own output) and ``status.txt``
(``memtui status`` after the change), and exits 0 only when every check passed.

The training is karpathy/nanoGPT's ``train.py`` from the client corpus (``tests/clients/nanogpt``:
its upstream files, carried in ``tests/clients/upstream/``, with the documented lines patched in) on
``cuda`` with a 2-layer model and local token files; where the corpus cannot give it (its files
not cached, numpy missing), ``cuda_train.py serve`` stands in, and ``client.json`` says why.

``MEMTUI_GPU_TEST_DEVICE`` (default ``cuda``) moves either to another device: a rehearsal of the
driver on a CPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEVICE = os.environ.get("MEMTUI_GPU_TEST_DEVICE", "cuda")


@dataclass
class Client:
    """A training to start, the change to queue in it, and how it ends."""

    name: str
    argv: list[str]
    cwd: Path
    change: Callable[[dict[str, Any]], tuple[list[str], dict[str, int]]]
    """From ``memtui status --json`` before it: the words of ``memtui set`` and the config the
    run must report once the change has landed."""
    stop: Callable[[subprocess.Popen[Any]], None]
    """Ends the training once the checks are done."""
    exit_code: int
    """The exit status the training ends with when stopped so."""
    result: Path | None = None
    """A JSON file the training writes at its end (None: none)."""
    progress: str = ""
    """A regular expression for a line the script prints itself as it trains ("": none)."""


def nanogpt_client(work: Path) -> Client | str:
    """nanoGPT's ``train.py`` from the corpus, or why it cannot run here."""
    try:
        import numpy  # noqa: F401  (nanoGPT's get_batch memory-maps its token files with it)

        from tests.clients import local_data
        from tests.clients.upstream import Manifest, materialise, missing
    except ImportError as exc:
        return f"the corpus's nanoGPT cannot run here: {exc}"
    manifest = Manifest.load("nanogpt")
    reason = missing(manifest)
    if reason:
        return f"the corpus's nanoGPT is not cached: {reason}"
    script = materialise(manifest, work / "nanogpt")
    local_data.nanogpt_dataset(script.parent, "tiny")
    config = {
        "device": DEVICE,
        "compile": False,
        "dtype": "bfloat16" if DEVICE.startswith("cuda") else "float32",
        "dataset": "tiny",
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 64,
        "block_size": 64,
        "dropout": 0.0,
        "batch_size": 8,
        "gradient_accumulation_steps": 2,
        "max_iters": 10**6,  # stopped by the driver once the change has been seen
        "lr_decay_iters": 10**6,
        "eval_interval": 10,
        "eval_iters": 2,
        "log_interval": 5,
    }

    def double(status: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
        batch = 2 * int(status["config"]["batch_size"])  # 8 x 2 -> 16 x 1
        return [f"batch_size={batch}", "--keep-effective-batch"], {
            "batch_size": batch,
            "grad_accum": 1,
        }

    return Client(
        name="nanogpt train.py (tests/clients/nanogpt)",
        argv=[sys.executable, script.name, *(f"--{k}={v}" for k, v in config.items())],
        cwd=script.parent,
        change=double,
        stop=lambda proc: proc.send_signal(signal.SIGTERM),  # how a user ends it: no handler
        exit_code=-signal.SIGTERM,
        progress=r"^iter \d+: loss",
    )


def serve_client(work: Path) -> Client:
    """``cuda_train.py serve``: a token model trained from a pinned-memory DataLoader made by
    ``tuner.loader``, under ``tuner.guard()``, a boundary every 5 steps."""
    out = work / "serve"

    def bigger(status: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
        batch = 2 * int(status["config"]["batch_size"])
        return [f"batch_size={batch}", "num_workers=2"], {"batch_size": batch, "num_workers": 2}

    return Client(
        name="cuda_train.py serve",
        argv=[sys.executable, str(HERE / "cuda_train.py"), "serve", str(out)],
        cwd=ROOT,
        change=bigger,
        stop=lambda proc: (out / "stop").touch(),
        exit_code=0,
        result=out / "result.json",
    )


def memtui(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """The ``memtui`` command line in a subprocess, as a user's shell runs it."""
    return subprocess.run(
        [sys.executable, "-m", "memtui.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@dataclass
class Checks:
    """What was checked, in order, and the numbers seen."""

    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> bool:
        (self.passed if ok else self.failed).append(what)
        print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
        return ok


def wait(what: str, probe: Callable[[], Any], timeout: float, proc: subprocess.Popen[Any]) -> Any:
    """Poll ``probe`` until it returns something (None after ``timeout`` or the training's end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        if proc.poll() is not None:
            print(f"the training exited ({proc.returncode}) while waiting for {what}", flush=True)
            return None
        time.sleep(0.5)
    print(f"no {what} within {timeout:.0f} s", flush=True)
    return None


def status_json(run: str) -> dict[str, Any] | None:
    """``memtui status RUN --json`` (None while the run does not answer)."""
    done = memtui("status", run, "--json")
    return dict(json.loads(done.stdout)) if done.returncode == 0 else None


def drive(client: Client, out: Path, checks: Checks) -> None:
    """Start the training, change it from the command line, stop it; every step checked."""
    log = out / "client.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as sink:
        proc = subprocess.Popen(
            client.argv, cwd=client.cwd, stdout=sink, stderr=subprocess.STDOUT, env=env
        )
    try:
        user(client, proc, log, out, checks)
    finally:
        if proc.poll() is None:
            client.stop(proc)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        checks.check(code == client.exit_code, f"the training ended as stopped (exit {code})")
    if client.result is None or not client.result.exists():
        return
    result = json.loads(client.result.read_text())
    checks.seen["result"] = result
    checks.check(result.get("errors") == 0, f"no hook errors ({result.get('last_error')!r})")
    wanted = checks.seen.get("expected", {})
    for knob in ("batch_size", "num_workers"):
        if knob in wanted:
            checks.check(result.get(knob) == wanted[knob], f"the script's {knob} is {wanted[knob]}")
    if "batch_size" in wanted and "rows_last" in result:
        rows = result["rows_last"]
        checks.check(
            bool(rows) and set(rows) == {wanted["batch_size"]},
            f"the loop received micro-batches of {wanted['batch_size']} ({rows})",
        )


def user(client: Client, proc: subprocess.Popen[Any], log: Path, out: Path, checks: Checks) -> None:
    """The user's side: find the run, watch it on the device, change it, see the change land."""

    def listed() -> str | None:
        done = memtui("ls", "--json")
        runs = json.loads(done.stdout) if done.returncode == 0 else []
        return next((r["run"] for r in runs if r["pid"] == proc.pid), None)

    run = wait("run in memtui ls", listed, 120, proc)
    if not checks.check(run is not None, f"the training registered a run ({run})"):
        return
    checks.seen["run"] = run

    def stepping() -> dict[str, Any] | None:
        status = status_json(str(run))
        memory = (status or {}).get("memory") or {}
        return status if status and status["step"] >= 10 and memory.get("kind") else None

    before = wait("10 timed steps with device memory", stepping, 120, proc)
    if not checks.check(before is not None, "memtui status shows steps and device memory"):
        return
    assert before is not None
    checks.seen["memory_before"] = before["memory"]
    kind = "cuda" if DEVICE.startswith("cuda") else "cpu"
    checks.check(
        before["memory"]["kind"] == kind,
        f"the memory read is the {kind} device's ({before['memory']['kind']}, {before['device']})",
    )
    words, expected = client.change(before)
    queued = memtui("set", str(run), *words, "-q")
    checks.seen["set"] = {"words": words, "stdout": queued.stdout, "stderr": queued.stderr}
    if not checks.check(
        queued.returncode == 0 and queued.stdout.strip().isdigit(),
        f"memtui set {' '.join(words)} queued it ({queued.stderr.strip()})",
    ):
        return
    checks.seen["expected"] = expected
    change_id = int(queued.stdout)

    def landed() -> dict[str, Any] | None:
        status = status_json(str(run))
        applied = [a for a in (status or {}).get("applied", []) if change_id in a["ids"]]
        return status if status and applied and status["step"] > applied[0]["step"] + 3 else None

    after = wait("the change applied and steps after it", landed, 120, proc)
    if not checks.check(after is not None, "the change landed at a checkpoint and steps went on"):
        return
    assert after is not None
    applied = next(a for a in after["applied"] if change_id in a["ids"])
    checks.seen["applied"] = applied
    for knob, value in expected.items():
        checks.check(after["config"][knob] == value, f"memtui status says {knob}={value}")
    samples = expected.get("batch_size", 0) * int(after["config"].get("grad_accum") or 1)
    last = after.get("last_step") or []  # a StepRecord: an array on the wire and in the JSON
    trained = last[4] if len(last) > 4 else None
    checks.check(trained == samples, f"the steps after it train on {samples} samples ({trained})")
    if client.progress:
        lines = log.read_text(errors="replace").splitlines()
        seen = [line for line in lines if re.match(client.progress, line)]
        checks.seen["progress_last"] = seen[-1:] if seen else []
        checks.check(bool(seen), f"the script's own progress lines go on ({seen[-1:]})")
    (out / "status.txt").write_text(memtui("status", str(run)).stdout)


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memtui-client-"))
    checks = Checks()
    corpus = nanogpt_client(work)
    if isinstance(corpus, str):
        print(f"{corpus}; cuda_train.py serve stands in", flush=True)
        checks.seen["why_not_the_corpus"] = corpus
    client = corpus if isinstance(corpus, Client) else serve_client(work)
    print(f"client: {client.name} on {DEVICE}", flush=True)
    started = time.monotonic()
    try:
        drive(client, out, checks)
    except Exception as exc:  # the report is written whatever broke
        checks.check(False, f"the driver itself: {exc!r}")
    report = {
        "client": client.name,
        "device": DEVICE,
        "seconds": round(time.monotonic() - started, 1),
        "passed": checks.passed,
        "failed": checks.failed,
        "seen": checks.seen,
    }
    (out / "client.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"client: {len(checks.passed)} passed, {len(checks.failed)} failed", flush=True)
    return 0 if checks.passed and not checks.failed else 1


if __name__ == "__main__":
    sys.exit(main())
