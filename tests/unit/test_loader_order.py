"""The tuned loader's order under several ranks: each epoch's order is drawn from the job's base
seed plus the epoch, never from a rank's global RNG, so the ranks' slices of one global batch
cover every sample once; a resumed epoch goes on exactly; a single process keeps the factory's
own order. The ranks run in this process, agreeing their seed through a real c10d store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed import HashStore
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, WeightedRandomSampler

from memtui.hooks.coordinate import Coordinator
from memtui.hooks.knobstore import KnobStore
from memtui.hooks.ledger import StepLedger
from memtui.hooks.loader import TunedLoader

SAMPLES = 48
BATCH = 4


class Indices(Dataset[int]):
    """Sample i is i."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> int:
        return index


def shuffled(batch_size: int) -> DataLoader[int]:
    """The usual factory: ``shuffle=True`` and no generator (the order from the global RNG)."""
    return DataLoader(Indices(), batch_size=batch_size, shuffle=True)


def report(exc: BaseException, where: str) -> None:
    raise AssertionError(f"{where}: {exc}")


def job_seed(store: Any, rank: int) -> Callable[[int], int]:
    """How the tuner agrees a loader's base seed: rank 0's, through the job's store."""
    ranks = SimpleNamespace(get_rank=lambda: rank, get_world_size=lambda: 2)
    coordinator = Coordinator(ranks, store=store)
    return lambda mine, nth: int(coordinator.agree(f"loader1/seed{nth}", str(mine), "0")[0])


def rank_loaders(
    factory: Callable[..., DataLoader[int]] = shuffled,
) -> tuple[TunedLoader, TunedLoader]:
    """Rank 0's and rank 1's loaders of one job (their own ledgers and configs, one store)."""
    store = HashStore()
    return tuple(  # type: ignore[return-value]
        TunedLoader(
            StepLedger(),
            KnobStore(SimpleNamespace(batch_size=BATCH), None, report),
            factory,
            shard=(rank, 2),
            seed=job_seed(store, rank),
        )
        for rank in (0, 1)
    )


def epoch(loader: TunedLoader, rng_seed: int, stop_after: int = -1) -> list[int]:
    """One epoch's indices from ``loader``, its rank's global RNG first set to ``rng_seed`` and
    moved on by a different amount at every batch (dropout over batches of other lengths)."""
    torch.manual_seed(rng_seed)
    seen: list[int] = []
    for i, batch in enumerate(loader):
        torch.rand(rng_seed + i)
        seen += [int(x) for x in batch]
        if i == stop_after:
            break
    return seen


def test_two_ranks_with_different_global_rngs_train_every_sample_once_per_epoch() -> None:
    zero, one = rank_loaders()
    orders = []
    for e in range(3):
        first, second = epoch(zero, 100 + e), epoch(one, 200 + 7 * e)
        assert len(first) == len(second) == SAMPLES // 2
        assert sorted(first + second) == list(range(SAMPLES)), f"epoch {e}: each sample once"
        orders.append(first)
    assert orders[0] != orders[1] != orders[2], "each epoch its own order"


@pytest.mark.parametrize(
    "sampler",
    [
        lambda: SubsetRandomSampler(range(SAMPLES)),
        lambda: WeightedRandomSampler([1.0] * SAMPLES, SAMPLES, replacement=True),
    ],
    ids=["subset", "weighted"],
)
def test_every_random_sampler_draws_the_same_order_on_every_rank(
    sampler: Callable[[], Any],
) -> None:
    zero, one = rank_loaders(
        lambda batch_size: DataLoader(Indices(), batch_size=batch_size, sampler=sampler())
    )
    for e in range(2):
        first, second = epoch(zero, 1 + e), epoch(one, 50 + e)
        # the two slices of one global order: rank 0 holds the first half of each global batch
        rows = [first[i : i + BATCH] + second[i : i + BATCH] for i in range(0, len(first), BATCH)]
        again = zero.rank_batches(e)
        assert [batch for batch, _ in again] == rows


def test_a_resumed_epoch_goes_on_exactly_whatever_the_restarted_ranks_rng() -> None:
    """The base seed is rank 0's (its global seed here, set at the first epoch) and travels in
    the position: a restart seeded otherwise resumes the run's own order."""
    whole = rank_loaders()
    for e in range(2):
        full = [epoch(loader, 7 * e + rank) for rank, loader in enumerate(whole)]
    stopped = rank_loaders()
    states = []
    for rank, loader in enumerate(stopped):
        epoch(loader, rank)
        head = epoch(loader, 3 + rank, stop_after=2)  # 3 batches of epoch 1
        assert head == full[rank][: 3 * BATCH]
        states.append(loader.state_dict())
    assert states[0] == states[1] == {"epoch": 1, "samples_in_epoch": 24, "seed": 0}
    for rank, loader in enumerate(rank_loaders()):
        loader.load_state_dict(states[rank])
        rest = epoch(loader, 999 - rank)
        assert full[rank][: 3 * BATCH] + rest == full[rank]
        assert loader.epoch == 1


def test_one_process_keeps_the_factorys_own_order() -> None:
    torch.manual_seed(5)
    plain = [[int(x) for x in batch] for _ in range(3) for batch in shuffled(BATCH)]
    tuned = TunedLoader(
        StepLedger(), KnobStore(SimpleNamespace(batch_size=BATCH), None, report), shuffled
    )
    torch.manual_seed(5)
    assert [[int(x) for x in batch] for _ in range(3) for batch in tuned] == plain


def test_a_sampler_that_is_not_random_is_left_alone() -> None:
    zero, one = rank_loaders(lambda batch_size: DataLoader(Indices(), batch_size=batch_size))
    first, second = epoch(zero, 1), epoch(one, 2)
    assert first[:BATCH] == list(range(BATCH)) and second[:BATCH] == list(range(BATCH, 2 * BATCH))


def test_the_ranks_take_the_fallback_seed_when_rank_0_never_posts() -> None:
    store = HashStore()
    store.set("failed", "1")  # a rank posted that memtui failed there
    store.set("fail/1", "rank 1 could not coordinate")
    ranks = SimpleNamespace(get_rank=lambda: 1, get_world_size=lambda: 2)
    value, why = Coordinator(ranks, store=store).agree("loader1/seed", "17", "0")
    assert (value, why) == ("0", "rank 1 could not coordinate")
    zero = SimpleNamespace(get_rank=lambda: 0, get_world_size=lambda: 2)
    assert Coordinator(zero, store=store).agree("loader1/seed", "17", "0")[0] == "0"


def test_the_sampler_and_batch_sampler_give_this_ranks_batches_outside_the_loader() -> None:
    zero, one = rank_loaders()
    seen = {}
    for rank, loader in enumerate((zero, one)):
        assert len(loader) == SAMPLES // (BATCH * 2)
        assert len(loader.sampler) == SAMPLES // 2
        planned = list(loader.sampler)  # the epoch the loader iterates next, as it will
        outside: Iterator[list[int]] = iter(loader.batch_sampler)
        seen[rank] = [i for batch in outside for i in batch]
        assert seen[rank] == planned
        assert loader.state_dict()["epoch"] == 0
        assert loader.state_dict()["samples_in_epoch"] == SAMPLES
    assert sorted(seen[0] + seen[1]) == list(range(SAMPLES))
    assert epoch(zero, 3) != seen[0], "the loader's own iteration is the next epoch"
    zero.set_epoch(0)
    assert epoch(zero, 4) == seen[0], "set_epoch names the epoch iterated next"
