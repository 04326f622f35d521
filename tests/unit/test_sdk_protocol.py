"""The SDK's channel (:mod:`hadar_sdk.protocol`): what it encodes, and that every hostile line
is a one-line ProtocolError -- never another exception, never a message -- on either end."""

from __future__ import annotations

import math

import pytest

from hadar_sdk.protocol import MAX_LINE, TO_HARNESS, TO_TRAINER, Message, ProtocolError, decode, encode


def test_a_message_round_trips() -> None:
    line = encode("progress", steps=3, samples=24, loss=0.5)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    message = decode(line, allowed=TO_HARNESS)
    assert message == Message(op="progress", fields={"steps": 3, "samples": 24, "loss": 0.5})
    assert (message.integer("steps"), message.integer("samples"), message.number("loss")) == (3, 24, 0.5)
    assert decode(line.rstrip(b"\n"), allowed=TO_HARNESS) == message


def test_encode_refuses_what_decode_would() -> None:
    with pytest.raises(ProtocolError, match="over"):
        encode("metric", name="x" * MAX_LINE, value=1.0)
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ProtocolError, match="not encodable"):
            encode("metric", name="loss", value=bad)
    with pytest.raises(ProtocolError, match="not encodable"):
        encode("metric", name="loss", value=object())
    assert len(encode("metric", name="x" * (MAX_LINE - 100), value=1.0)) <= MAX_LINE


@pytest.mark.parametrize(("line", "reason"), [
    (b"x" * (MAX_LINE + 1), "over"),                                           # huge line
    (b'{"op":"progress","steps":1,"samples":1,"loss":NaN}', "not a JSON line"),
    (b'{"op":"progress","loss":Infinity}', "not a JSON line"),
    (b'{"op":"progress","loss":-Infinity}', "not a JSON line"),
    (b'{"op":"round","round":1}', "unexpected message 'round'"),                # the other direction's op
    (b'{"op":"shell","cmd":"id"}', "unexpected message 'shell'"),
    (b'{"op":1}', "not a message"),
    (b'{"steps":1}', "not a message"),
    (b'["op","hello"]', "not a message"),
    (b'"hello"', "not a message"),
    (b"not json at all", "not a JSON line"),
    (b'{"op":"hello"', "not a JSON line"),                                     # cut short
    (b'{"op":"hello","sdk":"\xff\xfe"}', "not a JSON line"),                   # not UTF-8
    (b"[" * 40_000 + b"]" * 20_000, "not a JSON line"),                        # deep nesting, under MAX_LINE
    (b'{"op":"hello","n":' + b"9" * 5000 + b"}", "not a JSON line"),           # an integer too long to parse
])
def test_a_hostile_line_is_a_protocol_error(line: bytes, reason: str) -> None:
    assert len(line) <= MAX_LINE or reason == "over"
    with pytest.raises(ProtocolError, match=reason) as caught:
        decode(line, allowed=TO_HARNESS)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 200


def test_the_trainer_end_accepts_only_its_orders() -> None:
    assert decode(encode("stop"), allowed=TO_TRAINER).op == "stop"
    for op in ("saved", "progress", "hello"):
        with pytest.raises(ProtocolError, match="unexpected message"):
            decode(encode(op), allowed=TO_TRAINER)


@pytest.mark.parametrize(("fields", "call", "reason"), [
    ({"steps": -1}, lambda m: m.integer("steps"), "expected an integer in"),
    ({"steps": 2**53 + 1}, lambda m: m.integer("steps"), "expected an integer in"),
    ({"steps": 10**400}, lambda m: m.integer("steps"), "expected an integer in"),
    ({"steps": 1.5}, lambda m: m.integer("steps"), "expected an integer in"),
    ({"steps": True}, lambda m: m.integer("steps"), "expected an integer in"),
    ({"steps": "3"}, lambda m: m.integer("steps"), "expected an integer in"),
    ({}, lambda m: m.integer("steps"), "got None"),
    ({"loss": 1e999}, lambda m: m.number("loss"), "expected a finite number"),   # parsed as inf
    ({"loss": [1.0]}, lambda m: m.number("loss"), "expected a finite number"),
    ({"loss": False}, lambda m: m.number("loss"), "expected a finite number"),
    ({"name": "x" * 65}, lambda m: m.text("name", max_len=64), "at most 64 characters"),
    ({"name": {"a": 1}}, lambda m: m.text("name"), "expected text"),
])
def test_a_hostile_field_is_a_protocol_error(fields: dict[str, object], call, reason: str) -> None:
    raw = b'{"op":"progress","loss":1e999}' if fields == {"loss": 1e999} else encode("progress", **fields)
    message = decode(raw, allowed=TO_HARNESS)
    with pytest.raises(ProtocolError, match=reason) as caught:
        call(message)
    assert len(str(caught.value)) < 200   # a hostile value is shown shortened


def test_optional_fields() -> None:
    message = decode(encode("progress", steps=1, samples=1, loss=None), allowed=TO_HARNESS)
    assert message.number("loss", optional=True) is None
    assert message.text("reason", optional=True) is None
