"""The bus port: what every Hadar service may assume about publishing and consuming events.

Guarantees shared by :class:`~shared.bus.MemoryBus` and :class:`~shared.bus.KafkaBus`
(the contract suite in ``tests/contract/test_bus.py`` checks each of them on both):

* **Order.** Records with the same key go to the same partition of a topic, and a
  partition is delivered in offset order. Nothing is promised across partitions.
* **At-least-once.** A consumer group commits a partition's offset only up to the first
  delivered record that has not been acked (acks may come in any order). A group that
  restarts -- or a partition that moves to another member on a rebalance -- resumes at the
  first un-acked record, so records delivered but not acked are delivered again. Handlers
  must therefore be idempotent (by ``event.id``).
* **New groups** start from the earliest offset still in the log.
* **Dead letters.** A record that does not decode (or has no value) is published as a
  :class:`~shared.wire.events.DeadLetter` to ``hadar.deadletter`` (origin topic, partition,
  offset, reason, the first 1024 raw bytes), then committed; it is never yielded. Each
  group that meets it publishes one; they share a deterministic ``id`` so consumers of the
  dead-letter topic can drop duplicates.
* **Replay.** :meth:`Bus.read` is a bounded snapshot: it never waits for new records.
* **Timestamps.** A record's timestamp is the publishing bus's clock at publish time, so a
  fake clock drives :meth:`Bus.read` by time in tests. (On Kafka, a fake clock far in the
  past makes records due for time-based retention at once.)
* **Errors.** Every bus failure raises :class:`BusError`; ``retriable`` says whether the
  same call may succeed later (a broker that is down) or never will (a bad topic name).
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import math
import re
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, Self, final

from shared.errors import HadarError
from shared.wire.events import (
    DEADLETTER_RAW_LIMIT,
    DeadLetter,
    Event,
    encode,
    key_for,
    topic_for,
)
from shared.wire.sealed import open_unchecked
from shared.wire.topics import ALL_TOPICS

if TYPE_CHECKING:
    from shared.bus.fencing import FencedPublisher

__all__ = [
    "BusError", "bus_error", "TOMBSTONE_REASON", "Delivery", "Bus", "Subscription", "AckTracker",
    "Position", "TopicPartition", "dead_letter", "check_topic", "check_position", "topic_list",
    "start_ms", "replay_order", "partition_position", "Resume", "RecordSealer", "RecordVerifier",
]

TopicPartition = tuple[str, int]
Resume = Callable[[str, int], "int | None"]
"""Where a member starts a partition it is assigned (:meth:`Bus.subscribe`)."""
Position = int | float | Mapping[int, int] | None
"""A place in a partition for :meth:`Bus.read`: an offset (int), a unix time in seconds
(float: the first record whose timestamp is at or after it), an offset per partition
(``{partition: offset}``; a partition not named is at the log start / end, as for None),
or None (log start / end)."""

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
TOMBSTONE_REASON = "tombstone: record has no value"


class BusError(HadarError):
    """Any failure of the bus. ``retriable``: the same call may succeed if tried again later.

    Every raise decides ``retriable`` (it is a required argument); :func:`bus_error` is
    the rule for failures reported by a client library.
    """

    def __init__(self, message: str, *, retriable: bool) -> None:
        super().__init__(message, retriable=retriable)


# aiokafka's own timeout (a batch or a metadata wait expired: the broker is away or slow)
# is not flagged ``retriable`` by aiokafka, and is no asyncio.TimeoutError. Matched by
# name so this module does not depend on the Kafka client.
_CLIENT_TIMEOUTS = frozenset({"KafkaTimeoutError"})


def bus_error(what: str, exc: BaseException) -> BusError:
    """A BusError for a client exception, retriable when the broker may come back.

    Retriable: the client flags the error ``retriable`` (aiokafka's broker errors do:
    no leader, coordinator moving, node not ready); a timeout; an OS-level network error
    (refused, reset, unreachable, name resolution). Not retriable: everything else the
    broker or client refuses for good (authorisation, a record too large, a closed
    producer, an illegal state).
    """
    retriable = (bool(getattr(exc, "retriable", False))
                 or isinstance(exc, (OSError, asyncio.TimeoutError))
                 or type(exc).__name__ in _CLIENT_TIMEOUTS)
    return BusError(f"{what}: {type(exc).__name__}: {exc}", retriable=retriable)


@final   # never subclassed: readers test ``type(x) is Delivery``
@dataclass(frozen=True, kw_only=True, slots=True)
class Delivery:
    """One decoded record. ``key`` is ``""`` for a record published without a key.

    ``timestamp_ms`` is the record's timestamp: the publishing bus's clock at publish time.
    """

    topic: str
    partition: int
    offset: int
    key: str
    timestamp_ms: int
    event: Event
    _on_ack: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    async def ack(self) -> None:
        """Mark this record handled. Idempotent; a no-op for records from :meth:`Bus.read`
        and for records of a partition this consumer no longer owns (it will be redelivered
        to the new owner unless an earlier commit covered it)."""
        if self._on_ack is not None:
            self._on_ack()


class Subscription(abc.ABC):
    """An async iterator of :class:`Delivery` for one group member; also an async context
    manager whose exit stops it. It joins the group lazily, on first use.

    Stopping commits every acked offset, then leaves the group. Leaving the iteration
    without stopping (``break``) keeps the member in the group until :meth:`stop` or
    ``bus.stop()``; prefer ``async with bus.subscribe(...) as sub``.
    """

    def __aiter__(self) -> Subscription:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> Delivery: ...

    @abc.abstractmethod
    async def start(self) -> None:
        """Join the group now (the first ``__anext__`` does it otherwise). Idempotent."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Commit acked offsets and leave the group. Idempotent; iteration then ends."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()


