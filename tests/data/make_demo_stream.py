"""Record tests/data/demo_starving.mtrec from a real demo training run (CPU, a few minutes' work).

The demo starts with ``--workers 0`` (it starves: ~60% of each step waits on slow data); after
``--set-after`` seconds of recording ``num_workers=4`` is queued through the control socket, and
lands at the next checkpoint; the recording runs until the demo ends. Replays of this file drive
the snapshot tests and the screenshots: starving (with the change pending), then balanced.
With ``--autotune`` no change is queued: the demo starts with its autopilot on, which tunes it by
itself (tests/data/demo_autopilot.mtrec, the snapshot of the viewer's autopilot line).

    .venv/bin/python tests/data/make_demo_stream.py [--out tests/data/demo_starving.mtrec]
    .venv/bin/python tests/data/make_demo_stream.py --autotune --checkpoint-every 25 \
        --out tests/data/demo_autopilot.mtrec
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from memtui.storage.registry import find_run
from memtui.transport.client import ControlClient
from memtui.transport.recording import read_recording
from memtui.transport.sources import record

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Run the demo, record it, queue the change; print what was written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "demo_starving.mtrec")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--set-after", type=float, default=32.0)
    parser.add_argument("--autotune", action="store_true", help="the autopilot on, no change set")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds recorded at most")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="mtrec", dir="/tmp"))
    os.environ["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    os.environ["XDG_STATE_HOME"] = str(base / "state")
    demo = subprocess.Popen(
        [
            sys.executable, "-m", "memtui.demo", "--steps", str(args.steps),
            "--checkpoint-every", str(args.checkpoint_every), "--workers", "0",
            "--out", str(base / "out"), "--progress-every", "5", "--name", "demo",
            *(["--autotune"] if args.autotune else []),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert demo.stdout is not None
    run_id = demo.stdout.readline().split()[1]
    time.sleep(2.0)  # a little history for the snapshot

    def queue_change() -> None:
        time.sleep(args.set_after)
        client = ControlClient(find_run(run_id).control)
        reply = client.set({"num_workers": 4})
        print(f"set num_workers=4: ok={reply.ok} id={reply.id} {reply.reason}", file=sys.stderr)

    if args.autotune:
        note = "memtui demo --workers 0 --autotune"
    else:
        threading.Thread(target=queue_change, daemon=True).start()
        note = "memtui demo --workers 0, then 4"
    summary = record(run_id, args.out, duration_s=args.duration, note=note)
    if demo.poll() is None and args.autotune:  # the recording's time is up before the demo's steps
        demo.terminate()
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
