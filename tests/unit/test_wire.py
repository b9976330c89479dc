"""The wire: round trips, and decoding that counts and drops anything malformed (property tests)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from memtui.wire import (
    WIRE_VERSION,
    AppliedChange,
    ControlState,
    Decoder,
    DeviceSample,
    Hello,
    KnobDiff,
    Knobs,
    PendingChange,
    RunInfo,
    SetReply,
    SetRequest,
    Snapshot,
    StepRecord,
    Telemetry,
    encode,
)

TAGS = ["telemetry", "hello", "snapshot", "set", "set_reply", "cancel", "cancel_reply", "error"]


def _telemetry() -> Telemetry:
    control = ControlState(
        config=Knobs(batch_size=16, grad_accum=2, num_workers=0, pin_memory=False),
        tunable=["batch_size", "grad_accum", "num_workers", "pin_memory"],
        pending=[
            PendingChange(
                id=3,
                changes={"batch_size": 24},
                requested={"batch_size": 24},
                queued_time=1.0,
                queued_step=7,
            )
        ],
        applied=[
            AppliedChange(ids=[1, 2], step=50, time=2.0, changes={"num_workers": KnobDiff(0, 4)})
        ],
    )
    return Telemetry(
        run="demo-abc123",
        rank=0,
        seq=5,
        time=3.0,
        step=51,
        steps=[StepRecord(51, 3.0, 0.1, 0.06, 32, 2, 1)],
        device=[
            DeviceSample(
                time=3.0,
                step=51,
                kind="cuda",
                capacity_bytes=24 << 30,
                peak_reserved_bytes=20 << 30,
            )
        ],
        control_seq=4,
        control=control,
    )


def test_telemetry_and_a_snapshot_decode_to_what_was_encoded() -> None:
    decoder = Decoder()
    message = _telemetry()
    assert decoder.decode(encode(message)) == message
    snapshot = Snapshot(
        info=RunInfo(run="r", pid=1, host="h", started=0.0), control=message.control
    )  # type: ignore[arg-type]
    assert decoder.decode(encode(snapshot)) == snapshot
    assert decoder.bad_frames == 0


def test_set_request_carries_strings_and_bools() -> None:
    decoder = Decoder()
    request = SetRequest(changes={"batch_size": "24", "pin_memory": True, "num_workers": 4})
    decoded = decoder.decode(encode(request))
    assert isinstance(decoded, SetRequest)
    assert decoded.changes == {"batch_size": "24", "pin_memory": True, "num_workers": 4}


def test_unknown_major_version_is_dropped() -> None:
    decoder = Decoder()
    frame = msgspec.msgpack.encode({"type": "hello", "v": WIRE_VERSION + 1})
    assert decoder.decode(frame) is None
    assert decoder.bad_frames == 1
    assert "version" in decoder.last_error


def test_unknown_fields_are_ignored() -> None:
    """A newer peer may add fields: they are ignored, not fatal."""
    frame = msgspec.msgpack.encode({"type": "hello", "client": "x", "future_field": [1, 2]})
    assert Decoder().decode(frame) == Hello(client="x")


def test_run_info_allocator_settings_are_optional_both_ways() -> None:
    """``alloc_conf`` came later: an older hook's RunInfo decodes to None, a newer one's keeps it,
    and an older viewer ignores it (unknown fields are ignored)."""
    old = msgspec.msgpack.encode({"run": "r", "pid": 1, "host": "h", "started": 0.0})
    assert msgspec.msgpack.decode(old, type=RunInfo).alloc_conf is None
    new = msgspec.msgpack.encode(RunInfo(run="r", pid=1, host="h", started=0.0, alloc_conf=""))
    assert b"alloc_conf" in new, "an empty setting is sent: it says none are set"
    for conf in ("", "expandable_segments:True"):
        info = RunInfo(run="r", pid=1, host="h", started=0.0, alloc_conf=conf)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=RunInfo) == info


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_raise(frame: bytes) -> None:
    decoder = Decoder()
    result = decoder.decode(frame)
    assert result is None or result.v == WIRE_VERSION
    assert decoder.bad_frames in (0, 1)


_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
_values = st.recursive(
    _json_leaf,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from(
    [
        "run",
        "rank",
        "seq",
        "time",
        "step",
        "steps",
        "device",
        "changes",
        "ok",
        "id",
        "info",
        "control",
        "v",
        "history",
        "reason",
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    tag=st.sampled_from([*TAGS, "bogus"]), fields=st.dictionaries(_field_names, _values, max_size=6)
)
def test_valid_msgpack_wrong_messages_are_counted(tag: str, fields: dict[str, object]) -> None:
    """Well-formed msgpack that is not a valid message decodes to None (counted), never raises."""
    frame = msgspec.msgpack.encode({"type": tag, **fields})
    decoder = Decoder()
    result = decoder.decode(frame)
    if result is None:
        assert decoder.bad_frames == 1
    else:
        assert result.v == WIRE_VERSION


def test_reply_types_are_distinct() -> None:
    decoder = Decoder()
    assert isinstance(decoder.decode(encode(SetReply(ok=False, reason="nope"))), SetReply)
