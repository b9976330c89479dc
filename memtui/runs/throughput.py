"""What samples/s means, for a rank and for the job: one definition for the viewer, the exporter
and ``memtui status``.

A **rank's** samples/s is its own: the samples of the training batches it drew (a sample is a
row of a batch, the first dimension of its first tensor: not a token) over its last 50 steps,
divided by those steps' wall time (``memtui.core.stats.summarize_steps``). Evaluation batches are
not counted.

The **job's** samples/s is the sum of its ranks': in data-parallel training each rank trains on
its own batches (its slice of the global batch), so the job trains on them all. A rank with no
timed steps, none counted, that is silent or did not answer is left out of the sum, and the
figure says over how many of the ranks it is. (Ranks that share their batches, tensor or pipeline
parallel, would each count the same rows: there the job's figure counts them once per rank.)

A **step** is one optimizer step: the micro-batches it drew (gradient accumulation) and their
samples. A framework may print its time per micro-batch (litgpt's "iter time") or tokens/s;
``step_words`` says what memtui's step is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memtui.core.stats import StepStats, format_rate


@dataclass(frozen=True)
class Throughput:
    """The job's samples/s and what it is made of."""

    samples_per_s: float
    """The job's samples/s: the ranks' own summed (0 where none counted a sample)."""
    ranks: int
    """The ranks summed: those with counted samples in their recent steps."""
    world_size: int
    """The job's ranks."""
    micro_batches_per_step: float
    """Micro-batches a step draws on a rank (the lowest rank summed; 0: no batch seen)."""
    samples_per_step: float
    """The samples of one step over the ranks summed (the global batch, where all are)."""

    @property
    def counted(self) -> bool:
        """Whether any rank counted samples (False: samples/s is not known, not 0)."""
        return self.ranks > 0


def job_throughput(ranks: Iterable[StepStats | None], world_size: int) -> Throughput:
    """The job's samples/s from each rank's step summary in rank order (None: a rank with no
    timed steps, silent or not answering, left out)."""
    counted = [stats for stats in ranks if stats is not None and stats.samples_counted]
    first = counted[0] if counted else None
    return Throughput(
        samples_per_s=sum(stats.samples_per_s for stats in counted),
        ranks=len(counted),
        world_size=max(world_size, len(counted), 1),
        micro_batches_per_step=first.micro_batches_per_step if first is not None else 0.0,
        samples_per_step=sum(stats.samples_per_step for stats in counted),
    )


def samples_words(throughput: Throughput, short: bool = False) -> str:
    """``1,654 samples/s (2 ranks)``, ``827 samples/s (1 of 2 ranks)``, or that the samples were
    not counted; ``short``: ``1,654 samples/s`` where every rank is in it."""
    if not throughput.counted:
        return "samples not counted"
    words = f"{format_rate(throughput.samples_per_s)} samples/s"
    if throughput.world_size == 1 or (short and throughput.ranks == throughput.world_size):
        return words
    if throughput.ranks == throughput.world_size:
        return f"{words} ({throughput.ranks} ranks)"
    return f"{words} ({throughput.ranks} of {throughput.world_size} ranks)"


def micro_words(micro: float) -> str:
    """``2 micro-batches``, ``1 micro-batch``, ``2.5 micro-batches on average``."""
    whole = round(micro)
    if abs(micro - whole) < 0.05:
        return f"{whole} micro-batch" + ("" if whole == 1 else "es")
    return f"{micro:.1f} micro-batches on average"


def step_words(throughput: Throughput, short: bool = False) -> str:
    """What one of memtui's steps is: ``step = one optimizer step of 2 micro-batches, 32 samples
    (batch rows, not tokens)``; ``short``: ``step = 2 micro-batches`` ("" before a batch was
    counted)."""
    if not throughput.counted or throughput.micro_batches_per_step <= 0:
        return ""
    micro = micro_words(throughput.micro_batches_per_step)
    several = throughput.world_size > 1
    if short:
        return f"step = {micro}" + (" a rank" if several else "")
    samples = _count(throughput.samples_per_step)
    if not several:
        return f"step = one optimizer step of {micro}, {samples} samples (batch rows, not tokens)"
    return (
        f"step = one optimizer step of {micro} a rank, {samples} samples over "
        f"{throughput.ranks} ranks (batch rows, not tokens)"
    )


def _count(value: float) -> str:
    """A mean count: ``32``, ``1,024``, ``30.5``."""
    return f"{value:,.0f}" if abs(value - round(value)) < 0.05 else f"{value:,.1f}"
