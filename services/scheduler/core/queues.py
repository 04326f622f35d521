"""Teams on one cluster: every policy honours queue quotas through this one mechanism.

:func:`plan_with_queues` is what the live scheduler, the simulator and replay call for a
round. Without queues (``request.queues`` is None) it returns ``policy.plan(request)``
unchanged. With queues (``shared/wire/queues.py``), each round:

1. **Jobs.** A job belongs to its queue (``JobState.queue``; "" is the default queue). A job
   naming a queue that does not exist waits (``quota``). Within a queue, jobs are in queue
   order: higher priority class first, then arrival, then id. A user's jobs past
   ``user_max_queued``, or whose W would take the user past ``user_max_gpus``, wait.
2. **Entitlements** (:mod:`services.scheduler.core.quota`): GPUs of each type each queue
   may hold: the part of its quota (scaled down where nodes are missing) its jobs can use,
   each on types it runs on at its number of workers (:func:`job_rate`); idle GPUs lent
   one at a time to the queue with jobs still short whose fair-share standing (decayed
   usage over weight) is lowest, within its borrowing limit, of a type the job runs on;
   for a policy that forks (``forks``: its copies use more than W), what is still idle,
   to queues with jobs; for the others it stays in no queue's partition. For a policy that
   runs a job on one GPU type (all but Hadar and HadarE: ``mixes_types``), a job's GPUs
   are all of one type, and what it borrows completes that type.
3. **Partition.** The entitlement becomes concrete GPUs, in two passes. First every queue
   keeps, of the GPUs it held last round, as many of each type as it is entitled to: its
   running jobs' GPUs whole, job by job in keep order (the reverse of the reclaim order
   below; a job whose GPUs no longer all fit is passed over), then GPUs its jobs ran on,
   then the others, by (node, index). Then every queue takes the free GPUs it still lacks,
   on nodes where it already holds GPUs, then on those with the most free GPUs of the
   type. Queues go in name order in each pass; no GPU goes to two, and no queue takes a
   GPU another held while that one keeps its entitlement.
4. **Plan.** For each queue, its priority classes from the highest: the policy plans that
   class's jobs on the queue's GPUs that a higher class left free, with the state it
   carried for that (queue, class) and the previous placements of those jobs that lie in
   them. The plans are merged, GPU indices mapped back.
5. **Fair share.** A queue's usage decays by ``2^(-round_s / half_life)`` and grows by the
   round's normalized GPU-seconds (:func:`~services.scheduler.core.quota.charge`).

Guarantees (``tests/unit/test_queues.py`` and ``test_queues_properties.py`` check them on
random clusters, queues and jobs, every round, for every policy):

* no queue holds more GPUs of a type than its entitlement, nor more in all than its quota
  plus its borrowing limit;
* a queue with demand gets at least ``min(demand, quota)`` GPUs in the first round that
  sees the demand, counting the GPUs of its quota its jobs can run on -- with a one-type
  policy, only jobs that one type of its quota could hold count (a gang of 4 in a queue
  whose quota is 2 V100s + 2 K80s runs only on borrowed GPUs, which nobody can promise:
  another queue may own them or stand lower in fair share): borrowed GPUs are
  reclaimed at that round boundary, which loses nothing (every placement is renewed each
  round and every copy checkpoints at a round's end);
* a queue keeps the GPUs its running jobs hold, as many of each type as it is entitled to:
  a running job's GPU goes to another queue only when its queue holds fewer of that type
  than its jobs ran on, because that queue reclaims its own quota or stands lower in fair
  share for idle ones; so a job is preempted to serve another queue only when its queue ran
  above its guarantee (on borrowed GPUs), never within it. To a job of its own queue it
  leaves its GPUs only of a higher class (within a class, the policy's own rules decide, as
  without queues).

Reclaim order (:func:`keep_order`, reversed). When a queue is entitled to fewer GPUs of a
type than its running jobs hold (its borrowed GPUs are reclaimed by their owner, or lent by
fair share to a queue standing lower), it gives back the GPUs of the job that comes first in:

1. the lowest priority class;
2. the least progress lost. At a round boundary no job loses a sample: every copy
   checkpoints at the round's end. What a preempted job loses is the restore of that
   checkpoint onto its W GPUs when it resumes, counted as ``model_bytes x workers`` (0 when
   the size is unknown): the smallest first;
3. the latest arrival, then the greatest job id.

This decides which GPUs the queue gives back, and so which previous placements still lie in
its partition; on what it keeps, its policy plans as in step 4 (a non-preemptive policy
such as YARN-CS keeps exactly those jobs running; a preemptive one may, by its own rules,
run another job of the same class there).

How quotas enter Hadar's primal-dual: each queue's Hadar plans on its partition, so its
ledger's capacity -- and the exponential prices that rise as it fills -- is the queue's
entitlement, and its critical rule's LP (and HadarE's) sees the same capacity. The
mechanism's waits are ``WaitCode.QUOTA`` with the reason in queue terms; a job the policy
leaves waiting inside a queue that holds all it may is told so (``over quota: ...``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import (
    JobState,
    Placement,
    Plan,
    PlanRequest,
    Policy,
    PolicyState,
    Wait,
    WaitCode,
    forks,
    mixes_types,
)
from services.scheduler.core.quota import Entitlement, Rate, charge, decayed, entitlements
from shared.persistence.codec import snapshot_type
from shared.wire.queues import QueueConfig, QueueStanding

__all__ = ["QueuedState", "plan_with_queues", "queue_order", "keep_order", "previous_queued", "job_rate"]

Gpu = tuple[str, int]   # (node id, GPU index on it)


@snapshot_type("core.QueuedState")
@dataclass(frozen=True, eq=False)
class QueuedState(PolicyState):
    """What the mechanism carries between rounds: the policy's own state per (queue, class)
    (key ``"queue/class"``), the GPUs each queue held, each queue's decayed usage as of
    ``usage_at`` and the round's standings (published with the round)."""

    inner: Mapping[str, PolicyState | None] = field(default_factory=dict)
    held: Mapping[str, tuple[Gpu, ...]] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)
    usage_at: float = 0.0
    standings: tuple[QueueStanding, ...] = ()


