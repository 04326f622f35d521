"""KafkaBus: the bus contract on Apache Kafka, through aiokafka 0.14.

Producer: idempotent (``enable_idempotence=True``, hence ``acks=all``), so a retried
batch is never written twice and a partition keeps send order. Record timestamps are the
bus clock's time at publish (CreateTime).

Durability: a publish is durable when its future resolves -- the partition leader has
the record and so do all in-sync replicas (``acks=all``). Topics this bus creates are
replicated as the cluster's ``default.replication.factor`` says (:mod:`shared.bus.kafka_topics`):
on a single broker (development, loopback) that is the leader's log only; on a cluster of
three with ``min.insync.replicas=2`` (``hadar infra up --brokers 3``, production) a record
acknowledged is on at least two brokers and survives the loss of one; with only one broker
left a publish is not acknowledged -- the producer retries it until a second broker is back
in sync, or it fails -- never acknowledged with one copy. ``bootstrap`` may list several
brokers; any one that answers will do, and the clients follow partition leaders as they
move. The latency settings below never weaken this.

Latency settings (issue 14): aiokafka keeps one produce request in flight per broker,
so records gather into batches while it is out; ``linger_ms=0`` therefore sends a lone
record at once and batches under load by itself (a larger linger only delays the first
record of each batch). ``max_batch_size`` 256 KiB bounds a partition's batch (the
broker takes 1 MiB). No compression: on loopback and LAN links the CPU costs more than
the bytes. Keys are hashed to partitions exactly as by Kafka's default partitioner
(:class:`KeyPartitioner`). Consumer settings: :mod:`shared.bus.kafka_group`.

Consumer groups: see :mod:`shared.bus.kafka_group`. Replay (:meth:`KafkaBus.read`) uses
a group-less consumer assigned to every partition of the topic.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, for_code
from aiokafka.partitioner import DefaultPartitioner, murmur2

from shared.bus.base import (
    Bus,
    BusError,
    Delivery,
    Position,
    Resume,
    bus_error,
    check_position,
    check_started,
    check_topic,
    replay_order,
    start_ms,
    topic_list,
)
from shared.bus.kafka_group import KafkaSubscription
from shared.bus.kafka_login import diagnose, security_options
from shared.bus.kafka_topics import UNKNOWN_TOPIC, admin_request, cluster_replication_factor, create_topics
from shared.bus.settings import KafkaSecurity
from shared.clock import Clock, SystemClock
from shared.wire.events import Event, InvalidEvent
from shared.wire.topics import ALL_TOPICS

if TYPE_CHECKING:
    from aiokafka.structs import ConsumerRecord

    from shared.bus.fencing import FencedPublisher
    from shared.bus.settings import KafkaSettings

__all__ = ["KafkaBus", "KeyPartitioner"]

log = structlog.get_logger(__name__)


class KafkaBus(Bus):
    """The bus on a Kafka cluster at ``bootstrap`` (``host:port[,host:port]``).

    ``partitions``/``replication_factor`` apply to topics this bus creates; no
    ``replication_factor`` means the cluster's ``default.replication.factor``.
    ``linger_ms`` makes the producer wait that long for more records before a batch
    goes out (0: batches form only while a request is in flight; see the module doc).
    ``security`` says how every client of this bus authenticates (default PLAINTEXT);
    a start that fails for a security reason raises a non-retriable BusError whose one
    line names the setting (:mod:`shared.bus.kafka_login`).

    Its consumer-group members (:class:`~shared.bus.kafka_group.KafkaSubscription`) use only
    :attr:`is_started`, :meth:`ensure_known`, :meth:`client_options`,
    :meth:`register`/:meth:`unregister`, :meth:`~shared.bus.base.Bus.publish` and the
    attributes ``clock``, ``source`` and ``commit_interval_s``. That interface is for this
    package, not for services, which use the :class:`~shared.bus.base.Bus` contract.
    """

    def __init__(self, bootstrap: str, *, partitions: int = 3, replication_factor: int | None = None,
                 clock: Clock | None = None, source: str = "bus", linger_ms: int = 0,
                 commit_interval_s: float = 0.2, request_timeout_ms: int = 30_000,
                 security: KafkaSecurity | None = None) -> None:
        if partitions < 1 or (replication_factor is not None and replication_factor < 1):
            raise ValueError("partitions and replication_factor must be >= 1")
        self.bootstrap = bootstrap
        self.security = security or KafkaSecurity()
        self._security_options = security_options(self.security)
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.commit_interval_s = commit_interval_s
        self.request_timeout_ms = request_timeout_ms
        self.clock = clock or SystemClock()
        self.source = source
        self._linger_ms = linger_ms
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._known_topics: set[str] = set()
        self._cluster_replication: int | None = None
        self._subscriptions: set[KafkaSubscription] = set()

    @classmethod
    def from_settings(cls, settings: KafkaSettings, **options: Any) -> KafkaBus:
        return cls(settings.bootstrap, partitions=settings.partitions, security=settings.security, **options)

    async def start(self) -> None:
        if self._producer is not None:
            return
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, client_id=f"hadar-{self.source}",
            enable_idempotence=True, acks="all", linger_ms=self._linger_ms,
            max_batch_size=256 * 1024, compression_type=None,
            request_timeout_ms=self.request_timeout_ms, partitioner=KeyPartitioner(), **self._security_options)
        admin = AIOKafkaAdminClient(**self.client_options("admin"))
        try:
            await producer.start()
            await admin.start()
        except (TimeoutError, KafkaError, OSError) as exc:
            await producer.stop()
            await admin.close()
            reason = await diagnose(self.bootstrap, self.security) if self.security.protocol != "PLAINTEXT" else None
            if reason is not None:
                raise BusError(reason, retriable=False) from None
            raise bus_error(f"cannot connect to kafka at {self.bootstrap} ({self.security.describe()})",
                            exc) from exc
        self._producer, self._admin = producer, admin

    async def stop(self) -> None:
        for sub in list(self._subscriptions):
            await sub.stop()
        producer, admin = self._producer, self._admin
        self._producer = self._admin = None
        if producer is not None:
            await producer.stop()  # flushes records still in flight
        if admin is not None:
            await admin.close()

    async def ping(self, timeout_s: float = 5.0) -> None:
        """A metadata round trip to the cluster; BusError (retriable) if none answers in time."""
        check_started(self._admin is not None)
        assert self._admin is not None
        try:
            await asyncio.wait_for(admin_request(self._admin, self._admin.describe_cluster), timeout_s)
        except Exception as exc:   # whatever the client raises, the broker was not reached
            raise bus_error("ping", exc) from exc

    async def ensure_topics(self, topics: Iterable[str] = ALL_TOPICS) -> None:
        check_started(self._admin is not None)
        assert self._admin is not None
        names = topic_list(topics)
        factor = self.replication_factor or self._cluster_replication
        if factor is None:
            factor = self._cluster_replication = await cluster_replication_factor(self._admin)
        await create_topics(self._admin, names, partitions=self.partitions, replication_factor=factor,
                            security=self.security)
        self._known_topics.update(names)

    async def _enqueue(self, topic: str, key: str | None, value: bytes | None,
                       partition: int | None) -> Awaitable[tuple[int, int]]:
        check_started(self._producer is not None)
        assert self._producer is not None
        if topic not in self._known_topics:
            await self.ensure_known([check_topic(topic)])
        try:
            future = await self._producer.send(
                topic, value=value, key=key.encode() if key is not None else None, partition=partition,
                timestamp_ms=int(self.clock.time() * 1000))
        except (TimeoutError, KafkaError, OSError) as exc:
            raise bus_error(f"publish to {topic}", exc) from exc
        return _durable(topic, future)

    def subscribe(self, topics: str | Iterable[str], group: str, *, resume: Resume | None = None
                  ) -> KafkaSubscription:
        if not group:
            raise BusError("subscribe needs a group id", retriable=False)
        return KafkaSubscription(self, topic_list(topics), group, resume=resume)

    def fenced_publisher(self, fencing_id: str) -> FencedPublisher:
        from shared.bus.kafka_fencing import KafkaFencedPublisher

        return KafkaFencedPublisher(self, fencing_id)

    async def read(self, topic: str, *, start: Position = None, end: Position = None
                   ) -> AsyncGenerator[Delivery, None]:
        check_started(self._admin is not None)
        assert self._admin is not None
        check_position("start", start)
        check_position("end", end)
        try:
            partitions = await _partitions(self._admin, check_topic(topic))
        except (TimeoutError, KafkaError, OSError) as exc:
            raise bus_error(f"replay {topic}", exc) from exc
        if not partitions:
            return
        consumer = AIOKafkaConsumer(
            **self.client_options("replay"), group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", isolation_level="read_committed")
        try:
            await consumer.start()
            bounds = await _replay_bounds(consumer, topic, partitions, start, end)
            async for delivery in _merged(consumer, bounds, self.event_of):
                yield delivery
        except (TimeoutError, KafkaError, OSError) as exc:
            raise bus_error(f"replay {topic}", exc) from exc
        finally:
            await consumer.stop()

    # ------------------------------------------------------------------ for consumer-group members

    @property
    def is_started(self) -> bool:
        """True from a successful :meth:`start` until :meth:`stop`."""
        return self._producer is not None

    async def ensure_known(self, topics: Iterable[str]) -> None:
        """:meth:`ensure_topics` for those of ``topics`` this bus has not ensured yet."""
        missing = [t for t in topics if t not in self._known_topics]
        if missing:
            await self.ensure_topics(missing)

    def client_options(self, role: str) -> dict[str, Any]:
        """Connection options for an aiokafka client of this bus; ``role`` ends its client id."""
        return {"bootstrap_servers": self.bootstrap, "client_id": f"hadar-{self.source}-{role}",
                "request_timeout_ms": self.request_timeout_ms, **self._security_options}

    def register(self, sub: KafkaSubscription) -> None:
        """Track a started member, so that :meth:`stop` stops it."""
        self._subscriptions.add(sub)

    def unregister(self, sub: KafkaSubscription) -> None:
        """Forget a member that is stopping (no-op if it was never registered)."""
        self._subscriptions.discard(sub)


class KeyPartitioner:
    """aiokafka's :class:`DefaultPartitioner` (Kafka's: murmur2 of the key modulo the topic's
    partition count; keyless records spread at random) with each key's hash remembered.

    aiokafka computes murmur2 in pure Python for every record, ~10% of a Progress's
    publish cost; Hadar's keys (job and node ids) are few and recur. The choice is the
    same as any Kafka client's for the same key and partition count. At most
    ``capacity`` hashes are kept; past that they are forgotten at once.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._hashes: dict[bytes, int] = {}
        self._default: Callable[[bytes | None, list[int], list[int]], int] = DefaultPartitioner()

    def __len__(self) -> int:
        return len(self._hashes)

    def __call__(self, key: bytes | None, all_partitions: list[int], available: list[int]) -> int:
        if key is None:
            return self._default(key, all_partitions, available)
        hashed = self._hashes.get(key)
        if hashed is None:
            if len(self._hashes) >= self._capacity:
                self._hashes.clear()
            hashed = self._hashes[key] = murmur2(key) & 0x7FFFFFFF
        return all_partitions[hashed % len(all_partitions)]


