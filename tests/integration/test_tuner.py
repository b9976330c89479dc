"""The Tuner in one process: the boundary, the audit log and tuned YAML, resume, and its promises."""

from __future__ import annotations

import gc
import json
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from memtui.hooks import Options, Tuner, install
from memtui.hooks.publisher import HISTORY_STEPS
from memtui.hooks.sampler import CudaDeviceProbe
from memtui.transport.client import ControlClient
from memtui.wire import CancelRequest, KnobDiff, SetRequest
from tests.support.clock import patience
from tests.support.processes import wait_for


@dataclass
class Config:
    batch_size: int = 16
    grad_accum: int = 2
    num_workers: int = 0
    pin_memory: bool = False


def quiet(config: Any, tmp_path: Path, **kwargs: Any) -> Tuner:
    return Tuner(config, state_dir=tmp_path, options=Options(publish=False), **kwargs).start()


def queue(tuner: Tuner, keep: bool = False, **changes: Any) -> int:
    reply = tuner.control.queue(
        SetRequest(changes=changes, keep_effective_batch=keep, client="test")
    )
    assert reply.ok, reply.reason
    return reply.id


def test_changes_apply_only_at_the_boundary_and_merge(tmp_path: Path) -> None:
    config = Config()
    tuner = quiet(config, tmp_path)
    for _ in range(3):
        tuner.step()
    first = queue(tuner, batch_size=24)
    second = queue(tuner, num_workers=2, batch_size=32)
    tuner.step()
    assert config.batch_size == 16, "nothing changes between boundaries"
    applied = tuner.checkpoint()
    assert applied is not None
    assert applied.step == 4 and applied.ids == [first, second]
    assert applied.changes == {"batch_size": KnobDiff(16, 32), "num_workers": KnobDiff(0, 2)}
    assert config.batch_size == 32 and config.num_workers == 2
    assert "applied at step 4: batch_size 16 -> 32, num_workers 0 -> 2" in str(applied)
    assert tuner.checkpoint() is None, "a change applies once"


def test_a_kept_effective_batch_halves_the_accumulation_when_the_micro_batch_doubles(
    tmp_path: Path,
) -> None:
    config = Config(batch_size=16, grad_accum=4)
    tuner = quiet(config, tmp_path)
    queue(tuner, keep=True, batch_size=32)
    tuner.checkpoint()
    assert (config.batch_size, config.grad_accum) == (32, 2)


def test_a_cancelled_change_is_not_applied_and_cannot_be_cancelled_twice(tmp_path: Path) -> None:
    tuner = quiet(Config(), tmp_path)
    change = queue(tuner, batch_size=8)
    queue(tuner, grad_accum=3)
    assert tuner.control.cancel(CancelRequest(id=change)).cancelled == [change]
    assert not tuner.control.cancel(CancelRequest(id=change)).ok
    applied = tuner.checkpoint()
    assert applied is not None and applied.changes == {"grad_accum": KnobDiff(2, 3)}


def test_rejections_have_reasons(tmp_path: Path) -> None:
    tuner = quiet({"batch_size": 8}, tmp_path)
    reply = tuner.control.queue(SetRequest(changes={"grad_accum": 2}))
    assert not reply.ok and "not tunable" in reply.reason
    reply = tuner.control.queue(SetRequest(changes={"batch_size": "lots"}))
    assert not reply.ok and "must be an integer" in reply.reason
    assert [r.reason for r in tuner.control.state().rejected] == [
        "grad_accum is not tunable in this run (the config given to hooks.install holds no "
        "grad_accum under the names memtui looks for (gradient_accumulation_steps, grad_accum, "
        "accumulation_steps); to make it tunable, name yours: hooks.install(..., "
        'knobs={"grad_accum": "<its name in your config>"}))',
        "batch_size must be an integer, got 'lots'",
    ]


class Stubborn:
    """A config whose batch_size refuses a write: the change is rejected, training goes on."""

    def __init__(self) -> None:
        object.__setattr__(self, "batch_size", 8)
        object.__setattr__(self, "grad_accum", 1)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "batch_size":
            raise AttributeError("batch_size is read-only here")
        object.__setattr__(self, name, value)


