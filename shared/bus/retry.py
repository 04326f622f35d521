"""Publishing an event that must not be lost through a broker that may be away for minutes.

Rule (:func:`publish_until`): hand the record to the bus (:meth:`~shared.bus.base.Bus.publish_pipelined`)
and wait until it is durable. A failure that may heal (a :class:`~shared.errors.HadarError`
with ``retriable``, as :func:`~shared.bus.base.bus_error` sets it for a broker that is away or
slow) is tried again -- first after ``first_s``, doubling up to ``max_s`` -- and any other
failure (the bus refuses this record for good, or a bug) ends at once. It goes on until the
bus acknowledges the record or ``give_up()`` says the record can no longer matter; the
outcome says which, and the callbacks let the caller log and count it. Never raises but for
cancellation.

Why waiting is checked in slices: Kafka's idempotent producer (what
:class:`~shared.bus.KafkaBus` runs) never expires a record it has accepted -- it keeps retrying
the batch until the broker takes it, so a publish during an outage neither fails nor
returns until the broker is back (aiokafka 0.14: ``_can_retry`` never expires batches with
idempotence; measured: one publish waited 92 s through a 75 s outage and then succeeded).
Only a record the client could not even accept fails (``KafkaTimeoutError`` after
``request_timeout_ms`` when the partition's buffer is full, or a batch whose partition had
no leader past the same time). So the wait for the acknowledgement is cut into slices of
``check_s`` and ``give_up()`` is asked between them: the bound holds while the client
still holds the record.

Guarantees: a record reported PUBLISHED is durable. A record never reported PUBLISHED may
still be written later (an attempt the client was still retrying when we tried again or
gave up), so it may arrive more than once, each time with the same event id: consumers
are idempotent by id (the bus contract is at-least-once). Nothing is dropped without
``on_give_up`` being told.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shared.bus.base import Bus
from shared.errors import HadarError
from shared.wire.events import Event, key_for, topic_for

__all__ = ["Outcome", "RetryPolicy", "Send", "bus_send", "publish_until", "retriable"]

Send = Callable[[Event], Awaitable[Awaitable[object]]]
"""Hands one event to the bus; the awaitable it returns completes once the event is durable
(:meth:`Bus.publish_pipelined <shared.bus.base.Bus.publish_pipelined>`)."""


class Outcome(enum.Enum):
    PUBLISHED = "published"
    NOT_RETRIABLE = "not_retriable"
    ABANDONED = "abandoned"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Waits between attempts: ``first_s``, doubling, never more than ``max_s``; while the
    bus holds a record, ``give_up`` is asked every ``check_s``."""

    first_s: float = 0.5
    max_s: float = 5.0
    check_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {self.first_s}, {self.max_s}")
        if not self.check_s > 0:
            raise ValueError(f"need check_s > 0, got {self.check_s}")

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt ``attempt`` (0-based)."""
        return min(self.max_s, self.first_s * 2.0 ** min(attempt, 64))


class _NotAcknowledged(HadarError):
    """The bus still holds the record (made ``retriable=True``: it may yet be written)."""


def retriable(exc: BaseException) -> bool:
    return isinstance(exc, HadarError) and exc.retriable


async def publish_until(send: Send, event: Event, *, policy: RetryPolicy, give_up: Callable[[], bool],
                        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                        on_retry: Callable[[BaseException, int, float], None] | None = None,
                        on_give_up: Callable[[BaseException, Outcome], None] | None = None) -> Outcome:
    """Publish ``event`` through ``send`` under the module's rule.

    ``on_retry(error, attempt, wait_s)`` is told of each retry; ``on_give_up(error, outcome)``
    of the last error when the outcome is not PUBLISHED.
    """
    attempt = 0
    while True:
        try:
            ack = asyncio.ensure_future(await send(event))
        except Exception as exc:   # every failure is judged by retriable(), none escapes
            error: BaseException = exc
        else:
            acked, error = await _acknowledged(ack, policy=policy, give_up=give_up, sleep=sleep)
            if acked:
                return Outcome.PUBLISHED
        if not retriable(error):
            outcome = Outcome.NOT_RETRIABLE
        elif isinstance(error, _NotAcknowledged) or give_up():
            outcome = Outcome.ABANDONED
        else:
            wait_s = policy.delay(attempt)
            if on_retry is not None:
                on_retry(error, attempt, wait_s)
            await sleep(wait_s)
            attempt += 1
            continue
        if on_give_up is not None:
            on_give_up(error, outcome)
        return outcome


async def _acknowledged(ack: asyncio.Future[object], *, policy: RetryPolicy, give_up: Callable[[], bool],
                        sleep: Callable[[float], Awaitable[None]]) -> tuple[bool, BaseException]:
    """Wait for ``ack`` in slices of ``check_s``: (True, _) once it succeeded, (False, its
    error) if it failed, (False, _NotAcknowledged) if ``give_up()`` came first -- the record
    is left to the client, which may still write it."""
    while True:
        tick = asyncio.ensure_future(sleep(policy.check_s))
        waiting: set[asyncio.Future[Any]] = {ack, tick}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            ack.cancel()   # stops our wait only: a record the client accepted may still be written
            raise
        finally:
            tick.cancel()
        if ack.done():
            exc = ack.exception()
            return (True, _NotAcknowledged(retriable=True)) if exc is None else (False, exc)
        if give_up():
            ack.add_done_callback(_consume)
            return False, _NotAcknowledged("gave up waiting for the broker to acknowledge the record",
                                     retriable=True)


def _consume(future: asyncio.Future[object]) -> None:
    """Retrieve a detached attempt's outcome, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


def bus_send(bus: Bus) -> Send:
    """The :data:`Send` of ``bus``: each event on its own topic with its own key."""
    async def send(event: Event) -> Awaitable[object]:
        return await bus.publish_pipelined(event, topic=topic_for(event), key=key_for(event))
    return send
