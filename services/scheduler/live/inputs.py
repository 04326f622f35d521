"""The scheduler's input side: what it has read, folded into one state, and how far.

Guarantees:

* Every input record is folded into ``state`` once, in partition order. An event the state
  refuses, or whose fold raises, is dead-lettered with the reason, counted and logged, and
  changes nothing; consuming goes on.
* ``folded`` (``"topic:partition" -> offset``), ``placed`` (placements partition -> offset)
  and ``lettered`` (dead-letter partition -> offset) each name the next offset not yet
  folded, past the scheduler's own published rounds, and past the dead letters counted:
  what a snapshot records and where a restart resumes, never a consumer group's commits.
* Folding holds ``lock``; a round holds it while it plans, and a snapshot while it is
  captured, so the state never changes under either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from services.scheduler.live.metrics import SchedulerCounters, SchedulerTelemetry
from services.scheduler.live.rerun import LoggedEvent
from services.scheduler.live.state import SchedulerState
from shared.bus import Bus, Delivery
from shared.bus.rejection import Rejected, dead_letter_delivery
from shared.clock import Clock
from shared.persistence.snapshot import Recovered
from shared.wire.events import DeadLetter, Event, Progress, topic_for
from shared.wire.topics import DEADLETTER, JOBS, MODELS, NODES, PLACEMENTS, PROGRESS, QUEUES, THROUGHPUT

INPUT_TOPICS = (JOBS, NODES, THROUGHPUT, PROGRESS, MODELS, QUEUES)
RECOVERY_TOPICS = (*INPUT_TOPICS, PLACEMENTS)   # read from the start (or a snapshot) at start-up


class Inputs:
    def __init__(self, *, bus: Bus, group: str, source: str, clock: Clock, counters: SchedulerCounters,
                 telemetry: SchedulerTelemetry, log: Any, on_folded: Callable[[], None],
                 on_progress: Callable[[Progress], None]) -> None:
        """``on_folded`` runs after every record consumed; ``on_progress`` after each Progress applied."""
        self.bus, self.group, self.source, self.clock = bus, group, source, clock
        self.counters, self.telemetry, self._log = counters, telemetry, log
        self._on_folded, self._on_progress = on_folded, on_progress
        self.state = SchedulerState()
        self.folded: dict[str, int] = {}
        self.placed: dict[int, int] = {}
        self.lettered: dict[int, int] = {}
        self.lock = asyncio.Lock()

    @property
    def records(self) -> int:
        """Input records folded so far (those a restored snapshot covers included)."""
        return sum(self.folded.values())

    def adopt(self, state: SchedulerState, *, folded: dict[str, int], placed: dict[int, int],
              lettered: dict[int, int]) -> None:
        """Start from a restored snapshot's state and the offsets it covers."""
        self.state, self.folded, self.placed, self.lettered = state, folded, placed, lettered

    async def read_log(self, found: Recovered) -> list[LoggedEvent]:
        """Every record of the recovery topics past ``found``'s offsets (all without a snapshot),
        with the offsets advanced past them: what a restart re-derives its rounds from."""
        log: list[LoggedEvent] = []
        for topic in RECOVERY_TOPICS:
            async for d in self.bus.read(topic, start=found.start(topic)):
                log.append(LoggedEvent(topic=d.topic, partition=d.partition, offset=d.offset, event=d.event))
                if topic == PLACEMENTS:
                    self.note_placed(d.partition, d.offset)
                else:
                    self._note_folded(d)
        return log

    async def count_letters(self) -> int:
        """Count the dead letters past those already counted (all of them without a snapshot that counts them)."""
        letters = 0
        async for d in self.bus.read(DEADLETTER, start=dict(self.lettered)):
            letters += 1
            self._count_letter(d)
        return letters

    async def consume(self) -> None:
        """Fold every input record and count every dead letter, from where recovery ended, forever."""
        def resume(topic: str, partition: int) -> int:
            # Recovery read every input from the start (or a snapshot's offsets) to the end: a
            # partition it found nothing in is read from its start.
            if topic == DEADLETTER:
                return self.lettered.get(partition, 0)
            return self.folded.get(f"{topic}:{partition}", 0)
        async with self.bus.subscribe(list(INPUT_TOPICS) + [DEADLETTER], self.group, resume=resume) as sub:
            async for delivery in sub:
                if delivery.topic == DEADLETTER:
                    self._count_letter(delivery)
                else:
                    await self._fold(delivery)
                    self._note_folded(delivery)
                await delivery.ack()
                self._on_folded()

    async def applied(self, event: Event, partition: int | None = None, offset: int | None = None) -> None:
        """One of the scheduler's own events, acked by the bus, folded like any input."""
        async with self.lock:
            self.state.apply(event)
        if partition is not None and offset is not None and topic_for(event) == PLACEMENTS:
            self.note_placed(partition, offset)
        self.counters.events_out.labels(type=event.TYPE).inc()

    def note_placed(self, partition: int, offset: int) -> None:
        self.placed[partition] = max(self.placed.get(partition, 0), offset + 1)

    def _note_folded(self, delivery: Delivery) -> None:
        tp = f"{delivery.topic}:{delivery.partition}"
        self.folded[tp] = max(self.folded.get(tp, 0), delivery.offset + 1)

    def _count_letter(self, delivery: Delivery) -> None:
        """Count a record of hadar.deadletter (once per origin) and the offset it covers."""
        if isinstance(delivery.event, DeadLetter):
            self.telemetry.dead_letters.add(delivery.event)
        self.lettered[delivery.partition] = max(self.lettered.get(delivery.partition, 0), delivery.offset + 1)

    async def _fold(self, delivery: Delivery) -> None:
        event = delivery.event
        try:
            async with self.lock:
                applied = self.state.apply(event)
        except Exception as exc:   # Rejected, or a bug a hostile event found: never stop consuming
            reason = str(exc) if isinstance(exc, Rejected) else f"scheduler: {type(exc).__name__}: {exc}"
            self.counters.rejected.labels(type=event.TYPE).inc()
            self._log.warning("event.rejected", topic=delivery.topic, offset=delivery.offset, event_type=event.TYPE,
                              job=getattr(event, "job_id", None), node=getattr(event, "node_id", None),
                              round=getattr(event, "round", None), reason=reason[:300])
            await dead_letter_delivery(self.bus, delivery, reason, ts=self.clock.time(), source=self.source)
            return
        if applied:
            self.counters.events_in.labels(type=event.TYPE).inc()
            if isinstance(event, Progress):
                self._on_progress(event)
