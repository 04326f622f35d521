"""The one interface every scheduling policy implements: ``plan(request) -> Plan``.

A policy is pure: given the same request it returns the same plan. It does no I/O,
reads no clock (time comes in ``PlanRequest.now_s``), and draws randomness only from
``PlanRequest.seed``. State a policy carries from round to round (Hadar's ledger) is a
:class:`PolicyState` that travels in ``Plan.state`` and comes back as
``request.previous.state``, so the simulator, the live scheduler and replay all drive the
same function the same way.

A plan places job *copies*: copy 0 is the job itself; HadarE adds copies 1, 2, ...
that train independently and are weight-averaged at the round end. One copy may span
several nodes (Hadar's task-level placement): it then has one ``Placement`` per node.
Every active job that gets no placement is listed in ``Plan.waiting`` with a reason.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.throughput import Part, ThroughputModel
from shared.errors import HadarError
from shared.persistence.codec import snapshot_type
from shared.wire.queues import QueueConfig


@dataclass(frozen=True, kw_only=True)
class JobState:
    """An active job (arrived, not completed, not cancelled) as the policy sees it."""

    job_id: str
    job_type: str
    workers: int                 # W: the scale factor requested
    total_steps: int
    steps_done: float = 0.0
    arrival_s: float = 0.0
    priority: float = 1.0
    attained_gpu_s: float = 0.0  # GPU-seconds of service received so far (Tiresias)
    # The job's checkpoint, what consolidating forked copies moves (shared.domain.fork_cost): FP32
    # weights in bytes (0: unknown, charged nothing) and optimizer state tensors per parameter
    # (None: the policy's own default). Live: stated by the profiler; simulated: the trace's
    # workload (shared.domain.workloads.model_bytes).
    model_bytes: int = 0
    optimizer_slots: int | None = None
    # Seconds a cold copy of the job (new processes, or another GPU set) trains less than a
    # warm one on the GPUs it ran on last round: what a move costs it. 0: unknown, taken as
    # free. Simulated: the run's charges (sim/charges.py); live: its copies' measured
    # start-ups, cold over warm (live/records.JobRecord.move_cost_s).
    restart_s: float = 0.0
    # Teams (services/scheduler/core/queues.py): the queue named at submission ("": the
    # default queue), the submitting user and the job's priority class in its queue.
    queue: str = ""
    user: str = ""
    priority_class: int = 0

    @property
    def remaining(self) -> float:
        return max(0.0, self.total_steps - self.steps_done)


@snapshot_type("core.Placement", formerly="services.scheduler.policy.Placement")
@dataclass(frozen=True, kw_only=True)
class Placement:
    """``gpus`` (indices on ``node_id``) given to copy ``copy`` of ``job_id`` this round."""

    job_id: str
    copy: int
    node_id: str
    gpus: tuple[int, ...]


@snapshot_type("core.WaitCode", formerly="services.scheduler.policy.WaitCode")
class WaitCode(str, enum.Enum):  # noqa: UP042 - str() and format() of a member stay as logged and replayed
    CAPACITY = "capacity"        # not enough free GPUs of a usable kind this round
    PRIORITY = "priority"        # GPUs went to jobs ahead of it (queue order, fairness)
    INFEASIBLE = "infeasible"    # no GPU type in the cluster can run it (zero throughput / too few GPUs)
    PAYOFF = "payoff"            # Hadar: no schedule's utility exceeds its cost at current prices
    NON_PREEMPTIVE = "non-preemptive"  # a running job holds the GPUs (YARN-CS)
    QUOTA = "quota"              # its queue's quota, a user limit or a higher priority class holds it back


@snapshot_type("core.Wait", formerly="services.scheduler.policy.Wait")
@dataclass(frozen=True, kw_only=True)
class Wait:
    job_id: str
    code: WaitCode
    detail: str = ""


@snapshot_type("core.PolicyState", formerly="services.scheduler.policy.PolicyState")
@dataclass(frozen=True, eq=False)
class PolicyState:
    """Base of the state a policy carries from one round to the next (``Plan.state``).

    Each policy that keeps books across rounds declares its own frozen dataclass on this
    base (Hadar's ``LedgerState``, ``GavelState``, ``TiresiasState``, ``YarnState``). The
    driver hands it back untouched as ``request.previous.state``: never copied, compared
    or serialised; a restarted scheduler or a replay gets it back by re-running the rounds.
    A policy reads it only through :func:`previous_state`, which gives None for anything
    that is not its own type (the first round, or a plan another policy made), and then
    starts from empty books.

    The base has no fields and ``eq=False``: a subclass that compares by identity (Hadar's
    ledger, which holds arrays) must not inherit a field-less ``__eq__`` under which any
    two instances are equal.
    """


S = TypeVar("S", bound=PolicyState)


@snapshot_type("core.Plan", formerly="services.scheduler.policy.Plan")
@dataclass(frozen=True, kw_only=True)
class Plan:
    placements: tuple[Placement, ...] = ()
    waiting: tuple[Wait, ...] = ()
    state: PolicyState | None = None                            # policy-private, carried to the next round
    explain: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per job: what the policy saw

    def copies(self) -> dict[tuple[str, int], list[Placement]]:
        """Placements grouped by (job, copy)."""
        grouped: dict[tuple[str, int], list[Placement]] = defaultdict(list)
        for p in self.placements:
            grouped[(p.job_id, p.copy)].append(p)
        return dict(grouped)

    def decision(self) -> tuple[object, ...]:
        """What the plan decides, without policy-private state: compare plans with this."""
        return (tuple(sorted((p.job_id, p.copy, p.node_id, p.gpus) for p in self.placements)),
                tuple(sorted((w.job_id, w.code.value) for w in self.waiting)))


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    round: int
    now_s: float
    round_s: float
    cluster: Cluster
    jobs: tuple[JobState, ...]
    throughput: ThroughputModel
    previous: Plan | None = None
    seed: int = 0
    queues: QueueConfig | None = None   # the teams' queues in force (None: no quotas)


class Policy(Protocol):
    """A scheduling policy: ``plan`` is pure (all it carries between rounds is in
    ``Plan.state``). A policy whose plans may put a job on more GPUs than its W (HadarE's
    forked copies) says so with a class attribute ``forks = True`` (read by
    :func:`forks`); the queue mechanism lends it GPUs no job needs. A policy that may run
    one job's workers on several GPU types at once says so with ``mixes_types = True``
    (:func:`mixes_types`); for any other, the queue mechanism entitles each job to GPUs of
    one type."""

    name: str

    def plan(self, request: PlanRequest) -> Plan: ...


def forks(policy: Policy) -> bool:
    """Whether ``policy`` may place a job on more GPUs than its W (``Policy`` docstring)."""
    return bool(getattr(policy, "forks", False))


def mixes_types(policy: Policy) -> bool:
    """Whether ``policy`` may run one job's workers on several GPU types (``Policy`` docstring)."""
    return bool(getattr(policy, "mixes_types", False))


def previous_state(request: PlanRequest, kind: type[S]) -> S | None:
    """The state the previous plan carried, if it is a ``kind``; else None."""
    state = request.previous.state if request.previous is not None else None
    return state if isinstance(state, kind) else None


def parts_of(request: PlanRequest, placements: list[Placement]) -> list[Part]:
    """The throughput model's view of one copy's placements."""
    by_id = request.cluster.by_id
    counts: dict[tuple[str, str], int] = defaultdict(int)
    for p in placements:
        node = by_id[p.node_id]
        for g in p.gpus:
            counts[(p.node_id, node.gpus[g])] += 1
    return [Part(node_id, gpu_type, c) for (node_id, gpu_type), c in counts.items()]


def previous_parts(request: PlanRequest) -> dict[str, list[Part]]:
    """Where each job ran in the previous round's plan, all its copies together: (node, GPU
    type, GPUs) on the nodes still in the cluster (a node that left, or GPUs it no longer
    has, hold nothing). What the policies keep a job on when they may (a move is a restart)."""
    if request.previous is None:
        return {}
    by_id = request.cluster.by_id
    kept: dict[str, list[Placement]] = defaultdict(list)
    for p in request.previous.placements:
        node = by_id.get(p.node_id)
        gpus = tuple(g for g in p.gpus if g < len(node.gpus)) if node is not None else ()
        if gpus:
            kept[p.job_id].append(replace(p, gpus=gpus))
    return {job_id: parts_of(request, placements) for job_id, placements in kept.items()}


def copy_rate(request: PlanRequest, job: JobState, placements: list[Placement]) -> float:
    return request.throughput.placement_rate(job.job_type, parts_of(request, placements))


class InvalidPlan(HadarError):
    """A plan that breaks an invariant of :func:`check_plan`: a bug in the policy."""


def check_plan(request: PlanRequest, plan: Plan) -> None:
    """Raise InvalidPlan unless the plan respects the invariants every policy must keep.

    No GPU used twice; GPUs exist; only active jobs placed; a copy uses at most W workers;
    copies of one job are on distinct nodes (a copy spanning nodes counts on each);
    every active job is either placed or waiting with a reason, never both.
    """
    jobs = {j.job_id: j for j in request.jobs}
    used: set[tuple[str, int]] = set()
    nodes_of_job: dict[str, set[str]] = defaultdict(set)
    for (job_id, copy), parts in plan.copies().items():
        if job_id not in jobs:
            raise InvalidPlan(f"placed unknown or inactive job {job_id}")
        workers = sum(len(p.gpus) for p in parts)
        if workers > jobs[job_id].workers:
            raise InvalidPlan(f"{job_id} copy {copy}: {workers} workers > W={jobs[job_id].workers}")
        copy_nodes = {p.node_id for p in parts}
        if len(copy_nodes) != len(parts):
            raise InvalidPlan(f"{job_id} copy {copy}: two placements on one node")
        if nodes_of_job[job_id] & copy_nodes:
            raise InvalidPlan(f"{job_id}: two copies on node {sorted(nodes_of_job[job_id] & copy_nodes)}")
        nodes_of_job[job_id] |= copy_nodes
        for p in parts:
            node = request.cluster.by_id.get(p.node_id)
            if node is None:
                raise InvalidPlan(f"{job_id}: unknown node {p.node_id}")
            if not p.gpus:
                raise InvalidPlan(f"{job_id} copy {copy}: empty placement on {p.node_id}")
            for g in p.gpus:
                if not 0 <= g < node.size:
                    raise InvalidPlan(f"{job_id}: GPU {g} does not exist on {p.node_id}")
                if (p.node_id, g) in used:
                    raise InvalidPlan(f"GPU {p.node_id}:{g} assigned twice")
                used.add((p.node_id, g))
    placed = set(nodes_of_job)
    waiting = [w.job_id for w in plan.waiting]
    if len(set(waiting)) != len(waiting):
        raise InvalidPlan("a job is listed twice as waiting")
    if placed & set(waiting):
        raise InvalidPlan(f"jobs both placed and waiting: {sorted(placed & set(waiting))}")
    unaccounted = set(jobs) - placed - set(waiting)
    if unaccounted:
        raise InvalidPlan(f"active jobs neither placed nor waiting: {sorted(unaccounted)[:5]}")
