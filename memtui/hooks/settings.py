"""The hook's configuration: every option, whichever way it was given, resolved once at install.

An option is given in one of four ways; the first that gives it wins:

1. an ``install`` argument (``record=...``; ``autotune=True``, which only turns the autopilot on);
2. a field of the ``Options`` passed to ``install`` (or to ``Tuner``);
3. its ``MEMTUI_*`` environment variable (read by ``memtui.hooks.environment``);
4. the built-in default.

``Options()`` takes the defaults of its fields from the environment (rules 3 and 4), so an
``Options`` holds every field it was not given as the environment says; ``HookSettings.resolve``
lays the ``install`` arguments over it, adds the switches that are no ``Options`` field
(``MEMTUI_DISABLE``, ``MEMTUI_INSECURE_CONTROL``), and logs, once, each variable whose value it
ignored. Nothing here raises into training.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memtui.hooks.environment import HookEnvironment

log = logging.getLogger("memtui")


def _budget() -> int:
    """The autopilot's default budget (imported when asked: the policy is not light)."""
    from memtui.advice.autopilot import BUDGET

    return BUDGET


_DEFAULTS: dict[str, Any] = {
    "tcp": None,
    "insecure": False,
    "memory_limit": None,
    "stand_in_heap": True,
    "reset_peaks": False,
    "record": None,
    "rollback_steps": 50,
    "boundary_timeout_s": 1800.0,
    "autotune": False,
    "autotune_budget": _budget,
}
"""The built-in default of each option its variable may give (a function: computed when asked)."""


def _or_default(name: str, value: Any) -> Any:
    """``value`` if the environment gave it, else the option's built-in default."""
    if value is not None:
        return value
    default = _DEFAULTS[name]
    return default() if callable(default) else default


def _environment_or_default(name: str) -> Callable[[], Any]:
    """An ``Options`` field's default: its variable's value now, else its built-in default."""
    return lambda: _or_default(name, getattr(HookEnvironment.read(), name))


@dataclass
class Options:
    """Rates and switches of the hook's background work (a field not given: its environment
    variable's value, else its default)."""

    flush_period_s: float = 0.5
    """How often telemetry is sent while a viewer is subscribed or a recording is written (two
    batches a second, whatever the step rate: the viewer redraws its charts at 2 Hz; a change
    of the control state goes out at once). Each batch wakes the agent, and a wake-up costs
    ~70-120 µs of CPU while training holds the GIL: 4 Hz cost ~0.09% of a core more."""
    idle_flush_s: float = 1.0
    """How often telemetry is sent while nobody is subscribed (each send wakes a thread)."""
    device_period_s: float = 1.0
    """How often device memory is sampled while a viewer is subscribed or a recording is
    written: once a second, as while nobody watches (allocator peaks in between are kept, so a
    sample misses no peak; a CPU run's sample costs ~0.25 ms of CPU, a fifth of it glibc's
    ``mallinfo2`` with the GIL held)."""
    idle_device_period_s: float = 1.0
    """How often device memory is sampled while nobody watches: the peaks stay exact (they are
    the allocator's and the kernel's high-water marks), and each wake-up takes the GIL."""
    host_period_s: float = 1.0
    """How often host memory is sampled (psutil)."""
    reset_peaks: bool = field(default_factory=_environment_or_default("reset_peaks"))
    """Reset torch's CUDA peak counters after every device sample (``MEMTUI_RESET_PEAKS=1``):
    per-sample peaks, but the training's own ``torch.cuda.max_memory_allocated()`` then covers
    only the last sample period. Off (the default), memtui resets them only when it applies a
    change or rolls one back, and reads them untouched in between."""
    publish: bool = True
    """Start the sampler and agent threads (False: changes and timing only, nothing sent)."""
    boundary_timeout_s: float = field(default_factory=_environment_or_default("boundary_timeout_s"))
    """How long a rank waits at a checkpoint boundary for the others before changes are
    switched off (long enough for the slowest checkpoint save; ``MEMTUI_BOUNDARY_TIMEOUT``);
    capped at half the process group's own timeout, so the job's collectives never time out
    first."""
    boundary_warn_s: float = 60.0
    """How often a rank waiting at a boundary names the ranks it waits for."""
    tcp: str | None = field(default_factory=_environment_or_default("tcp"))
    """Also publish over TCP on this address (multi-node; CURVE keys from ``memtui keygen``;
    ``MEMTUI_TCP``)."""
    insecure: bool = field(default_factory=_environment_or_default("insecure"))
    """Allow plain TCP (loopback addresses only; ``MEMTUI_INSECURE=1``)."""
    memory_limit: int | None = field(default_factory=_environment_or_default("memory_limit"))
    """On CPU runs, the budget the device (the process tree) is held to; default: the cgroup's
    limit, else total RAM (``MEMTUI_MEMORY_LIMIT``). Given, the process is a device's stand-in:
    memtui fixes glibc's mmap threshold so that its peak follows its live tensors (unless
    ``stand_in_heap`` is off)."""
    stand_in_heap: bool = field(default_factory=_environment_or_default("stand_in_heap"))
    """With ``memory_limit`` on a CPU run, fix glibc's mmap threshold (``MEMTUI_STAND_IN_HEAP=0``:
    leave glibc alone, its peaks then follow its heap's history); it costs CPU, the kernel zeroing
    fresh pages for every large tensor (docs/explanation/measurement.md, "A CPU run as a
    device's stand-in")."""
    record: str | None = field(default_factory=_environment_or_default("record"))
    """Also write the published stream to this file (replay it with ``memtui replay``;
    ``MEMTUI_RECORD``)."""
    rollback_steps: int = field(default_factory=_environment_or_default("rollback_steps"))
    """An out-of-memory error inside ``tuner.guard()`` within this many steps after an applied
    change reverts that change and training goes on (0: never roll back;
    ``MEMTUI_ROLLBACK_STEPS``)."""
    autotune: bool = field(default_factory=_environment_or_default("autotune"))
    """Start with the autopilot on (``MEMTUI_AUTOTUNE=1``): it tunes the knobs by itself."""
    autotune_budget: int = field(default_factory=_environment_or_default("autotune_budget"))
    """The most checkpoint boundaries the autopilot's trials and reverts may take
    (``MEMTUI_AUTOTUNE_BUDGET``)."""


