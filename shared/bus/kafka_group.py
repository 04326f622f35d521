"""Kafka consumer-group members for :class:`~shared.bus.kafka.KafkaBus`.

Consumers: ``enable_auto_commit=False``, ``auto_offset_reset="earliest"``,
``isolation_level="read_committed"`` (a fenced publisher's open or aborted batch is never
delivered: :mod:`shared.bus.kafka_fencing`). Fetches favour
latency: ``fetch_min_bytes=1`` (the broker answers as soon as any record is there; a
larger minimum would hold records back), ``fetch_max_wait_ms=500`` (how long an empty
fetch waits at the broker -- it never delays a record, which completes the wait), and
``max_partition_fetch_bytes`` 1 MiB (a backlog drains in few round trips). Acks update an
:class:`~shared.bus.base.AckTracker`; a background task commits the tracker's points every
``commit_interval_s`` and ``stop()`` commits a final time, so a clean stop loses no ack and
a crash re-delivers at most the acks of the last interval (at-least-once).

Rebalances (aiokafka's eager protocol): when partitions are revoked the member commits
what was acked for them, forgets their un-acked deliveries (later acks for them are
ignored) and drops records it had fetched but not yet yielded; the next owner -- possibly
the same member -- resumes at the committed offset, so un-acked records are delivered
again. A handler that keeps the iterator waiting longer than ``max_poll_interval_ms``
(5 minutes) makes the member leave the group, with the same effect.

Tombstones (records with no value) and records that fail to decode are dead-lettered
(see :mod:`shared.bus.base`). A failure to publish the dead letter ends the iteration
with :class:`~shared.bus.base.BusError`; the record stays un-committed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import ConsumerStoppedError, KafkaError

from shared.bus.base import (
    TOMBSTONE_REASON,
    AckTracker,
    BusError,
    Delivery,
    Resume,
    Subscription,
    bus_error,
    check_started,
    dead_letter,
)
from shared.wire.events import InvalidEvent

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

    from shared.bus.kafka import KafkaBus

__all__ = ["KafkaSubscription"]

log = structlog.get_logger(__name__)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped: an Any base
    def __init__(self, sub: KafkaSubscription) -> None:
        self._sub = sub

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._sub.revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self._sub.assigned(list(assigned))


class KafkaSubscription(Subscription):
    """One member of a Kafka consumer group (one AIOKafkaConsumer)."""

    def __init__(self, bus: KafkaBus, topics: tuple[str, ...], group: str, *, resume: Resume | None = None) -> None:
        self.bus = bus
        self.topics = topics
        self.group = group
        self._resume = resume
        self._consumer: AIOKafkaConsumer | None = None
        self._tracker = AckTracker()
        self._generation: dict[tuple[str, int], int] = {}
        self._next_generation = 0
        self._committed: dict[tuple[str, int], int] = {}
        self._buffer: deque[ConsumerRecord] = deque()
        self._commit_lock = asyncio.Lock()
        self._committer: asyncio.Task[None] | None = None
        self._closing: asyncio.Future[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        if self._stopped:
            raise BusError("subscription already stopped", retriable=False)
        if self._consumer is not None:
            return
        check_started(self.bus.is_started)
        await self.bus.ensure_known(self.topics)
        consumer = AIOKafkaConsumer(
            **self.bus.client_options(self.group), group_id=self.group, enable_auto_commit=False,
            auto_offset_reset="earliest", fetch_min_bytes=1, fetch_max_wait_ms=500, isolation_level="read_committed",
            max_partition_fetch_bytes=1024 * 1024)
        consumer.subscribe(list(self.topics), listener=_Rebalance(self))
        self._consumer = consumer
        try:
            await consumer.start()
        except (TimeoutError, KafkaError, OSError) as exc:
            self._consumer = None
            await consumer.stop()
            raise bus_error(f"join group {self.group}", exc) from exc
        self.bus.register(self)
        self._committer = asyncio.create_task(self._commit_loop())

    async def stop(self) -> None:
        if self._closing is None:
            self._stopped = True
            self.bus.unregister(self)
            self._closing = asyncio.ensure_future(self._shutdown())
        # Shielded: a caller cancelled mid-stop must not leave the member in the group.
        await asyncio.shield(self._closing)

    async def _shutdown(self) -> None:
        if self._committer is not None:
            self._committer.cancel()
            await asyncio.gather(self._committer, return_exceptions=True)
        if self._consumer is not None:
            try:
                await self._commit()
            finally:
                self._generation.clear()
                await self._consumer.stop()

    async def __anext__(self) -> Delivery:
        if self._consumer is None:
            await self.start()
        assert self._consumer is not None
        while not self._stopped:
            while self._buffer:
                rec = self._buffer.popleft()
                out = self._deliver(rec)
                if type(out) is Delivery:
                    return out
                if out is not None:
                    await self._dead_letter(rec, out)
            try:
                batch = await self._consumer.getmany(timeout_ms=1000, max_records=2000)
            except ConsumerStoppedError:
                break
            except KafkaError as exc:
                raise bus_error(f"consume {','.join(self.topics)}", exc) from exc
            for records in batch.values():
                self._buffer.extend(records)
        raise StopAsyncIteration

    def _deliver(self, rec: ConsumerRecord) -> Delivery | str | None:
        """The Delivery for ``rec``; the dead-letter reason if it is bad; None if revoked."""
        tp = (rec.topic, rec.partition)
        generation = self._generation.get(tp)
        if generation is None:
            return None  # revoked after it was fetched
        self._tracker.delivered(tp, rec.offset)
        if rec.value is None:
            return TOMBSTONE_REASON
        try:
            event = self.bus.event_of(rec.value)
        except InvalidEvent as exc:
            return exc.reason
        return Delivery(topic=rec.topic, partition=rec.partition, offset=rec.offset,
                        key=rec.key.decode(errors="replace") if rec.key else "",
                        timestamp_ms=rec.timestamp, event=event,
                        _on_ack=partial(self._on_ack, tp, rec.offset, generation))

    async def _dead_letter(self, rec: ConsumerRecord, reason: str) -> None:
        tp = (rec.topic, rec.partition)
        generation = self._generation.get(tp)
        letter = dead_letter(topic=rec.topic, partition=rec.partition, offset=rec.offset,
                             reason=reason, raw=rec.value, ts=self.bus.clock.time(),
                             source=f"{self.bus.source}/{self.group}")
        log.warning("bus.deadletter", topic=rec.topic, partition=rec.partition,
                    offset=rec.offset, group=self.group, reason=reason)
        await self.bus.publish(letter)
        if generation is not None:
            self._on_ack(tp, rec.offset, generation)

    def _on_ack(self, tp: tuple[str, int], offset: int, generation: int) -> None:
        if self._generation.get(tp) == generation:
            self._tracker.ack(tp, offset)

    def assigned(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            self._next_generation += 1
            self._generation[(tp.topic, tp.partition)] = self._next_generation
            own = self._resume(tp.topic, tp.partition) if self._resume is not None else None
            if own is not None and self._consumer is not None:
                self._consumer.seek(tp, own)

    async def revoked(self, tps: list[TopicPartition]) -> None:
        keys = {(tp.topic, tp.partition) for tp in tps}
        await self._commit(only=keys)
        self._tracker.forget(keys)
        for key in keys:
            self._generation.pop(key, None)
            self._committed.pop(key, None)
        self._buffer = deque(r for r in self._buffer if (r.topic, r.partition) not in keys)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.bus.commit_interval_s)
            await self._commit()

    async def _commit(self, only: set[tuple[str, int]] | None = None) -> None:
        """Commit acked points not yet committed; a failed commit is logged and retried later
        (or superseded by the next owner re-reading from the last good commit)."""
        assert self._consumer is not None
        async with self._commit_lock:
            offsets = {
                TopicPartition(*tp): point for tp, point in self._tracker.points().items()
                if tp in self._generation and point > self._committed.get(tp, -1)
                and (only is None or tp in only)
            }
            if not offsets:
                return
            try:
                await self._consumer.commit(offsets)
            except (TimeoutError, KafkaError, OSError) as exc:
                log.warning("bus.commit.failed", group=self.group, error=f"{type(exc).__name__}: {exc}")
                return
            for tp, point in offsets.items():
                self._committed[(tp.topic, tp.partition)] = point
