"""MemoryBus: the bus contract in one process, for the embedded demo and for tests.

The MemoryBus object plays the broker: its logs and its groups' committed offsets outlive
``stop()``/``start()``, so a service "restarted" on the same object sees what a restarted
Kafka consumer sees. Records are stored encoded, so decoding and dead-lettering follow
the same path as on Kafka. The partition of a key is ``crc32(key) % partitions``.

Groups: the partitions of the topics a group reads are dealt round-robin, in join order,
to the members subscribed to each topic, again whenever a member joins or leaves. A
partition that moves resumes at the group's committed offset; the old member's late acks
for it are ignored. A member keeps the position of a partition it still owns.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import structlog

from shared.bus.base import (
    TOMBSTONE_REASON,
    AckTracker,
    Bus,
    BusError,
    Delivery,
    Position,
    Resume,
    Subscription,
    TopicPartition,
    check_position,
    check_started,
    check_topic,
    dead_letter,
    partition_position,
    start_ms,
    topic_list,
    yield_now,
)
from shared.bus.fencing import BatchFailed, Fenced, FencedPublisher
from shared.clock import Clock, SystemClock
from shared.wire.events import Event, InvalidEvent, encode, key_for, topic_for
from shared.wire.topics import ALL_TOPICS

__all__ = ["MemoryBus", "MemoryFencedPublisher"]

log = structlog.get_logger(__name__)
YIELD_EVERY = 64  # deliveries between forced yields to the event loop


@dataclass(frozen=True, slots=True)
class _Record:
    offset: int
    key: str | None
    timestamp_ms: int
    value: bytes | None


class _Group:
    def __init__(self) -> None:
        self.committed: dict[TopicPartition, int] = {}
        self.members: list[MemorySubscription] = []


class MemoryBus(Bus):
    """In-process bus with the same semantics as :class:`~shared.bus.KafkaBus`."""

    def __init__(self, partitions: int = 3, *, clock: Clock | None = None, source: str = "bus") -> None:
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self._partitions = partitions
        self._clock = clock or SystemClock()
        self._source = source
        self._logs: dict[str, list[list[_Record]]] = {}
        self._groups: dict[str, _Group] = {}
        self._subscriptions: set[MemorySubscription] = set()
        self._fencing: dict[str, int] = {}   # fencing id -> epoch of its newest publisher
        self._started = False

    async def start(self) -> None:
        self._started = True

    async def stop(self) -> None:
        for sub in list(self._subscriptions):
            await sub.stop()
        self._started = False

    async def ensure_topics(self, topics: Iterable[str] = ALL_TOPICS) -> None:
        check_started(self._started)
        for topic in topic_list(topics):
            self._create(topic)

    async def _enqueue(self, topic: str, key: str | None, value: bytes | None,
                       partition: int | None) -> Awaitable[tuple[int, int]]:
        check_started(self._started)
        done: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        done.set_result(self._append(topic, key, value, partition=partition))
        return done

    def subscribe(self, topics: str | Iterable[str], group: str, *, resume: Resume | None = None
                  ) -> MemorySubscription:
        if not group:
            raise BusError("subscribe needs a group id", retriable=False)
        return MemorySubscription(self, topic_list(topics), group, resume=resume)

    def fenced_publisher(self, fencing_id: str) -> FencedPublisher:
        return MemoryFencedPublisher(self, fencing_id)

    async def read(self, topic: str, *, start: Position = None, end: Position = None
                   ) -> AsyncGenerator[Delivery, None]:
        check_started(self._started)
        check_position("start", start)
        check_position("end", end)
        partitions = self._logs.get(check_topic(topic), [])
        # Logs are append-only, so [lo, hi) fixed now is a snapshot.
        heads = {p: _bound(records, partition_position(start, p), 0) for p, records in enumerate(partitions)}
        ends = {p: _bound(records, partition_position(end, p), len(records)) for p, records in enumerate(partitions)}
        live = {p for p in heads if heads[p] < ends[p]}
        emitted = 0
        while live:
            # (timestamp, partition) of each partition's next record; offsets tie-break within one.
            p = min(live, key=lambda q: (partitions[q][heads[q]].timestamp_ms, q))
            rec = partitions[p][heads[p]]
            heads[p] += 1
            if heads[p] == ends[p]:
                live.discard(p)
            event = self._decode_for_replay(topic, p, rec, self.event_of)
            if event is not None:
                yield Delivery(topic=topic, partition=p, offset=rec.offset, key=rec.key or "",
                               timestamp_ms=rec.timestamp_ms, event=event)
                emitted += 1
                if emitted % YIELD_EVERY == 0:
                    await yield_now()

    @staticmethod
    def _decode_for_replay(topic: str, partition: int, rec: _Record,
                           event_of: Callable[[bytes], Event]) -> Event | None:
        if rec.value is None:
            return None
        try:
            return event_of(rec.value)
        except InvalidEvent as exc:
            log.warning("bus.read.skip", topic=topic, partition=partition, offset=rec.offset,
                        reason=exc.reason)
            return None

    # ------------------------------------------------------------ broker side

    def _create(self, topic: str) -> list[list[_Record]]:
        partitions = self._logs.get(topic)
        if partitions is None:
            partitions = self._logs[check_topic(topic)] = [[] for _ in range(self._partitions)]
        return partitions

    def _append(self, topic: str, key: str | None, value: bytes | None,
                *, partition: int | None = None) -> tuple[int, int]:
        partitions = self._create(topic)
        if partition is None:
            partition = zlib.crc32((key or "").encode()) % len(partitions)
        elif not 0 <= partition < len(partitions):
            raise BusError(f"{topic} has no partition {partition}", retriable=False)
        records = partitions[partition]
        offset = len(records)
        records.append(_Record(offset, key, int(self._clock.time() * 1000), value))
        for sub in self._subscriptions:
            if topic in sub.topics:
                sub.wake()
        return partition, offset

    def _join(self, sub: MemorySubscription) -> None:
        for topic in sub.topics:
            self._create(topic)
        group = self._groups.setdefault(sub.group, _Group())
        group.members.append(sub)
        self._subscriptions.add(sub)
        _rebalance(group)

    def _leave(self, sub: MemorySubscription) -> None:
        group = self._groups[sub.group]
        group.members.remove(sub)
        self._subscriptions.discard(sub)
        _rebalance(group)


def _rebalance(group: _Group) -> None:
    if not group.members:
        return
    bus = group.members[0].bus
    owners: dict[MemorySubscription, set[TopicPartition]] = {m: set() for m in group.members}
    topics = sorted({t for m in group.members for t in m.topics})
    for topic in topics:
        readers = [m for m in group.members if topic in m.topics]
        for partition in range(len(bus._logs[topic])):
            owners[readers[partition % len(readers)]].add((topic, partition))
    for member, tps in owners.items():
        member.assign(tps, group.committed)


def _bound(records: list[_Record], position: float | None, default: int) -> int:
    """Index in ``records`` (offset == index) of a start/end position."""
    if position is None:
        return default
    if isinstance(position, float):
        at = start_ms(position)
        return next((r.offset for r in records if r.timestamp_ms >= at), len(records))
    return min(position, len(records))


class MemorySubscription(Subscription):
    """One member of a MemoryBus consumer group."""

    def __init__(self, bus: MemoryBus, topics: tuple[str, ...], group: str, *, resume: Resume | None = None) -> None:
        self.bus = bus
        self.topics = topics
        self.group = group
        self._resume = resume
        self._positions: dict[TopicPartition, int] = {}
        self._generation: dict[TopicPartition, int] = {}
        self._next_generation = 0
        self._tracker = AckTracker()
        self._wakeup = asyncio.Event()
        self._order: list[TopicPartition] = []
        self._cursor = 0
        self._since_yield = 0
        self._joined = False
        self._stopped = False

    async def start(self) -> None:
        if self._stopped:
            raise BusError("subscription already stopped", retriable=False)
        if not self._joined:
            check_started(self.bus._started)
            self._joined = True
            self.bus._join(self)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._joined:
            self.bus._leave(self)  # acks already committed: memory commits on ack
        self._positions.clear()
        self._order = []
        self._generation.clear()  # later acks must not move the group past its next member
        self.wake()

    def wake(self) -> None:
        self._wakeup.set()

    def assign(self, tps: set[TopicPartition], committed: dict[TopicPartition, int]) -> None:
        lost = [tp for tp in self._positions if tp not in tps]
        self._tracker.forget(lost)
        for tp in lost:
            del self._positions[tp]
            del self._generation[tp]
        for tp in sorted(tps - self._positions.keys()):
            own = self._resume(*tp) if self._resume is not None else None
            self._positions[tp] = own if own is not None else committed.get(tp, 0)
            self._next_generation += 1
            self._generation[tp] = self._next_generation
        self._order = sorted(self._positions)
        self.wake()

    async def __anext__(self) -> Delivery:
        await self.start()
        while True:
            self._since_yield += 1
            if self._since_yield >= YIELD_EVERY:  # like a fetched batch: let others run
                self._since_yield = 0
                await yield_now()  # before picking: a rebalance may run while we yield
            if self._stopped:
                raise StopAsyncIteration
            found = self._next_record()
            if found is None:
                self._wakeup.clear()
                self._since_yield = 0
                await self._wakeup.wait()
                continue
            tp, rec = found
            delivery = self._deliver(tp, rec)
            if delivery is not None:
                return delivery

    def _next_record(self) -> tuple[TopicPartition, _Record] | None:
        tps = self._order
        for i in range(len(tps)):
            tp = tps[(self._cursor + i) % len(tps)]
            records = self.bus._logs[tp[0]][tp[1]]
            position = self._positions[tp]
            if position < len(records):
                self._positions[tp] = position + 1
                self._cursor = (self._cursor + i + 1) % len(tps)
                return tp, records[position]
        return None

    def _deliver(self, tp: TopicPartition, rec: _Record) -> Delivery | None:
        self._tracker.delivered(tp, rec.offset)
        on_ack = partial(self._on_ack, tp, rec.offset, self._generation[tp])

        if rec.value is None:
            reason = TOMBSTONE_REASON
        else:
            try:
                event = self.bus.event_of(rec.value)
            except InvalidEvent as exc:
                reason = exc.reason
            else:
                return Delivery(topic=tp[0], partition=tp[1], offset=rec.offset, key=rec.key or "",
                                timestamp_ms=rec.timestamp_ms, event=event, _on_ack=on_ack)
        letter = dead_letter(topic=tp[0], partition=tp[1], offset=rec.offset, reason=reason,
                             raw=rec.value, ts=self.bus._clock.time(),
                             source=f"{self.bus._source}/{self.group}")
        log.warning("bus.deadletter", topic=tp[0], partition=tp[1], offset=rec.offset,
                    group=self.group, reason=reason)
        self.bus._append(topic_for(letter), key_for(letter), encode(letter))
        on_ack()
        return None

    def _on_ack(self, tp: TopicPartition, offset: int, generation: int) -> None:
        if self._generation.get(tp) != generation:
            return  # the partition moved on a rebalance; the new owner gets the record again
        if self._tracker.ack(tp, offset):
            group = self.bus._groups[self.group]
            point = self._tracker.points()[tp]
            group.committed[tp] = max(group.committed.get(tp, 0), point)


class MemoryFencedPublisher(FencedPublisher):
    """A fenced publisher on a MemoryBus: the bus keeps each id's newest epoch; a batch is
    appended in one step (no await), so no consumer ever sees part of it."""

    def __init__(self, bus: MemoryBus, fencing_id: str) -> None:
        if not fencing_id:
            raise BusError("a fenced publisher needs a fencing id", retriable=False)
        self.bus = bus
        self.fencing_id = fencing_id
        self._epoch: int | None = None

    async def start(self) -> None:
        check_started(self.bus._started)
        if self._epoch is None:
            self._epoch = self.bus._fencing.get(self.fencing_id, 0) + 1
            self.bus._fencing[self.fencing_id] = self._epoch

    async def publish_all(self, events: Sequence[Event]) -> list[tuple[int, int]]:
        if self._epoch is None:
            raise BatchFailed(f"fenced publisher {self.fencing_id} not started", retriable=False,
                              maybe_visible=False)
        if self.bus._fencing.get(self.fencing_id) != self._epoch:
            raise Fenced(f"fenced publisher {self.fencing_id}: a newer publisher of this id started")
        if not self.bus._started:
            raise BatchFailed("bus not started", retriable=True, maybe_visible=False)
        records = [(topic_for(e), key_for(e), self.bus.wire_value(e)) for e in events]   # encode all first
        return [self.bus._append(topic, key, value) for topic, key, value in records]

    async def stop(self) -> None:
        self._epoch = None
