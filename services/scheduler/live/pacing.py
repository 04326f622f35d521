"""When the scheduler's round loop wakes: waits on the service clock, cut short by folded events.

:class:`Pacer` owns the signal the consumer raises after each folded event. Its waits read
time only from the service clock, so under a fake clock (tests) a sleep jumps at once, as
the clock's own sleep does. :func:`wake_after_empty_round` is the rule for ending a round
early, pure over the scheduler's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.scheduler.live.state import SchedulerState
from shared.clock import Clock

POLL_S = 0.5   # the longest a wait goes without reading the clock again
WAKE_EVERY_S = 0.25   # the most often a sleep re-checks ``wake``: a check may read the whole state,
                      # and a large cluster's heartbeats are hundreds of events a second


class Pacer:
    """Waits that end when a predicate over the folded state holds, time runs out, or the
    service stops (``stopping``). ``changed()`` is called after every folded event."""

    def __init__(self, clock: Clock, *, stopping: Callable[[], bool]) -> None:
        self.clock = clock
        self._stopping = stopping
        self._changed = asyncio.Event()

    def changed(self) -> None:
        self._changed.set()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``predicate()`` holds (True) or ``timeout_s`` of clock time passed or the
        service stops (then ``predicate()``'s value)."""
        deadline = self.clock.time() + timeout_s
        while not predicate():
            remaining = deadline - self.clock.time()
            if remaining <= 0 or self._stopping():
                return predicate()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(remaining, POLL_S))
            except TimeoutError:
                pass
        return True

    async def sleep_until(self, at: float, wake: Callable[[], bool] | None = None) -> bool:
        """The clock's sleep until ``at``, ended early once ``wake()`` holds after an event
        (checked at most every ``WAKE_EVERY_S``); True if it was."""
        if wake is None:
            await self.clock.sleep(at - self.clock.time())
            return False
        while not self._stopping() and at > self.clock.time():
            if wake():
                return True
            self._changed.clear()
            sleeping = asyncio.ensure_future(self.clock.sleep(at - self.clock.time()))
            changed = asyncio.ensure_future(self._changed.wait())
            await asyncio.wait((sleeping, changed), return_when=asyncio.FIRST_COMPLETED)
            for task in (sleeping, changed):
                task.cancel()
            if sleeping.done() and not sleeping.cancelled():
                return False
            await self.clock.sleep(min(WAKE_EVERY_S, at - self.clock.time()))
        return False


def wake_after_empty_round(state: SchedulerState, round_: int, *, now: Callable[[], float],
                           heartbeat_s: float) -> Callable[[], bool] | None:
    """For a round that placed nothing while jobs wait: a predicate, true once a job gets its
    first estimate or a node joins (:meth:`SchedulerState.placeable` grows past what the
    round was planned with), so the next round need not wait out this one: nothing runs in
    it. None for any other round, which runs its full length."""
    record = state.rounds.get(round_)
    if record is None or record.assignments or not state.active_jobs():
        return None
    jobs, nodes = state.placeable(now(), heartbeat_s)

    def grown() -> bool:
        now_jobs, now_nodes = state.placeable(now(), heartbeat_s)
        return not (now_jobs <= jobs and now_nodes <= nodes)
    return grown
