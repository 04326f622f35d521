"""The bus contract, run on MemoryBus and on KafkaBus (a real broker; ``kafka_bootstrap``).

Every test uses its own topic and group names, so tests never see each other's records;
the shared ``hadar.deadletter`` topic is filtered by origin topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.bus import (
    AckTracker,
    Bus,
    BusError,
    Delivery,
    KafkaBus,
    MemoryBus,
    Subscription,
)
from shared.bus.eventlog import fetch_log, read_bus
from shared.clock import FakeClock
from shared.wire.events import CopyFinished, DeadLetter, JobCancelled, Progress, encode
from shared.wire.topics import DEADLETTER, JOBS

WAIT_S = 30.0  # generous: a Kafka group join plus fetches on a loaded 2-core machine


@contextlib.asynccontextmanager
async def open_bus(kind: tuple[str, str | None], clock: FakeClock) -> AsyncIterator[Bus]:
    name, bootstrap = kind
    bus: Bus
    if name == "kafka":
        assert bootstrap is not None
        bus = KafkaBus(bootstrap, partitions=3, clock=clock, source="contract",
                       commit_interval_s=0.05)
    else:
        bus = MemoryBus(partitions=3, clock=clock, source="contract")
    await bus.start()
    try:
        yield bus
    finally:
        await bus.stop()


def unique(prefix: str) -> str:
    return f"test.{prefix}.{uuid.uuid4().hex[:12]}"


def progress(job: str, step: int, ts: float = 1.0) -> Progress:
    return Progress(ts=ts, source="test", job_id=job, round=0, copy=0, node_id="n1",
                    gpu_type="v100", workers=1, steps_round=step, steps_total=step,
                    samples_per_s=10.0, loss=0.5)


async def take(sub: Subscription, n: int, *, ack: bool = True) -> list[Delivery]:
    got: list[Delivery] = []
    async with asyncio.timeout(WAIT_S):
        async for delivery in sub:
            got.append(delivery)
            if ack:
                await delivery.ack()
            if len(got) == n:
                break
    return got


async def read_all(bus: Bus, topic: str, **bounds: object) -> list[Delivery]:
    async with asyncio.timeout(WAIT_S):
        return [d async for d in bus.read(topic, **bounds)]


async def test_round_trip_reports_where_each_record_landed(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("roundtrip")
        await bus.ensure_topics([topic])
        sent = {}
        for i in range(6):
            event = progress(f"job-{i % 3}", i)
            sent[await bus.publish(event, topic=topic, key=event.job_id)] = event
        cancel = JobCancelled(ts=2.0, source="test", job_id="job-x")
        where = await bus.publish(cancel)  # emit: its own topic and key
        async with bus.subscribe(topic, unique("group")) as sub:
            got = await take(sub, 6)
        assert {(d.partition, d.offset): d.event for d in got} == sent
        for d in got:
            assert d.topic == topic and d.key == d.event.job_id
            assert d.timestamp_ms == int(clock.time() * 1000)
        jobs = [d for d in await read_all(bus, JOBS) if d.event.id == cancel.id]
        assert [(d.key, d.event, (d.partition, d.offset)) for d in jobs] == [("job-x", cancel, where)]


async def test_records_of_one_key_keep_publish_order(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("order")
        pending = [await bus.publish_pipelined(progress(f"job-{i % 4}", i), topic=topic, key=f"job-{i % 4}")
                   for i in range(40)]
        landed = [await p for p in pending]
        async with bus.subscribe([topic], unique("group")) as sub:
            got = await take(sub, 40)
    partitions: dict[str, set[int]] = {}
    for (partition, _), i in zip(landed, range(40)):
        partitions.setdefault(f"job-{i % 4}", set()).add(partition)
    assert all(len(p) == 1 for p in partitions.values())
    for job in partitions:
        steps = [d.event.steps_round for d in got if d.key == job]
        assert steps == sorted(steps) and len(steps) == 10


async def test_restarted_member_resumes_at_first_unacked_record(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic, group = unique("acks"), unique("group")
        for i in range(10):
            await bus.publish(progress("job-a", i), topic=topic, key="job-a")
        async with bus.subscribe(topic, group) as first:
            got = await take(first, 10, ack=False)
            for d in got:
                if d.offset != 3:  # acked out of order around a hole at offset 3
                    await d.ack()
        async with bus.subscribe(topic, group) as second:
            again = await take(second, 7, ack=False)
            assert [d.offset for d in again] == list(range(3, 10))
            for d in reversed(again):
                await d.ack()
        await bus.publish(progress("job-a", 10), topic=topic, key="job-a")
        async with bus.subscribe(topic, group) as third:
            (latest,) = await take(third, 1)
        assert latest.offset == 10 and latest.event.steps_round == 10


async def test_every_group_sees_every_record(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("groups")
        for i in range(9):
            await bus.publish(progress(f"job-{i}", i), topic=topic, key=f"job-{i}")
        seen = []
        for _ in range(2):
            async with bus.subscribe(topic, unique("group")) as sub:
                seen.append(sorted(d.event.steps_round for d in await take(sub, 9)))
        assert seen == [list(range(9))] * 2


async def test_members_of_one_group_share_the_partitions(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic, group = unique("share"), unique("group")
        await bus.ensure_topics([topic])
        seen: list[set[int]] = [set(), set()]

        async def member(k: int) -> None:
            async with bus.subscribe(topic, group) as sub:
                async for d in sub:
                    seen[k].add(d.event.steps_round)
                    await d.ack()

        members = [asyncio.create_task(member(k)) for k in range(2)]
        published: set[int] = set()
        try:
            async with asyncio.timeout(WAIT_S):
                # Keep publishing on fresh keys until both members have had records (the
                # second one joins while the first is consuming) and nothing is missing.
                while not (seen[0] and seen[1] and seen[0] | seen[1] >= published):
                    step = len(published)
                    await bus.publish(progress(f"job-{step}", step), topic=topic, key=f"job-{step}")
                    published.add(step)
                    await asyncio.sleep(0.02)
        finally:
            for task in members:
                task.cancel()
            outcomes = await asyncio.gather(*members, return_exceptions=True)
        assert [o for o in outcomes if not isinstance(o, asyncio.CancelledError)] == []
        assert seen[0] | seen[1] == published


async def test_stop_from_another_task_ends_the_iteration(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("stop")
        await bus.publish(progress("job-a", 1), topic=topic, key="job-a")
        sub = bus.subscribe(topic, unique("group"))
        got: list[Delivery] = []

        async def handle() -> None:
            async for d in sub:
                got.append(d)
                await d.ack()

        task = asyncio.create_task(handle())
        async with asyncio.timeout(WAIT_S):
            while not got:
                await asyncio.sleep(0.01)
            await sub.stop()  # the handler is now waiting for more records
            await task
        assert [d.event.steps_round for d in got] == [1]
        with pytest.raises(BusError):
            await sub.start()


async def test_read_by_offset_is_half_open_and_bounded(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("replay")
        for i in range(8):
            await bus.publish(progress("job-a", i), topic=topic, key="job-a")
            await bus.publish(progress(f"job-{i}", 100 + i), topic=topic, key=f"job-{i}")
        everything = await read_all(bus, topic)
        assert len(everything) == 16 and all(d.topic == topic for d in everything)
        window = await read_all(bus, topic, start=2, end=5)
        per_partition = {p: [d.offset for d in window if d.partition == p] for p in range(3)}
        for p, offsets in per_partition.items():
            size = sum(1 for d in everything if d.partition == p)
            assert offsets == list(range(2, min(5, size)))
        assert await read_all(bus, topic, start=5, end=5) == []

        # Records published while a replay runs are not part of it.
        replayed = []
        async with asyncio.timeout(WAIT_S):
            async for d in bus.read(topic):
                replayed.append(d)
                if len(replayed) == 1:
                    await bus.publish(progress("job-a", 999), topic=topic, key="job-a")
        assert len(replayed) == 16
        assert await read_all(bus, "test.never.created." + uuid.uuid4().hex[:8]) == []


async def test_read_by_time_orders_by_timestamp(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("time")
        marks = []
        for batch in range(3):
            marks.append(clock.time())
            for i in range(4):
                await bus.publish(progress(f"job-{i}", batch * 10 + i), topic=topic, key=f"job-{i}")
            clock.advance(10.0)
        tail = await read_all(bus, topic, start=marks[1])
        assert sorted(d.event.steps_round for d in tail) == [10, 11, 12, 13, 20, 21, 22, 23]
        keys = [(d.timestamp_ms, d.partition, d.offset) for d in tail]
        assert keys == sorted(keys)
        middle = await read_all(bus, topic, start=marks[1] - 0.5, end=marks[2])
        assert sorted(d.event.steps_round for d in middle) == [10, 11, 12, 13]
        assert await read_all(bus, topic, start=clock.time() + 1.0) == []


async def test_undecodable_records_are_dead_lettered_and_skipped(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic, group = unique("dead"), unique("group")
        garbage = b"\xc1" + bytes(range(256)) * 8  # 0xc1 is never valid msgpack
        wrong_version = msgpack.packb({"type": "Progress", "v": 99, "id": "x", "ts": 1.0,
                                       "source": "s", "body": {}})
        finished = msgpack.unpackb(encode(CopyFinished(
            ts=1.0, source="s", job_id="job-a", round=0, copy=0, node_id="n1", status="failed",
            steps_round=0)))
        finished["body"]["status"] = "x" * 200_000  # the reason quotes the bad value
        huge_reason = msgpack.packb(finished)
        bad = [await bus.write_raw(topic, "job-a", garbage),
               await bus.write_raw(topic, "job-a", wrong_version),
               await bus.write_raw(topic, "job-a", None),
               await bus.write_raw(topic, "job-a", huge_reason)]
        await bus.publish(progress("job-a", 7), topic=topic, key="job-a")
        async with bus.subscribe(topic, group) as sub:
            (good,) = await take(sub, 1)
        assert good.event.steps_round == 7 and good.offset == 4

        async with asyncio.timeout(WAIT_S):
            while True:  # dead letters are durable before the consumer moves on
                letters = [d.event for d in await read_all(bus, DEADLETTER)
                           if isinstance(d.event, DeadLetter) and d.event.topic == topic]
                if len(letters) >= 4:
                    break
                await asyncio.sleep(0.05)
        assert sorted((dl.partition, dl.offset) for dl in letters) == sorted(bad)
        by_offset = {dl.offset: dl for dl in letters}
        assert by_offset[0].raw == garbage[:1024] and by_offset[0].reason.startswith("not msgpack")
        assert "unsupported schema version 99" in by_offset[1].reason
        assert by_offset[1].raw == wrong_version
        assert "tombstone" in by_offset[2].reason and by_offset[2].raw == b""
        assert by_offset[3].reason.startswith("CopyFinished.status: must be one of")
        assert len(by_offset[3].reason) <= 1024 and len(by_offset[3].raw) == 1024
        assert all(dl.source.endswith(group) for dl in letters)

        await bus.publish(progress("job-a", 8), topic=topic, key="job-a")
        async with bus.subscribe(topic, group) as again:
            (latest,) = await take(again, 1)
        assert latest.event.steps_round == 8  # bad records were committed, never redelivered


async def test_ensure_topics_is_idempotent_and_rejects_bad_names(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topics = [unique("ensure"), unique("ensure")]
        await bus.ensure_topics(topics)
        await bus.ensure_topics(topics)
        partitions = {(await bus.publish(progress("job-a", i), topic=topics[0], key=f"k{i}"))[0]
                      for i in range(30)}
        assert partitions == {0, 1, 2}
        with pytest.raises(BusError) as err:
            await bus.ensure_topics(["bad topic!"])
        assert not err.value.retriable


async def test_calls_before_start_fail_with_bus_error(bus_kind, clock) -> None:
    name, bootstrap = bus_kind
    bus = KafkaBus(bootstrap, clock=clock) if name == "kafka" and bootstrap else MemoryBus(clock=clock)
    event = progress("job-a", 1)
    with pytest.raises(BusError):
        await bus.publish(event, topic=unique("early"), key="job-a")
    with pytest.raises(BusError):
        await bus.subscribe(unique("early"), unique("group")).start()
    await bus.stop()


async def test_kafka_unreachable_is_a_retriable_bus_error(clock) -> None:
    bus = KafkaBus("127.0.0.1:1", clock=clock, request_timeout_ms=2000)
    with pytest.raises(BusError) as err:
        await bus.start()
    assert err.value.retriable


@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_ack_tracker_commits_the_longest_acked_prefix(gaps: list[int], rnd) -> None:
    offsets, at = [], 5
    for gap in gaps:  # delivered offsets may skip (compaction, control records)
        at += gap + 1
        offsets.append(at)
    tracker = AckTracker()
    for o in offsets:
        tracker.delivered(("t", 0), o)
    order = offsets[:]
    rnd.shuffle(order)
    acked: set[int] = set()
    for o in order:
        tracker.ack(("t", 0), o)
        acked.add(o)
        prefix = 0
        while prefix < len(offsets) and offsets[prefix] in acked:
            prefix += 1
        expected = offsets[prefix - 1] + 1 if prefix else None
        assert tracker.points().get(("t", 0)) == expected
        assert tracker.pending(("t", 0)) == len(offsets) - prefix



async def test_a_started_bus_answers_a_ping(bus_kind, clock):
    async with open_bus(bus_kind, clock) as bus:
        await bus.ping(timeout_s=10.0)   # raises BusError if the broker did not answer


async def test_read_starts_each_partition_at_its_own_offset(bus_kind, clock) -> None:
    """What a restart from a state snapshot does: resume each partition after what it covers."""
    async with open_bus(bus_kind, clock) as bus:
        topic = unique("perpartition")
        await bus.ensure_topics([topic])
        landed = {}
        for i in range(12):
            event = progress(f"job-{i % 4}", i)
            landed[await bus.publish(event, topic=topic, key=event.job_id)] = i
        partitions = sorted({p for p, _ in landed})
        assert len(partitions) >= 2, "the keys must spread over partitions for this test"
        named = partitions[0]
        covered = {named: 2}      # partition 0: skip two records; others not named: from the start
        got = await read_all(bus, topic, start=covered)
        expected = {(p, o) for (p, o) in landed if p != named or o >= 2}
        assert {(d.partition, d.offset) for d in got} == expected
        ends = await read_all(bus, topic, start={named: 1}, end={named: 2})
        assert {(d.partition, d.offset) for d in ends if d.partition == named} == {(named, 1)}
        assert not await read_all(bus, topic, start=dict.fromkeys(partitions, 100))
        with pytest.raises(ValueError):
            await read_all(bus, topic, start={named: -1})


async def test_a_log_read_collects_every_record_of_the_topics_in_the_order_asked(bus_kind, clock) -> None:
    """``read_bus`` (a started bus) and ``fetch_log`` (starts and stops it): what the CLI's
    replay, the fault harness and the end-to-end tests read a whole log with."""
    async with open_bus(bus_kind, clock) as bus:
        first, second = unique("logread-a"), unique("logread-b")
        await bus.ensure_topics([first, second])
        landed = {}
        for i in range(8):
            event = progress(f"job-{i % 3}", i)
            topic = first if i % 2 else second
            landed[(topic, *await bus.publish(event, topic=topic, key=event.job_id))] = event
        records = await read_bus(bus, [second, first])
        assert [r.topic for r in records] == [second] * 4 + [first] * 4
        assert {(r.topic, r.partition, r.offset): r.event for r in records} == landed
        assert {r.ts_ms for r in records} == {int(clock.time() * 1000)}
        name, bootstrap = bus_kind
        fresh = (KafkaBus(bootstrap, clock=clock, source="contract") if name == "kafka" else bus)
        if name == "memory":
            await bus.stop()
        assert await fetch_log(fresh, [second, first]) == records
        with pytest.raises(BusError):   # stopped again once read
            await read_all(fresh, first)
