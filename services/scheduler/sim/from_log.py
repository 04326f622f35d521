"""A live run's event log as a simulator workload, and the two runs' JCTs side by side.

:func:`live_workload` reads what the live system recorded (``hadar demo --record``,
``hadar replay --file``'s format) and builds the same workload for the simulator:

* **cluster** -- every node a round of the run planned on (``RoundStarted.nodes``), its GPUs
  by index as it registered;
* **jobs** -- each submitted job, arriving when the profiler first published a rate for it
  (the scheduler cannot place a job before: ``services/scheduler/live/state.py``), with its
  workers and iterations; times are seconds from ``t0``, the start the first round of the
  log would have had if every round had run ``round_s``, so the simulator's rounds
  (multiples of ``round_s``) fall where the live ones were planned: t0 is the first round's
  start, unless rounds before the first that placed anything, placing nothing, ended early
  when a rate or a node came (``services/scheduler/live/pacing.py``); then t0 is set back
  from that first placing round's start;
* **throughput** -- per (job, GPU type) the mean of every rate the profiler *measured* over
  the run, and for a type never measured the mean of its estimates: a live copy's rate moves
  with what else runs beside it, a simulated one's does not, so the mean is the fairest one
  figure;
* **policy** -- the one the rounds record (name, options, seed) and their length;
* **model bytes** -- the largest ``model_bytes`` the profiler published for the job;
* **placements** -- every round's Assignments, as a plan (:class:`RecordedPlacements`).

:func:`compare` simulates it and sets each job's simulated JCT (from its submission) beside
the live one (``JobCompleted.jct_s``), either under the live run's policy (``replay=False``:
it decides afresh, knowing every rate from the start, where the live one began from the
profiler's first estimates) or placing exactly what the live rounds placed (``replay=True``:
only time accounting differs -- each move's cost, round-boundary waits, and a rate that
changed with contention where the simulator holds its mean; a job the live run completed
keeps its last placement until the replay completes it too, :class:`RecordedPlacements`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import Placement, Plan, PlanRequest
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import make_policy
from services.scheduler.sim.simulator import SimOptions, simulate
from services.scheduler.sim.traces import TraceJob
from shared.wire.events import (
    Assignment,
    Event,
    JobCompleted,
    JobSubmitted,
    NodeRegistered,
    RoundStarted,
    ThroughputEstimate,
)

__all__ = ["LiveWorkload", "JobComparison", "RecordedPlacements", "live_workload", "compare"]


class RecordedPlacements:
    """A policy placing in round r what the live scheduler placed in its round r (of the jobs
    still active in the simulation).

    A job the live run completed but the replay has not by the end of its last recorded round
    (it sped up at the end, say once it ran alone, where the replay holds its mean rate) keeps
    its last round's placement, as the live scheduler renews a placement each round until the
    job is done: copy by copy, each copy whole, on GPUs that no other job's copy 0 and no
    earlier-ending job's renewal hold (the job placed longest ago first), the copies kept
    numbered from 0. Another job's forked copy (copy >= 1) on those GPUs gives way: HadarE
    forks onto GPUs the active jobs leave, and the live round found them free only because
    this job had completed. (Renewed only whole, a forked job one of whose GPUs went to another
    job's copy 0 waited for a round that held none of them: 19.5 s live, 41.1 s replayed.) A
    job the live run did not complete is never placed beyond what was recorded."""

    name = "recorded"
    forks = True          # the live policy may have forked and mixed: the plans are taken as they were
    mixes_types = True

    def __init__(self, rounds: Mapping[int, tuple[Placement, ...]], *, completed: Iterable[str] = ()) -> None:
        self.rounds = rounds
        last: dict[str, int] = {}
        for r, placements in rounds.items():
            for p in placements:
                last[p.job_id] = max(last.get(p.job_id, r), r)
        done = set(completed)
        self._renewable = sorted(
            ((r, job_id, tuple(p for p in rounds[r] if p.job_id == job_id))
             for job_id, r in last.items() if job_id in done), key=lambda t: (t[0], t[1]))

    def plan(self, request: PlanRequest) -> Plan:
        active = {j.job_id for j in request.jobs}
        placed = [p for p in self.rounds.get(request.round, ()) if p.job_id in active]
        held = {(p.node_id, g) for p in placed if p.copy == 0 for g in p.gpus}
        for last_round, job_id, placements in self._renewable:
            if last_round >= request.round or job_id not in active:
                continue
            copies: dict[int, list[Placement]] = {}
            for p in placements:
                copies.setdefault(p.copy, []).append(p)
            free = [parts for _, parts in sorted(copies.items())
                    if not {(p.node_id, g) for p in parts for g in p.gpus} & held]
            if not free:
                continue
            gpus = {(p.node_id, g) for parts in free for p in parts for g in p.gpus}
            held |= gpus
            displaced = {(p.job_id, p.copy) for p in placed if gpus & {(p.node_id, g) for g in p.gpus}}
            placed = [p for p in placed if (p.job_id, p.copy) not in displaced]
            placed.extend(dataclasses.replace(p, copy=i) for i, parts in enumerate(free) for p in parts)
        return Plan(placements=tuple(placed))


@dataclass(frozen=True, kw_only=True)
class LiveWorkload:
    cluster: Cluster
    jobs: tuple[TraceJob, ...]
    throughput: ThroughputModel
    model_bytes: Mapping[str, int]
    submitted_s: Mapping[str, float]      # from t0 (module docstring)
    live_jct_s: Mapping[str, float]       # jobs the live run completed
    policy: str
    policy_options: Mapping[str, object]
    seed: int
    round_s: float
    placements: Mapping[int, tuple[Placement, ...]]


@dataclass(frozen=True, kw_only=True)
class JobComparison:
    job_id: str
    live_jct_s: float | None
    simulated_jct_s: float | None


def live_workload(events: Iterable[Event], *, since: float = 0.0) -> LiveWorkload:
    """The workload of a recorded live run (module docstring) of the events from ``since`` (unix
    time: a persistent broker's log also holds earlier runs; a node's registration counts from
    any time, as an agent registers once); ValueError if it has no round, no node or no job."""
    nodes: dict[str, NodeRegistered] = {}
    submitted: dict[str, JobSubmitted] = {}
    first_rate: dict[str, float] = {}
    measured: dict[tuple[str, str], list[float]] = defaultdict(list)
    estimated: dict[tuple[str, str], list[float]] = defaultdict(list)
    sizes: dict[str, int] = defaultdict(int)
    completed: dict[str, JobCompleted] = {}
    rounds: list[RoundStarted] = []
    placed: dict[int, list[Placement]] = defaultdict(list)
    for e in events:
        if isinstance(e, NodeRegistered):
            nodes.setdefault(e.node_id, e)
        elif e.ts < since:
            continue
        elif isinstance(e, JobSubmitted):
            submitted.setdefault(e.job.job_id, e)
        elif isinstance(e, ThroughputEstimate):
            first_rate[e.job_id] = min(first_rate.get(e.job_id, e.ts), e.ts)
            target = measured if e.basis == "measured" else estimated
            for gpu_type, rate in e.rates.items():
                target[(e.job_id, gpu_type)].append(rate)
            sizes[e.job_id] = max(sizes[e.job_id], e.model_bytes)
        elif isinstance(e, JobCompleted):
            completed[e.job_id] = e
        elif isinstance(e, RoundStarted):
            rounds.append(e)
        elif isinstance(e, Assignment) and not e.evaluation:   # an evaluation copy trains nothing
            placed[e.round].append(Placement(job_id=e.job.job_id, copy=e.copy, node_id=e.node_id, gpus=e.gpus))
    planned_on = {node for r in rounds for node in r.nodes} & set(nodes)
    if not rounds or not planned_on or not submitted:
        raise ValueError("the log holds no round, node or job: not a live run")
    first = min(rounds, key=lambda r: r.round)
    round_s = first.round_s or first.ends_at - first.started_at
    base = min((r for r, ps in placed.items() if ps), default=first.round)
    t0 = min((r.started_at - (r.round - first.round) * round_s for r in rounds if r.round == base),
             default=first.started_at)
    rates = {(job, gpu_type, 1): statistics.fmean(values) for (job, gpu_type), values in estimated.items()}
    rates.update({(job, gpu_type, 1): statistics.fmean(values) for (job, gpu_type), values in measured.items()})
    cluster = Cluster(name="live", nodes=tuple(
        Node(node_id=n.node_id, gpus=tuple(g.type for g in sorted(n.gpus, key=lambda g: g.index)))
        for n in sorted((nodes[node] for node in planned_on), key=lambda n: n.node_id)))
    jobs = tuple(
        TraceJob(job_id=job_id, arrival_s=max(0.0, first_rate[job_id] - t0), job_type=job_id,
                 workers=s.job.workers, total_steps=s.job.iterations)
        for job_id, s in sorted(submitted.items(), key=lambda kv: kv[1].submitted_at) if job_id in first_rate)
    return LiveWorkload(
        cluster=cluster, jobs=jobs, throughput=ThroughputModel(rates=rates), model_bytes=dict(sizes),
        submitted_s={job_id: s.submitted_at - t0 for job_id, s in submitted.items()},
        live_jct_s={job_id: c.jct_s for job_id, c in completed.items()},
        policy=first.policy, policy_options=json.loads(first.policy_options), seed=first.seed, round_s=round_s,
        placements={r: tuple(ps) for r, ps in placed.items()})


def compare(workload: LiveWorkload, options: SimOptions | None = None, *, replay: bool) -> tuple[JobComparison, ...]:
    """Each job's live JCT beside the simulator's for the same workload and round length, under the
    live policy or its recorded placements (module docstring; ``options`` gives the charges, its
    ``round_s`` and ``seed`` are the live run's)."""
    sim_options = dataclasses.replace(options or SimOptions(), round_s=workload.round_s, seed=workload.seed)
    policy = (RecordedPlacements(workload.placements, completed=workload.live_jct_s) if replay
              else make_policy(workload.policy, **workload.policy_options))
    result = simulate(policy=policy, cluster=workload.cluster,
                      jobs=workload.jobs, throughput=workload.throughput, options=sim_options,
                      model_bytes=lambda job_id: workload.model_bytes.get(job_id, 0))
    simulated = {j.job_id: j.completion_s for j in result.jobs}
    return tuple(
        JobComparison(job_id=j.job_id, live_jct_s=workload.live_jct_s.get(j.job_id),
                      simulated_jct_s=(None if (done := simulated.get(j.job_id)) is None
                                       else done - workload.submitted_s[j.job_id]))
        for j in workload.jobs)
