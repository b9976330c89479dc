"""Record tests/data/mlp_loaded.mtrec: a parameter-heavy MLP with AdamW on a busy CPU (two minutes).

benchmarks/scripts/mlp.py (9.4M parameters, AdamW: its peak is the optimizer's step, whatever the
micro-batch, up to a few hundred samples) trains under a 740 MiB memory limit while two
``yes > /dev/null`` processes keep both cores busy, so its steps are slow and the hook's samples
fall all over the step cycle, between steps too. The script acts as an operator would: three
times it queues the largest micro-batch ``memtui status`` calls safe (at most 1024), then
micro-batch 16, then the largest safe again (never forced: a change the gate refuses is
skipped), each once the one before it has its measured effect, then stops the run. Replays of
this file check that the max safe batch moves between changes only as far as what was measured
justifies, and that each change's predicted peak is near the one it ran at.

    .venv/bin/python tests/data/make_loaded_mlp_stream.py [--out tests/data/mlp_loaded.mtrec]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memtui.advice.assess import assess
from memtui.storage.registry import find_run
from memtui.transport.client import ControlClient
from memtui.transport.recording import read_recording
from memtui.transport.sources import record
from memtui.wire import Snapshot

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PLAN: tuple[int | None, ...] = (None, None, None, 16, None)
"""The micro-batches queued in turn (None: the largest safe one; the run starts at 8)."""
LARGEST = 1024
"""The largest micro-batch queued (past it the MLP's activations near the limit)."""


def main() -> int:
    """Start the hogs and the run, record it, act on it; print what was written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "mlp_loaded.mtrec")
    parser.add_argument("--limit", default="740MiB")
    parser.add_argument("--hogs", type=int, default=2)
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="mtrec", dir="/tmp"))
    os.environ["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    os.environ["XDG_STATE_HOME"] = str(base / "state")
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(max(0, args.hogs))]
    run = subprocess.Popen(
        [
            sys.executable, str(ROOT / "benchmarks" / "scripts" / "mlp.py"), "--batch_size", "8",
            "--checkpoint_every", "10", "--out", str(base / "out"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "MEMTUI_MEMORY_LIMIT": args.limit},
    )  # fmt: skip
    try:
        assert run.stdout is not None
        run_id = run.stdout.readline().split()[1]
        output = run.stdout
        threading.Thread(target=output.read, daemon=True).start()
        time.sleep(1.0)
        client = ControlClient(find_run(run_id).control, timeout_s=10.0)

        def wait(predicate: Callable[[Snapshot], object], what: str, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not predicate(client.hello(history=0)):
                if time.monotonic() > deadline:
                    print(f"gave up waiting for {what}", file=sys.stderr)
                    return
                time.sleep(0.5)
            print(f"seen: {what}", file=sys.stderr)

        def measured(batch: int) -> Callable[[Snapshot], bool]:
            def landed_and_measured(snapshot: Snapshot) -> bool:
                applied = snapshot.control.applied
                return (
                    bool(applied)
                    and applied[-1].changes["batch_size"].new == batch
                    and (applied[-1].effect is not None)
                )

            return landed_and_measured

        def operate() -> None:
            wait(lambda s: s.control.model is not None, "the memory model", 90.0)
            time.sleep(4.0)
            for planned in PLAN:
                batch = planned
                if batch is None:
                    safe = assess(client.hello(history=64)).max_safe_batch_size
                    if safe is None:
                        print("no max safe batch to queue", file=sys.stderr)
                        continue
                    batch = min(safe, LARGEST)
                reply = client.set({"batch_size": batch})
                print(f"set batch_size={batch}: ok={reply.ok} {reply.reason}", file=sys.stderr)
                if not reply.ok:
                    continue
                wait(measured(batch), f"the effect of micro-batch {batch}", 90.0)
                time.sleep(3.0)
            run.send_signal(signal.SIGTERM)

        threading.Thread(target=operate, daemon=True).start()
        summary = record(run_id, args.out, duration_s=420.0, note="mlp.py under two CPU hogs")
        run.wait(30)
    finally:
        processes: list[subprocess.Popen[Any]] = [run, *hogs]
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        shutil.rmtree(base, ignore_errors=True)
    recording = read_recording(args.out)
    print(
        f"{summary.path}: run {summary.run}, {summary.frames} frames, {summary.bytes} bytes, "
        f"{recording.duration_s:.1f} s, ended={summary.ended}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
