"""A viewer opened before the run exists (the README's quick start: ``memtui attach`` in one pane,
``memtui run -- python train.py`` in the other, the viewer first): it shows the knobs, which of
them it can change, and the recommendations as soon as the run publishes them, and its keys take
the change, as in a viewer attached later.

The run registers at its loader's first iteration and finds its knobs at its first optimizer
step; a real training spends seconds between the two (a large model's first forward), so the
script here waits between them until the viewer has the run's first word."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot

from memtui.transport.sources import LiveSource
from memtui.tui.app import MemtuiApp
from memtui.tui.screens.edit import EditKnobScreen
from tests.support.processes import ROOT, logged_subprocess
from tests.support.viewer import run, screen_text, until

pytestmark = pytest.mark.heavy

SCRIPT = """
import sys, time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, index):
        time.sleep(0.004)  # the loop waits for its data: STARVED
        return torch.randn(8), torch.tensor(index % 2)


stop, go = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(Slow(), batch_size=4, num_workers=0)
next(iter(loader))  # the run registers here; its knobs are found at the first optimizer step
deadline = time.monotonic() + 60
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.02)
for epoch in range(400):
    if stop.exists():
        break
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("EPOCH", epoch, loader.num_workers, flush=True)
"""


@pytest.fixture
def training(tmp_path: Path) -> Iterator[Path]:
    """The script, not started yet; stopped (and waited for) at the end."""
    (tmp_path / "train.py").write_text(SCRIPT)
    yield tmp_path
    (tmp_path / "stop").touch()


def test_a_viewer_opened_before_the_run_shows_its_knobs_and_advice_and_takes_a_change(
    training: Path,
) -> None:
    app = MemtuiApp(LiveSource(None))
    started: list[Any] = []

    async def check(pilot: Pilot[Any]) -> None:
        await pilot.pause(0.5)
        assert "waiting for the run's config" in screen_text(app)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("MEMTUI_DISABLE", None)
        command = [sys.executable, "-m", "memtui.cli", "run", "--name", "early", "--"]
        command += [sys.executable, "train.py", str(training / "stop"), str(training / "go")]
        started.append(logged_subprocess(command, env, training, training / "train.log"))
        state = app.state
        await until(pilot, lambda: state.control is not None, 60, "the run's first word")
        assert state.control is not None and state.control.tunable == [], "nothing found yet"
        (training / "go").touch()

        def knobs_known() -> bool:
            control = state.control
            return control is not None and "num_workers" in control.tunable

        await until(pilot, knobs_known, 60, "the run's knobs")
        assert state.knob_value("num_workers") == 0
        await until(pilot, lambda: state.step >= 8, 30, "steps")
        app.refresh_view()
        await pilot.pause()
        text = screen_text(app)
        rows = {  # the value, and "measured" where the steps measured it
            cells[1]: [cell for cell in cells[2:4] if "│" not in cell]
            for line in text.splitlines()
            if len(cells := line.split()) > 3 and cells[1] in ("batch_size", "grad_accum")
        }
        assert rows == {"batch_size": ["4"], "grad_accum": ["1", "measured"]}, text
        assert "not tunable: batch_size, grad_accum" in text

        def advised() -> bool:
            advice = state.summary().advice
            return advice is not None and any(
                "num_workers" in o.changes for o in advice.recommendations
            )

        await until(pilot, advised, 30, "the recommendation of more workers")
        app.refresh_view()
        await pilot.pause()
        assert "more loader workers" in screen_text(app)

        await pilot.press("w")
        assert isinstance(app.screen, EditKnobScreen)
        await pilot.press("2", "enter")
        assert not isinstance(app.screen, EditKnobScreen)

        def taken() -> bool:
            control = state.control
            if control is None:
                return False
            landed = any("num_workers" in a.changes for a in control.applied)
            return landed or state.pending_values() == {"num_workers": 2}

        await until(pilot, taken, 30, "num_workers=2 pending or applied")
        await until(pilot, lambda: state.knob_value("num_workers") == 2, 60, "applied")

    try:
        run(app, check, (120, 40))
    finally:
        (training / "stop").touch()
        for process in started:
            try:
                process.wait(30)
            except Exception:
                process.kill()
    log = (training / "train.log").read_text()
    assert any(line.endswith(" 2") for line in log.splitlines() if line.startswith("EPOCH")), log
