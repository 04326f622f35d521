"""Delivering a copy's result (its CopyFinished, which names the final checkpoint) through a
bus that may be away.

Rule (:func:`deliver`): publish; on a failure that may heal (:class:`~shared.errors.HadarError`
with ``retriable``, as :class:`~shared.bus.BusError` sets it for a broker that is away or
slow) wait and try again -- first after ``first_s``, doubling up to ``max_s`` -- until the bus
takes it or ``abandon()`` says the result can no longer matter. Any other failure (the bus
refuses this record for good, or a bug) ends at once: trying again would fail the same way.

When a result no longer matters (:func:`result_abandoned`): its round's deadline +
``deadline_grace_s`` + ``result_ttl_s`` has passed **and** the agent believes a newer round
exists. By then the scheduler has planned past the round and the tracker has consolidated it
without this copy (it waits ``finish_timeout_s`` past the deadline). While no newer round is
known the result is kept: the broker may be away for everyone, and the round is still open.

How the daemon acks: the Assignment is acked once :func:`deliver` returns, whatever the
outcome (``PUBLISHED``; ``NOT_RETRIABLE`` and ``ABANDONED`` are logged and counted), because a
redelivered Assignment would end the same way. A delivery still retrying when the agent stops
is cancelled and its Assignment left un-acked, so the agent's next run gets it again, resumes
the copy from its checkpoint and reports it then.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.errors import HadarError
from shared.events import Event

__all__ = ["Outcome", "RetryPolicy", "deliver", "result_abandoned"]


class Outcome(enum.Enum):
    PUBLISHED = "published"
    NOT_RETRIABLE = "not_retriable"
    ABANDONED = "abandoned"


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Waits between attempts: ``first_s``, doubling, never more than ``max_s``."""

    first_s: float = 0.5
    max_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {self.first_s}, {self.max_s}")

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt ``attempt`` (0-based)."""
        return min(self.max_s, self.first_s * 2.0 ** min(attempt, 64))


def retriable(exc: BaseException) -> bool:
    return isinstance(exc, HadarError) and exc.retriable


async def deliver(publish: Callable[[Event], Awaitable[object]], event: Event, *, policy: RetryPolicy,
                  abandon: Callable[[], bool], sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                  on_retry: Callable[[BaseException, int, float], None] | None = None,
                  on_give_up: Callable[[BaseException, Outcome], None] | None = None) -> Outcome:
    """Publish ``event`` under the module's rule; never raises but for cancellation.

    ``on_retry(error, attempt, wait_s)`` is told of each retry; ``on_give_up(error, outcome)``
    of the last error when the outcome is not PUBLISHED.
    """
    attempt = 0
    while True:
        try:
            await publish(event)
            return Outcome.PUBLISHED
        except Exception as exc:   # every failure is judged by retriable(), none escapes
            error = exc
        if not retriable(error):
            outcome = Outcome.NOT_RETRIABLE
        elif abandon():
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


def result_abandoned(*, now: float, deadline: float, grace_s: float, ttl_s: float, latest_round: int,
                     round_: int) -> bool:
    """Whether the result of a copy of round ``round_`` no longer matters (module rule)."""
    return now > deadline + grace_s + ttl_s and latest_round > round_
