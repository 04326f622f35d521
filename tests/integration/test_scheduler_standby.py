"""Two scheduler replicas with ``standby`` on one MemoryBus: one active, the other takes over
when it stops renewing, with no round published twice and no round number reused, and a
replica taken over while frozen publishes nothing after its successor (fencing)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from services.scheduler.live.service import SchedulerService
from shared.bus import MemoryBus
from shared.clock import SystemClock
from shared.wire.events import RoundStarted
from shared.wire.topics import PLACEMENTS
from tests.integration.test_scheduler_service import YARN, _seed

STANDBY = replace(YARN, round_s=0.5, standby=True, lease_ttl_s=1.0, snapshot_every=0)


async def rounds(bus: MemoryBus) -> list[RoundStarted]:
    return [d.event async for d in bus.read(PLACEMENTS) if isinstance(d.event, RoundStarted)]


async def until(predicate, timeout_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while not await predicate():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def replica(bus: MemoryBus, name: str) -> SchedulerService:
    return SchedulerService(bus=bus, config=STANDBY, clock=SystemClock(), holder=name)


def assert_one_history(started: list[RoundStarted]) -> None:
    numbers = [r.round for r in started]
    assert numbers == list(range(len(numbers))), numbers   # no round twice, none skipped or reused


async def test_the_standby_takes_over_a_crashed_active_one_and_numbers_on() -> None:
    bus = MemoryBus()
    await bus.start()
    await _seed(bus, SystemClock())   # type: ignore[arg-type]
    a, b = replica(bus, "a"), replica(bus, "b")
    await a.start()
    await until(lambda: _true(a.active))
    await b.start()
    await until(lambda: _count(bus, 3))
    assert a.health()["role"] == "active" and b.health()["role"] == "standby" and b.health()["ok"]
    for task in a._tasks:   # a crash: nothing stops cleanly, renewals and rounds just end
        task.cancel()
    crashed_at, last = time.monotonic(), len(await rounds(bus))
    await until(lambda: _count(bus, last + 3))
    took_over_s = time.monotonic() - crashed_at
    await b.stop()
    started = await rounds(bus)
    assert_one_history(started)
    assert b.recovery["term"] == 2 and b.health()["role"] == "active"
    # within two round lengths of the lease running out (ttl 1 s, rounds 0.5 s), on a loaded machine
    assert took_over_s < STANDBY.lease_ttl_s + 2 * STANDBY.round_s + 5.0


async def test_a_frozen_active_one_that_resumes_publishes_nothing_and_steps_down() -> None:
    bus = MemoryBus()
    await bus.start()
    await _seed(bus, SystemClock())   # type: ignore[arg-type]
    stepped: list[str] = []
    a = SchedulerService(bus=bus, config=STANDBY, clock=SystemClock(), holder="a",
                         on_stepped_down=lambda: stepped.append("a"))
    a.run_rounds = False   # rounds only when asked: the "freeze" is simply not asking
    await a.start()
    await until(lambda: _true(a.active))
    await a.plan_round()
    leading = next(t for t in a._tasks if t.get_name() == "scheduler-leadership")
    leading.cancel()   # frozen: no renewal from here on
    b = replica(bus, "b")
    await b.start()
    await until(lambda: _true(b.active))
    await until(lambda: _count(bus, 3))
    before = len(await rounds(bus))
    try:
        await a.plan_round()   # a wakes up believing it leads
    except Exception as exc:
        assert getattr(exc, "stage", None) == "fenced", exc
    else:
        raise AssertionError("a frozen replica published a round after its successor took over")
    assert stepped == ["a"] and a.health()["role"] == "stepped_down" and not a.health()["ok"]
    await b.stop()
    await a.stop()
    started = await rounds(bus)
    assert len(started) >= before
    assert_one_history(started)   # a's late round would have reused a number b had published


async def _true(value: bool) -> bool:
    return value


async def _count(bus: MemoryBus, n: int) -> bool:
    return len(await rounds(bus)) >= n
