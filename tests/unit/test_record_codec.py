"""The compiled record codec (shared/wire/record_codec.py) against the rules it compiles.

The oracle below is the codec as it was before compilation (issue 14): it walks each
record's annotations per value. The compiled codec must agree with it exactly -- the
same event, or an InvalidEvent with the same reason -- for hostile records and
arguments, and must write the same bytes.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import random
import sys
import types
import typing
import uuid
from typing import Any, Literal

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_events import (
    HOSTILE,
    ROUND_TRIP,
    any_event,
    envelope_shaped,
    msgpack_values,
    mutated_valid,
)

from shared.wire import records
from shared.wire.events import (
    EVENT_TYPES,
    Assignment,
    CopyWeight,
    DeadLetter,
    Event,
    GpuInfo,
    Hyperparameters,
    InvalidEvent,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeRegistered,
    Progress,
    Record,
    RoundStarted,
    ThroughputEstimate,
    Waiting,
    decode,
    encode,
)
from shared.wire.record_codec import converter
from shared.wire.record_compile import NAMES, fast_test, wire_test
from shared.wire.records import check_job_id, new_event_id, short_repr

# ---------------------------------------------------------------- the oracle

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


def ref_convert(hint: Any, value: Any, path: str) -> Any:
    if hint is str:
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidEvent(f"{path}: not valid UTF-8 text") from None
            return value
        raise InvalidEvent(f"{path}: expected str, got {type(value).__name__}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT_MIN <= value <= _INT_MAX:
                raise InvalidEvent(f"{path}: integer out of the 64-bit range")
            return value
        raise InvalidEvent(f"{path}: expected int, got {type(value).__name__}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise InvalidEvent(f"{path}: must be a finite number, got {value!r}")
            return float(value)
        raise InvalidEvent(f"{path}: expected float, got {type(value).__name__}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
    elif origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise InvalidEvent(f"{path}: must be one of {list(args)}, got {short_repr(value)}")
    elif origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        return ref_convert(next(a for a in args if a is not type(None)), value, path)
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(ref_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    elif origin is dict:
        if isinstance(value, dict):
            return {ref_convert(str, k, f"{path} key"): ref_convert(args[1], v, f"{path}[{k!r}]")
                    for k, v in value.items()}
    elif isinstance(hint, type) and issubclass(hint, Record):
        if isinstance(value, hint):
            return value
        if isinstance(value, dict):
            return ref_from_wire(hint, value, path)
    name = getattr(hint, "__name__", None) or str(hint)
    raise InvalidEvent(f"{path}: expected {name}, got {type(value).__name__}")


def ref_build(cls: type[Record], kwargs: dict[str, Any]) -> Record:
    """``cls(**kwargs)`` as it was: defaults, every field converted in order, then the checks."""
    hints = typing.get_type_hints(cls)
    record = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        object.__setattr__(record, f.name, ref_convert(hints[f.name], value, f"{cls.__name__}.{f.name}"))
    record._check()
    if isinstance(record, Event):
        record._check_envelope()
    return record


def ref_from_wire(cls: type[Record], data: dict[Any, Any], path: str) -> Record:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise InvalidEvent(f"{path}: unknown field {short_repr(unknown[0])}")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise InvalidEvent(f"{path}: missing field {missing[0]!r}")
    try:
        return ref_build(cls, data)
    except InvalidEvent:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"{path}: {exc}") from None


def ref_unpack(data: bytes) -> object:
    budget = 16 * len(data) + 64 * 1024

    def charge(container: Any) -> Any:
        nonlocal budget
        budget -= sys.getsizeof(container) + 40 * len(container)
        if budget < 0:
            raise OverflowError("too costly")
        return container

    most = max(1 << 16, len(data) // 8)
    return msgpack.unpackb(data, raw=False, strict_map_key=True, object_hook=charge, list_hook=charge,
                           max_array_len=most, max_map_len=most, max_ext_len=0)


def ref_decode(data: bytes) -> Event:
    envelope = ("type", "v", "id", "ts", "source", "body")
    try:
        msg = ref_unpack(data)
    except OverflowError:
        raise InvalidEvent("record too costly to decode: its objects exceed the limit of "
                           f"16x its {len(data)} bytes") from None
    except Exception as exc:
        raise InvalidEvent(f"not msgpack: {type(exc).__name__}: {exc}"[:200]) from None
    if not isinstance(msg, dict):
        raise InvalidEvent(f"envelope: expected a map, got {type(msg).__name__}")
    missing = [k for k in envelope if k not in msg]
    if missing:
        raise InvalidEvent(f"envelope: missing key {missing[0]!r}")
    extra = [k for k in msg if k not in envelope]
    if extra:
        raise InvalidEvent(f"envelope: unknown key {extra[0]!r}")
    etype = msg["type"]
    cls = EVENT_TYPES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        raise InvalidEvent(f"envelope: unknown event type {short_repr(etype)}")
    if msg["v"] != cls.VERSION or isinstance(msg["v"], bool):
        raise InvalidEvent(f"{etype}: unsupported schema version {short_repr(msg['v'])}")
    body = msg["body"]
    if not isinstance(body, dict):
        raise InvalidEvent(f"{etype}: body must be a map")
    for key in ("id", "ts", "source"):
        if key in body:
            raise InvalidEvent(f"{etype}: body must not contain envelope key {key!r}")
    event = ref_from_wire(cls, dict(body, id=msg["id"], ts=msg["ts"], source=msg["source"]), etype)
    assert isinstance(event, Event)
    return event


def ref_to_wire(value: Any) -> Any:
    if isinstance(value, Record):
        return {f.name: ref_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [ref_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: ref_to_wire(v) for k, v in value.items()}
    return value


def ref_encode(event: Event) -> bytes:
    body = {f.name: ref_to_wire(getattr(event, f.name)) for f in dataclasses.fields(event)
            if f.name not in ("id", "ts", "source")}
    return msgpack.packb({"type": event.TYPE, "v": event.VERSION, "id": event.id, "ts": event.ts,
                          "source": event.source, "body": body}, use_bin_type=True)


def outcome(call: Any, *args: Any) -> tuple[str, Any]:
    """("ok", result) or ("invalid", reason); any other exception fails the test."""
    try:
        return "ok", call(*args)
    except InvalidEvent as exc:
        return "invalid", exc.reason


def assert_same_decode(data: bytes) -> None:
    got, want = outcome(decode, data), outcome(ref_decode, data)
    assert got == want
    if got[0] == "ok":
        assert type(got[1]) is type(want[1])


# ---------------------------------------------------------------- a corpus of valid events

SPEC = JobSpec(job_id="resnet-17", user="alice", model="resnet18", dataset="cifar10", batch_size=128,
               workers=4, iterations=50_000, priority=2.0, deadline_s=3600.0,
               hyper=Hyperparameters(optimizer="adam", lr=0.01, seed=3))
CORPUS: list[Event] = [
    Progress(ts=1.5, source="agent/n1", job_id="resnet-17", round=4, copy=1, node_id="n1", gpu_type="v100",
             workers=2, steps_round=30, steps_total=900, samples_per_s=120.5, loss=0.7),
    Assignment(ts=2.0, source="scheduler", round=4, job=SPEC, copy=1, node_id="n1", gpus=(0, 1), gpu_type="v100",
               world_size=4, ranks=(2, 3), step_budget=300, deadline=9.0, start_from="m/3", rendezvous="h:1"),
    RoundStarted(ts=3.0, source="scheduler", round=4, policy="hadare", started_at=3.0, ends_at=9.0,
                 nodes=("n1", "n2"), waiting=(Waiting(job_id="j2", code="no_gpu"),),
                 inputs={"hadar.progress:0": 12}, policy_options='{"a":1}', seed=2, round_s=6.0),
    JobSubmitted(ts=0.5, source="cli", job=SPEC, submitted_at=0.5),
    NodeRegistered(ts=0.1, source="agent/n1", node_id="n1", gpus=(GpuInfo(index=0, type="V100", memory_gb=16.0),)),
    ThroughputEstimate(ts=1.0, source="profiler", job_id="resnet-17", basis="measured", workers=2,
                       rates={"v100": 3.5, "k80": 1}),
    ModelConsolidated(ts=8.0, source="tracker", job_id="resnet-17", round=4, key="m/4", total_steps=930,
                      copies=(CopyWeight(copy=0, steps=30, weight=0.5),), missing=(1,)),
    DeadLetter(ts=1.0, source="bus", topic="t", partition=0, offset=3, reason="bad", raw=b"\x00\xff"),
]

HOSTILE_VALUES: list[Any] = [
    None, True, False, 0, -1, 7, 2**63, 2**64 - 1, -(2**63), 1.5, -0.0, float("nan"), float("inf"), "", "x",
    "é", "A/../x", "y" * 70, b"", b"b", [], [1, 2], ["a"], [{}], [{"copy": 1}], {}, {"a": 1}, {"k": "v"},
    {b"k": 1}, {"job_id": "j"}, "sgd", "measured", "ok",
]


def _containers(value: Any) -> list[Any]:
    out = []
    if isinstance(value, dict):
        out.append(value)
        for v in value.values():
            out += _containers(v)
    elif isinstance(value, list):
        out.append(value)
        for v in value:
            out += _containers(v)
    return out


def mutate(rng: random.Random, wire: dict[str, Any]) -> None:
    """One random edit anywhere in a decoded wire map, in place."""
    target = rng.choice(_containers(wire))
    value = copy.deepcopy(rng.choice(HOSTILE_VALUES))
    if isinstance(target, list):
        if target and rng.random() < 0.7:
            target[rng.randrange(len(target))] = value
        else:
            target.append(value)
        return
    keys = list(target)
    action = rng.random()
    if keys and action < 0.6:
        target[rng.choice(keys)] = value
    elif keys and action < 0.75:
        del target[rng.choice(keys)]
    elif action < 0.9:
        target[rng.choice(["extra", "z" * 80, b"job_id", "id", "ts", "source", "body", "v", "hyper"])] = value
    else:
        wire["type"] = rng.choice([*EVENT_TYPES, "Nope", 3])


MUTATIONS = 20_000


def test_decode_agrees_with_the_oracle_on_random_mutations_of_valid_records() -> None:
    rng = random.Random(14)
    originals = [msgpack.unpackb(encode(e), raw=False) for e in CORPUS]
    refused = 0
    for i in range(MUTATIONS):
        wire = msgpack.unpackb(msgpack.packb(originals[i % len(originals)], use_bin_type=True), raw=False)
        for _ in range(rng.choice([1, 1, 2, 3])):
            mutate(rng, wire)
        data = msgpack.packb(wire, use_bin_type=True)
        got, want = outcome(decode, data), outcome(ref_decode, data)
        assert got == want, (i, wire)
        refused += got[0] == "invalid"
    assert MUTATIONS // 2 < refused < MUTATIONS  # the mutations mostly, not always, break records


@HOSTILE
@given(mutated_valid())
def test_decode_agrees_with_the_oracle_on_mutated_events(data: bytes) -> None:
    assert_same_decode(data)


@HOSTILE
@given(envelope_shaped())
def test_decode_agrees_with_the_oracle_on_envelope_shaped_maps(envelope: dict[Any, Any]) -> None:
    assert_same_decode(msgpack.packb(envelope, use_bin_type=True))


@HOSTILE
@given(msgpack_values)
def test_decode_agrees_with_the_oracle_on_any_msgpack(value: Any) -> None:
    assert_same_decode(msgpack.packb(value, use_bin_type=True))


@ROUND_TRIP
@given(any_event)
def test_encode_writes_the_same_bytes_as_before(event: Event) -> None:
    assert encode(event) == ref_encode(event)


@pytest.mark.parametrize("event", CORPUS, ids=[type(e).__name__ for e in CORPUS])
def test_corpus_round_trips_byte_for_byte(event: Event) -> None:
    assert encode(event) == ref_encode(event)
    assert decode(encode(event)) == event


# ---------------------------------------------------------------- construction


class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    pass


ARGUMENT_VALUES: list[Any] = [*HOSTILE_VALUES, Colour.RED, Name("n1"), Name("é"), "\ud800", bytearray(b"ab"),
                              (1, 2), ("a", Name("b")), (), SPEC, Hyperparameters(), Waiting(job_id="j", code="c")]


def test_construction_agrees_with_the_oracle_on_odd_arguments() -> None:
    rng = random.Random(5)
    for i in range(5_000):
        event = CORPUS[i % len(CORPUS)]
        kwargs = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        for name in rng.sample(sorted(kwargs), rng.choice([1, 1, 2])):
            kwargs[name] = rng.choice(ARGUMENT_VALUES)
        cls = type(event)
        got, want = outcome(lambda: cls(**kwargs)), outcome(lambda: ref_build(cls, kwargs))  # noqa: B023 - called at once
        assert got == want, (i, kwargs)


def test_a_constructed_record_keeps_no_reference_to_a_callers_dict() -> None:
    rates = {"v100": 1.0}
    estimate = ThroughputEstimate(ts=1.0, source="p", job_id="j", basis="estimate", workers=1, rates=rates)
    rates["v100"] = 99.0
    assert estimate.rates == {"v100": 1.0}


# ---------------------------------------------------------------- the fast tests


def _hints() -> set[Any]:
    """Every annotation a record uses, and the annotations inside them."""
    found: set[Any] = set()

    def walk(hint: Any) -> None:
        if hint in found:
            return
        found.add(hint)
        for arg in typing.get_args(hint):
            if arg is not Ellipsis and not isinstance(arg, str):
                walk(arg)
        if isinstance(hint, type) and issubclass(hint, Record):
            for inner in typing.get_type_hints(hint).values():
                walk(inner)

    for cls in [*EVENT_TYPES.values(), JobSpec, GpuInfo, Waiting, CopyWeight]:
        walk(cls)
    return {h for h in found if h is not type(None) and not (isinstance(h, type) and issubclass(h, Event))}


HINTS = sorted(_hints(), key=repr)


def _passes(test: str | None, value: Any, hint: Any) -> bool:
    if test is None:
        return False
    return bool(eval(test, dict(NAMES), {"v": value}))


@pytest.mark.parametrize("hint", HINTS, ids=[repr(h) for h in HINTS])
def test_a_value_the_fast_test_passes_is_one_the_converter_keeps(hint: Any) -> None:
    for value in ARGUMENT_VALUES:
        if _passes(fast_test(hint, "v"), value, hint):
            assert converter(hint)(value, "p") is value, value
        wired = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False) if _packable(value) else None
        if wired is not None and _passes(wire_test(hint, "v"), wired, hint):
            assert converter(hint)(wired, "p") is wired, wired


def _packable(value: Any) -> bool:
    try:
        msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return False
    return not isinstance(value, Record)


@given(st.text() | st.integers() | st.floats() | st.booleans() | st.binary() | st.none())
def test_wire_tests_hold_for_anything_msgpack_decodes(value: Any) -> None:
    try:
        wired = msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)
    except (OverflowError, ValueError):
        return
    for hint in (str, int, float, bool, bytes, str | None, float | None):
        if _passes(wire_test(hint, "v"), wired, hint):
            assert ref_convert(hint, wired, "p") == wired


# ---------------------------------------------------------------- remembered ids


def test_a_str_subclass_cannot_pass_as_a_remembered_id() -> None:
    check_job_id("resnet-17", "T")   # remembered

    class Liar(str):
        def __eq__(self, other: object) -> bool:
            return True

        def __hash__(self) -> int:
            return hash("resnet-17")

    with pytest.raises(InvalidEvent, match="job_id"):
        check_job_id(Liar("BAD/ID"), "T")


def test_remembered_ids_are_bounded() -> None:
    for i in range(3 * records._VALID_IDS_MAX):
        check_job_id(f"job-{i}", "T")
    assert len(records._VALID_JOB_IDS) <= records._VALID_IDS_MAX
    with pytest.raises(InvalidEvent):
        check_job_id("Job-0", "T")


def test_a_record_built_from_a_callers_map_does_not_share_it() -> None:
    spec = {f.name: getattr(SPEC, f.name) for f in dataclasses.fields(SPEC)}
    spec["hyper"] = {"optimizer": "adam", "lr": 0.01, "seed": 3}
    assignment = dataclasses.replace(CORPUS[1], job=spec)   # type: ignore[arg-type]
    assert assignment.job == SPEC
    spec["workers"], spec["hyper"]["lr"] = 0, 99.0
    assert assignment.job == SPEC


def test_a_decoded_event_equals_the_constructed_one_field_by_field_and_in_repr() -> None:
    for event in CORPUS:
        decoded = decode(encode(event))
        assert repr(decoded) == repr(event)
        assert dataclasses.asdict(decoded) == dataclasses.asdict(event)
        assert vars(decoded).keys() == vars(event).keys()


def test_event_ids_are_random_version_4_uuids_in_hex() -> None:
    ids = [new_event_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for text in ids:
        parsed = uuid.UUID(hex=text)
        assert (parsed.hex, parsed.version, parsed.variant) == (text, 4, uuid.RFC_4122)
