"""Publishing a round's events through a broker that may be away.

Two ways, one per deployment: a lone scheduler publishes a round event by event
(:func:`publish_each`), a standby replica as one fenced batch (:func:`publish_fenced`),
so a replica that was taken over publishes nothing of it. Either way the round number is
*spent* once any of its events is (or may be) visible: it is never planned again.

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
import functools
from collections.abc import Awaitable, Callable, Sequence

from shared.bus import Bus
from shared.bus.fencing import BatchFailed, Fenced, FencedPublisher
from shared.bus.retry import Outcome, RetryPolicy, publish_until
from shared.errors import HadarError
from shared.wire.events import Event, key_for, topic_for

__all__ = ["PUBLISH_RETRY", "PublishGivenUp", "RoundFailed", "publish_by", "publish_each", "publish_fenced"]

PUBLISH_RETRY = RetryPolicy(first_s=0.05, max_s=5.0, check_s=0.25)


class RoundFailed(HadarError):
    """A round could not be planned (``stage="plan"``: the policy raised), was planned
    against an invariant (``"invalid_plan"``: the plan check refused it, so nothing of it
    is published and its number is not spent), could not be published (``"publish"``) or
    was refused because a newer replica took over (``"fenced"``); the round loop logs it,
    counts it and tries again after a back-off (a plan failure may pass once the inputs
    change; a publish failure once the bus is back). ``spent``: the round's number must
    not be used again (some of it is, or may be, visible)."""

    def __init__(self, message: str, *, stage: str, round: int, spent: bool = False) -> None:
        super().__init__(message, retriable=stage == "publish")
        self.stage = stage
        self.round = round
        self.spent = spent


Applied = Callable[[Event, int, int], Awaitable[None]]   # an event acknowledged at (partition, offset)


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


async def publish_each(bus: Bus, events: Sequence[Event], *, round_: int, give_up: Callable[[], bool],
                       placed: Callable[[int, int], None], applied: Callable[[Event], Awaitable[None]],
                       on_retry: Callable[[Event, BaseException, int, float], None]) -> None:
    """Publish ``events`` in order, each by :func:`publish_by`, calling ``applied`` after each
    acknowledgement; raise :class:`RoundFailed` (``spent`` when any event was, or may yet
    be, written) at the first that cannot be published."""
    for published, event in enumerate(events):
        try:
            await publish_by(bus, event, give_up=give_up, placed=placed, sleep=asyncio.sleep,
                             on_retry=functools.partial(on_retry, event))
        except PublishGivenUp as exc:   # a held record may yet appear: then its number is spent
            raise RoundFailed(str(exc), stage="publish", round=round_,
                              spent=bool(published) or exc.retriable) from exc
        await applied(event)
        if (published + 1) % 64 == 0:
            await asyncio.sleep(0)   # a bus that never blocks must not starve /healthz


async def publish_fenced(publisher: FencedPublisher, events: Sequence[Event], *, round_: int, timeout_s: float,
                         applied: Applied) -> None:
    """Publish ``events`` as one batch through ``publisher``: all visible or none. Raise
    :class:`RoundFailed` with ``stage="fenced"`` when a newer replica fenced this one (nothing
    of the round is visible), ``"publish"`` otherwise (``spent`` if the batch may have landed)."""
    try:
        where = await asyncio.wait_for(publisher.publish_all(events), max(1.0, timeout_s))
    except Fenced as exc:
        raise RoundFailed(f"round {round_} not published: {exc}", stage="fenced", round=round_) from exc
    except (BatchFailed, TimeoutError) as exc:
        maybe = not isinstance(exc, BatchFailed) or exc.maybe_visible
        raise RoundFailed(f"round {round_} not published: {type(exc).__name__}: {exc}", stage="publish",
                          round=round_, spent=maybe) from exc
    for event, (partition, offset) in zip(events, where, strict=True):
        await applied(event, partition, offset)