class RecordSealer(Protocol):
    """Seals the encoded events a bus publishes (:class:`shared.security.authorship.Sealer`)."""

    identity: str

    def seal(self, inner: bytes) -> bytes: ...


class RecordVerifier(Protocol):
    """Opens every record a bus delivers, or raises InvalidEvent with the reason
    (:class:`shared.security.authorship.Verifier`); ``refusals`` counts them by kind."""

    @property
    def refusals(self) -> Mapping[str, int]: ...

    def open(self, data: bytes) -> Event: ...


class Bus(abc.ABC):
    """Publish events and consume them in groups; the port every service talks through.

    Topics must exist before use; :meth:`ensure_topics` creates them, and publishing
    and :meth:`subscribe` create a topic they have not seen yet (with the bus's partition
    count), so a missing topic is never silently created with another layout.

    Authorship (:mod:`shared.security.authorship`): with a ``sealer`` every record this bus
    publishes is sealed by its identity (a GPU node's bus); with a ``verifier`` every record
    it delivers or replays was opened by it, and one it refuses is dead-lettered (or skipped
    by :meth:`read`) with the reason, like any record that does not decode. Neither: records
    are read sealed or not, their seals unchecked.
    """

    sealer: RecordSealer | None = None
    verifier: RecordVerifier | None = None

    def wire_value(self, event: Event) -> bytes:
        """The bytes this bus publishes for ``event`` (sealed if it has a sealer)."""
        data = encode(event)
        return data if self.sealer is None else self.sealer.seal(data)

    def event_of(self, value: bytes) -> Event:
        """The event in a record's value, opened by the verifier if this bus has one;
        :class:`InvalidEvent` with the reason if it is refused."""
        return self.verifier.open(value) if self.verifier is not None else open_unchecked(value)

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect. Every other call except :meth:`subscribe` needs a started bus."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop every subscription (committing acked offsets), flush pending publishes,
        disconnect. Idempotent."""

    async def ping(self, timeout_s: float = 5.0) -> None:  # noqa: B027 - a default, not abstract
        """Raise a retriable :class:`BusError` if the broker cannot be reached now (within
        ``timeout_s``). A bus without a broker is always reachable."""

    @abc.abstractmethod
    async def ensure_topics(self, topics: Iterable[str] = ALL_TOPICS) -> None:
        """Create the topics that do not exist yet; existing ones are left as they are."""

    async def publish(self, event: Event, *, topic: str | None = None, key: str | None = None) -> tuple[int, int]:
        """Publish one event; returns (partition, offset) once the record is durable
        (Kafka: written to all in-sync replicas, idempotent producer).

        ``topic`` and ``key`` default to the event's own (:func:`topic_for`, :func:`key_for`);
        services never pass them (the contract tests and benchmarks do, to isolate runs)."""
        return await (await self.publish_pipelined(event, topic=topic, key=key))

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        """:meth:`publish` in two steps: awaiting this enqueues the record, fixing its order
        among records with the same key; awaiting the returned awaitable waits until it is
        durable. Many records in flight are batched together.

        A record is only known to be published once its awaitable has succeeded. If one fails,
        records enqueued after it with the same key may still have been written, so a caller
        that needs a gap-free order must stop and re-publish from the failed one.
        """
        return await self._enqueue(topic if topic is not None else topic_for(event),
                                   key if key is not None else key_for(event), self.wire_value(event), None)

    async def write_raw(self, topic: str, key: str | None, value: bytes | None,
                        *, partition: int | None = None) -> tuple[int, int]:
        """Write arbitrary bytes (``None``: a tombstone), bypassing the event codec, and wait
        until they are durable. For tests and tools that need malformed records; services
        publish events."""
        return await (await self._enqueue(topic, key, value, partition))

    @abc.abstractmethod
    async def _enqueue(self, topic: str, key: str | None, value: bytes | None,
                       partition: int | None) -> Awaitable[tuple[int, int]]:
        """Enqueue one record (the one primitive every publish goes through); the awaitable
        resolves to (partition, offset) once it is durable, or raises :class:`BusError`."""

    @abc.abstractmethod
    def subscribe(self, topics: str | Iterable[str], group: str, *, resume: Resume | None = None) -> Subscription:
        """A member of consumer ``group`` reading ``topics``; see the module guarantees.

        ``resume(topic, partition)``: where this member starts reading a partition each time
        it is assigned, instead of the group's committed offset (None: the committed one) --
        for a consumer that knows better than the group what it has handled: one that rebuilt
        its state from a snapshot and :meth:`read`, or a replica taking over from one that
        may have committed records it never saw."""

    @abc.abstractmethod
    def fenced_publisher(self, fencing_id: str) -> FencedPublisher:
        """A publisher of atomic batches that fences earlier ones of ``fencing_id`` when it
        starts (:mod:`shared.bus.fencing`)."""

    @abc.abstractmethod
    def read(self, topic: str, *, start: Position = None, end: Position = None
             ) -> AsyncGenerator[Delivery, None]:
        """Replay ``topic``: every partition's records in [start, end), ordered by
        (timestamp, partition, offset), then stop.

        ``start``/``end`` are each an offset (applied to every partition), a unix time in
        seconds (the first record at/after it), an offset per partition (``{partition:
        offset}``, e.g. the offsets a state snapshot covers; partitions not named as for
        None), or None (the log start / the end offsets current when the iteration starts).
        An offset below the log start (deleted by retention) starts at the log start.
        Records appended after that are never yielded, so replay always terminates.
        Partition order always holds: if timestamps within a partition go backwards
        (producers' clocks disagree) the merge keeps each partition in offset order.
        Undecodable records are skipped (consumers dead-letter them). An unknown topic
        yields nothing. ``ack()`` on these deliveries is a no-op. To stop early, iterate
        under ``contextlib.aclosing`` so the Kafka reader closes at once rather than when
        the generator is garbage-collected.
        """


class AckTracker:
    """Commit points of a consumer, given deliveries in offset order and acks in any order.

    For each partition the commit point is one past the longest run of delivered records,
    from the first delivery on, that are all acked: the first un-acked record is where a
    restarted group must resume. Offsets skipped by the log (compaction, control records)
    never hold the point back, since only delivered offsets are tracked.
    """

    def __init__(self) -> None:
        self._outstanding: dict[TopicPartition, deque[int]] = {}
        self._acked: dict[TopicPartition, set[int]] = {}
        self._points: dict[TopicPartition, int] = {}

    def delivered(self, tp: TopicPartition, offset: int) -> None:
        """Record that ``offset`` was handed out; offsets of a partition must increase."""
        queue = self._outstanding.setdefault(tp, deque())
        last = queue[-1] if queue else self._points.get(tp, -1) - 1
        if offset <= last:
            raise ValueError(f"{tp}: delivered offset {offset} after {last}")
        queue.append(offset)

    def ack(self, tp: TopicPartition, offset: int) -> bool:
        """Mark a delivered offset handled; True when the partition's commit point moved."""
        queue = self._outstanding.get(tp)
        if not queue or offset < queue[0]:
            return False  # unknown partition, or already covered by the commit point
        acked = self._acked.setdefault(tp, set())
        acked.add(offset)
        moved = False
        while queue and queue[0] in acked:
            acked.discard(queue[0])
            self._points[tp] = queue.popleft() + 1
            moved = True
        return moved

    def points(self) -> dict[TopicPartition, int]:
        """The commit point of every partition that has one (some acked prefix)."""
        return dict(self._points)

    def pending(self, tp: TopicPartition) -> int:
        """Delivered records of ``tp`` not yet covered by the commit point."""
        return len(self._outstanding.get(tp, ()))

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop partitions this consumer no longer owns."""
        for tp in tps:
            self._outstanding.pop(tp, None)
            self._acked.pop(tp, None)
            self._points.pop(tp, None)


def dead_letter(*, topic: str, partition: int, offset: int, reason: str, raw: bytes | None,
                ts: float, source: str) -> DeadLetter:
    """The DeadLetter for one bad record; its id depends only on the record's origin.

    ``reason`` is cut to 1024 characters too: a reason quoting a huge field must not make
    the dead letter itself too large to publish (the record would then block its group)."""
    origin = f"{topic}/{partition}/{offset}".encode()
    return DeadLetter(
        id=hashlib.sha256(origin).hexdigest()[:32], ts=ts, source=source[:128],
        topic=topic, partition=partition, offset=offset, reason=reason[:DEADLETTER_RAW_LIMIT],
        raw=(raw or b"")[:DEADLETTER_RAW_LIMIT],
    )


def check_topic(topic: str) -> str:
    if not isinstance(topic, str) or not _TOPIC_RE.match(topic) or topic in (".", ".."):
        raise BusError(f"invalid topic name {topic!r}: 1-249 of A-Z a-z 0-9 . _ -", retriable=False)
    return topic


def topic_list(topics: str | Iterable[str]) -> tuple[str, ...]:
    """Topics as a de-duplicated tuple; a bare string is one topic, not its characters."""
    names = (topics,) if isinstance(topics, str) else tuple(topics)
    if not names:
        raise BusError("subscribe needs at least one topic", retriable=False)
    return tuple(dict.fromkeys(check_topic(t) for t in names))


def check_position(name: str, value: Position) -> Position:
    if value is None or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, Mapping):
        if all(_natural(k) and _natural(v) for k, v in value.items()):
            return value
        raise ValueError(f"{name}: per-partition offsets must map partitions >= 0 to offsets >= 0, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ValueError(f"{name}: expected an offset >= 0, a unix time (float) or None, got {value!r}")


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def partition_position(position: Position, partition: int) -> int | float | None:
    """The position of one partition: a per-partition mapping's entry (None if absent)."""
    if isinstance(position, Mapping):
        return position.get(partition)
    return position


def start_ms(seconds: float) -> int:
    """The smallest integer millisecond timestamp at or after ``seconds``."""
    return math.ceil(seconds * 1000)


def replay_order(delivery: Delivery) -> tuple[int, int, int]:
    return (delivery.timestamp_ms, delivery.partition, delivery.offset)


def check_started(started: bool) -> None:
    if not started:
        raise BusError("bus not started: await bus.start() first", retriable=False)


async def yield_now() -> None:
    """Let other tasks run (a consumer that always has data must not starve the loop)."""
    await asyncio.sleep(0)
