"""Pure glue between the live scheduler's state and the policies.

``build_request`` turns folded events into the policy's input; ``plan_to_events`` turns
its plan into the RoundStarted and Assignment events agents act on. Both are
deterministic functions of their arguments, which is what lets replay re-derive every
recorded round.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import (
    JobState,
    Placement,
    Plan,
    PlanRequest,
    copy_rate,
)
from services.scheduler.core.queues import QueuedState
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.live.evaluations import evaluation_assignments
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice
from shared.domain.progress import credited_steps
from shared.wire.events import Assignment, Event, RoundStarted, Waiting

RENDEZVOUS_BASE_PORT = 29500
RENDEZVOUS_PORTS = 2000


@dataclass(frozen=True, kw_only=True)
class RoundTiming:
    round: int
    started_at: float
    round_s: float
    heartbeat_s: float

    @property
    def ends_at(self) -> float:
        return self.started_at + self.round_s


def cluster_from_state(state: SchedulerState, timing: RoundTiming,
                       nodes: tuple[str, ...] | None = None) -> Cluster:
    """The round's cluster; GPUs by position.

    Live (``nodes`` None): nodes that sent a heartbeat within 3 periods of the round start.
    Re-deriving a recorded round: exactly the ``nodes`` it recorded, so the result does not
    depend on the heartbeat period or on how heartbeats interleaved with other topics.
    """
    if nodes is None:
        records = state.live_nodes(timing.started_at, timing.heartbeat_s)
    else:
        records = [state.nodes[n] for n in nodes if n in state.nodes]
    members = []
    for record in records:
        gpus = sorted(record.registered.gpus, key=lambda g: g.index)
        members.append(Node(node_id=record.registered.node_id, gpus=tuple(g.type for g in gpus)))
    return Cluster(name="live", nodes=tuple(members))


def throughput_from_state(state: SchedulerState) -> ThroughputModel:
    """Rates keyed by job id (each live job is its own "job type"); measured beat estimated."""
    return ThroughputModel(rates={key: rate for key, (_, rate) in state.rates.items()})


def build_request(state: SchedulerState, timing: RoundTiming, previous: Plan | None, seed: int,
                   nodes: tuple[str, ...] | None = None) -> PlanRequest:
    """The policy's input for the round ``timing`` describes (``nodes``: see cluster_from_state).

    A job's ``model_bytes``/``optimizer_slots`` are the last size its estimates stated
    (0 and None while none has: charged nothing, as the simulator charges a workload it
    does not know); its ``restart_s`` what its copies' measured start-ups say a move costs
    (``JobRecord.move_cost_s``; 0 until a cold and a warm copy both reported one)."""
    jobs = tuple(
        JobState(
            job_id=j.spec.job_id, job_type=j.spec.job_id, workers=j.spec.workers,
            total_steps=j.spec.iterations, steps_done=float(j.steps_done), arrival_s=j.submitted_at,
            priority=j.spec.priority, attained_gpu_s=j.attained_gpu_s, restart_s=j.move_cost_s,
            queue=j.spec.queue, user=j.spec.user, priority_class=j.spec.priority_class,
            **_size(state.sizes.get(j.spec.job_id)),
        )
        for j in state.active_jobs()
    )
    return PlanRequest(round=timing.round, now_s=timing.started_at, round_s=timing.round_s,
                    cluster=cluster_from_state(state, timing, nodes), jobs=jobs,
                    throughput=throughput_from_state(state), previous=previous, seed=seed,
                    queues=state.queues)


def _size(size: tuple[int, int] | None) -> dict[str, int]:
    return {} if size is None else {"model_bytes": size[0], "optimizer_slots": size[1]}


def _workers(parts: list[Placement]) -> int:
    return sum(len(p.gpus) for p in parts)


def _budget(remaining: int, share: float, *, copy_workers: int, job_workers: int) -> int:
    """A copy's own steps for ``share`` of the job's ``remaining`` steps, rounded up; never
    more than would do all of them alone. Exact integers but for the share."""
    alone = -(-remaining * job_workers // copy_workers)      # ceil(remaining x W / k)
    return min(alone, math.ceil(remaining * share * job_workers / copy_workers))


def rendezvous_port(job_id: str, copy: int) -> int:
    return RENDEZVOUS_BASE_PORT + zlib.crc32(f"{job_id}/{copy}".encode()) % RENDEZVOUS_PORTS


def plan_to_events(plan: Plan, request: PlanRequest, state: SchedulerState, timing: RoundTiming, *,
                   choice: PolicyChoice, seed: int, source: str, inputs: dict[str, int],
                   decision_ms: float) -> list[Event]:
    """RoundStarted first, then one Assignment per (node, job copy), in a stable order.

    Each copy's step budget is in its own steps (docs/architecture.md "Work accounting"):
    the job's remaining steps are split across its copies in proportion to their credited
    rates (a copy's rate x k/W on k of the job's W workers), and a copy's share of job
    steps is W/k of its own steps, rounded up -- so copies together do not overshoot the
    job by more than one of their own steps each when the estimates hold. Evaluation copies
    of completed user-code jobs come last, on GPUs the plan left free
    (:mod:`services.scheduler.live.evaluations`).
    """
    jobs = {j.job_id: j for j in request.jobs}
    copies = plan.copies()
    rates = {key: credited_steps(copy_rate(request, jobs[key[0]], parts),
                                 copy_workers=_workers(parts), job_workers=jobs[key[0]].workers)
             for key, parts in copies.items()}
    total_rate: dict[str, float] = {}
    for (job_id, _), rate in rates.items():
        total_rate[job_id] = total_rate.get(job_id, 0.0) + rate
    ts = timing.started_at
    evaluations = evaluation_assignments(plan, request, state, round_=timing.round, ts=ts,
                                         deadline=timing.ends_at, source=source)
    events: list[Event] = [RoundStarted(
        ts=ts, source=source, round=timing.round, policy=choice.name, policy_options=choice.options_json,
        seed=seed, round_s=timing.round_s, heartbeat_s=timing.heartbeat_s, started_at=timing.started_at,
        ends_at=timing.ends_at, nodes=tuple(n.node_id for n in request.cluster.nodes),
        assignments=sum(len(p) for p in copies.values()) + len(evaluations),
        waiting=tuple(Waiting(job_id=w.job_id, code=w.code.value, detail=w.detail[:200]) for w in plan.waiting),
        decision_ms=decision_ms, inputs=dict(sorted(inputs.items())),
        queues=plan.state.standings if isinstance(plan.state, QueuedState) else (),
    )]
    fork: dict[str, tuple[int, int]] = {}     # job -> (copies, workers of all its copies)
    for (job_id, _), parts in copies.items():
        n, k = fork.get(job_id, (0, 0))
        fork[job_id] = (n + 1, k + _workers(parts))
    for (job_id, copy) in sorted(copies):
        parts = sorted(copies[(job_id, copy)], key=lambda p: p.node_id)
        record = state.jobs[job_id]
        remaining = max(0, record.spec.iterations - record.steps_done)
        share = rates[(job_id, copy)] / total_rate[job_id] if total_rate[job_id] > 0 else 1.0 / len(
            [k for k in copies if k[0] == job_id])
        world = _workers(parts)
        budget = _budget(remaining, share, copy_workers=world, job_workers=record.spec.workers)
        first_node = state.nodes[parts[0].node_id].registered
        rendezvous: str | None = None
        peers: tuple[str, ...] = ()
        if len(parts) > 1:
            host = first_node.address or parts[0].node_id
            rendezvous = f"{host}:{rendezvous_port(job_id, copy)}"
            peers = tuple(p.node_id for p in parts for _ in p.gpus)   # each rank's node, in rank order
        rank = 0
        for part in parts:
            registered = state.nodes[part.node_id].registered
            by_position = sorted(registered.gpus, key=lambda g: g.index)
            gpus = tuple(by_position[i].index for i in part.gpus)
            types = sorted({by_position[i].type for i in part.gpus})
            ranks = tuple(range(rank, rank + len(gpus)))
            rank += len(gpus)
            events.append(Assignment(
                ts=ts, source=source, round=timing.round, job=record.spec, copy=copy, node_id=part.node_id,
                gpus=gpus, gpu_type="+".join(types), world_size=world, ranks=ranks, step_budget=budget,
                deadline=timing.ends_at, start_from=record.model_key, rendezvous=rendezvous, peers=peers,
                copies=fork[job_id][0], fork_workers=fork[job_id][1],
            ))
    events.extend(evaluations)
    return events
