"""A service whose broker stays unreachable past a deadline says so on /healthz and exits
non-zero (so swarm restarts it); a short outage changes nothing (issue 12)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from shared.bus import BusError, MemoryBus
from shared.clock import FakeClock
from shared.runtime.service import BusWatchdog, run_service


class FlakyPing(MemoryBus):
    """A bus that cannot be reached while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def ping(self, timeout_s: float = 5.0) -> None:
        if self.down:
            raise BusError("ping: ConnectionRefusedError", retriable=True)


class Idle:
    name = "idle"

    def __init__(self) -> None:
        self.registry = CollectorRegistry()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def health(self) -> dict[str, Any]:
        return {"ok": True}


async def _until(probe: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Yield to the loop until ``probe()``; the deadline is generous because only the
    watchdog's own (fake) clock measures the outage, never the machine's load."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not probe():
        assert loop.time() < end, "the watchdog never got there"
        await asyncio.sleep(0.005)


async def test_a_short_outage_is_survived():
    """The outage is measured on a fake clock: a loaded machine that stalls the loop for
    longer than the deadline (CI did, stop 54) must not turn a short outage into a fatal one."""
    bus = FlakyPing()
    await bus.start()
    clock = FakeClock()
    watchdog = BusWatchdog(bus, interval_s=0.01, deadline_s=0.5, now=clock.time)
    stop = asyncio.Event()
    task = asyncio.create_task(watchdog.run(stop))
    await _until(lambda: watchdog.health()["bus_reachable"] is True)
    bus.down = True
    await _until(lambda: watchdog.health()["bus_reachable"] is False)
    clock.advance(0.4)
    await asyncio.sleep(0.05)
    assert watchdog.health() == {"ok": True, "bus_reachable": False, "bus_unreachable_s": 0.4}
    bus.down = False
    await _until(lambda: watchdog.health()["bus_reachable"] is True)
    assert watchdog.health() == {"ok": True, "bus_reachable": True, "bus_unreachable_s": 0.0}
    stop.set()
    await task
    assert watchdog.fatal is None


async def test_the_deadline_counts_on_the_watchdogs_clock():
    bus = FlakyPing()
    await bus.start()
    clock = FakeClock()
    watchdog = BusWatchdog(bus, interval_s=0.01, deadline_s=0.5, now=clock.time)
    stop = asyncio.Event()
    bus.down = True
    task = asyncio.create_task(watchdog.run(stop))
    await _until(lambda: watchdog.health()["bus_reachable"] is False)
    assert watchdog.fatal is None and not stop.is_set()
    clock.advance(0.6)
    await asyncio.wait_for(task, 30)
    assert stop.is_set() and watchdog.fatal == "broker unreachable for more than 0.5 s"
    assert watchdog.health()["ok"] is False


async def test_a_broker_unreachable_past_the_deadline_fails_health_and_exits_non_zero():
    bus = FlakyPing()
    await bus.start()
    bus.down = True
    code = await asyncio.wait_for(
        run_service(Idle(), http_port=None, bus=bus, bus_check_s=0.01, bus_deadline_s=0.2), 10)
    assert code == 1


async def test_a_clean_stop_exits_zero():
    bus = FlakyPing()
    await bus.start()
    stop = asyncio.Event()
    run = asyncio.create_task(run_service(Idle(), http_port=None, bus=bus, bus_check_s=0.01, stop_event=stop))
    await asyncio.sleep(0.05)
    stop.set()
    assert await asyncio.wait_for(run, 10) == 0
