"""Who may act on a job: its owner, the ``user`` its JobSubmitted named.

A JobCancelled names the user who cancels (``hadar cancel`` names the user it runs as; with
authorship checked, :mod:`shared.security.authorship` has made sure that user sealed it).
Every consumer that acts on a cancellation (scheduler, tracker, profiler, agent) asks
:func:`cancel_refusal` with the owner it knows, so one user cannot stop another's job.
"""

from __future__ import annotations

from shared.wire.events import JobCancelled

__all__ = ["cancel_refusal"]


def cancel_refusal(event: JobCancelled, owner: str | None) -> str | None:
    """Why ``event`` must be refused: it names a user other than the job's ``owner``. None
    when it may act: it names the owner, or no user (a development cluster without
    authorship, an older CLI), or the owner is not known here (then this consumer holds
    nothing of the job to stop)."""
    if event.user and owner is not None and event.user != owner:
        return f"user {event.user!r} may not cancel job {event.job_id!r} of user {owner!r}"
    return None