def queue_order(job: JobState) -> tuple[int, float, str]:
    """Queue order: higher priority class first, then arrival, then id."""
    return (-job.priority_class, job.arrival_s, job.job_id)


def previous_queued(request: PlanRequest) -> QueuedState | None:
    state = request.previous.state if request.previous is not None else None
    return state if isinstance(state, QueuedState) else None


def plan_with_queues(policy: Policy, request: PlanRequest) -> Plan:
    """The round's plan under the queues in force (module docstring)."""
    config = request.queues
    if config is None:
        return policy.plan(request)
    prev = previous_queued(request)
    visible, waits = _visible_jobs(request.jobs, config)
    rate = job_rate(request)
    capacity = request.cluster.gpus_by_type
    usage = decayed(prev.usage, request.now_s - prev.usage_at, config.fair_share_half_life_s) if prev else {}
    ent = entitlements(config, capacity, visible, rate, usage=usage, round_s=request.round_s, spare=forks(policy),
                       one_type=not mixes_types(policy))
    ran_on = _previous_gpus(request.previous)
    held = _partition(request.cluster, ent, prev.held if prev else {}, visible, ran_on)
    placements: list[Placement] = []
    inner_states: dict[str, PolicyState | None] = {}
    explain: dict[str, Mapping[str, object]] = {}
    for queue in config.queues:
        jobs = visible.get(queue.name, [])
        free = list(held.get(queue.name, ()))
        for cls in sorted({j.priority_class for j in jobs}, reverse=True):
            members = tuple(j for j in jobs if j.priority_class == cls)
            key = f"{queue.name}/{cls}"
            plan = _plan_on(policy, request, members, free, prev.inner.get(key) if prev else None)
            inner_states[key] = plan.state
            taken = {(p.node_id, g) for p in plan.placements for g in p.gpus}
            free = [g for g in free if g not in taken]
            placements += plan.placements
            gave_back = len(prev.held.get(queue.name, ())) - ent[queue.name].total if prev else 0
            waits += [_in_queue_terms(w, queue.name, ent[queue.name], cls, jobs, ran_on, gave_back)
                      for w in plan.waiting]
            explain.update(plan.explain)
    used_by: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    queue_of_job = {j.job_id: q for q, js in visible.items() for j in js}
    jobs_by_id = {j.job_id: j for j in request.jobs}
    new_usage = dict(usage)
    types = request.cluster.types
    for p in placements:
        q = queue_of_job[p.job_id]
        gpu_type = request.cluster.by_id[p.node_id].gpus[p.gpus[0]]
        for g in p.gpus:
            used_by[q][request.cluster.by_id[p.node_id].gpus[g]] += 1
        new_usage[q] = new_usage.get(q, 0.0) + charge(jobs_by_id[p.job_id], gpu_type, len(p.gpus), request.round_s,
                                                      rate, types)
    placed = {p.job_id for p in placements}
    pending: dict[str, int] = defaultdict(int)
    for j in request.jobs:
        if j.job_id not in placed:
            pending[config.queue_of(j.queue)] += 1
    standings = tuple(QueueStanding(
        name=q.name, entitled=dict(ent[q.name].gpus), used=dict(sorted(used_by[q.name].items())),
        borrowed=ent[q.name].borrowed, lent=ent[q.name].lent, usage=new_usage.get(q.name, 0.0),
        running=len({j.job_id for j in visible.get(q.name, ()) if j.job_id in placed}),
        pending=pending[q.name],
    ) for q in config.queues)
    state = QueuedState(inner=inner_states, held={q: tuple(g) for q, g in held.items()}, usage=new_usage,
                        usage_at=request.now_s, standings=standings)
    return Plan(placements=tuple(placements), waiting=tuple(waits), state=state, explain=explain)


