"""The round loop's waits (services/scheduler/live/pacing.py) on the real clock: a sleep ends
at its time, or early once its wake predicate holds after an event, and however many events
come, the predicate (which may read the whole state) is checked at most every WAKE_EVERY_S."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.live.pacing import WAKE_EVERY_S, Pacer
from shared.clock import FakeClock, SystemClock


async def _events(pacer: Pacer, *, every_s: float, for_s: float) -> None:
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        pacer.changed()
        await asyncio.sleep(every_s)


async def test_a_storm_of_events_checks_the_wake_predicate_a_few_times_a_second() -> None:
    pacer = Pacer(SystemClock(), stopping=lambda: False)
    checks: list[float] = []

    def wake() -> bool:
        checks.append(time.monotonic())
        return False

    began = time.monotonic()
    storm = asyncio.create_task(_events(pacer, every_s=0.002, for_s=1.0))   # ~500 events a second
    woken = await pacer.sleep_until(time.time() + 1.0, wake)
    await storm
    assert woken is False and time.monotonic() - began >= 0.95
    assert len(checks) <= 1.0 / WAKE_EVERY_S + 2, len(checks)


async def test_a_sleep_ends_early_once_its_predicate_holds_after_an_event() -> None:
    pacer = Pacer(SystemClock(), stopping=lambda: False)
    ready = asyncio.Event()

    async def later() -> None:
        await asyncio.sleep(0.3)
        ready.set()
        pacer.changed()

    began = time.monotonic()
    task = asyncio.create_task(later())
    assert await pacer.sleep_until(time.time() + 30.0, ready.is_set) is True
    await task
    assert time.monotonic() - began < 10.0   # long before the 30 s it would have slept


async def test_under_a_fake_clock_a_sleep_jumps_to_its_end_as_the_clock_does() -> None:
    clock = FakeClock()
    pacer = Pacer(clock, stopping=lambda: False)
    start = clock.time()
    assert await pacer.sleep_until(start + 360.0, lambda: False) is False
    assert clock.time() == start + 360.0
    assert await pacer.sleep_until(clock.time() + 10.0) is False and clock.time() == start + 370.0
