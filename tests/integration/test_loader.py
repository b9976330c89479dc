"""The DataLoader wrapper: wait timing, rebuilds on knob changes, exact data position, no leaked workers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler

from memtui.hooks import Options, Tuner
from memtui.wire import KnobDiff, Knobs, SetRequest
from tests.support.clock import patience


class Indices(Dataset[int]):
    """Sample i is i, after an optional wait."""

    def __init__(self, size: int, wait_s: float = 0.0) -> None:
        self.size = size
        self.wait_s = wait_s

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        if self.wait_s:
            time.sleep(self.wait_s)
        return index


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        yield from range(10_000)


def make_tuner(**config: object) -> Tuner:
    return Tuner(SimpleNamespace(**config), options=Options(publish=False)).start()


def queue(tuner: Tuner, **changes: object) -> None:
    reply = tuner.control.queue(SetRequest(changes=dict(changes)))  # type: ignore[arg-type]
    assert reply.ok, reply.reason


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def flat(batch: torch.Tensor) -> list[int]:
    return [int(i) for i in batch.tolist()]


@pytest.mark.parametrize("workers", [0, 2])
def test_rebuild_mid_epoch_keeps_exact_position_sequential(workers: int) -> None:
    tuner = make_tuner(batch_size=4, num_workers=workers, grad_accum=1)
    loader = tuner.loader(
        lambda batch_size, num_workers: DataLoader(
            Indices(100), batch_size=batch_size, num_workers=num_workers
        )
    )
    seen: list[int] = []
    sizes: list[int] = []
    for i, batch in enumerate(loader):
        seen += flat(batch)
        sizes.append(len(batch))
        tuner.step()
        if i == 4:  # workers have prefetched batches 5.. by now: they must be replayed, not lost
            queue(tuner, batch_size=6, num_workers=1 if workers else 0)
            applied = tuner.checkpoint()
            assert applied is not None and applied.changes["batch_size"] == KnobDiff(4, 6)
    assert seen == list(range(100))
    assert sizes[:5] == [4] * 5 and set(sizes[5:-1]) == {6}
    assert loader.generation == 1 and "exactly" in loader.last_rebuild
    loader.close()


def test_rebuild_with_unseeded_random_sampler_loses_and_repeats_nothing() -> None:
    tuner = make_tuner(batch_size=8, num_workers=2)
    dataset = Indices(200)
    loader = tuner.loader(
        lambda batch_size, num_workers: DataLoader(
            dataset, batch_size=batch_size, sampler=RandomSampler(dataset), num_workers=num_workers
        )
    )
    seen: list[int] = []
    for i, batch in enumerate(loader):
        seen += flat(batch)
        if i in (2, 9):
            queue(tuner, batch_size=5 if i == 2 else 11, num_workers=3 if i == 2 else 0)
            tuner.checkpoint()
    assert sorted(seen) == list(range(200))
    assert loader.generation == 2
    loader.close()


def test_old_workers_are_shut_down_on_rebuild() -> None:
    tuner = make_tuner(batch_size=4, num_workers=2)
    loader = tuner.loader(
        lambda batch_size, num_workers: DataLoader(
            Indices(400), batch_size=batch_size, num_workers=num_workers, persistent_workers=True
        )
    )
    before = children()
    iterator = iter(loader)
    next(iterator)
    first_workers = children() - before
    assert len(first_workers) == 2
    queue(tuner, num_workers=3)
    tuner.checkpoint()
    next(iterator)
    second_workers = children() - before
    assert len(second_workers) == 3
    assert not (first_workers & second_workers)
    assert not any(
        psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        for pid in first_workers
    )
    del iterator
    loader.close()
    deadline = time.monotonic() + patience(10)
    while children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (children() - before), "worker processes leaked"


def test_a_prefetch_factor_change_rebuilds_the_loader_and_its_workers_load_that_far_ahead() -> None:
    """torch's worker iterator draws prefetch_factor x workers index batches ahead: the batches
    drawn and not yet delivered show the factor the DataLoader really uses."""
    tuner = make_tuner(batch_size=4, num_workers=1)
    loader = tuner.loader(
        lambda batch_size, num_workers: DataLoader(
            Indices(400), batch_size=batch_size, num_workers=num_workers
        )
    )
    assert tuner.knobs().prefetch_factor == 2, "torch's default, taken from the DataLoader"
    iterator = iter(loader)
    seen = flat(next(iterator))
    assert len(loader.epoch_stream.inflight) == 2  # type: ignore[union-attr]
    queue(tuner, prefetch_factor=4)
    assert tuner.checkpoint() is not None
    seen += flat(next(iterator))  # from the rebuilt loader
    seen += flat(next(iterator))
    assert loader.dataloader.prefetch_factor == loader.prefetch_factor == 4
    assert len(loader.epoch_stream.inflight) == 4  # type: ignore[union-attr]
    assert seen == list(range(12)), "the epoch continues exactly"
    refused = tuner.control.queue(SetRequest(changes={"num_workers": 0, "prefetch_factor": 3}))
    assert not refused.ok and "only used with num_workers > 0" in refused.reason
    del iterator
    loader.close()


def test_data_wait_is_measured_per_step() -> None:
    tuner = make_tuner(batch_size=4, grad_accum=2, num_workers=0)
    loader = tuner.loader(
        lambda batch_size: DataLoader(Indices(64, wait_s=0.005), batch_size=batch_size)
    )
    it = iter(loader)
    for _ in range(3):
        next(it)
        next(it)
        time.sleep(0.01)  # "compute"
        tuner.step()
    records = tuner.ledger.drain_steps()
    assert [r[0] for r in records] == [1, 2, 3]
    for _step, _end, step_time, wait, samples, micro, _flags in records[1:]:
        assert micro == 2 and samples == 8
        assert wait >= 0.035  # 8 samples x 5 ms
        assert step_time >= wait + 0.009


def test_iterable_dataset_rebuilds_with_restart() -> None:
    tuner = make_tuner(batch_size=4)
    loader = tuner.loader(lambda batch_size: DataLoader(Stream(), batch_size=batch_size))
    sizes = []
    for i, batch in enumerate(loader):
        sizes.append(len(batch))
        if i == 2:
            queue(tuner, batch_size=7)
            tuner.checkpoint()
        if i == 5:
            break
    assert sizes == [4, 4, 4, 7, 7, 7]
    assert loader.mode == "restart" and "restarted" in loader.last_rebuild


def test_state_dict_resumes_the_epoch_exactly() -> None:
    dataset = Indices(60)

    def factory(batch_size: int) -> DataLoader[int]:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=3),
        )

    tuner = make_tuner(batch_size=5)
    loader = tuner.loader(factory)
    loader.sampler.set_epoch(1)
    full = []
    for batch in loader:
        full += flat(batch)
    loader.sampler.set_epoch(1)
    first = []
    for i, batch in enumerate(loader):
        first += flat(batch)
        tuner.step()
        if i == 3:
            state = tuner.state_dict()
            break
    assert state["step"] == 4 and state["loaders"] == [{"epoch": 1, "samples_in_epoch": 20}]
    resumed = make_tuner(batch_size=5)
    loader2 = resumed.loader(factory)
    resumed.load_state_dict(state)
    rest = []
    for batch in loader2:
        rest += flat(batch)
    assert resumed.step_count == 4
    assert first + rest == full


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_shuffled_epoch_has_the_order_of_the_run_it_resumes(workers: int) -> None:
    """``DataLoader(shuffle=True, generator=g)``: the loader draws its workers' base seed from
    ``g`` before the sampler draws the epoch's order from it; a resumed epoch keeps that order
    of draws, so a restart seeded as the run was goes on with the run's own order."""
    dataset = Indices(60)

    def run(
        state: dict[str, object] | None = None, stop_after: int = -1
    ) -> tuple[list[int], Tuner]:
        generator = torch.Generator().manual_seed(11)  # the script seeds it at every start
        tuner = make_tuner(batch_size=5, num_workers=workers)
        loader = tuner.loader(
            lambda batch_size, num_workers: DataLoader(
                dataset,
                batch_size=batch_size,
                shuffle=True,
                generator=generator,
                num_workers=num_workers,
            )
        )
        if state is not None:
            tuner.load_state_dict(state)
        seen: list[int] = []
        for i, batch in enumerate(loader):
            seen += flat(batch)
            tuner.step()
            if i == stop_after:
                break
        return seen, tuner

    full, whole = run()
    first, stopped = run(stop_after=3)
    state = stopped.state_dict()
    rest, resumed = run(state)
    for tuner in (whole, stopped, resumed):
        tuner.close()
    assert first == full[:20]
    assert first + rest == full, "the epoch's own order, no sample lost or repeated"


