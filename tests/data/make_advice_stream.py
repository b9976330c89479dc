"""Record tests/data/demo_advice.mtrec from a real demo training run on CPU (about two minutes).

The demo runs a model whose logits dominate memory (so the micro-batch matters) under a 900 MiB
memory limit with a small micro-batch (4): memory is underused. The script acts as an operator
would: once the hook has a memory model it queues the top recommendation (a bigger micro-batch),
waits for its measured effect (and the prediction error), then asks (dry run) for the smallest
micro-batch predicted past the limit (so over the 90% band: refused unless forced) and queues
it with ``force`` (the predicted overshoot);
the run goes out of memory, rolls the change back and goes on; the demo is then stopped. (No
loader workers: on CPU their RSS counts pages shared with the main process again.) Replays of this file drive the viewer's
advice tests: the memory breakdown, the prediction of a pending change, the measured effect,
the prediction error and the out-of-memory rollback.

    .venv/bin/python tests/data/make_advice_stream.py [--out tests/data/demo_advice.mtrec]
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

from memtui.advice.assess import assess
from memtui.advice.predict import fraction
from memtui.storage.registry import find_run
from memtui.transport.client import ControlClient
from memtui.transport.recording import read_recording
from memtui.transport.sources import record
from memtui.wire import Snapshot

HERE = Path(__file__).resolve().parent
HEAVY = ["--seq-len", "256", "--width", "64", "--vocab", "8192", "--layers", "1"]


def main() -> int:
    """Run the demo, record it, act on it; print what was written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "demo_advice.mtrec")
    parser.add_argument("--limit", default="900MiB")
    parser.add_argument("--slow-data-ms", default="1")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="mtrec", dir="/tmp"))
    os.environ["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    os.environ["XDG_STATE_HOME"] = str(base / "state")
    demo = subprocess.Popen(
        [
            sys.executable, "-m", "memtui.demo", "--steps", "100000", "--checkpoint-every", "5",
            "--workers", "0", "--batch-size", "4", "--grad-accum", "1",
            "--slow-data-ms", args.slow_data_ms, "--memory-limit", args.limit, *HEAVY,
            "--out", str(base / "out"), "--progress-every", "5", "--name", "demo",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert demo.stdout is not None
    run_id = demo.stdout.readline().split()[1]
    threading.Thread(target=lambda: demo.stdout and demo.stdout.read(), daemon=True).start()
    time.sleep(2.0)  # a little history for the snapshot
    client = ControlClient(find_run(run_id).control, timeout_s=5.0)

    def wait(predicate: Callable[[Snapshot], object], what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(client.hello(history=0)):
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            time.sleep(0.5)
        print(f"seen: {what}", file=sys.stderr)

    def operate() -> None:
        wait(lambda s: s.control.model is not None and s.step >= 12, "the memory model")
        snapshot = client.hello(history=64)
        found = assess(snapshot)
        top = next(r for r in found.recommendations if r.applicable)
        print(f"top recommendation: {top.title}", file=sys.stderr)
        safe = found.max_safe_batch_size or 8
        reply = client.set({"batch_size": min(8, safe)})  # the bigger micro-batch it recommends
        print(f"set batch_size={min(8, safe)}: ok={reply.ok} {reply.reason}", file=sys.stderr)
        wait(lambda s: s.control.applied and s.control.applied[-1].effect, "the measured effect")
        time.sleep(3.0)
        model = client.hello(history=0).control.model
        assert model is not None
        # over the danger band, and far enough over for the limit to be hit (a real overshoot)
        batch = next(b for b in range(model.batch_size + 1, 256) if fraction(model, b) > 1.02)
        dry = client.set({"batch_size": batch}, dry_run=True)
        print(f"dry run batch_size={batch}: needs_force={dry.needs_force}", file=sys.stderr)
        reply = client.set({"batch_size": batch}, force=True)
        print(f"set batch_size={batch} --force: ok={reply.ok} {reply.note}", file=sys.stderr)
        wait(lambda s: bool(s.control.ooms), "the out-of-memory error", 90.0)
        time.sleep(8.0)  # the rollback and a few steps after it
        demo.send_signal(signal.SIGTERM)

    threading.Thread(target=operate, daemon=True).start()
    summary = record(run_id, args.out, duration_s=240.0, note="memtui demo: advice, rollback")
    demo.wait(30)
    shutil.rmtree(base, ignore_errors=True)
    recording = read_recording(args.out)
    print(
        f"{summary.path}: run {summary.run}, {summary.frames} frames, {summary.bytes} bytes, "
        f"{recording.duration_s:.1f} s, ended={summary.ended}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
