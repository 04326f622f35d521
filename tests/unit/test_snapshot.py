"""State snapshots: the value codec keeps types, the format refuses anything not whole and
its own, and the store falls back past corrupt snapshots and keeps a bounded number."""

from __future__ import annotations

import asyncio
import struct
from collections import deque
from dataclasses import dataclass, replace
from types import MappingProxyType

import numpy as np
import pytest

from services.scheduler.core.policy import Placement, Plan, Wait, WaitCode
from shared.domain.layout import parse_snapshot_key, snapshot_key
from shared.persistence.codec import SnapshotDecodeError, pack, register, unpack
from shared.persistence.snapshot import (
    FORMAT_VERSION,
    MAGIC,
    SnapshotCorrupt,
    SnapshotStore,
    StateSnapshot,
    dump,
    load,
)
from shared.store import LocalStore
from shared.wire.events import GpuInfo, JobSpec, NodeRegistered


@dataclass(frozen=True, kw_only=True)
class _Frozen:
    a: int
    b: tuple[int, ...]


class _Plain:
    def __init__(self) -> None:
        self.items = {("x", 1): 2.5}


class _Unregistered:
    pass


register(_Frozen, "tests.Frozen")
register(_Plain, "tests.Plain")


def _sample() -> dict:
    spec = JobSpec(job_id="j1", user="u", model="resnet", dataset="digits", batch_size=32, workers=2, iterations=10)
    return {
        "tuple_keys": {("j1", "v100", 2): ("measured", 3.5)},
        "set": {"a", "b"}, "frozen": frozenset({1, 2}), "deque": deque([1, 2, 3], maxlen=5),
        "array": np.arange(6, dtype=np.int32).reshape(2, 3), "scalar": np.float64(0.1), "bools": np.array([True]),
        "enum": WaitCode.PAYOFF, "proxy": MappingProxyType({"k": 1}),
        "event": NodeRegistered(ts=1.0, source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="v100"),)),
        "record": spec, "frozen_dc": _Frozen(a=1, b=(2, 3)),
        "plan": Plan(placements=(Placement(job_id="j1", copy=0, node_id="n1", gpus=(0, 1)),),
                     waiting=(Wait(job_id="j2", code=WaitCode.CAPACITY, detail="full"),)),
        "none": None, "bytes": b"\x00\x01", "nested": [[1, (2, 3)], {"s": {4}}],
    }


def test_a_field_added_since_a_snapshot_was_written_takes_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # A scheduler upgraded across a change that added policy-state fields (HadarE's rounding
    # credit, Hadar's gang credit) restores the snapshot its predecessor wrote: the missing
    # fields take their defaults instead of failing the first plan with AttributeError.
    from services.scheduler.policies.hadar.ledger import LedgerState
    from services.scheduler.policies.hadare.timeline import TimelineState
    from shared.persistence import codec as snapshot_codec

    @dataclass(frozen=True, kw_only=True)
    class WrittenBefore:             # TimelineState as it was before ``credit``
        end_s: float
        job_ids: frozenset[str] = frozenset()

    monkeypatch.setitem(snapshot_codec._NAME_OF, WrittenBefore, snapshot_codec._NAME_OF[TimelineState])
    back = unpack(pack(WrittenBefore(end_s=5.0, job_ids=frozenset({"a"}))))
    assert back == TimelineState(end_s=5.0, job_ids=frozenset({"a"}))
    assert back.credit == {}

    @dataclass(frozen=True, kw_only=True)
    class Unknowable:                # a field with no default cannot be made up: refused
        end_s: float

    monkeypatch.setitem(snapshot_codec._NAME_OF, Unknowable, snapshot_codec._NAME_OF[LedgerState])
    with pytest.raises(SnapshotDecodeError, match="lacks"):
        unpack(pack(Unknowable(end_s=1.0)))


def test_values_come_back_equal_and_of_the_same_types() -> None:
    original = _sample()
    back = unpack(pack(original))
    for key, value in original.items():
        got = back[key]
        assert type(got) is type(value), key
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.shape == value.shape and (got == value).all()
        else:
            assert got == value, key
    assert back["deque"].maxlen == 5
    assert type(back["nested"][0][1]) is tuple and type(back["nested"][1]["s"]) is set
    plain = unpack(pack(_Plain()))
    assert type(plain) is _Plain and plain.items == {("x", 1): 2.5}


def test_unregistered_and_unsafe_values_are_refused() -> None:
    with pytest.raises(TypeError, match="not registered"):
        pack(_Unregistered())
    with pytest.raises(TypeError, match="dtype"):
        pack(np.array([object()], dtype=object))
    forged = pack(_Frozen(a=1, b=())).replace(b"tests.Frozen", b"tests.Fozren")
    with pytest.raises(SnapshotDecodeError, match="not registered"):
        unpack(forged)