def job_rate(request: PlanRequest) -> Rate:
    """The rate the mechanism counts with: a job's steps/s on a type at its own number of
    workers (a job that runs on a K80 alone but not as a pair of them does not run there)."""
    def rate(job: JobState, gpu_type: str) -> float:
        return request.throughput.rate(job.job_type, gpu_type, job.workers)
    return rate


def _visible_jobs(jobs: Sequence[JobState], config: QueueConfig) -> tuple[dict[str, list[JobState]], list[Wait]]:
    """Each queue's jobs the policy may see, in queue order, and waits for the others."""
    by_queue: dict[str, list[JobState]] = defaultdict(list)
    waits: list[Wait] = []
    for job in sorted(jobs, key=queue_order):
        name = config.queue_of(job.queue)
        if config.queue(name) is None:
            waits.append(Wait(job_id=job.job_id, code=WaitCode.QUOTA, detail=f"unknown queue {name!r}"))
        else:
            by_queue[name].append(job)
    visible: dict[str, list[JobState]] = {}
    for name, members in by_queue.items():
        spec = config.queue(name)
        assert spec is not None
        queued: dict[str, int] = defaultdict(int)
        asked: dict[str, int] = defaultdict(int)
        shown = []
        most = None if spec.borrowing_limit is None else spec.nominal + spec.borrowing_limit
        for job in members:
            queued[job.user] += 1
            if most is not None and job.workers > most:
                waits.append(Wait(job_id=job.job_id, code=WaitCode.QUOTA,
                                  detail=f"never fits {name}: asks {job.workers} GPUs, the queue may hold {most}"))
            elif spec.user_max_queued is not None and queued[job.user] > spec.user_max_queued:
                detail = f"user limit: {job.user or '?'} has {spec.user_max_queued} jobs queued in {name}"
                waits.append(Wait(job_id=job.job_id, code=WaitCode.QUOTA, detail=detail))
            elif spec.user_max_gpus is not None and asked[job.user] + job.workers > spec.user_max_gpus:
                waits.append(Wait(job_id=job.job_id, code=WaitCode.QUOTA,
                                  detail=f"user limit: {job.user or '?'} asks {asked[job.user]}/{spec.user_max_gpus} "
                                         f"GPUs in {name}"))
            else:
                asked[job.user] += job.workers
                shown.append(job)
        visible[name] = shown
    return visible, waits


def _previous_gpus(previous: Plan | None) -> dict[str, set[Gpu]]:
    """The GPUs each job ran on in the previous plan."""
    out: dict[str, set[Gpu]] = defaultdict(set)
    for p in previous.placements if previous is not None else ():
        out[p.job_id].update((p.node_id, g) for g in p.gpus)
    return out


def keep_order(job: JobState) -> tuple[int, int, float, str]:
    """The order in which a queue that must give GPUs back keeps its running jobs' GPUs
    (module docstring, "Reclaim order"); its reverse is the reclaim order: lowest priority
    class first, then least progress lost (``model_bytes x workers``), then the latest
    arrival, then the greatest job id."""
    return (-job.priority_class, -job.model_bytes * job.workers, job.arrival_s, job.job_id)


