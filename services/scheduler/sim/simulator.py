"""Round-based simulation of a policy on a job trace, in simulated time.

Semantics (exact; metrics.py and the tests rely on them):

* Rounds start at ``t0 + r*round_s`` with ``t0 = floor(first arrival / round_s) * round_s``;
  ``PlanRequest.round`` is ``r``. A job is active in a round if it arrived at or before the
  round start and has not completed. Rounds with no active job are skipped (no plan() call,
  no record), jumping to the first round that starts at or after the next arrival; so are
  rounds where every active job is *unrunnable*: no GPU type of the cluster gives it a
  positive rate at any worker count 1..W, so no placement of any policy can move it.
* Each simulated round builds a ``PlanRequest`` (the policy's previous ``Plan``, the seed, and
  one ``JobState`` per active job in arrival order, with steps done and attained
  GPU-seconds, and ``model_bytes``: the simulator keeps each job's from
  ``shared.domain.workloads.model_bytes``, 0 for a type it does not know, and hands it to the
  policy as the live scheduler hands it the profiler's), times
  ``policy.plan`` with ``time.perf_counter`` -- the one clock read here, reported only --
  and, with ``check=True``, validates the plan with ``policy.check_plan``.
* Work is counted in samples (``shared.domain.progress``, docs/architecture.md "Work
  accounting"): a job's work is ``total_steps`` steps of its global batch (W per-worker
  batches). Every (job, copy) of the plan steps at its own rate ``s = copy_rate(request,
  job, placements)``; a copy on k of the job's W workers keeps the per-worker batch, so
  each of its steps is k/W of a job step and it credits ``s * k / W`` job steps per
  second. A copy with more than W workers is an ``InvalidPlan``.
* Moving state costs time (``services.scheduler.sim.charges``): a copy is *cold* when its set
  of (node, GPU) is not the set of any copy of its job in the previous simulated round
  (whatever the copies' numbers: a warm process is the job's on those GPUs, as the agent's
  warm key is), and loses ``start`` seconds at the round's start and ``end``
  at its end; a job loses ``consolidation`` at the round's end. By default (``data_plane``
  None) ``start`` is ``restart_s`` (``restart_s_by_job_type[job type]`` where given) for a
  cold copy, ``end`` 0, and a job with n > 1 copies (HadarE) pays
  ``shared.domain.fork_cost.consolidation_s``, (2 n + 1) checkpoints through ``store_gbps``;
  with ``data_plane`` every charge is that measured model's (``shared.domain.data_plane``).
  Every copy trains in ``[start, round_s - tail]``, ``tail`` = the largest ``end`` of the
  job's copies + ``consolidation``. Steps of a job = sum over
  copies of credited rate x training time, capped at what remains;
  ``RoundObservation.copy_steps`` has each copy's own steps, so that sum over copies of own
  steps x k = job steps x W (samples are conserved).
* A job whose copies can do what remains finishes at ``round start + T + tail`` where T is
  when the copies, training in parallel at their summed credited rate, reach the total; it
  leaves at the round end (its GPUs are freed only then, as in Gavel).
* Busy GPU-seconds: every placed GPU is held, and counts as busy, from the round start until
  its job completes (T + tail) or, if it does not, for the whole round -- restart
  and consolidation time included, zero-rate placements included. Attained GPU-seconds and
  time per GPU type of a job count the same held time.
* The run stops when every job completed; when no arrivals remain and only unrunnable jobs
  are left ("unrunnable"); when no arrivals remain and ``stall_rounds`` consecutive rounds
  made no progress at all ("stalled": only the policy knows whether it will ever place what
  is left, e.g. a job-level policy facing 8 workers of a type the cluster has 4 of); or after
  ``max_rounds`` simulated rounds ("max_rounds"). Jobs left are reported not completed,
  each with the last wait reason its policy gave (``JobRecord.last_wait``; for a job no
  placement can move, the simulator's own).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import (
    InvalidPlan,
    Placement,
    Plan,
    PlanRequest,
    Policy,
    check_plan,
    copy_rate,
)
from services.scheduler.core.queues import plan_with_queues
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.sim.charges import Charges, DataPlaneCharges, FlatCharges, checkpoint_figures
from services.scheduler.sim.sim_job import JobRecord, LiveJob, advance, finish_time, move_cost
from services.scheduler.sim.traces import TraceJob
from shared.domain import workloads
from shared.domain.data_plane import DataPlane
from shared.wire.queues import QueueConfig

__all__ = ["InvalidPlan", "JobRecord", "RoundObservation", "RoundRecord", "SimOptions", "SimResult",
           "build_throughput", "can_ever_run", "default_model_bytes", "finish_time", "simulate"]



@dataclass(frozen=True, kw_only=True)
class SimOptions:
    round_s: float = 360.0
    restart_s: float = 0.0        # per re-placed copy; 0 as in Gavel's simulator
    # per job type, overriding restart_s (Sia charges each application its own checkpoint-restore time)
    restart_s_by_job_type: Mapping[str, float] = field(default_factory=dict)
    store_gbps: float = 1.0       # object-store bandwidth for HadarE consolidation, GB/s
    data_plane: DataPlane | None = None  # measured costs of moving state, replacing the three above
    seed: int = 0                 # PlanRequest.seed
    check: bool = False           # check_plan on every round (tests)
    max_rounds: int = 100_000
    stall_rounds: int = 50
    queues: QueueConfig | None = None   # team queues in force for the whole run (None: no quotas)

    def __post_init__(self) -> None:
        if not self.round_s > 0:
            raise ValueError("round_s must be positive")
        if self.restart_s < 0 or any(not v >= 0 for v in self.restart_s_by_job_type.values()):
            raise ValueError("restart_s must be >= 0")
        if not self.store_gbps > 0:
            raise ValueError("store_gbps must be positive")
        if self.max_rounds < 1 or self.stall_rounds < 1:
            raise ValueError("max_rounds and stall_rounds must be >= 1")
        if self.data_plane is not None and (self.restart_s or self.restart_s_by_job_type):
            raise ValueError("restart_s is charged by the data plane when one is given: give one or the other")

    def charges(self) -> Charges:
        if self.data_plane is not None:
            return DataPlaneCharges(plane=self.data_plane)
        return FlatCharges(restart_s=self.restart_s, restart_s_by_job_type=self.restart_s_by_job_type,
                           store_gbps=self.store_gbps)

    def first_start_s(self, job_type: str) -> float:
        """The least training time a ``job_type`` job loses in the round of its first placement
        (a round's start charge takes at most the round): what the TTD bounds charge it."""
        return min(self.charges().first_start_s(job_type), self.round_s)


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    round: int
    start_s: float
    active_jobs: int
    placed_gpus: Mapping[str, int]        # GPUs placed, by type
    busy_gpu_s: Mapping[str, float]       # GPU-seconds busy in this round, by type
    decision_ms: float


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    cluster: Cluster
    round_s: float
    jobs: tuple[JobRecord, ...]
    rounds: tuple[RoundRecord, ...]
    end_s: float                  # end of the last simulated round
    stop_reason: str              # completed | unrunnable | stalled | max_rounds
    gangs_only: bool = True       # every job placed ran as one copy of exactly W workers (bounds.py)


@dataclass(frozen=True, kw_only=True)
class RoundObservation:
    """What one round did, for observers (tests check invariants with it)."""

    request: PlanRequest
    plan: Plan
    steps: Mapping[str, float]            # job steps credited this round, per placed job
    completions: Mapping[str, float]      # completion time of jobs that finished this round
    copy_steps: Mapping[tuple[str, int], float]  # each copy's own steps this round


def default_model_bytes(job_type: str) -> int:
    """FP32 weight bytes of a Gavel job type or a Sia application (``charges.checkpoint_figures``),
    or 0 for a job type neither knows."""
    return checkpoint_figures(job_type)[0]


def can_ever_run(job: TraceJob, cluster: Cluster, throughput: ThroughputModel) -> bool:
    """False iff no placement of up to W GPUs of this cluster gives the job a positive rate.

    A mixed placement of n workers runs at n x the minimum per-worker rate(type, n)/n of its
    types, so some rate(type, n) > 0 with n <= W is necessary for any placement to move it.
    """
    limit = min(job.workers, cluster.total_gpus)
    return any(throughput.rate(job.job_type, t, n) > 0 for t in cluster.types for n in range(1, limit + 1))


def simulate(*, policy: Policy, cluster: Cluster, jobs: Sequence[TraceJob], throughput: ThroughputModel,
             options: SimOptions = SimOptions(), model_bytes: Callable[[str], int] | None = None,
             observer: Callable[[RoundObservation], None] | None = None) -> SimResult:
    """Run ``policy`` on ``jobs`` over ``cluster`` (see module docstring for the semantics)."""
    size_of = model_bytes or default_model_bytes
    round_s = options.round_s
    charges = options.charges()
    pending = sorted(jobs, key=lambda j: j.arrival_s)
    ids = [j.job_id for j in pending]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate job id in trace")
    bytes_of = {job_type: size_of(job_type) for job_type in {j.job_type for j in pending}}
    live = {j.job_id: LiveJob(j, bytes_of[j.job_type], move_cost(charges, j.job_type, bytes_of[j.job_type]))
            for j in pending}
    runnable = {j.job_id: can_ever_run(j, cluster, throughput) for j in pending}
    for job_id, ok in runnable.items():
        if not ok:  # a policy may never see it (no plan() once only such jobs are left)
            live[job_id].last_wait = "infeasible: no placement of up to W GPUs of the cluster gives it a positive rate"
    gpu_type_of = {n.node_id: n.gpus for n in cluster.nodes}
    t0 = math.floor(pending[0].arrival_s / round_s) * round_s if pending else 0.0

    active: list[LiveJob] = []
    rounds: list[RoundRecord] = []
    next_arrival = 0
    r = 0
    simulated = 0
    stall = 0
    previous: Plan | None = None
    # Per job, the GPU set of each of its copies last round: a copy is warm on one of them
    # whatever its number (the agent's warm key is the job and its GPUs, not the copy).
    prev_gpus: dict[str, set[frozenset[tuple[str, int]]]] = {}
    # A copy's rate depends only on its job type and GPU set (cluster and table are fixed).
    rate_cache: dict[tuple[str, frozenset[tuple[str, int]]], float] = {}
    stop_reason = "completed"
    end_s = t0
    gangs_only = True

    while True:
        now = t0 + r * round_s
        while next_arrival < len(pending) and pending[next_arrival].arrival_s <= now:
            active.append(live[pending[next_arrival].job_id])
            next_arrival += 1
            stall = 0
        if not any(runnable[j.trace.job_id] for j in active):
            if next_arrival >= len(pending):
                stop_reason = "unrunnable" if active else "completed"
                break
            r = max(r + 1, math.ceil((pending[next_arrival].arrival_s - t0) / round_s))
            prev_gpus = {}
            continue
        if simulated >= options.max_rounds:
            stop_reason = "max_rounds"
            break

        request = PlanRequest(round=r, now_s=now, round_s=round_s, cluster=cluster,
                            jobs=tuple(j.state() for j in active), throughput=throughput,
                            previous=previous, seed=options.seed, queues=options.queues)
        started = time.perf_counter()
        plan = plan_with_queues(policy, request)
        decision_ms = (time.perf_counter() - started) * 1000.0
        if options.check:
            check_plan(request, plan)
        for wait in plan.waiting:
            if wait.job_id in live:
                live[wait.job_id].last_wait = f"{wait.code.value}: {wait.detail}" if wait.detail else wait.code.value

        copies_by_job: dict[str, list[tuple[int, list[Placement]]]] = defaultdict(list)
        for (job_id, copy), placements in plan.copies().items():
            copies_by_job[job_id].append((copy, placements))
        placed: dict[str, int] = defaultdict(int)
        busy: dict[str, float] = defaultdict(float)
        steps_made: dict[str, float] = {}
        completions: dict[str, float] = {}
        copy_steps: dict[tuple[str, int], float] = {}
        next_gpus: dict[str, set[frozenset[tuple[str, int]]]] = defaultdict(set)

        for job_id, job_copies in copies_by_job.items():
            job = live.get(job_id)
            if job is None or job.completion_s is not None or job.trace.arrival_s > now:
                raise InvalidPlan(f"{job_id}: placed but not active in round {r}")
            copy_gpus = [frozenset((p.node_id, g) for p in parts for g in p.gpus) for _, parts in job_copies]
            runs = []
            for (copy, parts), gpus in zip(job_copies, copy_gpus):
                if len(gpus) > job.trace.workers:
                    raise InvalidPlan(f"{job_id} copy {copy}: {len(gpus)} workers > W={job.trace.workers}")
                rate = rate_cache.get((job.trace.job_type, gpus))
                if rate is None:
                    rate = rate_cache[(job.trace.job_type, gpus)] = copy_rate(request, job.state(), parts)
                nodes = tuple(sorted(Counter(node for node, _ in gpus).values()))
                runs.append((rate, len(gpus), nodes, gpus not in prev_gpus.get(job_id, ())))
                next_gpus[job_id].add(gpus)
            steps, held, own = advance(job, runs, now=now, round_s=round_s, charges=charges)
            steps_made[job_id] = steps
            gangs_only = gangs_only and len(runs) == 1 and runs[0][1] == job.trace.workers
            copy_steps.update({(job_id, copy): x for (copy, _), x in zip(job_copies, own)})
            if job.completion_s is not None:
                completions[job_id] = job.completion_s
            types = [[gpu_type_of[node][g] for node, g in gpus] for gpus in copy_gpus]
            for copy_types in types:
                for gpu_type in copy_types:
                    placed[gpu_type] += 1
                    busy[gpu_type] += held
            job.account(types, held, now)

        rounds.append(RoundRecord(round=r, start_s=now, active_jobs=len(active), placed_gpus=dict(placed),
                                  busy_gpu_s=dict(busy), decision_ms=decision_ms))
        if observer is not None:
            observer(RoundObservation(request=request, plan=plan, steps=steps_made, completions=completions,
                                      copy_steps=copy_steps))
        simulated += 1
        end_s = now + round_s
        previous = plan
        prev_gpus = next_gpus
        if completions:
            active = [j for j in active if j.completion_s is None]
        progressed = any(s > 0 for s in steps_made.values())
        stall = 0 if progressed else stall + 1
        if not active and next_arrival >= len(pending):
            break
        if stall >= options.stall_rounds and next_arrival >= len(pending):
            stop_reason = "stalled"
            break
        r += 1

    return SimResult(policy=getattr(policy, "name", type(policy).__name__), cluster=cluster, round_s=round_s,
                     jobs=tuple(live[j.job_id].record() for j in pending), rounds=tuple(rounds),
                     end_s=end_s, stop_reason=stop_reason, gangs_only=gangs_only)


def build_throughput(*, cross_node: bool = True, table_path: str | None = None) -> ThroughputModel:
    """Gavel's table, with ``shared.domain.workloads.calibrated_fallback`` (memoised: it is
    pure) for GPU types the table lacks; ``cross_node=False`` ignores node boundaries, as
    Gavel does."""
    base = ThroughputModel.from_gavel_table(table_path, cross_node=cross_node)
    fallback = functools.lru_cache(maxsize=None)(workloads.calibrated_fallback(base, reference="v100"))
    return dataclasses.replace(base, fallback=fallback)
