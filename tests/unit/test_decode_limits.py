"""decode's memory bound: no record costs more than a small multiple of its size to decode.

msgpack sends an empty map in 1 byte and CPython builds it in about 70; a 1 MiB record
of them used to cost ~72 MB (about 1 GB at the 16 MiB record cap). Each hostile record
below is a complete RoundStarted envelope whose ``waiting`` field carries the payload,
so nothing but the decode limits can stop it early.
"""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.wire.bounded_msgpack import (
    COST_PER_BYTE,
    COST_SLACK,
    MAX_COST_PER_BYTE,
    UNCHARGED_MAX,
    cost,
)
from shared.wire.events import (
    Assignment,
    CopyWeight,
    GpuInfo,
    InvalidEvent,
    JobSpec,
    ModelConsolidated,
    NodeRegistered,
    Rejection,
    RoundStarted,
    Waiting,
    decode,
    encode,
)

MIB = 1 << 20
INNER = 1 << 16
# Legitimate records cost up to ~12x their size (dicts and strings); hostile ones must
# stay in that league instead of the 40-72x they reached.
MAX_RATIO = 20


def _array(count: int) -> bytes:
    return b"\xdd" + count.to_bytes(4, "big")


def _round_started(waiting: bytes) -> bytes:
    """A RoundStarted record, complete but for ``waiting``, given as raw msgpack."""
    head = msgpack.packb({"type": "RoundStarted", "v": 1, "id": "x", "ts": 1.0, "source": "s"})
    fields = msgpack.packb({"round": 1, "policy": "hadar", "started_at": 1.0, "ends_at": 2.0})
    assert head[0] == 0x85 and fields[0] == 0x84  # fixmaps of 5 and 4 entries: one more each
    return (b"\x86" + head[1:] + msgpack.packb("body")
            + b"\x85" + fields[1:] + msgpack.packb("waiting") + waiting)


def _nested(item: bytes) -> bytes:
    """About 1 MiB of ``item``: 16 arrays of 65,536, so no single container is long."""
    outer = MIB // INNER
    return _array(outer) + (_array(INNER) + item * INNER) * outer


HOSTILE = {
    "empty maps, one flat array": _round_started(_array(MIB) + b"\x80" * MIB),
    "empty maps, nested arrays": _round_started(_nested(b"\x80")),
    "empty arrays, nested": _round_started(_nested(b"\x90")),
    "negative fixints (uncached ints)": _round_started(_nested(b"\xe0")),
    "two-character strings": _round_started(_nested(b"\xa2ab")),
    "maps of one nil-valued key": _round_started(_nested(b"\x81\xa1k\xc0")),
}


def _peak_bytes(data: bytes) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        try:
            decode(data)
            error = None
        except Exception as exc:
            error = exc
        return tracemalloc.get_traced_memory()[1], error
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_1_mib_record_of_tiny_objects_costs_a_small_multiple_of_its_size(name: str) -> None:
    data = HOSTILE[name]
    assert len(data) >= 0.9 * MIB
    peak, error = _peak_bytes(data)
    assert isinstance(error, InvalidEvent), error
    assert peak < MAX_RATIO * len(data), f"{name}: decoding cost {peak / len(data):.1f}x the record size"


def test_the_bound_refusal_names_the_limit() -> None:
    with pytest.raises(InvalidEvent, match=r"(?i)limit|too costly|exceeds"):
        decode(HOSTILE["empty maps, nested arrays"])


def test_ext_types_are_refused_before_they_are_built() -> None:
    record = _round_started(_array(1) + msgpack.packb(msgpack.ExtType(5, b"x" * 100)))
    with pytest.raises(InvalidEvent):
        decode(record)


def _spec() -> JobSpec:
    return JobSpec(job_id="j1", user="u", model="m", dataset="d", batch_size=32, workers=1, iterations=100)


