"""Turning the autopilot on and off cannot flood the audit log, however many connections ask."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from memtui.hooks import Options, Tuner, server
from memtui.hooks.persist import AUDIT_FILE, read_audit
from memtui.hooks.server import TOGGLES_BURST, TOGGLES_PER_S
from memtui.transport.client import ClientError, ControlClient
from tests.support.clock import patience


@pytest.fixture
def tuner(tmp_path: Path) -> Iterator[Tuner]:
    """A real hook (real sockets, a real audit log) in this process, its autopilot off."""
    hook = Tuner(
        SimpleNamespace(batch_size=4, num_workers=0), state_dir=tmp_path, options=Options()
    ).start()
    yield hook
    hook.close()


def toggle(endpoint: str, on: bool, client: str) -> str:
    """``memtui autotune on|off`` on a connection of its own: "ok", or why it was refused."""
    try:
        reply = ControlClient(endpoint, timeout_s=patience(10), client=client).autotune(on)
    except ClientError as exc:
        return str(exc)
    return "ok" if reply.ok else reply.reason


def test_toggles_from_fresh_connections_are_rated_over_all_of_them(
    tuner: Tuner, tmp_path: Path
) -> None:
    """200 toggles, each on a new connection (the per-connection rate never meets them): a
    burst is taken and audited, the rest are refused as rate limited and counted, while a change
    queued and cancelled in the middle of the flood is audited exactly."""
    endpoint = tuner.ranks[0].control
    started = time.monotonic()
    answers = [toggle(endpoint, i % 2 == 0, f"flood{i}") for i in range(100)]
    operator = ControlClient(endpoint, timeout_s=patience(10), client="operator")
    queued = operator.set({"batch_size": 8})
    assert queued.ok, queued.reason
    assert operator.cancel(queued.id).ok
    answers += [toggle(endpoint, i % 2 == 0, f"flood{i}") for i in range(100, 200)]
    elapsed = time.monotonic() - started

    taken = [i for i, answer in enumerate(answers) if answer == "ok"]
    refused = [answer for answer in answers if answer != "ok"]
    assert TOGGLES_BURST <= len(taken) <= TOGGLES_BURST + elapsed * TOGGLES_PER_S + 1, elapsed
    assert refused and all("rate limited: the autopilot was turned on" in a for a in refused)
    assert tuner.agent is not None
    assert tuner.agent.current_counters().requests_rate_limited >= len(refused)

    audit = read_audit(tmp_path / AUDIT_FILE)
    toggled = [e for e in audit if e["event"] == "autotune" and "on" in e]
    assert [(e["client"], e["on"]) for e in toggled] == [(f"flood{i}", i % 2 == 0) for i in taken]
    last = taken[-1]  # what the autopilot is now: the last toggle taken, then the operator's set
    expected = "off" if last % 2 else "paused" if last < 100 else "on"
    assert tuner.autopilot.state().mode == expected, (last, tuner.autopilot.state())
    assert [e["id"] for e in audit if e["event"] == "queued"] == [queued.id]
    assert [e["ids"] for e in audit if e["event"] == "cancelled"] == [[queued.id]]
    assert len(audit) <= len(taken) + 3, "the toggles refused wrote nothing"


def test_the_next_toggle_taken_says_how_many_were_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the rate has refilled, the toggle taken is audited with the count of those refused
    since the previous one (``rate_limited_before``)."""
    monkeypatch.setattr(server, "TOGGLES_PER_S", 1.0)
    monkeypatch.setattr(server, "TOGGLES_BURST", 2.0)
    hook = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options()).start()
    try:
        endpoint = hook.ranks[0].control
        answers = [toggle(endpoint, i % 2 == 0, f"quick{i}") for i in range(8)]
        refused = sum(answer != "ok" for answer in answers)
        assert refused >= 1, answers
        time.sleep(1.2)
        assert toggle(endpoint, False, "later") == "ok"
        last = read_audit(tmp_path / AUDIT_FILE)[-1]
        assert last["event"] == "autotune" and last["client"] == "later" and not last["on"]
        assert last["rate_limited_before"] == refused
        assert hook.autopilot.state().mode == "off"
    finally:
        hook.close()
