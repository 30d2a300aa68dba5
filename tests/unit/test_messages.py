"""Unit tests of shared/transport/messages.py: every control message round-trips, every malformed frame is a
MessageError.

Frames here are bytes built by hand with msgpack, so each kind of damage is exact; tests/system sends the
same messages through real ZeroMQ sockets.
"""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import numpy as np
import pytest
import torch

from specring.shared.errors import MessageError
from specring.shared.transport import messages

REQUIRED_KINDS = ("Hello", "Lease", "SlotReady", "SlotReleased", "Trained", "Heartbeat", "Shutdown", "Error")

# A value of each field type that is not the default, so a dropped field cannot go unnoticed.
_SAMPLE = {int: -123456789012, float: 0.1 + 0.2, str: "naïve ✓ text", bool: True,
           list: [1, -2, "three", 4.5, [6, 7], {"k": "v"}], dict: {"a": 1, "b": [2.5, "c"], "d": {"e": False}},
           bytes: b"\x00\xffraw"}


def example(cls) -> object:
    """An instance of message class ``cls`` with every field set to a non-default sample value."""
    hints = typing.get_type_hints(cls)
    items = getattr(cls, "ITEM_TYPES", {})  # lists whose items are typed (ids) get a list of such items
    return cls(**{f.name: [7, -8, 9] if items.get(f.name) is int else _SAMPLE[hints[f.name]]
                  for f in dataclasses.fields(cls)})


def frame(kind="shutdown", v=messages.SCHEMA_VERSION, **fields) -> bytes:
    """A hand-built msgpack frame (``kind``/``v`` omitted when passed as ``...``)."""
    body = {}
    if kind is not ...:
        body["kind"] = kind
    if v is not ...:
        body["v"] = v
    body.update(fields)
    return msgpack.packb(body, use_bin_type=True)


ALL_TYPES = sorted(messages.MESSAGE_TYPES.values(), key=lambda c: c.KIND)


def test_required_kinds_exist_with_distinct_tags():
    for name in REQUIRED_KINDS:
        cls = getattr(messages, name)
        assert messages.MESSAGE_TYPES[cls.KIND] is cls, name
    assert len({c.KIND for c in ALL_TYPES}) == len(ALL_TYPES)


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.KIND)
def test_every_kind_round_trips(cls):
    msg = example(cls)
    data = messages.encode(msg)
    assert isinstance(data, bytes)
    back = messages.decode(data)
    assert type(back) is cls
    assert back == msg
    raw = msgpack.unpackb(data, raw=False)
    assert raw["kind"] == cls.KIND and raw["v"] == messages.SCHEMA_VERSION


@pytest.mark.parametrize("cls", [c for c in ALL_TYPES if any(
    f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    for f in dataclasses.fields(c))], ids=lambda c: c.KIND)
def test_optional_fields_may_be_left_out_of_the_frame(cls):
    msg = example(cls)
    body = {"kind": cls.KIND, "v": messages.SCHEMA_VERSION}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            body[f.name] = getattr(msg, f.name)
    back = messages.decode(msgpack.packb(body))
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            assert getattr(back, f.name) == f.default
        elif f.default_factory is not dataclasses.MISSING:
            assert getattr(back, f.name) == f.default_factory()


def test_numpy_and_torch_scalars_are_encoded_as_python_numbers():
    msg = messages.Trained(consumer=np.int32(1), step=torch.tensor(7), batch_ids=np.array([3, 4], dtype=np.int64),
                           loss=np.float32(0.25), num_tokens=torch.tensor(11, dtype=torch.int64),
                           skipped=np.bool_(False))
    data = messages.encode(msg)
    raw = msgpack.unpackb(data, raw=False)
    assert type(raw["consumer"]) is int and raw["consumer"] == 1
    assert type(raw["step"]) is int and raw["step"] == 7
    assert raw["batch_ids"] == [3, 4] and all(type(x) is int for x in raw["batch_ids"])
    assert type(raw["loss"]) is float and raw["loss"] == 0.25
    assert type(raw["num_tokens"]) is int and raw["num_tokens"] == 11
    assert type(raw["skipped"]) is bool and raw["skipped"] is False
    back = messages.decode(data)
    assert back == messages.Trained(consumer=1, step=7, batch_ids=[3, 4], loss=0.25, num_tokens=11)

    hb = messages.Heartbeat(role="producer", index=0, generation=2, pid=99,
                            stats={"rss_mb": np.float64(1.5), "step": np.uint64(3), "t": torch.tensor(2.0)})
    stats = messages.decode(messages.encode(hb)).stats
    assert stats == {"rss_mb": 1.5, "step": 3, "t": 2.0}
    assert type(stats["step"]) is int and type(stats["t"]) is float


def _assert_message_error(data: bytes, *needles: str) -> None:
    with pytest.raises(MessageError) as ei:
        messages.decode(data)
    text = str(ei.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text!r}"


GOOD = frame(reason="bye")


