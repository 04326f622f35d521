"""Per-queue results of a simulated run under team queues (``hadar sim --queues``).

Pure functions over a ``SimResult``, the ``QueueConfig`` in force and what a
:class:`QueueObserver` (passed to ``simulate`` as its observer) recorded per round. Per
queue q, with ``N`` the number of queues and ``w_q`` its weight:

* jobs, completed, JCT mean and p95 (completion - arrival, completed jobs only; p95 by
  linear interpolation), as ``results.py`` does for the whole trace.
* Usage: each round, every GPU a job of q is placed on is charged
  ``quota.charge(job, type, 1, round_s, rate, types)`` normalized GPU-seconds with
  ``rate = queues.job_rate(request)`` (the job's rate on the type at its W) -- the charge the
  mechanism books for fair share (``services/scheduler/core/queues.py`` step 5): the whole round, as GPUs are
  freed only at a round's end; each GPU at its own type.
* Contended rounds: simulated rounds in which every queue had at least one active job
  ("while all queues have demand"); ``contended_s`` is their number x round_s (rounds
  the simulator skipped have no active job and are never contended).
* Attained ``share``: q's usage over all queues' usage, summed over the contended rounds;
  ``weight_share`` = ``w_q / sum(w)``; ``share_ratio`` = share / weight_share (1: the
  weights exactly). ``jain``: Jain's index ``(sum x)^2 / (N sum x^2)`` of the queues'
  share ratios (1: every queue got its weight; 1/N: one queue got everything).
* The same over *backlogged* rounds (``backlogged_share``, ``backlogged_jain``): contended
  rounds in which every queue's demand (its active jobs' W, summed, counting jobs some
  type can run) was at least its weight share of the cluster's GPUs -- rounds in which
  every queue could use its share. A queue with a single job left is "contended" but not
  backlogged: no scheduler can give it its weight. ``gpu_share`` and
  ``backlogged_gpu_share``: the same shares in plain GPU-seconds (what quotas count).
* Finish-time fairness (Themis's rho), per completed job: ``rho = JCT / T_alone`` with the
  closed form ``T_alone = total_steps / R``, R the best rate of the job alone on 1/N of the
  cluster: ``R = max sum_t x_t * throughput.rate(job_type, t, W)`` over time fractions
  ``x_t <= c_t / (N W)`` (c_t: GPUs of type t; a W-worker gang on ``c_t/N`` GPUs of t runs a
  fraction ``c_t/(N W)`` of the time when that is below 1) with ``sum x_t <= 1`` -- filled
  greedily from the fastest type. No round quantisation, node boundaries ignored, no
  restarts: with N = 1 and a job that ran alone on its best type from a round start,
  rho = 1. Reported per queue as mean and max; jobs with R = 0 or not completed are left
  out. Not computed with the simulator.

Undefined values (no completed job, no contended round) are None.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import JobState
from services.scheduler.core.queues import job_rate
from services.scheduler.core.quota import charge
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.sim.simulator import JobRecord, RoundObservation, SimResult
from services.scheduler.sim.traces import TraceJob
from shared.wire.queues import QueueConfig

__all__ = ["QueueRound", "QueueObserver", "QueueFigures", "QueueFairness", "queue_fairness", "queues_of",
           "jain_index", "alone_jct_s"]


@dataclass(frozen=True, kw_only=True)
class QueueRound:
    """One simulated round, per queue: active jobs, demand (W summed over the active jobs
    some type can run), normalized GPU-seconds charged and GPUs placed."""

    start_s: float
    round_s: float
    active: Mapping[str, int]
    demand: Mapping[str, int]
    charge: Mapping[str, float]
    gpus: Mapping[str, int]


@dataclass(eq=False)
class QueueObserver:
    """``simulate(..., observer=QueueObserver(config))``: records a :class:`QueueRound` per
    round. Jobs naming a queue ``config`` lacks are not counted."""

    config: QueueConfig
    rounds: list[QueueRound] = field(default_factory=list)
    _relative: dict[tuple[str, int, str], float] = field(default_factory=dict)   # (type, W, GPU type) -> charge/s
    _runnable: dict[tuple[str, int], bool] = field(default_factory=dict)         # (job type, W) -> some type runs it

    def _rel(self, job: JobState, gpu_type: str, obs: RoundObservation) -> float:
        key = (job.job_type, job.workers, gpu_type)
        if key not in self._relative:
            self._relative[key] = charge(job, gpu_type, 1, 1.0, job_rate(obs.request), obs.request.cluster.types)
        return self._relative[key]

    def __call__(self, obs: RoundObservation) -> None:
        req = obs.request
        names = {q.name for q in self.config.queues}
        queue_of = {j.job_id: self.config.queue_of(j.queue) for j in req.jobs}
        jobs = {j.job_id: j for j in req.jobs}
        active: dict[str, int] = dict.fromkeys(sorted(names), 0)
        demand: dict[str, int] = dict.fromkeys(sorted(names), 0)
        for j in req.jobs:
            q = queue_of[j.job_id]
            if q in names:
                active[q] += 1
                kind = (j.job_type, j.workers)
                if kind not in self._runnable:
                    rate = job_rate(req)
                    self._runnable[kind] = any(rate(j, t) > 0 for t in req.cluster.types)
                if self._runnable[kind]:
                    demand[q] += j.workers
        used: dict[str, float] = dict.fromkeys(sorted(names), 0.0)
        gpus: dict[str, int] = dict.fromkeys(sorted(names), 0)
        for p in obs.plan.placements:
            q = queue_of.get(p.job_id, "")
            if q not in names:
                continue
            node = req.cluster.by_id[p.node_id]
            for g in p.gpus:
                used[q] += self._rel(jobs[p.job_id], node.gpus[g], obs) * req.round_s
                gpus[q] += 1
        self.rounds.append(QueueRound(start_s=req.now_s, round_s=req.round_s, active=active, demand=demand,
                                      charge=used, gpus=gpus))


@dataclass(frozen=True, kw_only=True)
class QueueFigures:
    name: str
    weight: float
    weight_share: float
    jobs: int
    completed: int
    jct_mean_s: float | None
    jct_p95_s: float | None
    usage_gpu_s: float                  # normalized GPU-seconds over the whole run
    share: float | None                 # over contended rounds
    share_ratio: float | None
    backlogged_share: float | None      # over backlogged rounds
    backlogged_ratio: float | None
    gpu_share: float | None             # plain GPU-seconds (not normalized), over contended rounds
    backlogged_gpu_share: float | None  # the same over backlogged rounds
    rho_mean: float | None
    rho_max: float | None


@dataclass(frozen=True, kw_only=True)
class QueueFairness:
    queues: tuple[QueueFigures, ...]
    contended_s: float
    backlogged_s: float
    jain: float | None
    backlogged_jain: float | None
    rho_mean: float | None              # over every queue's completed jobs
    rho_max: float | None

    def as_dict(self) -> dict:
        out = asdict(self)
        out["queues"] = {q.name: {k: v for k, v in asdict(q).items() if k != "name"} for q in self.queues}
        return out


def queues_of(jobs: Sequence[TraceJob], config: QueueConfig) -> dict[str, str]:
    """Each trace job's queue under ``config`` ("" -> the default queue)."""
    return {j.job_id: config.queue_of(j.queue) for j in jobs}


