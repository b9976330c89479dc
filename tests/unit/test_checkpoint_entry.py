"""The tuned config in the script's own checkpoint: ``tuner.state_dict()`` keeps the knobs memtui
set, the LR factor and the ceiling as plain values, and ``load_state_dict`` gives them back to a
restarted run, with or without the tuned YAML beside it (one process, no publishing)."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from memtui.hooks import Options, Tuner
from memtui.hooks.persist import TUNED_FILE, write_tuned
from memtui.wire import Ceiling, KnobDiff, SetRequest

BASE_LR = 0.1
DATA = TensorDataset(torch.randn(1024, 4), torch.randn(1024, 1))


class Loop:
    """A plain loop's parts: its config, model, optimizer, scheduler, memtui and loader."""

    def __init__(self, state_dir: Path, **install: Any) -> None:
        self.config = SimpleNamespace(batch_size=8, grad_accum=1, num_workers=0, pin_memory=False)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=BASE_LR)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.tuner = Tuner(
            self.config,
            model=self.model,
            optimizer=self.optimizer,
            state_dir=state_dir,
            options=Options(publish=False),
            **install,
        ).start()
        self.tuner.watch_scheduler(self.scheduler)
        self.loader = self.tuner.loader(
            lambda batch_size, num_workers, pin_memory: DataLoader(
                DATA, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory
            )
        )
        self._batches: Any = None

    def steps(self, count: int) -> list[float]:
        """Train ``count`` steps of one micro-batch; the LR each step used."""
        used = []
        for _ in range(count):
            if self._batches is None:  # one epoch's iterator across calls: the loop's own
                self._batches = iter(self.loader)
            x, y = next(self._batches)
            torch.nn.functional.mse_loss(self.model(x), y).backward()
            used.append(self.optimizer.param_groups[0]["lr"])
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            self.tuner.step()
        return used

    def change(self, lr_scale: str = "linear", **changes: Any) -> None:
        """Queue ``changes`` and apply them at a boundary."""
        reply = self.tuner.control.queue(SetRequest(changes=changes, lr_scale=lr_scale))
        assert reply.ok, reply.reason
        assert self.tuner.checkpoint() is not None

    def checkpoint(self) -> dict[str, Any]:
        """The script's checkpoint, through ``torch.save`` and ``torch.load(weights_only=True)``."""
        buffer = io.BytesIO()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "memtui": self.tuner.state_dict(),
        }
        torch.save(state, buffer)
        buffer.seek(0)
        loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
        assert loaded["memtui"] == state["memtui"], "plain values, unchanged by the round trip"
        return loaded

    def load(self, checkpoint: dict[str, Any], memtui_first: bool = False) -> None:
        """The script's restart: its own state, then memtui's (or memtui's first)."""
        if memtui_first:
            self.tuner.load_state_dict(checkpoint["memtui"])
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if not memtui_first:
            self.tuner.load_state_dict(checkpoint["memtui"])

    def close(self) -> None:
        self.tuner.close()


def tuned_run(state_dir: Path) -> tuple[Loop, dict[str, Any]]:
    """A run that doubled its batch with the LR (x2 at step 3) and saved at step 5: it, and the
    checkpoint it saved."""
    loop = Loop(state_dir)
    loop.steps(3)
    loop.change(batch_size=16)
    loop.steps(2)
    return loop, loop.checkpoint()


def said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    """memtui's log lines that contain ``words``."""
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


def test_the_entry_keeps_the_tuned_config_as_plain_values(tmp_path: Path) -> None:
    loop, checkpoint = tuned_run(tmp_path)
    loop.tuner.control.restore_ceiling(Ceiling(batch_size=64, step=4, note="out of memory"))
    entry = loop.checkpoint()["memtui"]
    loop.close()
    assert entry == {
        "step": 5,
        "loaders": [{"epoch": 0, "samples_in_epoch": 8 * 3 + 16 * 2}],
        "run": loop.tuner.run_id,
        "config": {"batch_size": 16, "prefetch_factor": 2},  # the loader alone holds the factor
        "lr": {
            "factor": 2.0,
            "anchor": {"batch": 8, "factor": 1.0},
            "rule": "linear",
            "starts": [[pytest.approx(2 * BASE_LR)]],
            "carried": [2.0],
        },
        "ceiling": {"batch_size": 64, "step": 4, "note": "out of memory"},
    }
    assert checkpoint["memtui"]["config"] == entry["config"]


def test_an_untuned_run_keeps_no_knob_of_its_config_and_no_lr(tmp_path: Path) -> None:
    loop = Loop(tmp_path)
    loop.steps(2)
    entry = loop.tuner.state_dict()
    loop.close()
    assert entry["config"] == {"prefetch_factor": 2} and entry["lr"] == {}
    assert "ceiling" not in entry


