"""What the scheduler's state refuses: a well-formed event checked against what it knows.

:meth:`SchedulerState.apply <services.scheduler.live.state.SchedulerState.apply>` calls the
check of an event's type (``CHECKS``) before folding it; a reason (not None) makes it raise
:class:`~shared.bus.rejection.Rejected` and change nothing. The checks read the state, never
change it:

* ModelConsolidated: the job is known, the round has started (``round <= last_round``),
  the key is the layout's ``model_key(job, round)``, every weight is finite in [0, 1] and
  they sum to 1 (within ``WEIGHT_TOLERANCE``). So a forged announcement can neither point
  the next round's ``start_from`` at another object nor freeze a job's model with a
  far-future round.
* RoundAbandoned: the job is known and the round has started.
* JobCompleted: the key is the layout's ``final_key(job)``.
* ThroughputEstimate: every rate is 0 ("cannot run there") or in [MIN_RATE, MAX_RATE]
  steps/s; a rate of 5e-324 made Gavel's LP fail every round. (Its model size is bounded
  by the event itself; the last size stated, ``model_bytes > 0``, is the job's.)

News of a job finished long ago (its record dropped, its id remembered) is accepted and
changes nothing. A viewer that reads topics concurrently (``rounds_in_order=False``) skips
the round check, since a model may arrive before its RoundStarted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from shared.domain.layout import final_key, model_key
from shared.domain.ownership import cancel_refusal
from shared.wire.events import (
    JobCancelled,
    JobCompleted,
    ModelConsolidated,
    RoundAbandoned,
    ThroughputEstimate,
)

if TYPE_CHECKING:
    from services.scheduler.live.state import SchedulerState

__all__ = ["CHECKS", "MIN_RATE", "MAX_RATE", "WEIGHT_TOLERANCE"]

MIN_RATE = 1e-9         # steps/s: below this a positive rate is noise or forged
MAX_RATE = 1e6          # steps/s: far above any job on any GPU
WEIGHT_TOLERANCE = 1e-6


def check_model(state: SchedulerState, e: ModelConsolidated) -> str | None:
    if state.forgotten(e.job_id):
        return None   # late news of a job long finished: harmless, and nothing to update
    if e.job_id not in state.jobs:
        return f"ModelConsolidated: unknown job {e.job_id!r}"
    if e.round > state.last_round and state.rounds_in_order:
        return f"ModelConsolidated: round {e.round} has not started (latest round {state.last_round})"
    if e.key != model_key(e.job_id, e.round):
        return f"ModelConsolidated: key {e.key[:120]!r} is not {model_key(e.job_id, e.round)!r}"
    weights = [c.weight for c in e.copies]
    if not weights or any(not 0.0 <= w <= 1.0 for w in weights) or abs(sum(weights) - 1.0) > WEIGHT_TOLERANCE:
        return f"ModelConsolidated: weights {weights[:8]} are not in [0, 1] summing to 1"
    return None


def check_abandoned(state: SchedulerState, e: RoundAbandoned) -> str | None:
    if state.forgotten(e.job_id):
        return None
    if e.job_id not in state.jobs:
        return f"RoundAbandoned: unknown job {e.job_id!r}"
    if e.round > state.last_round and state.rounds_in_order:
        return f"RoundAbandoned: round {e.round} has not started (latest round {state.last_round})"
    return None


def check_completed(state: SchedulerState, e: JobCompleted) -> str | None:
    if e.job_id in state.jobs and e.final_key != final_key(e.job_id):
        return f"JobCompleted: final key {e.final_key[:120]!r} is not {final_key(e.job_id)!r}"
    return None


def check_estimate(state: SchedulerState, e: ThroughputEstimate) -> str | None:
    bad = {t: r for t, r in e.rates.items() if r != 0.0 and not MIN_RATE <= r <= MAX_RATE}
    if bad:
        return f"ThroughputEstimate: implausible rate {dict(list(bad.items())[:4])} steps/s"
    return None


def check_cancelled(state: SchedulerState, e: JobCancelled) -> str | None:
    job = state.jobs.get(e.job_id)
    return cancel_refusal(e, job.spec.user if job is not None else None)


CHECKS: dict[type, Callable[[SchedulerState, Any], str | None]] = {
    ModelConsolidated: check_model, RoundAbandoned: check_abandoned,
    JobCompleted: check_completed, ThroughputEstimate: check_estimate, JobCancelled: check_cancelled,
}
