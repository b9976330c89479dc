"""One predicted peak for a change wherever it is shown (the recommendation, the dry run, the
queued change, the applied one), and no recommendation that repeats a pending change."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec

from memtui.advice.assess import advise
from memtui.advice.verdict import Inputs as VerdictInputs
from memtui.advice.verdict import decide
from memtui.core.stats import StepStats
from memtui.hooks import Options, Tuner
from memtui.wire import MemoryModel, ModelPoint, SetRequest

MIB = 1 << 20
FED = StepStats(steps=20, step_time_s=0.1, data_wait_s=0.001, samples_per_s=80, steps_per_s=10)


def _model() -> MemoryModel:
    """A CPU run's model fitted at no loader workers (each one measured at 30 MiB), underused."""
    return MemoryModel(
        kind="cpu",
        batch_size=8,
        capacity_bytes=4096 * MIB,
        steady_bytes=200 * MIB,
        per_sample_bytes=5 * MIB,
        points=[ModelPoint(8, 240 * MIB, 5), ModelPoint(16, 280 * MIB, 5)],
        fit_error=0.01,
        workers=0,
        per_worker_bytes=30 * MIB,
        returns_freed=True,
    )


def test_a_change_has_one_predicted_peak_from_recommendation_to_applied(tmp_path: Path) -> None:
    """The run has 2 workers more than when its model was fitted: the recommendation's peak
    counts them as the queue's gate does (it left them out: 30 MiB x 2 under the queued one)."""
    config = SimpleNamespace(batch_size=8, gradient_accumulation_steps=1, num_workers=2)
    tuner = Tuner(config, state_dir=tmp_path / "state", options=Options(publish=False))
    try:
        control = tuner.control
        control.model = _model()
        verdict = decide(VerdictInputs())
        advice = advise(control.state(), None, FED, 8.0, None, verdict)
        (bigger,) = [o for o in advice.recommendations if "batch_size" in o.changes]
        changes = dict(bigger.changes)
        dry = control.queue(SetRequest(changes=changes, dry_run=True))  # type: ignore[arg-type]
        queued = control.queue(SetRequest(changes=changes))  # type: ignore[arg-type]
        assert dry.ok and queued.ok, (dry.reason, queued.reason)
        (pending,) = control.state().pending
        assert bigger.predicted_peak_bytes is not None
        assert bigger.predicted_peak_bytes > 240 * MIB + 2 * 30 * MIB, "the workers counted"
        figures = {
            "recommendation": bigger.predicted_peak_bytes,
            "dry run": dry.predicted_peak_bytes,
            "queued reply": queued.predicted_peak_bytes,
            "pending": pending.predicted_peak_bytes,
        }
        assert len(set(figures.values())) == 1, figures

        again = advise(control.state(), None, FED, 8.0, None, verdict)
        assert not [o for o in again.recommendations if set(o.changes) & set(changes)], (
            "a pending change is never recommended again"
        )

        control.model = msgspec.structs.replace(_model(), steady_bytes=260 * MIB)
        applied = tuner.checkpoint()  # the model moved since: the figure shown stands
        assert applied is not None
        assert applied.predicted_peak_bytes == pending.predicted_peak_bytes
    finally:
        tuner.close()
