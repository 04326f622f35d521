"""One bad record counts once in ``hadar_scheduler_dead_letters``: every consumer group that
meets it publishes a DeadLetter (same id, same origin), and a restarted scheduler reads the
dead-letter topic again -- before, one record showed as one count per group, doubled by a
restart (issue 17: ``hadar_dead_letters 8``)."""

from __future__ import annotations

import asyncio

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.metrics import DeadLetterTally
from services.scheduler.live.service import SchedulerService
from shared.bus import MemoryBus
from shared.bus.base import dead_letter
from shared.wire.topics import DEADLETTER, JOBS

CONFIG = SchedulerConfig(policy="yarn-cs", round_s=0.2, heartbeat_s=1000, consolidation_wait_s=0)


async def _letters(bus: MemoryBus) -> int:
    return len([d async for d in bus.read(DEADLETTER)])


async def _until(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def _count(service: SchedulerService) -> float | None:
    return service.registry.get_sample_value("hadar_scheduler_dead_letters", {"topic": JOBS})


async def test_one_bad_record_met_by_three_groups_and_a_restart_counts_once():
    bus = MemoryBus()
    await bus.start()
    await bus.ensure_topics()
    await bus.write_raw(JOBS, "bad", b"\xc1 not msgpack")
    others = [asyncio.create_task(_follow(bus, group)) for group in ("hadar-tracker", "hadar-profiler")]

    async def two_letters() -> bool:   # other services' groups met it first
        return await _letters(bus) == 2
    await _until(two_letters)
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)
    first = SchedulerService(bus=bus, config=CONFIG, run_rounds=False)
    await first.start()

    async def three_letters() -> bool:
        return await _letters(bus) == 3
    await _until(three_letters)
    await _until(lambda: _now(_count(first) == 1))
    await first.stop()

    again = SchedulerService(bus=bus, config=CONFIG, run_rounds=False)   # reads the topic from the start again
    await again.start()
    await asyncio.sleep(0.2)
    assert _count(again) == 1
    await again.stop()
    await bus.stop()


def test_the_tally_counts_origins_not_letters():
    tally = DeadLetterTally()
    letters = [dead_letter(topic=t, partition=p, offset=o, reason="bad", raw=b"x", ts=0.0, source=f"bus/{g}")
               for t, p, o in ((JOBS, 0, 5), ("hadar.progress", 1, 5)) for g in ("a", "b", "c")]
    assert [tally.add(letter) for letter in letters] == [True, False, False, True, False, False]
    assert tally.by_topic() == {JOBS: 1, "hadar.progress": 1}


async def _follow(bus: MemoryBus, group: str) -> None:
    async with bus.subscribe(JOBS, group) as sub:
        async for delivery in sub:
            await delivery.ack()


async def _now(value: bool) -> bool:
    return value
