"""The client-side view of the cluster: every topic folded as the scheduler folds it.

The connection flags and settings the subcommands use live in :mod:`shared.connect`.
"""

from __future__ import annotations

from services.scheduler.state import SchedulerState, fold_log
from shared.bus import Bus
from shared.topics import ALL_TOPICS

__all__ = ["fold_all"]


async def fold_all(bus: Bus) -> SchedulerState:
    """The cluster as the event log tells it: every topic folded, as the scheduler does."""
    items = []
    for topic in ALL_TOPICS:
        async for delivery in bus.read(topic):
            items.append((topic, delivery.event))
    return fold_log(items)
