"""Publishing a round's events through a broker that may be away.

Rule (:func:`publish_by`): each event is published until the bus acknowledges it, or
:class:`PublishGivenUp` is raised once it can no longer matter -- the bus refused it for good,
or ``give_up()`` (the service stopping, the round's end) said so. The end is checked while
the client still holds the record (Kafka's idempotent producer neither fails nor returns a
publish while the broker is away: :mod:`shared.bus.retry`), so a round loop is never blocked
past its round. ``placed(partition, offset)`` is told of every acknowledged record, also one
acknowledged after we gave up on it (it was written: the offsets must cover it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from shared.bus import Bus
from shared.bus.retry import Outcome, RetryPolicy, publish_until
from shared.errors import HadarError
from shared.wire.events import Event, key_for, topic_for

__all__ = ["PUBLISH_RETRY", "PublishGivenUp", "publish_by"]

PUBLISH_RETRY = RetryPolicy(first_s=0.05, max_s=5.0, check_s=0.25)


class PublishGivenUp(HadarError):
    """An event was not acknowledged before it stopped mattering (``outcome`` says why)."""


async def publish_by(bus: Bus, event: Event, *, give_up: Callable[[], bool],
                     placed: Callable[[int, int], None], sleep: Callable[[float], Awaitable[None]],
                     on_retry: Callable[[BaseException, int, float], None] | None = None,
                     policy: RetryPolicy = PUBLISH_RETRY) -> None:
    """Publish ``event`` under the module's rule; raise :class:`PublishGivenUp` if it was not."""
    def note(ack: asyncio.Future[tuple[int, int]]) -> None:
        if not ack.cancelled() and ack.exception() is None:
            placed(*ack.result())

    async def send(ev: Event) -> asyncio.Future[tuple[int, int]]:
        ack = asyncio.ensure_future(await bus.publish_pipelined(ev, topic=topic_for(ev), key=key_for(ev)))
        ack.add_done_callback(note)
        return ack

    last: list[BaseException] = []
    outcome = await publish_until(send, event, policy=policy, sleep=sleep, give_up=give_up, on_retry=on_retry,
                                  on_give_up=lambda error, _: last.append(error))
    if outcome is not Outcome.PUBLISHED:
        error = last[0] if last else None
        raise PublishGivenUp(f"publish {event.TYPE}: {outcome.value}: {error}"[:300],
                             retriable=outcome is Outcome.ABANDONED) from error
