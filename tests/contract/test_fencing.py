"""Fenced publishers and resumed subscriptions (:mod:`shared.bus.fencing`), on MemoryBus
and on KafkaBus (a real broker): the two parts a standby scheduler stands on."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from shared.bus import Bus, BusError
from shared.bus.fencing import Fenced
from shared.wire.events import JobCancelled
from shared.wire.topics import JOBS
from tests.contract.test_bus import WAIT_S, open_bus, progress, read_all, take, unique


def cancels(job: str, n: int) -> list[JobCancelled]:
    return [JobCancelled(ts=1.0, source="test", job_id=job, reason=f"r{i}") for i in range(n)]


async def of_job(bus: Bus, job: str, count: int) -> list[str]:
    """The reasons of ``job``'s events on hadar.jobs once ``count`` are visible (or WAIT_S
    passed). A committed batch becomes visible to read_committed readers when the broker has
    written its commit markers, just after ``publish_all`` returns (shared/bus/fencing.py)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        seen = [d.event.reason for d in await read_all(bus, JOBS) if getattr(d.event, "job_id", None) == job]
        if len(seen) >= count or asyncio.get_running_loop().time() > deadline:
            return seen
        await asyncio.sleep(0.05)


async def test_a_batch_lands_whole_and_reports_where(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        job = f"job-{uuid.uuid4().hex[:10]}"
        publisher = bus.fenced_publisher(unique("fence"))
        await publisher.start()
        try:
            where = await publisher.publish_all(cancels(job, 5))
        finally:
            await publisher.stop()
        assert await of_job(bus, job, 5) == [f"r{i}" for i in range(5)]
        assert len({p for p, _ in where}) == 1   # one key: one partition, offsets in order
        assert [o for _, o in where] == sorted(o for _, o in where)


async def test_a_newer_publisher_fences_the_older_one_for_good(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        job, fence = f"job-{uuid.uuid4().hex[:10]}", unique("fence")
        old, new = bus.fenced_publisher(fence), bus.fenced_publisher(fence)
        await old.start()
        try:
            await old.publish_all(cancels(job, 1))
            await new.start()
            for _ in range(2):   # and stays fenced: a resumed replica can never publish again
                with pytest.raises(Fenced) as raised:
                    await old.publish_all([JobCancelled(ts=1.0, source="old", job_id=job, reason="late")])
                assert not raised.value.retriable and isinstance(raised.value, BusError)
            await new.publish_all([JobCancelled(ts=1.0, source="new", job_id=job, reason="new")])
        finally:
            await old.stop()
            await new.stop()
        assert await of_job(bus, job, 2) == ["r0", "new"]


async def test_another_fencing_id_is_not_fenced(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        job = f"job-{uuid.uuid4().hex[:10]}"
        a, b = bus.fenced_publisher(unique("fence")), bus.fenced_publisher(unique("fence"))
        await a.start()
        await b.start()
        try:
            await a.publish_all(cancels(job, 1))
            await b.publish_all([JobCancelled(ts=1.0, source="b", job_id=job, reason="b")])
        finally:
            await a.stop()
            await b.stop()
        assert sorted(await of_job(bus, job, 2)) == ["b", "r0"]


async def test_a_member_resumes_where_it_says_not_where_the_group_committed(bus_kind, clock) -> None:
    async with open_bus(bus_kind, clock) as bus:
        topic, group = unique("resume"), unique("group")
        await bus.ensure_topics([topic])
        for i in range(8):
            await bus.publish(progress("job-a", i), topic=topic, key="job-a")
        async with bus.subscribe(topic, group) as first:   # another member handled and committed all 8
            done = await take(first, 8)
        (partition,) = {d.partition for d in done}
        own = {(topic, partition): 3}   # what this member itself handled: offsets 0-2
        async with bus.subscribe(topic, group, resume=lambda t, p: own.get((t, p))) as second:
            again = await take(second, 5)
        assert [d.event.steps_round for d in again] == [3, 4, 5, 6, 7]
        async with bus.subscribe(topic, group, resume=lambda t, p: None) as third:   # None: committed
            await bus.publish(progress("job-a", 8), topic=topic, key="job-a")
            (last,) = await take(third, 1)
        assert last.event.steps_round == 8
