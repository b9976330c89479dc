"""The hook's configuration: the environment read in one place, each option resolved once with
one precedence (an install argument over an ``Options`` field over its variable over the
default), and a bad value said and ignored, never raised into training."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from memtui.advice.autopilot import BUDGET
from memtui.hooks.environment import VARIABLES, HookEnvironment
from memtui.hooks.settings import HookSettings, Options, options_from
from memtui.hooks.tuner import Tuner

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's environment without any of the hook's variables."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)


def resolved(
    env: dict[str, str], options: Options | None = None, **install: object
) -> HookSettings:
    """The settings ``install(**install, options=options)`` resolves under ``env``."""
    return HookSettings.resolve(options, environment=HookEnvironment.read(env), **install)  # type: ignore[arg-type]


def test_with_nothing_given_every_option_is_its_default(clean_environment: None) -> None:
    settings = resolved({})
    assert settings == HookSettings.resolve(Options())
    assert (settings.tcp, settings.record, settings.memory_limit) == (None, None, None)
    assert (settings.rollback_steps, settings.boundary_timeout_s) == (50, 1800.0)
    assert (settings.autotune, settings.autotune_budget) == (False, BUDGET)
    assert settings.stand_in_heap and not settings.reset_peaks and not settings.insecure
    assert settings.publishes and not settings.disable and not settings.insecure_control


def test_an_install_argument_wins_over_the_options_field_which_wins_over_the_variable(
    clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"MEMTUI_RECORD": "from-env.mtrec", "MEMTUI_ROLLBACK_STEPS": "7"}
    assert resolved(env).record == "from-env.mtrec"
    assert resolved(env, Options(record="from-options.mtrec")).record == "from-options.mtrec"
    argument = resolved(env, Options(record="from-options.mtrec"), record=Path("arg.mtrec"))
    assert argument.record == "arg.mtrec"
    assert resolved(env, Options(rollback_steps=0)).rollback_steps == 0, "given, even as 0"
    # an Options built in this process takes the fields it is not given from the environment
    monkeypatch.setenv("MEMTUI_ROLLBACK_STEPS", "7")
    assert Options().rollback_steps == 7 and Options(rollback_steps=3).rollback_steps == 3


def test_autotune_as_an_argument_only_turns_the_autopilot_on(clean_environment: None) -> None:
    assert resolved({}, autotune=True).autotune
    assert resolved({"MEMTUI_AUTOTUNE": "1"}).autotune
    assert resolved({"MEMTUI_AUTOTUNE": "1"}, autotune=False).autotune, "False: not given"
    assert resolved({}, Options(autotune=True), autotune=False).autotune


@pytest.mark.parametrize(
    ("text", "on"),
    [("1", True), ("TRUE", True), (" yes ", True), ("0", False), ("False", False), ("no", False)],
)
def test_a_switch_reads_its_words_in_any_case(text: str, on: bool) -> None:
    environment = HookEnvironment.read({"MEMTUI_RESET_PEAKS": text, "MEMTUI_DISABLE": text})
    assert environment.reset_peaks is on and environment.disable is on
    assert not environment.problems
    assert resolved({"MEMTUI_DISABLE": text}).publishes is not on


def test_a_variable_set_empty_is_unset() -> None:
    env = {name: "" for name in VARIABLES}
    environment = HookEnvironment.read(env)
    assert environment == HookEnvironment() and not environment.problems
    assert resolved(env) == resolved({})


def test_every_kind_of_value_is_read(clean_environment: None) -> None:
    env = {
        "MEMTUI_TCP": "127.0.0.1",
        "MEMTUI_MEMORY_LIMIT": "720MiB",
        "MEMTUI_BOUNDARY_TIMEOUT": "90.5",
        "MEMTUI_AUTOTUNE_BUDGET": "3",
        "MEMTUI_STAND_IN_HEAP": "0",
        "MEMTUI_INSECURE": "1",
        "MEMTUI_INSECURE_CONTROL": "1",
        "MEMTUI_RUN_NAME": "nightly",
        "MEMTUI_RUN_STATE_DIR": "/ckpt",
    }
    settings = resolved(env)
    assert (settings.tcp, settings.memory_limit) == ("127.0.0.1", 720 << 20)
    assert (settings.boundary_timeout_s, settings.autotune_budget) == (90.5, 3)
    assert not settings.stand_in_heap and settings.insecure and settings.insecure_control
    environment = HookEnvironment.read(env)
    assert (environment.run_name, environment.run_state_dir) == ("nightly", "/ckpt")


BAD = {
    "MEMTUI_ROLLBACK_STEPS": "many",
    "MEMTUI_BOUNDARY_TIMEOUT": "soon",
    "MEMTUI_MEMORY_LIMIT": "1e999GiB",
    "MEMTUI_AUTOTUNE": "perhaps",
    "MEMTUI_AUTOTUNE_BUDGET": "8.5",
    "MEMTUI_DISABLE": "maybe",
}


def test_bad_values_are_said_once_each_and_the_defaults_kept(
    clean_environment: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="memtui"):
        settings = resolved(BAD)
    assert settings == resolved({})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == len(BAD)
    for name, text in BAD.items():
        assert any(line.startswith(f"memtui: {name}={text!r} is not ") for line in said), name
    assert all(line.endswith(": ignored") for line in said)


def test_bad_values_never_raise_into_the_script(
    clean_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Options()`` and a Tuner built with this process's environment hold the defaults."""
    for name, text in BAD.items():
        monkeypatch.setenv(name, text)
    monkeypatch.setenv("MEMTUI_RECORD", "x" * 10_000)  # text is taken as it is, however long
    assert Options().rollback_steps == 50 and Options().autotune_budget == BUDGET
    tuner = Tuner(SimpleNamespace(batch_size=4), options=None)
    assert tuner.settings.rollback_steps == 50 and tuner.settings.publishes
    assert tuner.oom.rollback_steps == 50


