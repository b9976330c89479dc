"""A plain PyTorch loop watched with no code: real scripts that import nothing of memtui, started
with ``memtui.hooks.auto.activate()`` in a ``sitecustomize`` on their ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memtui.storage import registry
from memtui.transport.client import ControlClient
from tests.support.cli import memtui_cli, memtui_here, status_json
from tests.support.clock import patience
from tests.support.processes import ROOT, logged_subprocess, wait_for

SCRIPT = """
import json, sys, time
from pathlib import Path


class Slow:
    def __len__(self):
        return 48

    def __getitem__(self, index):
        import torch

        time.sleep(0.003)
        return torch.randn(4), torch.tensor(index % 2)


class SlowToEvaluate(Slow):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        time.sleep(0.02)
        return super().__getitem__(index)


def as_mapping(samples):
    # a tokenizer's kind of batch: a mapping that is not a dict (a BatchEncoding is a UserDict)
    from collections import UserDict

    from torch.utils.data import default_collate

    x, y = default_collate(samples)
    return UserDict({"x": x, "y": y})


def main(held, mode):
    report = {"torch": "torch" in sys.modules}

    def wait_for_release():
        print("DONE " + json.dumps(report), flush=True)
        deadline = time.monotonic() + 60
        while held.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    if mode == "no-torch":
        return wait_for_release()
    import torch
    from torch.utils.data import DataLoader

    if mode == "imports-only":
        return wait_for_release()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.01)]
    if mode == "two-optimizers":
        optimizers.append(torch.optim.Adam(model.parameters(), lr=0.01))

    def train_step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    steps = samples = 0
    started = time.perf_counter()
    step_now = lambda: None
    if mode == "explicit":  # a loader iterated first starts the watch's run; then the script's own
        for _ in DataLoader(list(range(4)), batch_size=2):
            pass
        from memtui import hooks

        step_now = hooks.install({}, name="own").step
    if mode == "evaluates":  # a sanity pass, then one after every second step
        evaluation = DataLoader(SlowToEvaluate(), batch_size=4)

        def evaluate():
            model.eval()
            with torch.no_grad():
                for x, _y in evaluation:
                    model(x)
            model.train()

        evaluate()
        started = time.perf_counter()
        for index, batch in enumerate(DataLoader(Slow(), batch_size=6, collate_fn=as_mapping)):
            train_step(batch["x"], batch["y"])
            steps += 1
            samples += len(batch["x"])
            if index % 2:
                evaluate()
    elif mode == "no-loader":
        for _ in range(8):
            time.sleep(0.01)
            train_step(torch.randn(6, 4), torch.zeros(6, dtype=torch.long))
            steps += 1
            samples += 6
    else:
        workers = 2 if mode.startswith("workers") else 0
        context = mode.split("-")[1] if workers else None
        loader = DataLoader(Slow(), batch_size=6, num_workers=workers, multiprocessing_context=context)
        batches = iter(loader)
        started = time.perf_counter()  # the clock starts at the first batch
        for x, y in batches:
            train_step(x, y)
            step_now()
            steps += 1
            samples += len(x)
    report.update(steps=steps, samples=samples, seconds=time.perf_counter() - started)
    from torch.utils.data import dataloader

    wrapped = [dataloader.DataLoader.__iter__, dataloader._BaseDataLoaderIter.__next__]
    report["wrapped"] = sum(hasattr(function, "__wrapped__") for function in wrapped)
    wait_for_release()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
"""


def _started_runs() -> list[dict[str, Any]]:
    listed = memtui_here("ls", "--json")
    assert listed.exit_code == 0, listed.output
    return list(json.loads(listed.stdout))


class Script:
    """The plain loop in a subprocess, held alive after its training until released."""

    def __init__(self, base: Path, mode: str) -> None:
        self.base = base
        self.held = base / f"held-{mode}"
        self.held.touch()
        self.log = base / f"{mode}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(base / "site"), str(ROOT)])}
        env.pop("MEMTUI_DISABLE", None)
        command = [sys.executable, str(base / "train.py"), str(self.held), mode]
        self.proc = logged_subprocess(command, env, base, self.log)

    def report(self) -> dict[str, Any]:
        """What the script says it did, once its training is over."""

        def done() -> str | None:
            if self.proc.poll() is not None:
                pytest.fail(f"the script ended early:\n{self.log.read_text()}")
            lines = [ln for ln in self.log.read_text().splitlines() if ln.startswith("DONE ")]
            return lines[0] if lines else None

        line = wait_for(done, 60, 0.05, "the script's training")
        assert isinstance(line, str)
        return dict(json.loads(line[5:]))

    def release(self) -> int:
        """Let the script end; its exit status."""
        self.held.unlink(missing_ok=True)
        try:
            return self.proc.wait(patience(30))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(patience(10))


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A script and a ``sitecustomize`` that activates the watch, as ``memtui run`` does."""
    (tmp_path / "train.py").write_text(SCRIPT)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """\
            import memtui.hooks.auto as watch
            watch.activate()
            """
        )
    )
    yield tmp_path


