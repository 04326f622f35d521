"""The client-side view of the cluster: every topic folded as the scheduler folds it.

The connection flags and settings the subcommands use live in :mod:`shared.runtime.connection`; the
group-less reading and following of the log in :mod:`services.cli.follow`.
"""

from __future__ import annotations

from services.cli.follow import read_view
from services.scheduler.live.state import SchedulerState
from shared.bus import Bus

__all__ = ["fold_all"]


async def fold_all(bus: Bus) -> SchedulerState:
    """The cluster as the event log tells it: every topic folded, as the scheduler does,
    without joining a consumer group (:func:`services.cli.follow.read_view`)."""
    return (await read_view(bus)).state