def jain_index(values: Sequence[float]) -> float | None:
    """``(sum x)^2 / (n sum x^2)``; None for no values or all zero."""
    square = sum(x * x for x in values)
    return sum(values) ** 2 / (len(values) * square) if values and square > 0 else None


def alone_jct_s(job: JobRecord, cluster: Cluster, throughput: ThroughputModel, n_queues: int) -> float | None:
    """``T_alone`` of the module docstring: the job alone on 1/N of the cluster (closed form)."""
    rates = sorted(((throughput.rate(job.job_type, t, job.workers), count)
                    for t, count in cluster.gpus_by_type.items()), reverse=True)
    left, rate = 1.0, 0.0
    for r, count in rates:
        if r <= 0 or left <= 0:
            break
        x = min(left, count / (n_queues * job.workers))
        rate += x * r
        left -= x
    return job.total_steps / rate if rate > 0 else None


def _shares(rounds: Sequence[QueueRound], names: Sequence[str], *, plain: bool = False) -> dict[str, float | None]:
    totals = {q: sum(float(r.gpus.get(q, 0)) if plain else r.charge.get(q, 0.0) for r in rounds) for q in names}
    whole = sum(totals.values())
    return {q: v / whole if whole > 0 else None for q, v in totals.items()}


def _over(x: float | None, y: float) -> float | None:
    return None if x is None else x / y


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def queue_fairness(result: SimResult, config: QueueConfig, rounds: Sequence[QueueRound], *,
                   queue_of: Mapping[str, str], throughput: ThroughputModel) -> QueueFairness:
    """The module docstring's figures. ``rounds``: a QueueObserver's; ``queue_of``: job id ->
    queue (:func:`queues_of`); jobs of queues ``config`` lacks are left out."""
    names = [q.name for q in config.queues]
    weights = {q.name: q.weight for q in config.queues}
    total_w = sum(weights.values())
    weight_share = {q: weights[q] / total_w for q in names}
    gpus = result.cluster.total_gpus
    contended = [r for r in rounds if all(r.active.get(q, 0) > 0 for q in names)]
    backlogged = [r for r in contended if all(r.demand.get(q, 0) >= weight_share[q] * gpus for q in names)]
    shares, b_shares = _shares(contended, names), _shares(backlogged, names)
    plain, b_plain = _shares(contended, names, plain=True), _shares(backlogged, names, plain=True)
    jcts: dict[str, list[float]] = defaultdict(list)
    rhos: dict[str, list[float]] = defaultdict(list)
    members: dict[str, list[JobRecord]] = defaultdict(list)
    for job in result.jobs:
        q = queue_of.get(job.job_id, config.default_queue)
        if q not in weights:
            continue
        members[q].append(job)
        if job.completion_s is None:
            continue
        jct = job.completion_s - job.arrival_s
        jcts[q].append(jct)
        alone = alone_jct_s(job, result.cluster, throughput, len(names))
        if alone is not None:
            rhos[q].append(jct / alone)
    figures = []
    for q in names:
        figures.append(QueueFigures(
            name=q, weight=weights[q], weight_share=weight_share[q], jobs=len(members[q]),
            completed=len(jcts[q]), jct_mean_s=_mean(jcts[q]),
            jct_p95_s=float(np.percentile(jcts[q], 95)) if jcts[q] else None,
            usage_gpu_s=sum(r.charge.get(q, 0.0) for r in rounds),
            share=shares[q], share_ratio=_over(shares[q], weight_share[q]),
            backlogged_share=b_shares[q], backlogged_ratio=_over(b_shares[q], weight_share[q]),
            gpu_share=plain[q], backlogged_gpu_share=b_plain[q],
            rho_mean=_mean(rhos[q]), rho_max=max(rhos[q], default=None)))
    ratios = [f.share_ratio for f in figures if f.share_ratio is not None]
    b_ratios = [f.backlogged_ratio for f in figures if f.backlogged_ratio is not None]
    every_rho = [x for q in names for x in rhos[q]]
    return QueueFairness(
        queues=tuple(figures), contended_s=sum(r.round_s for r in contended),
        backlogged_s=sum(r.round_s for r in backlogged),
        jain=jain_index(ratios) if len(ratios) == len(names) else None,
        backlogged_jain=jain_index(b_ratios) if len(b_ratios) == len(names) else None,
        rho_mean=_mean(every_rho), rho_max=max(every_rho, default=None))