def _snapshot_steps(run: str) -> list[Any]:
    record = next(r for r in registry.list_runs() if r.run == run)
    snapshot = ControlClient(registry.rank_control(record.ranks[0]), timeout_s=patience(10)).hello()
    return list(snapshot.steps)


def _run_of(pid: int) -> dict[str, Any]:
    runs = wait_for(lambda: _started_runs(), 30, 0.1, "the run to register")
    assert isinstance(runs, list)
    assert [r["pid"] for r in runs] == [pid], runs
    return dict(runs[0])


def test_a_plain_loop_registers_with_its_steps_samples_and_data_wait(workdir: Path) -> None:
    script = Script(workdir, "loader")
    try:
        did = script.report()
        run = _run_of(script.proc.pid)
        wait_for(lambda: status_json(run["run"])["step"] == did["steps"], 10, 0.1, "every step")
        status = status_json(run["run"])
        metrics = status["metrics"]
        assert did["steps"] == 8 and did["samples"] == 48
        # every step's records: samples from the batches, the wait the slow dataset took
        steps = _snapshot_steps(run["run"])
        assert [s.step for s in steps] == list(range(1, 9))
        assert [s.samples for s in steps] == [6] * 8
        assert [s.micro_batches for s in steps] == [1] * 8
        # the DataLoader's ``__iter__`` (the epoch boundary) and its iterators' ``__next__``
        assert did["wrapped"] == 2
        assert all(s.data_wait_s >= 6 * 0.003 for s in steps)
        assert metrics["data_wait_fraction"] > 0.5
        own_rate = did["samples"] / did["seconds"]
        assert metrics["samples_per_s"] == pytest.approx(own_rate, rel=0.1)
        # the memory parts: the counted optimizer's Linear(4, 2), the rest of the process as
        # its runtime (read between steps at the first step's end), never as activations
        static = status["static_memory"]
        assert (static["parameters_bytes"], static["gradients_bytes"]) == (40, 40)
        assert static["between_steps_bytes"] > 100 << 20, "Python and torch stay between steps"
        parts = status["breakdown"]
        assert (parts["parameters"], parts["gradients"], parts["optimizer"]) == (40, 40, 0)
        assert parts["runtime and workers"] > 100 << 20
        assert "activations" not in parts and "not known yet" not in parts
    finally:
        assert script.release() == 0
    assert json.loads(memtui_cli("ls", "--json").stdout) == []  # the run left the registry


def test_an_evaluation_pass_adds_no_samples_and_no_wait_to_the_training_steps(
    workdir: Path,
) -> None:
    """A loop that evaluates on a second DataLoader before training and after every second step
    (``model.eval()``, ``torch.no_grad()``), its training batches a mapping that is not a dict:
    each step counts its own 6 rows and the wait for its own batch, none of the evaluation's."""
    script = Script(workdir, "evaluates")
    try:
        did = script.report()
        run = _run_of(script.proc.pid)
        wait_for(lambda: status_json(run["run"])["step"] == did["steps"], 10, 0.1, "every step")
        assert did["steps"] == 8 and did["samples"] == 48
        steps = _snapshot_steps(run["run"])
        assert [s.samples for s in steps] == [6] * 8
        assert [s.micro_batches for s in steps] == [1] * 8
        # a training batch waits ~18 ms (6 x 3 ms), an evaluation pass at least 160 ms (8 x 20 ms
        # of sleep, however busy the machine): a step under that counted no evaluation pass
        assert all(s.data_wait_s < 8 * 0.020 for s in steps), [s.data_wait_s for s in steps]
        assert all(s.data_wait_s >= 6 * 0.003 for s in steps)
        metrics = status_json(run["run"])["metrics"]
        assert metrics["samples_per_step"] == 6 and metrics["micro_batches_per_step"] == 1
        text = memtui_here("status", run["run"]).stdout
        assert "step = one optimizer step of 1 micro-batch, 6 samples" in text, text
    finally:
        assert script.release() == 0


