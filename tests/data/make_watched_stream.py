"""Record tests/data/watched_stream.mtrec: a plain loop under ``memtui run`` whose loader memtui
watches but did not build (about half a minute).

The loop reads an ``IterableDataset`` through a DataLoader with 2 workers and a micro-batch of 4,
and accumulates 2 micro-batches per optimizer step in its own code: memtui keeps the workers (a
stream splits its data between them itself), reads the micro-batch and the workers from the
loader, measures the accumulation from the steps, and takes ``pin_memory`` and
``prefetch_factor``. Once the run registered, ``prefetch_factor=4`` is queued (it lands at the
next epoch); when the last epoch starts, ``pin_memory=true`` is queued: the run ends before its
next epoch, so that change is never applied (the last batch says so). Replays of this file check
that every view shows the knobs memtui cannot change with their values, and the change pending
at the end.

    .venv/bin/python tests/data/make_watched_stream.py [--out tests/data/watched_stream.mtrec]
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

from memtui.storage.registry import find_run, list_runs
from memtui.transport.client import ControlClient
from memtui.transport.recording import read_recording
from memtui.transport.sources import record

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EPOCHS = 16

SCRIPT = """
import sys, time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        share, index = (info.num_workers, info.id) if info else (1, 0)
        for item in range(index, 480, share):  # each worker its own share of the stream
            time.sleep(0.004)
            yield torch.randn(16), item % 2


marks, epochs = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Stream(), batch_size=4, num_workers=2)
for epoch in range(epochs):
    (marks / f"epoch-{epoch}").touch()
    for micro, (x, y) in enumerate(loader, 1):
        loss = torch.nn.functional.cross_entropy(model(x), y) / 2
        loss.backward()
        if micro % 2 == 0:  # two micro-batches per optimizer step, in the loop's own code
            optimizer.step()
            optimizer.zero_grad()
"""


def main() -> int:
    """Run the loop under ``memtui run``, record it, queue the two changes; print what was
    written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "watched_stream.mtrec")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="mtrec", dir="/tmp"))
    os.environ["MEMTUI_RUNTIME_DIR"] = str(base / "rt")
    os.environ["XDG_STATE_HOME"] = str(base / "state")
    (base / "train.py").write_text(SCRIPT)
    marks = base / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "memtui.cli", "run", "--name", "stream", "--"]
    command += [sys.executable, str(base / "train.py"), str(marks), str(EPOCHS)]
    run = subprocess.Popen(command, env=env, cwd=base)
    deadline = time.monotonic() + 60
    while not list_runs() and time.monotonic() < deadline:
        time.sleep(0.1)
    run_id = list_runs()[0].run
    time.sleep(2.0)  # a little history for the snapshot

    def queue_changes() -> None:
        client = ControlClient(find_run(run_id).control)
        time.sleep(2.0)
        reply = client.set({"prefetch_factor": 4})
        print(f"set prefetch_factor=4: ok={reply.ok} {reply.reason}", file=sys.stderr)
        while not (marks / f"epoch-{EPOCHS - 1}").exists() and run.poll() is None:
            time.sleep(0.05)
        reply = client.set({"pin_memory": True})
        print(f"set pin_memory=true: ok={reply.ok} {reply.reason}", file=sys.stderr)

    threading.Thread(target=queue_changes, daemon=True).start()
    note = "memtui run: a stream's loader with 2 workers, accumulation in the loop"
    summary = record(run_id, args.out, duration_s=120.0, note=note)
    run.wait(60)
    shutil.rmtree(base, ignore_errors=True)
    recording = read_recording(args.out)
    print(
        f"{summary.path}: run {summary.run}, {summary.frames} frames, {summary.bytes} bytes, "
        f"{recording.duration_s:.1f} s, ended={summary.ended}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