def test_the_settings_hold_every_option_and_each_variable_gives_one(
    clean_environment: None,
) -> None:
    options = {f.name for f in dataclasses.fields(Options)}
    settings = {f.name for f in dataclasses.fields(HookSettings)}
    assert settings == options | {"disable", "insecure_control"}
    environment = set(HookEnvironment._fields)
    assert {setting for setting, _ in VARIABLES.values()} == environment - {"problems"}
    assert options_from(HookEnvironment()) == Options()


def test_the_reference_table_names_the_hooks_variables_and_the_paths_ones() -> None:
    """docs/reference/environment.md's table is the hook's variables and the storage paths'."""
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    table = set(re.findall(r"^\| `(MEMTUI_[A-Z0-9_]+)` \|", page, flags=re.MULTILINE))
    paths = (ROOT / "memtui" / "storage" / "paths.py").read_text()
    assert table == set(VARIABLES) | set(re.findall(r"\bMEMTUI_[A-Z0-9_]+\b", paths))


def test_no_other_module_of_the_hook_reads_a_memtui_variable() -> None:
    """Only the environment module reads the hook's variables (the start-up module of ``memtui
    run`` reads ``MEMTUI_DISABLE`` before it may import memtui)."""
    reading = re.compile(r"(environ(\.get)?[(\[]|getenv\()\s*[\"']MEMTUI_")
    readers = {
        path.relative_to(ROOT).as_posix()
        for folder in ("hooks", "launch")
        for path in (ROOT / "memtui" / folder).rglob("*.py")
        if reading.search(path.read_text())
    }
    assert readers == {"memtui/launch/boot/sitecustomize.py"}


def test_the_tuners_parts_share_one_queue_and_its_autopilot(clean_environment: None) -> None:
    """The composition: the queue publishes the autopilot it was made with, and the autopilot
    acts on that queue; the settings reach the parts they configure."""
    options = Options(rollback_steps=5, autotune=True, autotune_budget=2, boundary_timeout_s=9.0)
    tuner = Tuner(SimpleNamespace(batch_size=4), options=options)
    assert tuner.control.pilot is tuner.autopilot
    assert tuner.control.state().autopilot == tuner.autopilot.state()
    assert tuner.autopilot.state().mode == "on" and tuner.autopilot.state().budget == 2
    assert tuner.oom.rollback_steps == 5
    assert tuner.placement._timeout_s == 9.0
    assert tuner.tuned_paths() == [tuner.state_dir / "memtui-tuned.yaml"]