def test_two_optimizers_stepping_each_iteration_count_one_step(workdir: Path) -> None:
    script = Script(workdir, "two-optimizers")
    try:
        did = script.report()
        run = _run_of(script.proc.pid)
        wait_for(lambda: status_json(run["run"])["step"] >= did["steps"], 10, 0.1, "every step")
        time.sleep(0.3)
        assert status_json(run["run"])["step"] == did["steps"] == 8
        assert [s.samples for s in _snapshot_steps(run["run"])] == [6] * 8
    finally:
        assert script.release() == 0


def test_a_tuner_of_the_scripts_own_stands_the_watch_down(workdir: Path) -> None:
    script = Script(workdir, "explicit")
    try:
        did = script.report()
        run = _run_of(script.proc.pid)
        assert run["run"].startswith("own")
        wait_for(lambda: status_json(run["run"])["step"] >= did["steps"], 10, 0.1, "every step")
        time.sleep(0.3)
        assert status_json(run["run"])["step"] == did["steps"] == 8
        assert did["wrapped"] == 0  # the DataLoader is torch's own again
    finally:
        assert script.release() == 0


@pytest.mark.parametrize(
    "start",
    ["fork", pytest.param("spawn", marks=pytest.mark.slow)],  # spawn: torch per worker
)
def test_loader_workers_register_no_run(workdir: Path, start: str) -> None:
    script = Script(workdir, f"workers-{start}")
    try:
        did = script.report()
        run = _run_of(script.proc.pid)
        wait_for(lambda: status_json(run["run"])["step"] == did["steps"], 10, 0.1, "every step")
        steps = _snapshot_steps(run["run"])
        assert sum(s.samples for s in steps) == did["samples"] == 48
        assert len(_started_runs()) == 1
    finally:
        assert script.release() == 0


def test_a_loop_without_a_dataloader_says_its_data_wait_was_not_measured(workdir: Path) -> None:
    script = Script(workdir, "no-loader")
    try:
        did = script.report()
        run = _run_of(script.proc.pid)
        wait_for(lambda: status_json(run["run"])["step"] == did["steps"], 10, 0.1, "every step")
        steps = _snapshot_steps(run["run"])
        assert [s.step for s in steps] == list(range(1, 9))
        # no batch was seen: no micro-batch counted, so no wait claimed
        assert [s.micro_batches for s in steps] == [0] * 8
        assert all(s.data_wait_s == 0 for s in steps)
        status = status_json(run["run"])
        assert status["metrics"]["data_wait_measured"] is False
        assert status["verdict"]["headline"].startswith("data wait not measured")
        text = memtui_here("status", run["run"]).stdout
        assert "data wait not measured (no DataLoader seen)  samples not counted" in text
    finally:
        assert script.release() == 0


@pytest.mark.parametrize("mode", ["no-torch", "imports-only"])
def test_a_script_that_never_trains_registers_nothing(workdir: Path, mode: str) -> None:
    script = Script(workdir, mode)
    try:
        did = script.report()
        assert did["torch"] is False  # the watch itself imports no torch
        time.sleep(0.3)
        assert not _started_runs()
    finally:
        assert script.release() == 0
    assert "memtui" not in script.log.read_text()


def test_import_callbacks_run_once_after_the_module_and_leave_its_loader_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from memtui.hooks import auto

    (tmp_path / "watched_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []
    auto.on_import("watched_mod", lambda module: seen.append(module.VALUE))
    assert not seen
    import importlib

    module = importlib.import_module("watched_mod")
    try:
        assert seen == [1]
        assert type(module.__loader__).__name__ == "SourceFileLoader"
        assert module.__spec__ is not None and module.__spec__.loader is module.__loader__
        (tmp_path / "watched_mod.py").write_text("VALUE = 2\n")
        importlib.invalidate_caches()
        assert importlib.reload(module).VALUE == 2
        assert seen == [1]  # once per process
        auto.on_import("watched_mod", lambda module: seen.append(-module.VALUE))
        assert seen == [1, -2]  # already imported: at once
    finally:
        sys.modules.pop("watched_mod", None)


def test_python_dash_m_runs_as_without_the_watch(workdir: Path) -> None:
    (workdir / "entry.py").write_text("import sys\nprint(__name__, __spec__.name, sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(workdir / "site"), str(ROOT)])}
    watched = subprocess.run(
        [sys.executable, "-m", "entry", "x"], env=env, cwd=workdir, capture_output=True, text=True
    )
    assert (watched.returncode, watched.stdout, watched.stderr) == (0, "__main__ entry ['x']\n", "")
