"""Delivering a copy's results (its Progress reports and its CopyFinished, which names the
final checkpoint) through a bus that may be away.

The retry rule is the bus module's (:func:`shared.bus.retry.publish_until`): publish; on a
failure that may heal wait and try again -- first after ``first_s``, doubling up to ``max_s``
-- and, while the client holds a record it has not yet acknowledged (Kafka's idempotent
producer retries an accepted record until the broker is back), ask every ``check_s``
whether it still matters. Any other failure ends at once.

When a result no longer matters (:func:`result_abandoned`): its round's deadline +
``deadline_grace_s`` + ``result_ttl_s`` has passed **and** the agent believes a newer round
exists. By then the scheduler has planned past the round and the tracker has consolidated it
without this copy (it waits ``finish_timeout_s`` past the deadline), so the work is re-planned
from the last announced model. While no newer round is known the result is kept: the broker
may be away for everyone, and the round is still open. A Progress report follows the same
rule as its copy's result.

How the daemon acks: the Assignment is acked once delivery ends, whatever the outcome
(``PUBLISHED``; ``NOT_RETRIABLE`` and ``ABANDONED`` are logged and counted), because a
redelivered Assignment would end the same way. A delivery still retrying when the agent stops
is cancelled and its Assignment left un-acked, so the agent's next run gets it again, resumes
the copy from its checkpoint and reports it then.
"""

from __future__ import annotations

from shared.bus.retry import Outcome, RetryPolicy, publish_until

__all__ = ["Outcome", "RetryPolicy", "publish_until", "result_abandoned"]


def result_abandoned(*, now: float, deadline: float, grace_s: float, ttl_s: float, latest_round: int,
                     round_: int) -> bool:
    """Whether the result of a copy of round ``round_`` no longer matters (module rule)."""
    return now > deadline + grace_s + ttl_s and latest_round > round_