def test_factory_that_takes_no_knobs_still_gets_them() -> None:
    """memtui rebuilds the DataLoader itself, so a factory with no arguments works too."""
    tuner = make_tuner()
    loader = tuner.loader(lambda: DataLoader(Indices(40), batch_size=4, num_workers=0))
    assert tuner.knobs() == Knobs(batch_size=4, num_workers=0, pin_memory=False, prefetch_factor=2)
    queue(tuner, batch_size=10)
    tuner.checkpoint()
    assert [len(b) for b in loader] == [10, 10, 10, 10]


def test_not_in_worker_processes() -> None:
    """Forked workers disable the tuner: no sampling or publishing happens there."""
    tuner = Tuner(SimpleNamespace(batch_size=2), options=Options()).start()
    try:
        loader = tuner.loader(
            lambda batch_size: DataLoader(_ClosedProbe(), batch_size=batch_size, num_workers=1)
        )
        assert flat(next(iter(loader))) == [1, 1]
    finally:
        tuner.close()


class _ClosedProbe(Dataset[int]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        from memtui.hooks.tuner import _live_tuners

        assert os.getpid() != _parent_pid
        return int(all(t._closed for t in _live_tuners))


_parent_pid = os.getpid()


def test_a_loop_that_never_calls_step_stays_bounded() -> None:
    from memtui.hooks.ledger import MAX_STEP_BATCHES

    tuner = make_tuner(batch_size=2)
    try:
        loader = tuner.loader(lambda batch_size: DataLoader(Indices(20_000), batch_size=batch_size))
        for _ in loader:
            pass
        assert len(tuner.ledger.open.batches) == MAX_STEP_BATCHES
        requeued, skipped = tuner.ledger.requeue()
        assert requeued + skipped == 20_000  # none unaccounted for
        assert not tuner.ledger.open.batches
    finally:
        tuner.close()


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"batch_size": 0, "num_workers": 0}, "batch_size should be a positive integer value"),
        ({"batch_size": 4, "num_workers": -1}, "num_workers option should be non-negative"),
    ],
)
def test_a_bad_starting_value_gets_torchs_own_error_not_memtuis(
    config: dict[str, int], error: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``num_workers=-1`` or ``batch_size=0`` in the user's config must not end in a TypeError from
    memtui's loader (a missing argument): the value reaches the user's factory as it is, torch says
    what is wrong, and memtui says once that it cannot tune it."""
    tuner = make_tuner(**config)
    try:
        (knob,) = tuner.store.untunable
        assert knob not in tuner.store.tunable()
        assert f"{knob}={config[knob]} in your config is not a value memtui can use" in caplog.text

        def factory(batch_size: int, num_workers: int) -> DataLoader:
            return DataLoader(Indices(8), batch_size=batch_size, num_workers=num_workers)

        with pytest.raises(ValueError, match=error):
            tuner.loader(factory)
    finally:
        tuner.close()


def test_the_demo_refuses_bad_starting_values() -> None:
    """``memtui demo --workers -1`` fails at ``--dry-run``, not later in training."""
    from memtui.demo.options import build_parser

    parser = build_parser()
    for argv in (["--workers", "-1"], ["--batch-size", "0"], ["--grad-accum", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert parser.parse_args(["--workers", "0", "--seed", "-3"]).workers == 0
    from click.testing import CliRunner

    from memtui.cli import main

    refused = CliRunner().invoke(main, ["demo", "--workers", "-1", "--dry-run"])
    assert refused.exit_code == 2, refused.output
    assert "--workers" in refused.output and "-1" in refused.output, refused.output


def test_a_placed_batch_is_handed_out_placed_and_its_placing_is_not_data_wait() -> None:
    """``place`` (the accelerate adapter's move to the device) runs on each batch after its fetch
    was timed: the batch comes out placed, the time it took is not counted as data wait, and a
    knob change still rebuilds the loader mid-epoch."""
    tuner = make_tuner(batch_size=2, grad_accum=1)
    placed: list[list[int]] = []

    def place(batch: torch.Tensor) -> tuple[str, list[int]]:
        placed.append(flat(batch))
        time.sleep(0.2)
        return ("on device", flat(batch))

    tuner.loader_options = {"place": place}
    loader = tuner.loader(lambda batch_size: DataLoader(Indices(40), batch_size=batch_size))
    seen = []
    for index, batch in enumerate(loader):
        seen.append(batch)
        tuner.step()
        if index == 1:
            queue(tuner, batch_size=4)
            tuner.checkpoint()
        if index == 3:
            break
    assert seen == [("on device", b) for b in placed]
    assert [b for _, b in seen] == [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    records = tuner.ledger.records(tuner.ledger.drain_steps())
    assert len(records) == 4
    assert all(r.data_wait_s < 0.2 for r in records[1:]), records  # the 200 ms of placing each
    assert all(r.step_time_s >= 0.2 for r in records[1:]), records  # are the step's own
    tuner.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_frameworks_skip_first_batches_gives_the_rest_of_the_next_epoch(workers: int) -> None:
    """Accelerate's ``skip_first_batches`` builds ``DataLoader(dataset,
    batch_sampler=SkipBatchSampler(loader.batch_sampler, n), **the loader's attributes)``: from a
    tuned loader that is the next epoch after its first n batches, and the tuned loader's own
    iteration is the epoch after it."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    tuner = make_tuner(batch_size=4, num_workers=workers)
    loader = tuner.loader(
        lambda batch_size, num_workers: DataLoader(
            Indices(40), batch_size=batch_size, num_workers=num_workers
        )
    )
    try:
        assert loader.prefetch_factor == (2 if workers else None)
        assert loader.drop_last is False and len(loader) == 10
        skipped = accelerate.skip_first_batches(loader, 3)
        assert [flat(b) for b in skipped] == [list(range(i, i + 4)) for i in range(12, 40, 4)]
        assert loader.state_dict() == {"epoch": 0, "samples_in_epoch": 40}
        assert [len(b) for b in loader] == [4] * 10 and loader.epoch == 1
    finally:
        loader.close()
        tuner.close()


def test_factory_parameters_the_config_lacks_get_torchs_defaults_and_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The README's factory takes ``num_workers`` and ``pin_memory``; a config that names its
    workers ``workers`` and has no ``pin_memory`` gets torch's defaults, and one line that names
    the mapping that would take the config's own."""
    tuner = make_tuner(batch_size=4, workers=2)
    try:
        loader = tuner.loader(
            lambda batch_size, num_workers, pin_memory: DataLoader(
                Indices(8), batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory
            )
        )
        assert (loader.num_workers, loader.pin_memory) == (0, False)
        lines = [
            r.getMessage() for r in caplog.records if "torch's DataLoader defaults" in r.message
        ]
        assert lines == [
            "memtui: the loader factory takes num_workers and pin_memory, which your config "
            "holds under no name memtui knows: it gets torch's DataLoader defaults "
            "(num_workers=0, pin_memory=False); to take your config's own, name them: "
            'hooks.install(..., knobs={"num_workers": "workers"}), or give the factory\'s '
            "parameters defaults"
        ]
        assert [len(b) for b in loader] == [4, 4]
        with pytest.raises(TypeError, match=r'needs batch_size.*knobs=\{"batch_size": "bs"\}'):
            make_tuner(bs=4).loader(
                lambda batch_size: DataLoader(Indices(8), batch_size=batch_size)
            )
    finally:
        tuner.close()


@pytest.mark.parametrize("where", ["mid-epoch", "epoch start"])
def test_a_factory_that_raises_at_a_rebuild_keeps_its_loader_and_the_change_is_rolled_back(
    where: str,
) -> None:
    tuner = make_tuner(batch_size=4, num_workers=0)

    def factory(batch_size: int, num_workers: int) -> DataLoader[int]:
        if batch_size == 6:
            raise ValueError("no batch of 6 here")
        return DataLoader(Indices(40), batch_size=batch_size, num_workers=num_workers)

    loader = tuner.loader(factory)
    try:
        seen: list[int] = []
        for i, batch in enumerate(loader):
            seen += flat(batch)
            if i == 2 and where == "mid-epoch":
                queue(tuner, batch_size=6)
                assert tuner.checkpoint() is not None
        if where == "epoch start":
            queue(tuner, batch_size=6)
            assert tuner.checkpoint() is not None
            seen = [i for batch in loader for i in flat(batch)]
        assert seen == list(range(40)), "every sample once, at the batch size kept"
        assert loader.batch_size == 4 and tuner.knobs().batch_size == 4
        applied = tuner.control.applied_changes()
        assert applied[-1].rollback and "the loader factory raised ValueError" in applied[-1].note
        assert tuner.errors.count == 1 and "no batch of 6 here" in tuner.errors.last
        queue(tuner, batch_size=6)  # asked again: tried again, and rolled back again
        assert tuner.checkpoint() is not None
        assert [len(b) for b in loader] == [4] * 10 and tuner.knobs().batch_size == 4
        assert [c.rollback for c in tuner.control.applied_changes()] == [False, True] * 2
    finally:
        tuner.close()


def test_a_held_position_waits_for_the_scripts_skip_and_wins_over_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A checkpoint's place restored ``held`` (Accelerate's ``load_state``): the script's
    ``skip_first_batches`` takes it, and a count that disagrees is said; a script that skips its
    first batches itself gets the epoch from its first sample."""

    def run(skip: int | None) -> tuple[list[int], Tuner]:
        tuner = make_tuner(batch_size=4)
        loader = tuner.loader(lambda batch_size: DataLoader(Indices(40), batch_size=batch_size))
        tuner.load_state_dict(
            {"step": 3, "loaders": [{"epoch": 2, "samples_in_epoch": 12}]}, held=True
        )
        assert loader.state_dict() == {"epoch": 2, "samples_in_epoch": 12}
        if skip is not None:
            assert loader.skip_batches(skip) == (
                ""
                if skip == 3
                else "memtui: the script skips 5 batches (20 samples) of the epoch; the saved "
                "position memtui restored is sample 12 of epoch 2: the loader resumes there"
            )
        seen = [i for batch in loader for i in flat(batch)]
        assert loader.epoch == 2 and tuner.step_count == 3
        tuner.close()
        return seen, tuner

    assert run(3)[0] == list(range(12, 40))
    assert run(5)[0] == list(range(12, 40)), "memtui's place wins"
    assert "without skip_first_batches" not in caplog.text
    assert run(None)[0] == list(range(40)), "the script's own skip goes on from the first sample"
    assert "the checkpoint's place is sample 12 of epoch 2, and the script resumes" in caplog.text
