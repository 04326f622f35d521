"""When a job is stuck: it runs, round after round, and its consolidated steps do not grow.

Pure: a function of the job's record as ``SchedulerState`` folds it (``runs_since_progress``,
``decided_round``, ``last_round``, ``last_outcome``), so ``hadar jobs``, the scheduler's
``hadar_scheduler_jobs_stuck`` metric and a replayed log agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.live.records import JobRecord

__all__ = ["STUCK_AFTER_ROUNDS", "stuck_reason"]

STUCK_AFTER_ROUNDS = 3  # rounds run without consolidated progress before a job is reported stuck


def stuck_reason(job: JobRecord, rounds: int = STUCK_AFTER_ROUNDS) -> str | None:
    """Why an active job is stuck -- ``rounds`` or more rounds it ran in, over (decided, or
    followed by a later round), without its consolidated steps growing -- or None.

    The round in flight is not counted; a round the scheduler moved past without a model
    counts as one without progress. The reason names the rounds, the steps and the latest
    cause (a round abandoned and why, a model that added nothing, no model announced)."""
    if not job.active or job.last_round is None:
        return None
    in_flight = int(job.decided_round < job.last_round)
    idle = job.runs_since_progress - in_flight
    if idle < rounds:
        return None
    if job.decided_round < job.last_round - in_flight:
        cause = f"no model announced for rounds {job.decided_round + 1}..{job.last_round - in_flight}"
    else:
        cause = job.last_outcome or "no model added steps"
    return f"no progress in {idle} rounds (at {job.steps_done} of {job.spec.iterations} steps): {cause}"
