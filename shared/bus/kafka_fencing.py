"""The fenced publisher of :class:`~shared.bus.kafka.KafkaBus`: a transactional producer.

Kafka's own mechanism gives both guarantees of :mod:`shared.bus.fencing`: starting a producer
with a ``transactional.id`` bumps the id's epoch at the transaction coordinator, which aborts
the older producer's open transaction and refuses its every later request
(``ProducerFenced``); the events of one transaction are committed together, and every
consumer of this bus reads with ``isolation_level="read_committed"``, so aborted or open
batches are never delivered nor replayed. The id's ACL is a Kafka ``TransactionalId``
resource (:mod:`shared.security.principals`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import IllegalOperation, InvalidProducerEpoch, KafkaError, ProducerFenced

from shared.bus.base import bus_error, check_topic
from shared.bus.fencing import BatchFailed, Fenced, FencedPublisher
from shared.wire.events import Event, key_for, topic_for

if TYPE_CHECKING:
    from shared.bus.kafka import KafkaBus

__all__ = ["KafkaFencedPublisher"]

_FENCED = (ProducerFenced, InvalidProducerEpoch)


class KafkaFencedPublisher(FencedPublisher):
    """``fencing_id`` is the producer's ``transactional.id``. ``transaction_timeout_ms``: how
    long the coordinator keeps a batch open before aborting it (a producer that died mid-batch
    holds read_committed consumers of its partitions back at most that long)."""

    def __init__(self, bus: KafkaBus, fencing_id: str, *, transaction_timeout_ms: int = 30_000) -> None:
        if not fencing_id:
            raise ValueError("a fenced publisher needs a fencing id")
        self.bus = bus
        self.fencing_id = fencing_id
        self._timeout_ms = transaction_timeout_ms
        self._producer: AIOKafkaProducer | None = None
        self._lock = asyncio.Lock()
        self._fenced = False

    async def start(self) -> None:
        if self._producer is not None:
            return
        producer = AIOKafkaProducer(**self.bus.client_options(f"fenced-{self.fencing_id}"),
                                    transactional_id=self.fencing_id, enable_idempotence=True, acks="all",
                                    transaction_timeout_ms=self._timeout_ms, max_batch_size=256 * 1024)
        try:
            await producer.start()   # InitProducerId: bumps the id's epoch, fencing older producers
        except (TimeoutError, KafkaError, OSError) as exc:
            await producer.stop()
            raise bus_error(f"start fenced publisher {self.fencing_id}", exc) from exc
        self._producer = producer

    async def publish_all(self, events: Sequence[Event]) -> list[tuple[int, int]]:
        if self._fenced:
            raise Fenced(f"fenced publisher {self.fencing_id}: a newer publisher of this id started")
        producer = self._producer
        if producer is None:
            raise BatchFailed(f"fenced publisher {self.fencing_id} not started", retriable=False,
                              maybe_visible=False)
        records = [(check_topic(topic_for(e)), key_for(e), self.bus.wire_value(e)) for e in events]
        await self.bus.ensure_known({topic for topic, _, _ in records})
        async with self._lock:
            committing = False
            futures: list[asyncio.Future[Any]] = []
            try:
                await producer.begin_transaction()
                for topic, key, value in records:
                    futures.append(await producer.send(topic, value=value, key=key.encode(),
                                                       timestamp_ms=int(self.bus.clock.time() * 1000)))
                committing = True
                await producer.commit_transaction()   # flushes, then commits: every send acked
                return [((md := f.result()).partition, md.offset) for f in futures]
            except _FENCED as exc:
                _retrieve(futures)
                self._fenced = True
                raise Fenced(f"fenced publisher {self.fencing_id}: a newer publisher of this id started") from exc
            except (TimeoutError, KafkaError, OSError) as exc:
                _retrieve(futures)
                await self._abort()
                error = bus_error(f"publish batch as {self.fencing_id}", exc)
                raise BatchFailed(str(error), retriable=error.retriable, maybe_visible=committing) from exc
            except BaseException:
                _retrieve(futures)
                await self._abort()
                raise

    async def _abort(self) -> None:
        """Abort the open batch, if any; a producer that cannot is dropped (the next start
        of this publisher fences what it left open)."""
        producer = self._producer
        if producer is None:
            return
        try:
            await producer.abort_transaction()
        except IllegalOperation:   # no batch was open
            pass
        except _FENCED:
            self._fenced = True
        except Exception:
            await self.stop()

    async def stop(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.stop()
            except Exception:   # a fenced producer's stop may report the fencing again
                pass


def _retrieve(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Mark the failed sends of a failed batch as seen: the batch's own error says it all, and
    asyncio would otherwise log each as an exception never retrieved."""
    for future in futures:
        if future.done() and not future.cancelled():
            future.exception()