def options_from(environment: HookEnvironment) -> Options:
    """The ``Options`` that ``environment`` gives (the defaults for the rest), whatever this
    process's own environment holds."""
    return Options(**{name: _or_default(name, getattr(environment, name)) for name in _DEFAULTS})


@dataclass(frozen=True)
class HookSettings:
    """Every option of one Tuner, resolved once (``Options`` says what each field does), and
    the switches of the environment that are no ``Options`` field."""

    flush_period_s: float
    idle_flush_s: float
    device_period_s: float
    idle_device_period_s: float
    host_period_s: float
    reset_peaks: bool
    publish: bool
    boundary_timeout_s: float
    boundary_warn_s: float
    tcp: str | None
    insecure: bool
    memory_limit: int | None
    stand_in_heap: bool
    record: str | None
    rollback_steps: int
    autotune: bool
    autotune_budget: int
    disable: bool = False
    """``MEMTUI_DISABLE=1``: publish nothing (no threads, no run registered); steps still count."""
    insecure_control: bool = False
    """``MEMTUI_INSECURE_CONTROL=1``: plain TCP (with ``insecure``) also takes changes."""

    @classmethod
    def resolve(
        cls,
        options: Options | None = None,
        *,
        record: str | os.PathLike[str] | None = None,
        autotune: bool = False,
        environment: HookEnvironment | None = None,
    ) -> HookSettings:
        """The settings from the ``install`` arguments (``record``; ``autotune=True`` turns the
        autopilot on), over ``options``, over the environment, over the defaults; says each
        variable it ignored (a variable's value never raises)."""
        if environment is None:
            environment = HookEnvironment.read()
        for problem in environment.problems:
            log.warning("memtui: %s", problem)
        given = options if options is not None else options_from(environment)
        fields = {f.name: getattr(given, f.name) for f in dataclasses.fields(Options)}
        if record is not None:
            fields["record"] = os.fspath(record)
        if autotune:
            fields["autotune"] = True
        return cls(
            **fields,
            disable=bool(environment.disable),
            insecure_control=bool(environment.insecure_control),
        )

    @property
    def publishes(self) -> bool:
        """Whether the sampler and agent threads start (``publish``, and memtui not disabled)."""
        return self.publish and not self.disable
