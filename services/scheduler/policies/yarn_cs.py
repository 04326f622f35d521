"""YARN-CS: the FIFO, non-preemptive, gang, consolidating baseline (YARN's capacity scheduler).

Behaviour, each round:

1. Jobs are ordered by arrival (ties: job id). A job that was started in an earlier round
   and is still active keeps exactly the GPUs it had (non-preemptive: it holds them until
   it completes). If one of its nodes left the cluster it is re-queued at its FIFO spot.
2. The other jobs, in FIFO order, start if some usable GPU type (see gang.usable_types)
   has >= W free GPUs; all W workers on that one type, on as few nodes as possible. The
   scheduler is heterogeneity-unaware: it does not compare speeds; among fitting types it
   takes the one with the most free GPUs (ties: type name).
3. Head-of-line: YARN's capacity scheduler does not reserve GPUs for a waiting gang
   application, so by default (``skip_blocked_head=True``) a job that does not fit is
   skipped and later, smaller jobs may start (backfill without reservation; a large job
   can then wait long). With ``skip_blocked_head=False`` the first job that does not fit
   blocks every job behind it (strict FIFO).

Waiting codes: INFEASIBLE (no usable type), NON_PREEMPTIVE (the GPUs it needs are held by
jobs started in earlier rounds), PRIORITY (jobs ahead in the FIFO took them this round, or
it is behind a blocked head in strict mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.scheduler.core.policy import (
    Plan,
    PlanRequest,
    PolicyState,
    Wait,
    WaitCode,
    previous_state,
)
from services.scheduler.policies.gang import (
    GangRequest,
    assign_gangs,
    free_counts,
    gang_type,
    infeasible_detail,
    previous_gangs,
    usable_types,
)
from shared.persistence.codec import snapshot_type


@snapshot_type("policy.yarn_cs.YarnState", formerly="services.scheduler.policies.yarn_cs.YarnState")
@dataclass(frozen=True, kw_only=True)
class YarnState(PolicyState):
    started_s: Mapping[str, float] = field(default_factory=dict)  # job -> when it started, for running jobs


class YarnCS:
    name = "yarn-cs"

    def __init__(self, *, skip_blocked_head: bool = True) -> None:
        self.skip_blocked_head = skip_blocked_head

    def plan(self, request: PlanRequest) -> Plan:
        """One YARN-CS round (rules in the module docstring).

        Input: the request and, from ``request.previous``, copy-0 placements and the
        ``YarnState`` start times. Without a ``YarnState`` no job counts as running, and
        every job queues afresh in FIFO order.

        Output: copy 0 of each running or newly started job on exactly W GPUs of one
        type; every other active job waits (INFEASIBLE, NON_PREEMPTIVE or PRIORITY, the
        detail naming the free GPUs per usable type); a ``YarnState`` with the start time
        of each placed job only; queue position and state per job in ``explain``.

        Guarantees: non-preemptive, a started job keeps exactly its GPUs while it is
        active and all its nodes remain; no type is over-committed; jobs start in FIFO
        order of (arrival, job id), later ones passing a blocked head only when
        ``skip_blocked_head``. Speeds are never compared (heterogeneity-unaware).

        Cost: O(m log m + m n) for m jobs and n GPU types, plus gang placement.
        """
        prev = previous_state(request, YarnState)
        started_s = dict(prev.started_s) if prev is not None else {}
        prev_gangs = previous_gangs(request.previous)
        jobs = sorted(request.jobs, key=lambda j: (j.arrival_s, j.job_id))
        free = free_counts(request.cluster)

        requests: list[GangRequest] = []
        running: set[str] = set()
        for job in jobs:  # running jobs first: they hold their GPUs whatever the order
            parts = prev_gangs.get(job.job_id)
            gpu_type = gang_type(request.cluster, parts) if parts and job.job_id in started_s else None
            if parts and gpu_type is not None and sum(len(p.gpus) for p in parts) == job.workers:
                requests.append(GangRequest(job_id=job.job_id, gpu_type=gpu_type, workers=job.workers))
                free[gpu_type] -= job.workers
                running.add(job.job_id)
        free_after_running = dict(free)  # free GPUs once earlier-started jobs are counted

        waiting: list[Wait] = []
        explain: dict[str, dict[str, object]] = {}
        blocked_head: str | None = None
        for position, job in enumerate(jobs, start=1):
            info: dict[str, object] = {"queue_position": position}
            explain[job.job_id] = info
            if job.job_id in running:
                info["state"] = "running"
                info["started_s"] = started_s[job.job_id]
                continue
            usable = usable_types(request, job)
            if not usable:
                info["state"] = "infeasible"
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.INFEASIBLE,
                                    detail=infeasible_detail(request, job)))
                continue
            if blocked_head is not None and not self.skip_blocked_head:
                info["state"] = "waiting"
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.PRIORITY,
                                    detail=f"FIFO: behind blocked head {blocked_head}"))
                continue
            fitting = [t for t in usable if free[t] >= job.workers]
            if fitting:
                gpu_type = min(fitting, key=lambda t: (-free[t], t))
                free[gpu_type] -= job.workers
                requests.append(GangRequest(job_id=job.job_id, gpu_type=gpu_type, workers=job.workers))
                started_s[job.job_id] = request.now_s
                info["state"] = "started"
                continue
            info["state"] = "waiting"
            blocked_head = blocked_head or job.job_id
            have = ", ".join(f"{t}:{free[t]}" for t in usable)
            if any(free_after_running[t] >= job.workers for t in usable):
                code, why = WaitCode.PRIORITY, "taken by jobs ahead in FIFO"
            else:
                code, why = WaitCode.NON_PREEMPTIVE, "held by running jobs"
            waiting.append(Wait(job_id=job.job_id, code=code,
                                detail=f"needs {job.workers} GPUs of one type; free {have}; {why}"))

        gangs = assign_gangs(request.cluster, requests, prev_gangs)
        placements = tuple(p for r in requests for p in gangs[r.job_id])
        placed = {r.job_id for r in requests}
        state = YarnState(started_s={j: s for j, s in started_s.items() if j in placed})
        return Plan(placements=placements, waiting=tuple(waiting), state=state, explain=explain)