LEGIT = {
    "RoundStarted, 20,000 waiting jobs and 2,000 nodes": RoundStarted(
        ts=1.0, source="scheduler", round=7, policy="hadare", started_at=1.0, ends_at=2.0,
        nodes=tuple(f"n{i}" for i in range(2000)),
        waiting=tuple(Waiting(job_id=f"job-{i}", code="no_gpu", detail="") for i in range(20000))),
    "NodeRegistered, 1,024 GPUs": NodeRegistered(
        ts=1.0, source="agent", node_id="n1", gpus=tuple(GpuInfo(index=i, type="V100") for i in range(1024))),
    "ModelConsolidated, 1,024 copies": ModelConsolidated(
        ts=1.0, source="tracker", job_id="j1", round=3, key="models/j1/3.safetensors", total_steps=2**64 - 1,
        copies=tuple(CopyWeight(copy=i, steps=2**53, weight=1 / 1024) for i in range(1024)),
        rejected=tuple(Rejection(copy=i, reason="x" * 240) for i in range(100)),
        missing=tuple(range(1024))),
    "Assignment, 64 GPUs": Assignment(
        ts=1.0, source="scheduler", round=1, job=_spec(), copy=0, node_id="n1", gpus=tuple(range(64)),
        gpu_type="V100", world_size=64, ranks=tuple(range(64)), step_budget=100, deadline=2.0),
}


@pytest.mark.parametrize("name", list(LEGIT))
def test_large_legitimate_records_still_decode(name: str) -> None:
    event = LEGIT[name]
    assert decode(encode(event)) == event


# ---------------------------------------------------------------- small records skip the charging

def _charged(value: object) -> int:
    """What the decode hooks charge for ``value``: every map and array, by bounded_msgpack.cost."""
    total, stack = 0, [value]
    while stack:   # not recursive: the nested shapes are hundreds deep
        item = stack.pop()
        if isinstance(item, (dict, list)):
            total += cost(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    return total


def _fill(unit: bytes) -> bytes:
    """An array of as many ``unit`` as fit in UNCHARGED_MAX bytes."""
    count = (UNCHARGED_MAX - 3) // len(unit)
    return b"\xdc" + count.to_bytes(2, "big") + unit * count


def _chain(level: bytes, end: bytes) -> bytes:
    depth = (UNCHARGED_MAX - len(end)) // len(level)
    return level * depth + end


WORST_SMALL = {
    "empty maps": _fill(b"\x80"),
    "empty arrays": _fill(b"\x90"),
    "maps of one empty-str key to an empty map": _fill(b"\x81\xa0\x80"),
    "maps of one empty-bytes key to an empty map": _fill(b"\x81\xc4\x00\x80"),
    "maps of one empty-str key to nil": _fill(b"\x81\xa0\xc0"),
    "maps nested through an empty-str key": _chain(b"\x81\xa0", b"\x80"),
    "maps nested through an empty-bytes key": _chain(b"\x81\xc4\x00", b"\x80"),
    "arrays nested": _chain(b"\x91", b"\x90"),
    "fifteen-key maps of empty maps": _fill(msgpack.packb({chr(97 + i) * (i > 0): {} for i in range(15)})),
}


@pytest.mark.parametrize("name", list(WORST_SMALL))
def test_records_decoded_without_charging_cannot_spend_the_budget(name: str) -> None:
    data = WORST_SMALL[name]
    assert len(data) <= UNCHARGED_MAX
    charged = _charged(msgpack.unpackb(data, raw=False, strict_map_key=True))
    assert charged <= 112 * len(data) <= MAX_COST_PER_BYTE * len(data)
    assert MAX_COST_PER_BYTE * UNCHARGED_MAX <= COST_PER_BYTE * UNCHARGED_MAX + COST_SLACK


small_values = st.recursive(
    st.none() | st.booleans() | st.integers(-40, 40) | st.text(max_size=2) | st.binary(max_size=2),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=2) | st.binary(max_size=1),
                                                                inner, max_size=6),
    max_leaves=120,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_values)
def test_any_small_input_is_charged_at_most_112_bytes_per_byte(value: object) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    if len(data) <= UNCHARGED_MAX:
        assert _charged(msgpack.unpackb(data, raw=False, strict_map_key=True)) <= 112 * len(data)