def test_a_failed_write_rolls_back_and_is_rejected(tmp_path: Path) -> None:
    config = Stubborn()
    tuner = quiet(config, tmp_path)
    queue(tuner, grad_accum=4, batch_size=16)
    assert tuner.checkpoint() is None
    assert config.grad_accum == 1 and config.batch_size == 8, "rolled back"
    rejected = tuner.control.state().rejected[-1]
    assert "could not write batch_size" in rejected.reason and rejected.id == 1
    assert tuner.errors.count == 1


def test_audit_log_and_tuned_yaml(tmp_path: Path) -> None:
    config = Config()
    extra = tmp_path / "elsewhere" / "tuned.yaml"
    tuner = quiet(config, tmp_path, tuned_path=extra, name="audit")
    change = queue(tuner, batch_size=24, grad_accum=3)
    tuner.control.queue(SetRequest(changes={"nope": 1}, client="test"))
    for _ in range(5):
        tuner.step()
    tuner.checkpoint()
    events = [
        json.loads(line) for line in (tmp_path / "memtui-audit.jsonl").read_text().splitlines()
    ]
    assert [e["event"] for e in events] == ["queued", "rejected", "applying", "applied"]
    assert events[0]["id"] == change and events[0]["client"] == "test"
    for phase in events[2:]:  # the same change, before and after the tuned config's write
        assert phase["step"] == 5 and phase["changes"]["batch_size"] == [16, 24]
    for path in (tmp_path / "memtui-tuned.yaml", extra):
        body = yaml.safe_load(path.read_text())
        assert body["config"] == {
            "batch_size": 24,
            "grad_accum": 3,
            "num_workers": 0,
            "pin_memory": False,
        }
        assert body["step"] == 5 and body["run"].startswith("audit-")


def test_resume_loads_the_tuned_config_into_the_users_config(tmp_path: Path) -> None:
    first = quiet(Config(), tmp_path)
    queue(first, batch_size=24, num_workers=3)
    first.checkpoint()
    restarted = Config()
    tuner = quiet(restarted, tmp_path, resume=True)
    assert (restarted.batch_size, restarted.num_workers) == (24, 3)
    assert tuner.resumed == {"batch_size": KnobDiff(16, 24), "num_workers": KnobDiff(0, 3)}
    fresh = Config()
    quiet(fresh, tmp_path / "empty", resume=True)
    assert fresh.batch_size == 16, "no tuned file: the script's config stands"


