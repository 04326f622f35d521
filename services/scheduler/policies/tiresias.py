"""Tiresias: 2D-LAS with discretized priority queues (Gu et al., NSDI'19), job-level.

Mirrors the ``dlas-gpu`` scheduler of the authors' simulator (SymbioticLab/Tiresias,
``simulator/run_sim.py: dlas_sim_jobs(gputime=True, solve_starvation=knob)``), evaluated
once per round instead of at every event:

* Attained service ``a`` of a job = GPU-seconds it has run (W GPUs x seconds). The policy
  counts it itself from what it placed (W x the round time, at most ``round_s`` per round)
  and never reports less than ``JobState.attained_gpu_s`` when the driver fills that in.
* Queues: with thresholds ``t_1 < ... < t_{K-1}`` (GPU-seconds), a job is in queue
  ``k = #{i : t_i <= a - a_p}``, where ``a_p`` is its attained service at its last
  promotion (0 if never). Default ``thresholds_gpu_s=(3600,)``: two queues, Q0 below one
  GPU-hour, Q1 above (the paper's two-queue setup; the authors' simulator uses 3250/3600).
* Starvation guard (the simulator's ``solve_starvation``, the paper's PROMOTEKNOB): a job
  in queue k > 0 that has waited ``p`` seconds since its last promotion (waiting counted
  only once it has run) is promoted to Q0 when ``p >= promote_knob x (a - a_p) / W``,
  i.e. it has waited ``promote_knob`` times as long as it ran; promotion sets ``a_p = a``
  and ``p = 0``. Default ``promote_knob=8``; ``None`` or 0 disables it.
* Each round the order is (queue, arrival, job id): FIFO within a queue by arrival (the
  simulator keeps running jobs ahead of pending ones inside a queue; we keep strict arrival
  order, which gives the same set whenever arrivals and starts agree). Jobs are taken in
  that order and a job that does not fit is skipped (fit-first), so the policy is
  preemptive at round boundaries: a job placed last round that loses its turn is preempted.
* Heterogeneity-unaware: GPU types are treated as equal. A job runs on W GPUs of one
  usable type: the type it ran on last round if it still has room, else the type with the
  most free GPUs (ties: type name); consolidated on as few nodes as possible.

Waiting codes: INFEASIBLE (no usable type), PRIORITY (jobs in a better queue position took
the GPUs; a preempted job says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.core.policy import (
    JobState,
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


@snapshot_type("policy.tiresias.JobLedger", formerly="services.scheduler.policies.tiresias._JobLedger")
@dataclass(frozen=True, kw_only=True)
class _JobLedger:
    attained_gpu_s: float = 0.0        # a
    attained_at_promotion: float = 0.0  # a_p
    pending_s: float = 0.0             # p: waiting since last promotion, counted once it has run
    promotions: int = 0


@snapshot_type("policy.tiresias.TiresiasState", formerly="services.scheduler.policies.tiresias.TiresiasState")
@dataclass(frozen=True, kw_only=True)
class TiresiasState(PolicyState):
    now_s: float
    ledgers: Mapping[str, _JobLedger] = field(default_factory=dict)
    placed: frozenset[str] = frozenset()


class Tiresias:
    name = "tiresias"

    def __init__(self, *, thresholds_gpu_s: Sequence[float] = (3600.0,),
                 promote_knob: float | None = 8.0) -> None:
        thresholds = tuple(float(t) for t in thresholds_gpu_s)
        if any(t <= 0 for t in thresholds) or list(thresholds) != sorted(set(thresholds)):
            raise ValueError(f"thresholds_gpu_s must be positive and strictly increasing: {thresholds}")
        if promote_knob is not None and promote_knob < 0:
            raise ValueError(f"promote_knob must be >= 0 or None: {promote_knob}")
        self.thresholds_gpu_s = thresholds
        self.promote_knob = promote_knob

    def queue_of(self, service_since_promotion: float) -> int:
        return sum(1 for t in self.thresholds_gpu_s if t <= service_since_promotion)

    def _ledger(self, job: JobState, prev: TiresiasState | None, elapsed_s: float,
                round_s: float) -> _JobLedger:
        old = prev.ledgers.get(job.job_id) if prev is not None else None
        if old is None:  # first sight (or a restart): start from what the driver reports
            old = _JobLedger(attained_gpu_s=job.attained_gpu_s)
        ran = prev is not None and job.job_id in prev.placed
        attained = old.attained_gpu_s + (job.workers * min(elapsed_s, round_s) if ran else 0.0)
        attained = max(attained, job.attained_gpu_s)
        since = attained - old.attained_at_promotion
        pending = old.pending_s + (elapsed_s if not ran and since > 0 else 0.0)
        ledger = _JobLedger(attained_gpu_s=attained, attained_at_promotion=old.attained_at_promotion,
                            pending_s=pending, promotions=old.promotions)
        knob = self.promote_knob
        if (knob and self.queue_of(since) > 0 and since > 0
                and pending >= knob * since / job.workers):
            ledger = _JobLedger(attained_gpu_s=attained, attained_at_promotion=attained,
                                pending_s=0.0, promotions=old.promotions + 1)
        return ledger

    def plan(self, request: PlanRequest) -> Plan:
        prev = previous_state(request, TiresiasState)
        elapsed = max(0.0, request.now_s - prev.now_s) if prev is not None else 0.0
        prev_gangs = previous_gangs(request.previous) if prev is not None else {}

        ledgers = {j.job_id: self._ledger(j, prev, elapsed, request.round_s) for j in request.jobs}
        queue = {jid: self.queue_of(led.attained_gpu_s - led.attained_at_promotion)
                 for jid, led in ledgers.items()}
        order = sorted(request.jobs, key=lambda j: (queue[j.job_id], j.arrival_s, j.job_id))

        free = free_counts(request.cluster)
        requests: list[GangRequest] = []
        waiting: list[Wait] = []
        explain: dict[str, dict[str, object]] = {}
        for position, job in enumerate(order, start=1):
            led = ledgers[job.job_id]
            explain[job.job_id] = {
                "queue": queue[job.job_id], "position": position,
                "attained_gpu_s": round(led.attained_gpu_s, 3),
                "attained_since_promotion_gpu_s": round(led.attained_gpu_s - led.attained_at_promotion, 3),
                "pending_since_promotion_s": round(led.pending_s, 3), "promotions": led.promotions,
            }
            usable = usable_types(request, job)
            if not usable:
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.INFEASIBLE,
                                    detail=infeasible_detail(request, job)))
                continue
            fitting = [t for t in usable if free[t] >= job.workers]
            if not fitting:
                preempted = " (preempted)" if prev is not None and job.job_id in prev.placed else ""
                have = ", ".join(f"{t}:{free[t]}" for t in usable)
                waiting.append(Wait(job_id=job.job_id, code=WaitCode.PRIORITY,
                                    detail=f"Q{queue[job.job_id]} position {position}{preempted}: "
                                           f"needs {job.workers} GPUs of one type, free {have}"))
                continue
            last_parts = prev_gangs.get(job.job_id)
            last_type = gang_type(request.cluster, last_parts) if last_parts else None
            gpu_type = last_type if last_type in fitting else min(fitting, key=lambda t: (-free[t], t))
            free[gpu_type] -= job.workers
            requests.append(GangRequest(job_id=job.job_id, gpu_type=gpu_type, workers=job.workers))

        gangs = assign_gangs(request.cluster, requests, prev_gangs)
        placements = tuple(p for r in requests for p in gangs[r.job_id])
        state = TiresiasState(now_s=request.now_s, ledgers=ledgers,
                              placed=frozenset(r.job_id for r in requests))
        return Plan(placements=placements, waiting=tuple(waiting), state=state, explain=explain)