def _snapshot(seq: int = 7) -> StateSnapshot:
    return StateSnapshot(service="scheduler", seq=seq, created_at=5.0,
                         offsets={"hadar.jobs:0": 3, "hadar.placements:1": 9}, body=_sample())


def test_format_round_trip_and_partition_offsets() -> None:
    snap = load(dump(_snapshot()), service="scheduler")
    assert snap.seq == 7 and snap.offsets == {"hadar.jobs:0": 3, "hadar.placements:1": 9}
    assert snap.partition_offsets("hadar.placements") == {1: 9} and snap.partition_offsets("hadar.nodes") == {}
    assert snap.body["plan"] == _sample()["plan"]


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]


@pytest.mark.parametrize("damage", ["truncated", "truncated_header", "empty", "flip_magic", "flip_length",
                                    "flip_digest", "flip_payload", "flip_last", "version", "appended"])
def test_a_damaged_snapshot_is_refused_with_a_reason(damage: str) -> None:
    data = dump(_snapshot())
    bad = {
        "truncated": data[:-10], "truncated_header": data[:20], "empty": b"",
        "flip_magic": _flip(data, 0), "flip_length": _flip(data, 17), "flip_digest": _flip(data, 30),
        "flip_payload": _flip(data, 60), "flip_last": _flip(data, len(data) - 1),
        "version": MAGIC + struct.pack(">H", FORMAT_VERSION + 1) + data[10:], "appended": data + b"\x00",
    }[damage]
    with pytest.raises(SnapshotCorrupt) as info:
        load(bad, service="scheduler")
    assert info.value.reason


def test_a_snapshot_of_another_service_is_refused() -> None:
    with pytest.raises(SnapshotCorrupt, match="not of 'tracker'"):
        load(dump(_snapshot()), service="tracker")


def test_snapshot_keys_round_trip_and_refuse_bad_owners() -> None:
    assert parse_snapshot_key(snapshot_key("hadar-scheduler", 12)) == ("hadar-scheduler", 12)
    for bad in ("", "a/b", ".hidden", "x" * 64):
        with pytest.raises(ValueError):
            snapshot_key(bad, 1)
    for key in ("snapshots/a/01.snapshot", "snapshots/a/1.msgpack", "snapshots/a/b/1.snapshot", "models/a/1.snapshot"):
        assert parse_snapshot_key(key) is None


def _taken(snapshot: StateSnapshot):
    return lambda: snapshot


def _accept(snapshot: StateSnapshot) -> StateSnapshot:
    return snapshot


async def test_store_numbers_past_every_stored_snapshot_and_keeps_the_newest(tmp_path) -> None:
    store = LocalStore(tmp_path)
    await store.start()
    snaps = SnapshotStore(store, owner="grp", service="scheduler", keep=3)
    saved = [await snaps.save(_taken(_snapshot(99))) for _ in range(5)]   # the capture's seq is not the number
    assert [s.seq for s in saved] == [1, 2, 3, 4, 5] and saved[-1].key == snapshot_key("grp", 5)
    assert [seq for seq, _ in await snaps.keys()] == [5, 4, 3]              # bounded: older ones deleted
    other = SnapshotStore(store, owner="grp2", service="scheduler")
    assert (await other.save(_taken(_snapshot()))).seq == 1                 # another owner is not ours
    found = await snaps.recover(_accept)
    assert found.key == snapshot_key("grp", 5) and found.value.seq == 5 and found.skipped == ()
    assert load(await store.get(found.key), service="scheduler").seq == 5   # the file says its number too