def test_a_resumed_loader_knob_names_the_factorys_own_value(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A knob only the loader holds (no config field) has no old value when the tuned config is
    read; once ``tuner.loader(factory)`` is given, the factory's own default is named."""
    from torch.utils.data import DataLoader

    def factory(batch_size: int = 4, num_workers: int = 0) -> Any:
        return DataLoader(list(range(32)), batch_size=batch_size, num_workers=num_workers)

    first = quiet({}, tmp_path)
    first.loader(factory)
    queue(first, batch_size=6)
    first.checkpoint()
    restarted = quiet({}, tmp_path, resume=True)
    with caplog.at_level("WARNING", logger="memtui"):
        loader = restarted.loader(factory)
    assert loader.batch_size == 6
    said = [r.getMessage() for r in caplog.records if "built with the tuned" in r.getMessage()]
    assert said == [
        "memtui: the training loader is built with the tuned config: batch_size 4 -> 6 (its own "
        "values -> the tuned ones)"
    ]


def test_hot_path_never_raises(tmp_path: Path) -> None:
    tuner = quiet(Config(), tmp_path)
    tuner.ledger.open = None  # type: ignore[assignment]  # break the ledger on purpose
    tuner.step()
    tuner.boundary = None  # type: ignore[assignment]
    assert tuner.checkpoint() is None
    assert tuner.errors.count == 2 and "checkpoint" in tuner.errors.last


def test_auto_step_from_the_optimizer(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tuner = quiet(Config(), tmp_path, optimizer=optimizer, auto_step=True)
    for _ in range(3):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
    assert tuner.step_count == 3
    tuner.close()
    optimizer.step()
    assert tuner.step_count == 3, "close() removes the hook"


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_first_step_counts_the_gradients_the_loop_keeps(
    tmp_path: Path, set_to_none: bool
) -> None:
    """The first step's end counts the gradients held between steps (the memory model's steady
    part on the CPU), once: later steps are the ledger's own call, the hot path."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    tuner = quiet(Config(), tmp_path, model=model, optimizer=optimizer)
    assert tuner.control.static is not None and tuner.control.static.gradients_held_bytes is None
    for _ in range(2):
        model(torch.ones(1, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        tuner.step()
    static = tuner.control.static
    assert static is not None and static.gradients_bytes == (64 * 64 + 64) * 4
    assert static.gradients_held_bytes == (0 if set_to_none else static.gradients_bytes)
    assert tuner.step == tuner.ledger.close_step and tuner.step_count == 2
    tuner.close()


def test_a_loop_that_keeps_the_bound_step_measures_the_held_memory_once(tmp_path: Path) -> None:
    """A loop that binds ``step = tuner.step`` before its first step and calls ``step()`` ever
    after measures the memory held between steps at the first step only, not at every step."""
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tuner = quiet(Config(), tmp_path, model=model, optimizer=optimizer)
    measured: list[bool] = []
    refresh = tuner._refresh_static
    tuner._refresh_static = lambda **kw: measured.append(True) or refresh(**kw)  # type: ignore[method-assign]
    step = tuner.step
    for _ in range(5):
        step()
    assert tuner.step_count == 5 and measured == [True]
    tuner.close()


def test_timed_batches_count_a_batch_function_and_follow_a_change(tmp_path: Path) -> None:
    """A batch function over a tensor (nanoGPT's ``get_batch``, its config in ``globals()``): each
    call is a micro-batch whose wait and samples the step records, a ``batch_size`` change lands
    in the globals and the count follows, and memtui's own failures never reach training."""
    config = {"batch_size": 4, "gradient_accumulation_steps": 2}  # a module's globals()
    data = torch.arange(1000)

    def get_batch(split: str, as_dict: bool = False) -> Any:
        if split not in ("train", "val"):
            raise ValueError(f"no split {split!r}")
        time.sleep(0.002)  # a slow disk: the wait is at least this
        x = data[: config["batch_size"]].unsqueeze(1).expand(-1, 8)
        return {"input_ids": x} if as_dict else (x, x + 1)

    tuner = quiet(config, tmp_path)
    timed = tuner.timed_batches(get_batch)
    assert timed.__name__ == "get_batch" and timed.__wrapped__ is get_batch

    def train_step(fetch: Any = timed, **kwargs: Any) -> None:
        for _ in range(config["gradient_accumulation_steps"]):
            fetch("train", **kwargs)
        tuner.step()

    train_step()
    train_step(as_dict=True)
    queue(tuner, batch_size=6)
    applied = tuner.checkpoint()
    assert applied is not None and config["batch_size"] == 6
    # no loader of memtui's: the note says who reads the new value, not that a loader is rebuilt
    assert applied.note == (
        "no data loader to rebuild: the script reads batch_size from its config at its next batch"
    )
    train_step()
    train_step(tuner.timed_batches(lambda split: get_batch(split)[0].flatten()))
    train_step(tuner.timed_batches(lambda split: [get_batch(split)[0].tolist()]))  # len() of a list
    train_step(tuner.timed_batches(get_batch, samples=lambda xy: xy[0].numel() // 8 - 1))
    records = tuner.ledger.records(tuner.ledger.drain_steps())
    assert [(r.samples, r.micro_batches) for r in records] == [
        (8, 2), (8, 2), (12, 2), (6 * 8 * 2, 2), (12, 2), (10, 2)
    ]  # fmt: skip
    assert all(r.data_wait_s >= 2 * 0.002 for r in records), records
    assert all(r.step_time_s >= r.data_wait_s for r in records), records

    failing = tuner.timed_batches(get_batch, samples=lambda xy: xy[2])
    assert failing("val")[0].shape == (6, 8), "the batch is returned all the same"
    tuner.step()
    (record,) = tuner.ledger.records(tuner.ledger.drain_steps())
    assert (record.samples, record.micro_batches) == (0, 1) and record.data_wait_s >= 0.002
    assert tuner.errors.count == 1 and "counting a batch's samples" in tuner.errors.last
    with pytest.raises(ValueError, match="no split 'test'"):  # the script's own error is its own
        timed("test")


def test_memory_stays_bounded_over_1e5_steps_with_no_viewer(tmp_path: Path) -> None:
    options = Options(flush_period_s=0.01, idle_flush_s=0.01)
    tuner = Tuner(Config(), state_dir=tmp_path, options=options).start()
    try:
        assert tuner.agent is not None and tuner.agent.failed is None
        agent = tuner.agent
        for _ in range(20_000):
            tuner.step()
        wait_for(lambda: not tuner.ledger._outbox, 10, what="the agent to drain the outbox")
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i in range(80_000):
            tuner.step()
            if i % 20_000 == 0:
                tuner.checkpoint()
        wait_for(
            lambda: not tuner.ledger._outbox and len(agent.publisher._unsent) <= HISTORY_STEPS,
            10,
            what="the agent to drain all (unwatched, it keeps only the history's records)",
        )
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        growth = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert tuner.step_count == 100_000
        assert len(agent.publisher.steps) == HISTORY_STEPS
        assert growth < 1_000_000, f"grew {growth} bytes over 80,000 steps"
    finally:
        tuner.close()


def test_outbox_overflow_drops_oldest_and_counts(tmp_path: Path) -> None:
    """With the agent stalled, the outbox keeps only the newest records and the gap is counted."""
    tuner = quiet(Config(), tmp_path)
    for _ in range(20_000):
        tuner.step()
    outbox = tuner.ledger._outbox
    assert len(outbox) == outbox.maxlen
    from memtui.hooks.publisher import Publisher

    publisher = Publisher(tuner.ledger, tuner.control, lambda: None)
    publisher._last_step = 1
    publisher.drain()
    assert publisher.records_dropped == 20_000 - outbox.maxlen - 1  # type: ignore[operator]


def test_install_publishes_and_answers(tmp_path: Path) -> None:
    config = SimpleNamespace(batch_size=8, gradient_accumulation_steps=2)
    tuner = install(config, state_dir=tmp_path, name="inproc")
    try:
        client = ControlClient(
            f"ipc://{Path(tuner.agent.run_dir.path) / 'ctl'}", timeout_s=patience(5)
        )
        for _ in range(7):
            tuner.step()
        snapshot = client.hello()
        assert snapshot.info.run == tuner.run_id and snapshot.step == 7
        assert [r.step for r in snapshot.steps] == list(range(1, 8))
        assert snapshot.control.config.grad_accum == 2
        reply = client.set({"grad_accum": "4"})
        assert reply.ok and reply.id == 1
        tuner.checkpoint()
        assert config.gradient_accumulation_steps == 4
        assert client.hello().control.applied[-1].step == 7
    finally:
        tuner.close()


class FakeCuda:
    """Stands in for torch.cuda: the suite runs without a CUDA device."""

    def __init__(self) -> None:
        self.resets = 0

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(name="Fake GPU", total_memory=24 << 30, uuid="1234")

    def memory_stats(self, index: int) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": 10 << 30,
            "allocated_bytes.all.peak": 15 << 30,
            "reserved_bytes.all.current": 18 << 30,
            "reserved_bytes.all.peak": 19 << 30,
            "inactive_split_bytes.all.current": 3 << 30,
            "num_alloc_retries": 2,
            "num_ooms": 1,
        }

    def reset_peak_memory_stats(self, index: int) -> None:
        self.resets += 1

    def is_initialized(self) -> bool:
        return False


class FakeNvml:
    """Stands in for pynvml: the suite runs without NVML."""

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return ["GPU-0000", "GPU-1234"][handle]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        assert handle == 1, "matched by UUID, not by index"
        return SimpleNamespace(used=21 << 30, total=24 << 30)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return SimpleNamespace(gpu=97)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        import os

        return [
            SimpleNamespace(pid=os.getpid(), usedGpuMemory=19 << 30),
            SimpleNamespace(pid=1, usedGpuMemory=1 << 30),
        ]


def test_cuda_probe_reads_allocator_and_nvml() -> None:
    """The CUDA path with stand-ins for torch.cuda and NVML (no GPU here); run for real on one."""
    cuda = FakeCuda()
    probe = CudaDeviceProbe(cuda, 0, FakeNvml())
    sample = probe.sample(step=12)
    assert cuda.resets == 0, "the training's own peak readings are left alone by default"
    assert sample.kind == "cuda" and sample.name == "Fake GPU" and sample.step == 12
    assert sample.peak_reserved_bytes == 19 << 30 and sample.inactive_split_bytes == 3 << 30
    assert sample.nvml_used_bytes == 21 << 30 and sample.utilization_pct == 97.0
    assert sample.ooms == 1 and sample.alloc_retries == 2
    assert [p.pid for p in sample.other_processes] == [1]


def test_cuda_probe_resets_the_peaks_at_every_sample_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``MEMTUI_RESET_PEAKS=1`` (or ``Options(reset_peaks=True)``): per-sample peaks, as before;
    FakeCuda stands in for a CUDA device."""
    cuda = FakeCuda()
    probe = CudaDeviceProbe(cuda, 0, reset_peaks=True)
    probe.sample(step=1)
    probe.sample(step=2)
    assert cuda.resets == 2
    assert not Options().reset_peaks
    monkeypatch.setenv("MEMTUI_RESET_PEAKS", "1")
    assert Options().reset_peaks


def test_peaks_are_reset_only_at_an_applied_change_and_after_a_rollback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Between memtui's own changes the training's ``max_memory_allocated()`` stays its own; a
    fake torch (FakeCuda for a CUDA device) counts the resets."""
    cuda = FakeCuda()
    config = Config()
    tuner = quiet(config, tmp_path)
    tuner.device.cuda_index = 0
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    for _ in range(3):
        tuner.step()
    assert tuner.checkpoint() is None and cuda.resets == 0, "no change, no reset"
    queue(tuner, batch_size=32)
    assert tuner.checkpoint() is not None
    assert cuda.resets == 1, "the peak so far was the old micro-batch's"
    tuner.step()
    guard = tuner.guard()
    with guard:
        raise MemoryError("out of memory")
    assert guard.rolled_back and config.batch_size == 16
    monkeypatch.setattr("memtui.hooks.oom.release_caches", lambda: None)
    with guard:
        pass
    assert cuda.resets == 2, "after the rollback's caches are given back"
    with guard:
        pass
    assert cuda.resets == 2
    tuner.close()


def test_cpu_probe_reports_rss_against_the_limit(tmp_path: Path) -> None:
    tuner = Tuner(Config(), state_dir=tmp_path, options=Options(device_period_s=0.05)).start()
    try:
        sampler = tuner.sampler
        publisher = tuner.agent.publisher
        wait_for(lambda: publisher.device and publisher.host, 10, what="samples")
        sample = publisher.device[-1]
        assert sample.kind == "cpu" and sample.capacity_bytes > 0
        assert 0 < sample.allocated_bytes <= sample.peak_allocated_bytes
        assert sampler.probe is not None and sampler.probe.kind == "cpu"
    finally:
        tuner.close()


@pytest.mark.parametrize("value", ["0", "1"])
def test_memtui_disable_1_starts_no_agent_and_0_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    monkeypatch.setenv("MEMTUI_DISABLE", value)
    tuner = Tuner(Config(), state_dir=tmp_path).start()
    try:
        assert (tuner.agent is None) == (value == "1")
    finally:
        tuner.close()


def test_the_threads_wake_often_only_while_watched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each wake-up takes the GIL from training: the agent flushes and the sampler samples once a
    second unwatched; with a viewer subscribed, at their watched rates (here ten and five a
    second).

    (A poll timeout truncated to 0 ms once made the agent spin: 880 wake-ups a second.)
    """
    import zmq

    from memtui.hooks.agent import Agent
    from memtui.hooks.sampler import Sampler
    from memtui.storage import registry

    polls: list[float] = []
    samples: list[float] = []
    poller, wait = Agent._poller, Sampler._wait

    def counted_poller(self: Agent) -> Any:
        polls.append(time.monotonic())
        return poller(self)

    def counted_wait(self: Sampler, seconds: float) -> None:
        samples.append(time.monotonic())
        wait(self, seconds)

    def rates(seconds: float) -> tuple[float, float]:
        start = len(polls), len(samples)
        time.sleep(seconds)
        return (len(polls) - start[0]) / seconds, (len(samples) - start[1]) / seconds

    monkeypatch.setattr(Agent, "_poller", counted_poller)
    monkeypatch.setattr(Sampler, "_wait", counted_wait)
    options = Options(flush_period_s=0.1, device_period_s=0.2)  # idle: 1 s for both
    tuner = install(
        SimpleNamespace(batch_size=8), state_dir=tmp_path, name="wakeups", options=options
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        time.sleep(0.5)
        agent_rate, sampler_rate = rates(3.0)
        assert agent_rate <= 2.5 and sampler_rate <= 2.0, "unwatched: about once a second"
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(registry.find_run(tuner.run_id).ranks[0].pub)
        for _ in range(20):
            tuner.step()
        assert sub.poll(int(patience(1.5) * 1000)), (
            "a new viewer gets a batch at once, not at the next idle flush"
        )
        agent_rate, sampler_rate = rates(2.0)
        assert 5 <= agent_rate <= 15, "watched: ten flushes a second"
        assert 3 <= sampler_rate <= 7, "watched: five device samples a second"
        agent = tuner.agent
        assert isinstance(agent, Agent) and agent.subscribers == 1
        sub.close()
        wait_for(lambda: agent.subscribers == 0, 5, 0.05, "the unsubscribe")
        time.sleep(1.2)
        agent_rate, sampler_rate = rates(3.0)
        assert agent_rate <= 2.5 and sampler_rate <= 2.0, "unwatched again"
    finally:
        sub.close()
        tuner.close()


def test_a_queued_change_reaches_the_viewer_at_once_not_at_the_next_flush(tmp_path: Path) -> None:
    """A set request is news: the agent sends the control state right after answering it.

    The watched flush period here is 5 s, so the pending change arriving well within it can only
    be that prompt send (a run checkpointing often may apply a change before the next flush).
    """
    import zmq

    from memtui.storage import registry
    from memtui.wire import Decoder, Telemetry

    options = Options(flush_period_s=5.0, idle_flush_s=5.0)
    tuner = install(
        SimpleNamespace(batch_size=8), state_dir=tmp_path, name="prompt", options=options
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        run = registry.find_run(tuner.run_id)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(run.ranks[0].pub)
        assert sub.poll(int(patience(3) * 1000)), "a new viewer gets a batch at once"
        sub.recv()
        started = time.monotonic()
        assert ControlClient(run.control).set({"batch_size": 16}).ok
        decoder = Decoder()
        while sub.poll(int(patience(3) * 1000)):
            message = decoder.decode(sub.recv())
            if isinstance(message, Telemetry) and message.control is not None:
                break
        else:
            pytest.fail("no control state within 3 s")
        assert time.monotonic() - started < patience(1.0)
        assert [c.changes for c in message.control.pending] == [{"batch_size": 16}]
    finally:
        sub.close()
        tuner.close()


def test_closing_an_unwatched_run_does_not_wait_for_the_agent_s_next_wake_up(
    tmp_path: Path,
) -> None:
    """``close`` wakes the agent thread at once: its poll is a second long while nobody watches
    (30 s here), and the demo stops after ``q`` without waiting for it."""
    options = Options(flush_period_s=30.0, idle_flush_s=30.0)
    tuner = install(
        SimpleNamespace(batch_size=8), state_dir=tmp_path, name="quick", options=options
    )
    agent = tuner.agent
    assert agent is not None
    time.sleep(0.2)  # the agent is in its 30 s poll
    tuner.close()  # stop() joins the agent for 2 s at most, then goes on without it
    assert not agent.is_alive(), "the agent sleeps out its poll after close"
