"""A rank of several that is not coordinated yet refuses changes rather than apply them alone."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from memtui.hooks.tuner import Options, Tuner
from memtui.wire import SetRequest


def test_an_uncoordinated_rank_of_two_rejects_changes(tmp_path: Path) -> None:
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = Tuner(
        config, state_dir=tmp_path, options=Options(publish=False), placement=(0, 0, 2)
    ).start()
    try:
        assert (tuner.rank, tuner.world_size) == (0, 2)
        assert tuner.coordinate() is False, "no process group in this process"
        assert tuner.control.queue(SetRequest(changes={"grad_accum": 2})).ok
        tuner.step()
        assert tuner.checkpoint() is None
        assert config.grad_accum == 1, "nothing applied on this rank alone"
        reason = tuner.control.state().rejected[-1].reason
        assert "not coordinated" in reason and "tuner.coordinate()" in reason
    finally:
        tuner.close()


def test_a_single_process_still_applies(tmp_path: Path) -> None:
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    tuner = Tuner(
        config, state_dir=tmp_path, options=Options(publish=False), placement=(0, 0, 1)
    ).start()
    try:
        assert tuner.control.queue(SetRequest(changes={"grad_accum": 2})).ok
        applied = tuner.checkpoint()
        assert applied is not None and config.grad_accum == 2
    finally:
        tuner.close()