@pytest.mark.parametrize("memtui_first", [False, True])
def test_the_entry_alone_restarts_at_the_tuned_batch_and_lr_once(
    tmp_path: Path, memtui_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    first, checkpoint = tuned_run(tmp_path / "first")
    first.close()
    restarted = Loop(tmp_path / "moved")  # no tuned YAML there
    caplog.clear()
    with caplog.at_level(logging.WARNING, "memtui"):
        restarted.load(checkpoint, memtui_first)
    assert restarted.config.batch_size == 16
    assert restarted.tuner.resumed == {"batch_size": KnobDiff(8, 16)}
    assert restarted.tuner.step_count == 5 and restarted.tuner.lr.factor == 2.0
    assert restarted.steps(2) == [pytest.approx(2 * BASE_LR)] * 2, "x2, never x4"
    assert restarted.loader.batch_size == 16, "the loader followed at its next iteration"
    assert restarted.tuner.errors.count == 0, restarted.tuner.errors.last
    assert said(caplog, "memtui:") == [
        "memtui: resumed the tuned config from the checkpoint (step 5): batch_size 8 -> 16, lr x2.0"
    ]
    restarted.close()


def test_an_entry_of_before_restores_the_step_and_the_loaders_only(tmp_path: Path) -> None:
    first, _ = tuned_run(tmp_path)
    first.close()
    restarted = Loop(tmp_path, resume=True)  # from the tuned YAML
    restarted.tuner.load_state_dict({"step": 5, "loaders": [{"epoch": 0, "samples_in_epoch": 56}]})
    assert restarted.tuner.step_count == 5 and restarted.loader.resume_position == (0, 56)
    assert restarted.config.batch_size == 16 and restarted.tuner.lr.factor == 2.0
    assert restarted.tuner.errors.count == 0
    restarted.close()


def test_a_malformed_entry_is_reported_and_the_config_stands(tmp_path: Path) -> None:
    loop = Loop(tmp_path)
    loop.tuner.load_state_dict({"step": 3, "config": {"batch_size": "lots"}})
    assert loop.tuner.step_count == 3 and loop.config.batch_size == 8
    assert loop.tuner.errors.count == 1 and "batch_size" in loop.tuner.errors.last
    loop.close()


@pytest.mark.parametrize("memtui_first", [False, True])
def test_the_checkpoint_wins_over_a_newer_tuned_yaml_and_says_so(
    tmp_path: Path, memtui_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    first, checkpoint = tuned_run(tmp_path)  # saved at step 5 with batch 16, x2
    first.steps(1)
    first.change(batch_size=32)  # at step 6: the YAML says batch 32, x4
    first.close()
    restarted = Loop(tmp_path, resume=True)
    assert restarted.config.batch_size == 32
    caplog.clear()
    with caplog.at_level(logging.WARNING, "memtui"):
        restarted.load(checkpoint, memtui_first)
    assert restarted.config.batch_size == 16 and restarted.tuner.lr.factor == 2.0
    assert restarted.steps(2) == [pytest.approx(2 * BASE_LR)] * 2, "x2: the weights' LR"
    (line,) = said(caplog, "memtui:")
    assert line.startswith(
        "memtui: resumed the tuned config from the checkpoint (step 5): batch_size 32 -> 16, "
        f"lr x2.0; not {tmp_path / TUNED_FILE}'s (step 6: batch_size 32, grad_accum 1, "
        "num_workers 0, pin_memory false, prefetch_factor 2, lr x4.0): the checkpoint's weights "
        "were trained with its own"
    ), line
    restarted.close()


def test_a_yaml_written_at_the_checkpoints_step_after_its_save_wins(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, checkpoint = tuned_run(tmp_path)  # saved at step 5 with batch 16, x2
    first.change(batch_size=32)  # the boundary right after that save: batch 32, x4
    first.close()
    restarted = Loop(tmp_path)  # not told to resume: given the checkpoint's entry
    with caplog.at_level(logging.WARNING, "memtui"):
        restarted.load(checkpoint)
    assert restarted.config.batch_size == 32 and restarted.tuner.lr.factor == 4.0
    assert restarted.steps(2) == [pytest.approx(4 * BASE_LR)] * 2, "x4 once: never x8"
    (line,) = said(caplog, "rather than")
    assert line == (
        f"memtui: resumed the tuned config from {tmp_path / TUNED_FILE} (step 5: batch_size 32, "
        "grad_accum 1, num_workers 0, pin_memory false, prefetch_factor 2, lr x4.0) rather than "
        "the checkpoint's (step 5: batch_size 16, prefetch_factor 2, lr x2.0): it was written at "
        "the checkpoint's step, after its save, by a change applied there"
    )
    restarted.close()


def test_an_out_of_memory_safe_config_written_after_the_checkpoint_wins(tmp_path: Path) -> None:
    first, checkpoint = tuned_run(tmp_path)  # saved at step 5 with batch 16, x2
    first.close()
    safe = {"batch_size": 8, "grad_accum": 2, "prefetch_factor": 2}  # the effective batch kept
    lr = {"lr": checkpoint["memtui"]["lr"], "oom": {"step": 9}}
    write_tuned(tmp_path / TUNED_FILE, first.tuner.run_id, 9, safe, lr)
    restarted = Loop(tmp_path, resume=True)
    restarted.load(checkpoint)
    assert (restarted.config.batch_size, restarted.config.grad_accum) == (8, 2)
    assert restarted.tuner.lr.factor == 2.0
    assert restarted.steps(1) == [pytest.approx(2 * BASE_LR)]
    restarted.close()


def test_a_tuned_yaml_the_run_does_not_resume_from_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "memtui"):
        Loop(tmp_path / "fresh").close()
        assert not said(caplog, "keeps a tuned config"), "no YAML: nothing to say"
        first, _ = tuned_run(tmp_path)
        first.close()
        Loop(tmp_path, resume=True).close()
        assert not said(caplog, "keeps a tuned config"), "resumed: nothing to say"
        written = (tmp_path / TUNED_FILE).read_text()
        again = Loop(tmp_path)
        again.steps(2)
        again.tuner.checkpoint()
    (line,) = said(caplog, "keeps a tuned config")
    assert line.startswith(
        f"memtui: {tmp_path / TUNED_FILE} keeps a tuned config (step 3: batch_size 16, "
        "grad_accum 1, num_workers 0, pin_memory false, prefetch_factor 2, lr x2.0) that this run "
        "does not start from"
    ), line
    assert "resume=True" in line and 'tuner.load_state_dict(checkpoint["memtui"])' in line
    assert again.config.batch_size == 8 and (tmp_path / TUNED_FILE).read_text() == written
    again.close()
