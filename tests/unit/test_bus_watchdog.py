"""A service whose broker stays unreachable past a deadline says so on /healthz and exits
non-zero (so swarm restarts it); a short outage changes nothing (issue 12)."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from shared.bus import BusError, MemoryBus
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


async def test_a_short_outage_is_survived():
    bus = FlakyPing()
    await bus.start()
    watchdog = BusWatchdog(bus, interval_s=0.01, deadline_s=0.5)
    stop = asyncio.Event()
    task = asyncio.create_task(watchdog.run(stop))
    bus.down = True
    await asyncio.sleep(0.1)
    assert watchdog.health()["bus_reachable"] is False and watchdog.health()["ok"] is True
    bus.down = False
    await asyncio.sleep(0.1)
    assert watchdog.health() == {"ok": True, "bus_reachable": True, "bus_unreachable_s": 0.0}
    stop.set()
    await task
    assert watchdog.fatal is None


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