async def _durable(topic: str, future: asyncio.Future[Any]) -> tuple[int, int]:
    try:
        meta = await future
    except (TimeoutError, KafkaError, OSError) as exc:
        raise bus_error(f"publish to {topic}", exc) from exc
    return meta.partition, meta.offset


async def _partitions(admin: AIOKafkaAdminClient, topic: str) -> list[int]:
    """Partition ids of ``topic``; empty when it does not exist (describing never creates)."""
    (described,) = await admin_request(admin, lambda: admin.describe_topics([topic]))
    if described["error_code"] == UNKNOWN_TOPIC:
        return []
    if described["error_code"]:
        error = for_code(described["error_code"])
        raise BusError(f"describe {topic}: {error.__name__}", retriable=bool(error.retriable))
    return sorted(p["partition"] for p in described["partitions"])


async def _replay_bounds(consumer: AIOKafkaConsumer, topic: str, partitions: list[int],
                         start: Position, end: Position) -> dict[TopicPartition, tuple[int, int]]:
    """[first, stop) offsets per partition of ``topic``, fixed now."""
    tps = [TopicPartition(topic, p) for p in partitions]
    if not tps:
        return {}
    consumer.assign(tps)
    first = await consumer.beginning_offsets(tps)
    last = await consumer.end_offsets(tps)

    async def resolve(position: Position, default: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        if position is None:
            return dict(default)
        if isinstance(position, float):
            found = await consumer.offsets_for_times({tp: start_ms(position) for tp in tps})
            return {tp: last[tp] if found.get(tp) is None else found[tp].offset for tp in tps}
        if isinstance(position, Mapping):
            return {tp: position.get(tp.partition, default[tp]) for tp in tps}
        return dict.fromkeys(tps, position)

    lo, hi = await resolve(start, first), await resolve(end, last)
    bounds = {}
    for tp in tps:
        a, b = max(lo[tp], first[tp]), min(hi[tp], last[tp])
        if a < b:
            bounds[tp] = (a, b)
            consumer.seek(tp, a)
    return bounds


async def _merged(consumer: AIOKafkaConsumer, bounds: dict[TopicPartition, tuple[int, int]],
                  event_of: Callable[[bytes], Event]) -> AsyncIterator[Delivery]:
    """K-way merge of the partitions by (timestamp, partition, offset), each kept in order."""
    buffers: dict[TopicPartition, deque[Delivery]] = {tp: deque() for tp in bounds}
    fetching = set(bounds)
    consumer.pause(*[tp for tp in consumer.assignment() if tp not in bounds])
    while buffers:
        starving = [tp for tp in fetching if not buffers[tp]]
        if starving:
            batch = await consumer.getmany(*starving, timeout_ms=500)
            for tp in starving:
                stop = bounds[tp][1]
                for rec in batch.get(tp, ()):
                    if rec.offset >= stop:
                        break
                    delivery = _replay_delivery(rec, event_of)
                    if delivery is not None:
                        buffers[tp].append(delivery)
                if await consumer.position(tp) >= stop:
                    fetching.discard(tp)
                    consumer.pause(tp)
            continue
        for tp in [tp for tp in buffers if not buffers[tp] and tp not in fetching]:
            del buffers[tp]
        if buffers:
            tp = min(buffers, key=lambda q: replay_order(buffers[q][0]))
            yield buffers[tp].popleft()


def _replay_delivery(rec: ConsumerRecord, event_of: Callable[[bytes], Event]) -> Delivery | None:
    if rec.value is None:
        return None
    try:
        event = event_of(rec.value)
    except InvalidEvent as exc:
        log.warning("bus.read.skip", topic=rec.topic, partition=rec.partition, offset=rec.offset,
                    reason=exc.reason)
        return None
    return Delivery(topic=rec.topic, partition=rec.partition, offset=rec.offset,
                    key=rec.key.decode(errors="replace") if rec.key else "",
                    timestamp_ms=rec.timestamp, event=event)