async def test_store_falls_back_past_corrupt_and_refused_snapshots(tmp_path) -> None:
    store = LocalStore(tmp_path)
    await store.start()
    snaps = SnapshotStore(store, owner="grp", service="scheduler", keep=5)
    for _ in range(4):
        await snaps.save(_taken(_snapshot()))
    good = dump(_snapshot(4))
    await store.put(snapshot_key("grp", 4), good[: len(good) // 2])                    # partial
    await store.put(snapshot_key("grp", 3), _flip(dump(_snapshot(3)), 100))           # a flipped byte
    found = await snaps.recover(_accept)
    assert found.value is not None and found.value.seq == 2
    assert [k for k, _ in found.skipped] == [snapshot_key("grp", 4), snapshot_key("grp", 3)]
    assert "partial" in found.skipped[0][1] and "checksum" in found.skipped[1][1]
    assert found.recovery() == {"snapshot": snapshot_key("grp", 2),
                                "skipped": [snapshot_key("grp", 4), snapshot_key("grp", 3)]}
    assert found.start("hadar.placements") == {1: 9} and found.start("hadar.nodes") == {}

    def refuse_two(snapshot: StateSnapshot) -> int:   # a body the service cannot take: the one before
        if snapshot.seq == 2:
            raise SnapshotCorrupt("not a scheduler snapshot body")
        return snapshot.seq

    found = await snaps.recover(refuse_two)
    assert found.value == 1 and found.key == snapshot_key("grp", 1) and len(found.skipped) == 3

    await store.put(snapshot_key("grp", 1), MAGIC + struct.pack(">H", 2) + good[10:])   # wrong version
    none = await snaps.recover(refuse_two)
    assert none.snapshot is None and none.value is None and none.unavailable is None
    assert len(none.skipped) == 4 and "version 2" in none.skipped[3][1]
    assert none.start("hadar.jobs") is None and none.recovery()["snapshot"] is None


async def test_a_store_written_by_the_old_numbering_loads_and_new_snapshots_come_after(tmp_path) -> None:
    """Before one scheme, the scheduler numbered its snapshots by round, the profiler by
    clock milliseconds: the newest old one loads, and a new one is numbered past all."""
    store = LocalStore(tmp_path)
    await store.start()
    old = {"sched": (2, 5), "prof": (1_764_612_345_678, 1_764_612_945_678)}
    for owner, seqs in old.items():
        for seq in seqs:   # exactly as the old SnapshotStore.save wrote them
            await store.put(snapshot_key(owner, seq), dump(_snapshot(seq)))
    for owner, (_older, newest) in old.items():
        snaps = SnapshotStore(store, owner=owner, service="scheduler", keep=2)
        found = await snaps.recover(_accept)
        assert found.key == snapshot_key(owner, newest) and found.value.body["plan"] == _sample()["plan"]
        saved = await snaps.save(_taken(_snapshot()))
        assert saved.seq == newest + 1
        assert [k for _, k in await snaps.keys()] == [saved.key, snapshot_key(owner, newest)]   # the oldest pruned
        assert (await snaps.recover(_accept)).key == saved.key


async def test_save_captures_and_encodes_while_the_hold_is_held(tmp_path) -> None:
    store = LocalStore(tmp_path)
    await store.start()
    snaps = SnapshotStore(store, owner="grp", service="scheduler")
    lock = asyncio.Lock()
    held: list[bool] = []

    def capture() -> StateSnapshot:
        held.append(lock.locked())
        return _snapshot()

    saved = await snaps.save(capture, hold=lock)
    assert held == [True] and not lock.locked() and saved is not None
    assert await snaps.save(lambda: None, hold=lock) is None                 # nothing to write now
    assert [seq for seq, _ in await snaps.keys()] == [1]


def test_scheduler_dead_letter_origins_round_trip_and_malformed_ones_are_refused() -> None:
    from services.scheduler.live.snapshot import (
        capture,
        dead_letter_origins,
        dead_letter_start,
        restore,
    )
    from services.scheduler.live.state import SchedulerState

    origins = [("hadar.jobs", 0, 7), ("hadar.progress", 2, 1), ("hadar.jobs", 0, 3), ("hadar.jobs", 1, 0)]
    snap = capture(state=SchedulerState(), previous=None, previous_key=None, next_round=4, folded={"hadar.jobs:0": 9},
                   placed={0: 5}, created_at=1.0, dead_letters=origins, lettered={0: 12, 2: 3})
    body = restore(load(dump(snap), service="scheduler"))
    assert body.dead_letters == {"hadar.jobs:0": [3, 7], "hadar.jobs:1": [0], "hadar.progress:2": [1]}
    assert sorted(dead_letter_origins(body)) == sorted(origins)
    assert dead_letter_start(snap, body) == {0: 12, 2: 3}
    # written before
    old = restore(StateSnapshot(service="scheduler", created_at=1.0, body=replace(body, dead_letters=None)))
    assert list(dead_letter_origins(old)) == [] and dead_letter_start(snap, old) is None
    for bad in ({"hadar.jobs": [1]}, {"hadar.jobs:0": [1.5]}, {"hadar.jobs:0": (1,)}, [("hadar.jobs", 0, 1)]):
        with pytest.raises(SnapshotCorrupt, match="dead-letter"):
            restore(StateSnapshot(service="scheduler", created_at=1.0, body=replace(body, dead_letters=bad)))


def test_every_policy_state_type_is_registered_under_a_stable_name() -> None:
    """A policy's state registers itself beside the policy (``snapshot_type``); one that
    forgot would fail every snapshot write. Names are not module paths, so a move changes
    nothing on disk."""
    from services.scheduler.core.policy import PolicyState
    from services.scheduler.policies import import_all
    from shared.persistence.codec import name_of, registered

    import_all()
    pending, states = [PolicyState], []
    while pending:
        cls = pending.pop()
        states.append(cls)
        pending.extend(cls.__subclasses__())
    assert len(states) >= 6          # the base and one per policy that keeps books
    unnamed = [cls.__qualname__ for cls in states if name_of(cls) is None]
    assert unnamed == []
    assert all(not name.startswith(("services.", "shared.")) for name in registered())
