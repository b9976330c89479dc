"""The YAML files memtui reads but does not control never block or break install.

Beyond the alias bomb (tests/integration/test_faults.py): nesting deep enough to exhaust the composer's
recursion, a number whose conversion is quadratic or overflows, a date that does not exist, and
a FIFO where the file should be; each is, in the tuned YAML at resume and in ``$MEMTUI_CONFIG``
at install, one one-line warning within a second, and the script's config stands.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from memtui.advice.verdict import THRESHOLDS
from memtui.hooks import Options, Tuner
from memtui.storage import safeyaml
from tests.support.clock import patience

BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)

HOSTILE = {
    "billion laughs": BILLION_LAUGHS + "config: {batch_size: *i}\n",
    "deep nesting": "config: {batch_size: " + "[" * 50_000 + "]" * 50_000 + "}\n",
    "deep mappings": "config: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n",
    "sexagesimal bomb": "config: {batch_size: 1" + ":1" * 400_000 + "}\n",
    "float overflow": "config: {batch_size: 1" + ":1" * 2_000 + ".5}\n",
    "no such date": "config: {batch_size: 8}\nupdated: 2020-13-45\n",
    "digits over the limit": "config: {batch_size: 1" + "0" * 5_000 + "}\n",
}


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_hostile_yaml_is_one_yaml_error_in_no_time(shape: str) -> None:
    started = time.thread_time()  # CPU time of this thread: the bound holds under load
    with pytest.raises(yaml.YAMLError) as caught:
        safeyaml.load(HOSTILE[shape])
    assert time.thread_time() - started < 1.0
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_hostile_tuned_yaml_at_resume_is_one_warning(
    shape: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "memtui-tuned.yaml").write_text(HOSTILE[shape])
    config = SimpleNamespace(batch_size=4, grad_accum=1)
    started = time.thread_time()  # CPU time of this thread: the bound holds under load
    with caplog.at_level(logging.WARNING, "memtui"):
        tuner = Tuner(
            config, state_dir=tmp_path, resume=True, options=Options(publish=False)
        ).start()
    try:
        assert time.thread_time() - started < 1.0
        said = [r.getMessage() for r in caplog.records if "resume" in r.getMessage()]
        assert len(said) == 1 and "\n" not in said[0] and len(said[0]) < 600, said
        assert config.batch_size == 4 and tuner.resumed == {}
    finally:
        tuner.close()


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_hostile_memtui_config_at_install_is_one_warning(
    shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.yaml").write_text(HOSTILE[shape].replace("config:", "verdict:", 1))
    monkeypatch.setenv("MEMTUI_CONFIG", str(tmp_path / "config.yaml"))
    started = time.thread_time()  # CPU time of this thread: the bound holds under load
    with caplog.at_level(logging.WARNING, "memtui"):
        tuner = Tuner(
            SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options(publish=False)
        ).start()
    try:
        assert time.thread_time() - started < 1.0
        said = [r.getMessage() for r in caplog.records if "config.yaml" in r.getMessage()]
        assert len(said) == 1 and "\n" not in said[0] and len(said[0]) < 600, said
        assert tuner.control.thresholds == THRESHOLDS, "the defaults stand"
    finally:
        tuner.close()


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_fifo_as_the_tuned_yaml_or_the_config_does_not_block_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fifo(tmp_path / "memtui-tuned.yaml")
    monkeypatch.setenv("MEMTUI_CONFIG", str(_fifo(tmp_path / "config.yaml")))
    done: list[Tuner] = []

    def install() -> None:
        done.append(
            Tuner(
                SimpleNamespace(batch_size=4),
                state_dir=tmp_path,
                resume=True,
                options=Options(publish=False),
            ).start()
        )

    with caplog.at_level(logging.WARNING, "memtui"):
        thread = threading.Thread(target=install, daemon=True)
        thread.start()
        thread.join(patience(2.0))
        said_quickly = bool(done)
    deadline = time.monotonic() + patience(5)
    while not done and time.monotonic() < deadline:  # unblock the reader, then fail
        for name in ("memtui-tuned.yaml", "config.yaml"):
            with contextlib.suppress(OSError):
                os.close(os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK))
        time.sleep(0.05)
    if thread.is_alive() or len(done) == 0 or not said_quickly:
        if done:
            done[0].close()
        pytest.fail("install blocked on a FIFO")
    try:
        said = " | ".join(r.getMessage() for r in caplog.records)
        assert (
            "config.yaml" in said and "memtui-tuned.yaml" in said and "not a regular file" in said
        )
    finally:
        done[0].close()
