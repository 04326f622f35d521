"""How a consumer refuses an event: the dead-letter topic, with the event's origin and why.

A well-formed event can still be unacceptable to the consumer that reads it (a copy
nobody assigned, a key outside the layout, a round far ahead) or make its handler fail.
Either way the consumer publishes a :class:`~shared.wire.events.DeadLetter` naming the
record's topic, partition and offset and the reason, counts it, acks the record and goes
on: one bad event never stops a loop, and it changes nothing. The dead letter's id depends
only on the origin, so a redelivered record is dead-lettered once.
"""

from __future__ import annotations

import structlog

from shared.bus import Bus, BusError, Delivery
from shared.bus.base import dead_letter
from shared.errors import HadarError
from shared.wire.events import encode

__all__ = ["Rejected", "dead_letter_delivery"]

log = structlog.get_logger(__name__)


class Rejected(HadarError):
    """A well-formed event this consumer refuses; the message is the reason."""


async def dead_letter_delivery(bus: Bus, delivery: Delivery, reason: str, *, ts: float, source: str) -> bool:
    """Publish the dead letter of ``delivery``; False (logged) if the bus refused it."""
    letter = dead_letter(topic=delivery.topic, partition=delivery.partition, offset=delivery.offset,
                         reason=reason, raw=encode(delivery.event), ts=ts, source=source)
    try:
        await bus.publish(letter)
    except BusError as exc:
        log.error("dead_letter.publish_failed", topic=delivery.topic, offset=delivery.offset,
                  reason=reason[:200], error=str(exc)[:200])
        return False
    return True
