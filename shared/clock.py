"""Time behind an interface, so services can be driven by a fake clock in tests."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the Unix epoch."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when told; ``sleep`` advances it and yields to the loop."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        self._now += max(0.0, seconds)
        await asyncio.sleep(0)
