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

from shared.events import (
    Assignment, CopyWeight, GpuInfo, InvalidEvent, JobSpec, ModelConsolidated, NodeRegistered, Rejection,
    RoundStarted, Waiting, decode, encode,
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
        except Exception as exc:  # noqa: BLE001 - the test checks the type
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
    with pytest.raises(InvalidEvent, match="(?i)limit|too costly|exceeds"):
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