def _partition(cluster: Cluster, ent: Mapping[str, Entitlement], held: Mapping[str, Sequence[Gpu]],
               visible: Mapping[str, Sequence[JobState]], ran_on: Mapping[str, set[Gpu]]) -> dict[str, list[Gpu]]:
    """Concrete GPUs for every queue's entitlement (module docstring, step 3)."""
    type_of = {(n.node_id, i): t for n in cluster.nodes for i, t in enumerate(n.gpus)}
    free: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))   # type -> node -> indices
    for (node_id, index), gpu_type in type_of.items():
        free[gpu_type][node_id].add(index)
    out: dict[str, list[Gpu]] = {name: [] for name in ent}
    want = {name: dict(e.gpus) for name, e in ent.items()}

    def take(name: str, g: Gpu) -> None:
        free[type_of[g]][g[0]].discard(g[1])
        want[name][type_of[g]] -= 1
        out[name].append(g)

    for name in sorted(ent):   # every queue keeps what it held before any takes a free GPU
        mine = {g for g in held.get(name, ()) if g in type_of}
        running = sorted((j for j in visible.get(name, ()) if j.job_id in ran_on
                          and not ran_on[j.job_id].isdisjoint(mine)), key=keep_order) if mine else []
        for job in running:    # whole jobs, in keep order
            gpus = sorted(ran_on[job.job_id] & mine)
            need: dict[str, int] = defaultdict(int)
            for g in gpus:
                need[type_of[g]] += 1
            if all(want[name].get(t, 0) >= n for t, n in need.items()) and all(g[1] in free[type_of[g]][g[0]]
                                                                                for g in gpus):
                for g in gpus:
                    take(name, g)
        used = set().union(*(ran_on.get(j.job_id, set()) for j in running))
        for g in sorted(mine - set(out[name]), key=lambda g: (g not in used, g)):
            if want[name].get(type_of[g], 0) > 0 and g[1] in free[type_of[g]][g[0]]:
                take(name, g)
    for name in sorted(ent):
        for gpu_type, n in sorted(want[name].items()):
            nodes_of_mine = {g[0] for g in out[name]}
            nodes = sorted((node for node, idx in free[gpu_type].items() if idx),
                           key=lambda node: (node not in nodes_of_mine, -len(free[gpu_type][node]), node))
            for node in nodes:
                for index in sorted(free[gpu_type][node])[:n]:
                    take(name, (node, index))
                    n -= 1
                if n <= 0:
                    break
    return out


def _plan_on(policy: Policy, request: PlanRequest, jobs: tuple[JobState, ...], gpus: Sequence[Gpu],
             state: PolicyState | None) -> Plan:
    """The policy's plan for ``jobs`` on the sub-cluster of ``gpus``, mapped back to the
    cluster's GPU indices."""
    if not jobs:
        return Plan(state=state)
    by_node: dict[str, list[int]] = defaultdict(list)
    for node_id, index in sorted(gpus):
        by_node[node_id].append(index)
    order = [n.node_id for n in request.cluster.nodes if n.node_id in by_node]
    nodes = tuple(Node(node_id=n, gpus=tuple(request.cluster.by_id[n].gpus[i] for i in by_node[n])) for n in order)
    local = {(n, g): i for n in order for i, g in enumerate(by_node[n])}
    ids = {j.job_id for j in jobs}
    previous_placements = []
    for p in request.previous.placements if request.previous is not None else ():
        if p.job_id in ids and all((p.node_id, g) in local for g in p.gpus):
            previous_placements.append(Placement(job_id=p.job_id, copy=p.copy, node_id=p.node_id,
                                                 gpus=tuple(local[(p.node_id, g)] for g in p.gpus)))
    previous = Plan(placements=tuple(previous_placements), state=state)
    sub = replace(request, cluster=Cluster(name=request.cluster.name, nodes=nodes), jobs=jobs, previous=previous,
                  queues=None)
    plan = policy.plan(sub) if nodes else Plan(waiting=tuple(Wait(job_id=j.job_id, code=WaitCode.CAPACITY)
                                                              for j in jobs), state=state)
    return replace(plan, placements=tuple(Placement(job_id=p.job_id, copy=p.copy, node_id=p.node_id,
                                                    gpus=tuple(by_node[p.node_id][i] for i in p.gpus))
                                          for p in plan.placements))


def _in_queue_terms(wait: Wait, queue: str, ent: Entitlement, cls: int, jobs: Sequence[JobState],
                    ran_on: Mapping[str, set[Gpu]], gave_back: int) -> Wait:
    """A policy's wait for GPUs told in queue terms: the queue's GPUs are all taken (by a
    higher class, or because it gave borrowed ones back, or it holds all it may)."""
    if wait.code not in (WaitCode.CAPACITY, WaitCode.PRIORITY, WaitCode.NON_PREEMPTIVE):
        return wait
    if wait.job_id in ran_on and any(j.priority_class > cls for j in jobs):
        return Wait(job_id=wait.job_id, code=WaitCode.QUOTA, detail=f"preempted by a higher priority in {queue}")
    if wait.job_id in ran_on and gave_back > 0:
        return Wait(job_id=wait.job_id, code=WaitCode.QUOTA,
                    detail=f"reclaimed: {queue} gave back {gave_back} GPUs it had borrowed")
    held = ", ".join(f"{n}/{ent.nominal.get(t, 0)} {t}" for t, n in sorted(ent.gpus.items())) or "no GPUs"
    detail = f"over quota: {queue} holds {held}" + (f" (+{ent.borrowed} borrowed)" if ent.borrowed else "")
    return Wait(job_id=wait.job_id, code=WaitCode.QUOTA, detail=detail)