@pytest.mark.parametrize("data, needles", [
    (b"\xc1", ("undecodable",)),                          # a byte msgpack never uses
    (b"\x85\xa4kind", ("undecodable",)),                  # truncated map
    (bytes(range(256)), ("undecodable",)),                 # random garbage
    (GOOD + b"\x00", ("undecodable",)),                   # trailing bytes after a valid frame
    (b"", ("undecodable",)),
], ids=["reserved-byte", "truncated", "garbage", "trailing", "empty"])
def test_garbage_bytes(data, needles):
    _assert_message_error(data, *needles)


def test_good_frame_decodes():
    # The reference every malformed frame below is a one-change variant of.
    assert messages.decode(GOOD) == messages.Shutdown(reason="bye")


@pytest.mark.parametrize("data, needles", [
    (msgpack.packb([1, 2, 3]), ("list", "not a message map")),
    (msgpack.packb("shutdown"), ("str", "not a message map")),
    (msgpack.packb({1: "x"}), ("undecodable",)),  # non-string map keys are refused by the decoder
], ids=["list", "string", "int-keys"])
def test_frame_that_is_not_a_map(data, needles):
    _assert_message_error(data, *needles)


def test_unknown_or_missing_kind():
    _assert_message_error(frame(kind="launch_missiles", reason="x"), "unknown message kind 'launch_missiles'")
    _assert_message_error(frame(kind=7, reason="x"), "unknown message kind 7")
    _assert_message_error(frame(kind=..., reason="x"), "no 'kind'")


@pytest.mark.parametrize("v", [2, 0, "1", None, 1.5, True, 1.0])
def test_wrong_schema_version(v):
    _assert_message_error(frame(v=v, reason="x"), "shutdown", "schema version", repr(v))


def test_missing_schema_version():
    _assert_message_error(frame(v=..., reason="x"), "shutdown", "schema version None")


def test_missing_field_is_named():
    _assert_message_error(frame(kind="slot_released", producer=0, generation=1, slot=2),
                          "slot_released", "missing field 'batch_id'")


def test_unknown_field_is_named():
    _assert_message_error(frame(reason="x", colour="blue"), "shutdown", "unknown field", "colour")


@pytest.mark.parametrize("field, value, expected, got", [
    ("slot", "2", "int", "str"),
    ("slot", 2.0, "int", "float"),
    ("slot", True, "int", "bool"),
    ("slot", None, "int", "NoneType"),
    ("descriptor", {"a": 1}, "list", "dict"),
    ("checksum", [1], "int", "list"),
])
def test_wrong_field_type_is_named(field, value, expected, got):
    fields = dict(producer=0, generation=1, slot=2, batch_id=3, seq=4, descriptor=[], payload_bytes=0,
                  num_tokens=0, checksum=0)
    fields[field] = value
    _assert_message_error(frame(kind="slot_ready", **fields), "slot_ready", repr(field), expected, got)


def test_float_field_accepts_an_integer_but_bool_field_does_not():
    ok = frame(kind="trained", consumer=0, step=1, batch_ids=[], loss=2, num_tokens=0)
    assert messages.decode(ok).loss == 2
    _assert_message_error(frame(kind="error", role="p", index=0, generation=0, message="m", fatal=1),
                          "error", "'fatal'", "bool", "int")


def test_oversized_frames_are_refused_both_ways():
    big = b"\x00" * (messages.MAX_MESSAGE_BYTES + 1)
    _assert_message_error(big, str(messages.MAX_MESSAGE_BYTES + 1), str(messages.MAX_MESSAGE_BYTES))
    lease = messages.Lease(batch_id=0, slot=0, generation=0, epoch=0,
                           sample_ids=list(range(messages.MAX_MESSAGE_BYTES // 4)), pad_to=0)
    with pytest.raises(MessageError, match="lease message of .* exceeds the cap"):
        messages.encode(lease)


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(MessageError, match="not a control message"):
        messages.encode({"kind": "shutdown", "reason": "x"})

    @dataclasses.dataclass(frozen=True)
    class Shutdown:  # same name and tag, but not the registered class
        KIND: typing.ClassVar[str] = "shutdown"
        reason: str

    with pytest.raises(MessageError, match="not a control message"):
        messages.encode(Shutdown(reason="x"))
    with pytest.raises(MessageError, match="cannot encode heartbeat"):
        messages.encode(messages.Heartbeat(role="r", index=0, generation=0, pid=1, stats={"x": object()}))


def test_message_error_is_a_value_error():
    # Receivers may catch ValueError generically; MessageError must stay one.
    assert issubclass(MessageError, ValueError)


@pytest.mark.parametrize("kind, field, bad", [("trained", "batch_ids", [[1]]), ("trained", "batch_ids", [{}]),
                                              ("trained", "batch_ids", [True]), ("lease", "sample_ids", ["3"])])
def test_list_items_of_the_wrong_type_are_rejected(kind, field, bad):
    import msgpack

    from specring.shared.errors import MessageError
    from specring.shared.transport.messages import decode
    body = {"trained": {"consumer": 0, "step": 1, "batch_ids": [1], "loss": 1.0, "num_tokens": 1},
            "lease": {"batch_id": 1, "slot": 0, "generation": 1, "epoch": 0, "sample_ids": [1], "pad_to": 4}}[kind]
    body = dict(body, **{field: bad}, kind=kind, v=1)
    with pytest.raises(MessageError, match=field):
        decode(msgpack.packb(body))
