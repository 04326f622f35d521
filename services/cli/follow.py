"""Reading the cluster from the log without joining a consumer group.

``jobs``, ``status``, ``cancel`` and ``watch`` read through :meth:`Bus.read` (a bounded,
group-less snapshot), so they leave nothing behind on the broker. ``watch`` follows by
polling: each :meth:`LogFollower.poll` re-reads every topic from a time cursor and folds
what is new; the fold drops what it has already applied by event id.

Guarantees:

* A poll reads the topics effects-first (models, progress, placements, throughput,
  nodes, jobs, queues), so every effect it sees has its cause in the same or an earlier poll.
* The cursor trails the newest record timestamp seen by :data:`FOLLOW_SLACK_S`, and
  each partition is read from its first record stamped at or after the cursor, so a
  record appended later stamped up to that much older (producers' clocks disagree, a
  publish in flight) is still read. Missed by ``watch`` (never by ``status`` or
  ``jobs``, which read everything): a record stamped before the cursor, appended to a
  partition holding nothing stamped after it.
* The cursor never runs ahead of this machine's clock less the slack, so one record
  stamped in the future (a producer's clock far ahead) cannot stall the follow.
* Nothing is left on the broker: no consumer group is joined or committed to.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.cli.joblog import FoldedEvent, TrainingLog
from services.scheduler.live.state import SchedulerState
from shared.bus import Bus
from shared.bus.rejection import Rejected
from shared.clock import Clock, SystemClock
from shared.wire.events import (
    Assignment,
    Event,
    JobCancelled,
    JobSubmitted,
    RoundStarted,
)
from shared.wire.topics import JOBS, MODELS, NODES, PLACEMENTS, PROGRESS, QUEUES, THROUGHPUT

__all__ = ["ClusterView", "LogFollower", "read_view", "submitted_ids", "FOLLOW_SLACK_S", "READ_ORDER"]

FOLLOW_SLACK_S = 30.0
READ_ORDER: tuple[str, ...] = (MODELS, PROGRESS, PLACEMENTS, THROUGHPUT, NODES, JOBS, QUEUES)
_FOLD_RANK = {QUEUES: 0, JOBS: 1, NODES: 2, THROUGHPUT: 3, PROGRESS: 4, MODELS: 5}   # causes before effects


@dataclass
class ClusterView:
    """The folded log, plus when each cancelled job was cancelled (the state keeps no time)."""

    state: SchedulerState = field(default_factory=lambda: SchedulerState(
        seen_window=sys.maxsize, rounds_kept=sys.maxsize, finished_kept=sys.maxsize, rounds_in_order=False))
    cancelled_at: dict[str, float] = field(default_factory=dict)
    training: TrainingLog = field(default_factory=TrainingLog)   # loss, samples/s, metrics (``hadar logs``)
    new_training: list[FoldedEvent] = field(default_factory=list)   # what the last fold added to ``training``

    def fold(self, items: Iterable[tuple[str, Event]]) -> None:
        """Apply a batch as :func:`~services.scheduler.live.state.fold_log` orders a whole log:
        RoundStarted by round, then the other events (jobs, nodes, throughput, progress,
        models: a job exists before its news), then Assignments by round. Events the
        state refuses are left out, as the scheduler left them out; repeats change nothing."""
        items = list(items)
        self.new_training = self.training.fold(event for _, event in items)
        placements: list[Event] = []
        others: list[tuple[int, Event]] = []
        for topic, event in items:
            if topic == PLACEMENTS:
                placements.append(event)
            elif topic in _FOLD_RANK:
                others.append((_FOLD_RANK[topic], event))
        others.sort(key=lambda pair: pair[0])   # stable: each topic keeps its replay order
        rounds = sorted((e for e in placements if isinstance(e, RoundStarted)), key=lambda e: e.round)
        assignments = sorted((e for e in placements if isinstance(e, Assignment)), key=lambda e: e.round)
        for event in [*rounds, *(e for _, e in others), *assignments]:
            try:
                applied = self.state.apply(event)
            except Rejected:
                continue
            if applied and isinstance(event, JobCancelled):
                self.cancelled_at.setdefault(event.job_id, event.ts)


class LogFollower:
    """A view of the cluster kept current by polling the log; see the module guarantees."""

    def __init__(self, bus: Bus, *, slack_s: float = FOLLOW_SLACK_S, clock: Clock | None = None) -> None:
        self.view = ClusterView()
        self._bus = bus
        self._clock = clock or SystemClock()
        self._slack_s = slack_s
        self._start: float | None = None   # unix seconds; None: the log start
        self._newest_ms: int | None = None

    async def poll(self) -> ClusterView:
        """Read what was appended since the last poll (the whole log the first time) and fold it."""
        items: list[tuple[str, Event]] = []
        for topic in READ_ORDER:
            async with contextlib.aclosing(self._bus.read(topic, start=self._start)) as records:
                async for delivery in records:
                    items.append((topic, delivery.event))
                    if self._newest_ms is None or delivery.timestamp_ms > self._newest_ms:
                        self._newest_ms = delivery.timestamp_ms
        self.view.fold(items)
        if self._newest_ms is not None:
            self._start = min(self._newest_ms / 1000.0, self._clock.time()) - self._slack_s
        return self.view


async def read_view(bus: Bus) -> ClusterView:
    """The whole log folded, as of now."""
    return await LogFollower(bus).poll()


async def submitted_ids(bus: Bus) -> set[str]:
    """Every job id ever submitted (``hadar.jobs`` only: cheap next to a whole-log read)."""
    ids: set[str] = set()
    async for delivery in bus.read(JOBS):
        if isinstance(delivery.event, JobSubmitted):
            ids.add(delivery.event.job_id)
    return ids
