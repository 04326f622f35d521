"""Which jobs a Hadar round plans first: the configured critical rule applied to one request.

Two rules (``Hadar``'s ``critical_rule``): ``"timeline"`` (``hadar/timeline``, the default),
which also names the GPU types each critical job may use this round, and ``"laxity"``
(``hadar/critical``), which lets a critical job use any type. Both keep a target end round
E in the policy's state; ``critical=False`` still sets E (laxity rule's way) but names no job.

Pure: a function of the request, the jobs' profiles and the previous round's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.core.policy import JobState, PlanRequest
from services.scheduler.policies.hadar.critical import (
    critical_jobs,
    job_capacity_rounds,
    rounds_needed,
    target_end,
)
from services.scheduler.policies.hadar.ledger import LedgerState, RowLayout
from services.scheduler.policies.hadar.profile import JobProfile
from services.scheduler.policies.hadar.seats import Seat
from services.scheduler.policies.hadar.timeline import critical_types


@dataclass(frozen=True, kw_only=True)
class CriticalDecision:
    """E (the target end round), the critical jobs in planning order, the GPU type indices
    each may use (timeline rule; a job not named may use any), the gangs' rounding credit
    to carry to the next round (``LedgerState.gang_credit``) and the seats of the gangs
    seated (``hadar/seats``: exactly the GPUs to take)."""

    target_end: int
    order: tuple[str, ...]
    allowed: Mapping[str, set[int]] = field(default_factory=dict)
    gang_credit: Mapping[str, float] = field(default_factory=dict)
    seats: Mapping[str, Seat] = field(default_factory=dict)


def decide_critical(request: PlanRequest, jobs: Sequence[JobState], profiles: Mapping[str, JobProfile],
                    layout: RowLayout, previous: LedgerState | None, *,
                    held: Mapping[str, tuple[np.ndarray, np.ndarray]],
                    enabled: bool, rule: str, slack: float, keep_rounds: float, seat: bool) -> CriticalDecision:
    """The module's rules for this round (``jobs`` in arrival order; ``held``: the rows each
    job held in the previous round's plan and its GPUs on each, ``hadar/slot.held_rows``;
    ``seat``: the timeline rule seats its due gangs, ``hadar/seats``)."""
    last_end = previous.target_end if previous is not None and previous.target_end >= 0 else None
    new = [j.job_id for j in jobs if j.arrival_s > request.now_s - request.round_s]
    if enabled and rule == "timeline":
        count = np.bincount(layout.row_type, weights=layout.row_cap, minlength=len(layout.types))
        held_types = {job_id: set(layout.row_type[rows].tolist()) for job_id, (rows, _) in held.items()}
        decided = critical_types(jobs, profiles, count, round_=request.round, round_s=request.round_s,
                                 previous=last_end, arrived=bool(new), slack=slack,
                                 credit=previous.gang_credit if previous is not None else None,
                                 held=held_types, keep_rounds=keep_rounds,
                                 rows=(layout.row_type, layout.row_cap) if seat else None, held_rows=held)
        return CriticalDecision(target_end=decided.end, order=tuple(job_id for job_id, _ in decided.chosen),
                                allowed=dict(decided.chosen), gang_credit=decided.credit, seats=decided.seats)
    need = {j.job_id: rounds_needed(j, profiles[j.job_id], request.round_s) for j in jobs}
    capacity = (job_capacity_rounds(jobs, profiles, need, types=layout.row_type, caps=layout.row_cap,
                                    round_s=request.round_s)
                if last_end is None or new else 0.0)
    target = target_end(need, new, round_=request.round, previous=last_end, slack=slack, capacity=capacity)
    order = tuple(critical_jobs(jobs, need, round_=request.round, target=target)) if enabled else ()
    return CriticalDecision(target_end=target, order=order)
