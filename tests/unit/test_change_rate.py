"""Queueing and cancelling changes cannot flood the audit log, however many connections ask."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from memtui.hooks import Options, Tuner, server
from memtui.hooks.persist import AUDIT_FILE, read_audit
from memtui.hooks.server import CHANGES_BURST, CHANGES_PER_S
from memtui.transport.client import ClientError, ControlClient


@pytest.fixture
def tuner(tmp_path: Path) -> Iterator[Tuner]:
    """A real hook (real sockets, a real audit log) in this process."""
    hook = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options()).start()
    yield hook
    hook.close()


def change(endpoint: str, index: int) -> str:
    """A set (even ``index``) or a cancel of everything pending (odd), each on a connection of
    its own, as ``memtui set`` and ``memtui cancel`` send them: "ok", or why it was refused."""
    client = ControlClient(endpoint, timeout_s=10, client=f"flood{index}")
    try:
        reply = client.set({"batch_size": 8}) if index % 2 == 0 else client.cancel()
    except ClientError as exc:
        return str(exc)
    return "ok" if reply.ok else reply.reason


def test_sets_and_cancels_from_fresh_connections_are_rated_over_all_of_them(
    tuner: Tuner, tmp_path: Path
) -> None:
    """200 sets and cancels, each on a new connection (the per-connection rate never meets
    them): a burst is taken and audited, one line each, the rest are refused as rate limited
    and counted, and write nothing; dry runs and rejected requests spend nothing."""
    endpoint = tuner.ranks[0].control
    started = time.monotonic()
    answers = [change(endpoint, i) for i in range(200)]
    elapsed = time.monotonic() - started
    taken = [i for i, answer in enumerate(answers) if answer == "ok"]
    refused = [answer for answer in answers if answer != "ok"]
    assert CHANGES_BURST <= len(taken) <= CHANGES_BURST + elapsed * CHANGES_PER_S + 1, elapsed
    assert refused and all("rate limited: changes were queued or cancelled" in a for a in refused)
    assert tuner.agent is not None
    assert tuner.agent.current_counters().requests_rate_limited >= len(refused)

    audit = read_audit(tmp_path / AUDIT_FILE)
    written = [e for e in audit if e["event"] in ("queued", "cancelled")]
    assert len(written) == len(taken), "each change taken audited exactly, nothing else"
    operator = ControlClient(endpoint, timeout_s=10, client="operator")
    assert operator.set({"batch_size": 8}, dry_run=True).ok, "a dry run is not rate limited"


def test_dry_runs_and_rejected_requests_spend_nothing(tuner: Tuner) -> None:
    """Dry runs and requests the queue rejects (their audit lines are rated on their own) leave
    the whole burst of changes to the operator."""
    client = ControlClient(tuner.ranks[0].control, timeout_s=10, client="operator")
    for _ in range(int(CHANGES_BURST)):
        assert client.set({"batch_size": 8}, dry_run=True).ok
        rejected = client.set({"nope": 1})
        assert not rejected.ok and "rate limited" not in rejected.reason, rejected.reason
    answers = [change(tuner.ranks[0].control, i) for i in range(int(CHANGES_BURST))]
    assert set(answers) == {"ok"}, answers


def test_the_next_change_taken_follows_a_line_saying_how_many_were_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the rate has refilled, the request taken is preceded by one audit line that counts
    those refused since the last one (``rate_limited``), not by a line for each."""
    monkeypatch.setattr(server, "CHANGES_PER_S", 1.0)
    monkeypatch.setattr(server, "CHANGES_BURST", 2.0)
    hook = Tuner(SimpleNamespace(batch_size=4), state_dir=tmp_path, options=Options()).start()
    try:
        endpoint = hook.ranks[0].control
        answers = [change(endpoint, i) for i in range(8)]
        refused = sum(answer != "ok" for answer in answers)
        assert refused >= 1, answers
        time.sleep(1.2)
        assert change(endpoint, 0) == "ok"
        audit = read_audit(tmp_path / AUDIT_FILE)
        limited = [e for e in audit if e["event"] == "rate_limited"]
        assert len(limited) == 1 and limited[0]["refused"] == refused, limited
        assert limited[0]["requests"] == "set/cancel" and limited[0]["next_client"] == "flood0"
        assert audit[-1]["event"] == "queued" and audit[-2] == limited[0]
    finally:
        hook.close()
