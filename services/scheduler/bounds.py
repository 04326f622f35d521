"""Lower bounds on the time to drain a trace (TTD) that no policy can beat in the simulator.

TTD is measured as in ``metrics.py``: from the first arrival ``a_0`` to the last
completion. Notation, for a trace on a cluster:

* job j: arrival ``a_j`` (``s_j = a_j - a_0``), W_j workers, work ``w_j`` = ``total_steps``
  job steps (``shared.progress``), job type ``t_j``; GPU type r: ``n_r`` GPUs; ``N`` GPUs
  in all; ``m(j) = min(W_j, N)``; ``rate(t, r, n)`` a copy's own steps/s (``throughput.py``);
  ``x = max(1, default_cross_node)`` if the model applies cross-node factors, else 1 (table
  factors are capped at 1, so only a configured default above 1 can speed a copy up).
* Per-GPU rate ``rho[j,r] = x * max_{1<=n<=m(j)} rate(t_j, r, n) / W_j``. A copy of n
  workers steps at ``min over its types of rate(t, r, n)`` times a factor <= x, and is
  credited ``n / W`` of that per step, i.e. at most ``rate(t_j, r, n) / W_j * x`` per GPU of
  each type r it uses, for every n a copy may have (n <= W_j by ``check_plan``). So the
  job steps a job is credited are at most ``sum_r rho[j,r] * (GPU-seconds of r it held)``;
  restarts, consolidation and rounds only take time away.
* Best single copy ``R1_j = max_{1<=n<=m(j)} x * M_j(n) * n / W_j``, with ``M_j(n)`` the
  largest ``min_{r in S} rate(t_j, r, n)`` over type sets S with ``sum_{r in S} n_r >= n``
  (the prefix of types sorted by that rate that first holds n GPUs).
* Best forked job ``RF_j = sum over nodes of the largest min(W_j, node size) values of
  rho[j, type]`` over the node's GPUs: copies of one job are on distinct nodes and each
  has at most W_j GPUs (``check_plan``), so a node gives a job at most min(W_j, size) GPUs.
* GPUs of type r a job may hold at once: ``c1[j,r] = min(W_j, n_r)`` (one copy), or
  ``cF[j,r] = sum over nodes of min(W_j, GPUs of type r on the node)`` (forked); in all:
  ``G1_j = W_j`` or ``GF_j = sum over nodes of min(W_j, node size)``.

The bound is the optimum T of the LP over GPU-seconds ``X[j,r] >= 0`` (solved as the
share ``y[j,r] = X[j,r] * rho[j,r] / w_j`` of job j's work done on type r)::

    minimize T  subject to
      sum_r rho[j,r] X[j,r] >= w_j                         every job (its work)
      sum_{j: s_j >= s} X[j,r] <= n_r (T - s)              every arrival offset s, type r
      X[j,r] <= c[j,r] (T - s_j),  sum_r X[j,r] <= G_j (T - s_j)   every job
      T >= s_j + w_j / R_j                                 every job

with (c, G, R) = (c1, G1, R1) for the no-fork bound and (cF, GF, RF) for the fork bound.
Every schedule the simulator can produce gives a feasible point (X = GPU-seconds each job
held while active, T = its TTD): jobs arriving at s or later only run in [a_0 + s,
a_0 + T], and a job never holds more GPUs, nor trains faster, than the caps say. The fork
bound applies to policies that may place several copies of a job (``FORKING_POLICIES``, or
a run that did); the no-fork bound to the others. A job that no copy can move (R_j = 0)
makes the bound ``None``: no finite TTD exists. An empty trace has bound 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from services.scheduler.cluster import Cluster
from services.scheduler.throughput import ThroughputModel
from services.scheduler.traces import TraceJob

FORKING_POLICIES = frozenset({"hadare"})


@dataclass(frozen=True, kw_only=True)
class TtdBounds:
    ttd_fork_s: float | None      # valid for every policy
    ttd_nofork_s: float | None    # valid for policies that run one copy per job


def _boost(throughput: ThroughputModel) -> float:
    return max(1.0, throughput.default_cross_node) if throughput.cross_node else 1.0


def per_gpu_rate(job_type: str, workers: int, gpu_type: str, cluster: Cluster, throughput: ThroughputModel) -> float:
    """``rho``: the most job steps/s one GPU of ``gpu_type`` can be credited (module docstring)."""
    top = min(workers, cluster.total_gpus)
    best = max((throughput.rate(job_type, gpu_type, n) for n in range(1, top + 1)), default=0.0)
    return _boost(throughput) * best / workers


def best_copy_rate(job_type: str, workers: int, cluster: Cluster, throughput: ThroughputModel) -> float:
    """``R1``: the most job steps/s one copy of at most ``workers`` GPUs can be credited."""
    best = 0.0
    for n in range(1, min(workers, cluster.total_gpus) + 1):
        held = 0
        for rate, count in sorted(((throughput.rate(job_type, t, n), c) for t, c in cluster.gpus_by_type.items()),
                                  reverse=True):
            held += count
            if held >= n:
                best = max(best, rate * n / workers)
                break
    return _boost(throughput) * best


def best_fork_rate(job_type: str, workers: int, cluster: Cluster, throughput: ThroughputModel) -> float:
    """``RF``: the most job steps/s a job's copies together can be credited."""
    rho = {t: per_gpu_rate(job_type, workers, t, cluster, throughput) for t in cluster.types}
    return sum(sum(sorted((rho[t] for t in node.gpus), reverse=True)[:workers]) for node in cluster.nodes)


def _caps(job: TraceJob, cluster: Cluster, *, fork: bool) -> tuple[dict[str, int], int]:
    """(GPUs of each type, GPUs in all) the job may hold at once."""
    w = job.workers
    if not fork:
        return {t: min(w, n) for t, n in cluster.gpus_by_type.items()}, w
    per_type = {t: sum(min(w, len(node.indices_of(t))) for node in cluster.nodes) for t in cluster.types}
    return per_type, sum(min(w, node.size) for node in cluster.nodes)


def ttd_lower_bound(jobs: Sequence[TraceJob], cluster: Cluster, throughput: ThroughputModel, *,
                    fork: bool) -> float | None:
    """The LP bound of the module docstring, seconds from the first arrival (None: unbounded)."""
    if not jobs:
        return 0.0
    types = cluster.types
    a0 = min(j.arrival_s for j in jobs)
    offsets = np.array([j.arrival_s - a0 for j in jobs])
    work = np.array([float(j.total_steps) for j in jobs])
    rho = np.array([[per_gpu_rate(j.job_type, j.workers, t, cluster, throughput) for t in types] for j in jobs])
    best = np.array([(best_fork_rate if fork else best_copy_rate)(j.job_type, j.workers, cluster, throughput)
                     for j in jobs])
    if (best <= 0).any():
        return None
    n_jobs, n_types = rho.shape
    t_col = n_jobs * n_types
    # seconds[j, r]: GPU-seconds of type r that job j's whole work takes (inf: r cannot help)
    with np.errstate(divide="ignore"):
        seconds = np.where(rho > 0, work[:, None] / np.where(rho > 0, rho, 1.0), np.inf)
    usable = np.isfinite(seconds)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    rhs: list[float] = []

    def row(entries: list[tuple[int, float]], bound: float) -> None:
        r = len(rhs)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        rhs.append(bound)

    for j in range(n_jobs):       # work: sum_r y[j,r] >= 1
        row([(j * n_types + r, -1.0) for r in range(n_types) if usable[j, r]], -1.0)
    counts = [cluster.gpus_by_type[t] for t in types]
    for s in np.unique(offsets):  # capacity of the jobs arriving at s or later
        cohort = np.flatnonzero(offsets >= s)
        for r in range(n_types):
            row([(j * n_types + r, seconds[j, r]) for j in cohort if usable[j, r]] + [(t_col, -counts[r])],
                -counts[r] * s)
    for j, job in enumerate(jobs):
        per_type, total = _caps(job, cluster, fork=fork)
        for r, t in enumerate(types):
            if usable[j, r]:
                row([(j * n_types + r, seconds[j, r]), (t_col, -per_type[t])], -per_type[t] * offsets[j])
        row([(j * n_types + r, seconds[j, r]) for r in range(n_types) if usable[j, r]] + [(t_col, -total)],
            -total * offsets[j])
    a_ub = coo_matrix((vals, (rows, cols)), shape=(len(rhs), t_col + 1)).tocsr()
    bounds = [(0.0, None if usable[j, r] else 0.0) for j in range(n_jobs) for r in range(n_types)]
    bounds.append((float(np.max(offsets + work / best)), None))
    cost = np.zeros(t_col + 1)
    cost[t_col] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=np.array(rhs), bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"TTD bound LP failed: {res.message}")
    return float(res.x[t_col])


def ttd_bounds(jobs: Sequence[TraceJob], cluster: Cluster, throughput: ThroughputModel) -> TtdBounds:
    return TtdBounds(ttd_fork_s=ttd_lower_bound(jobs, cluster, throughput, fork=True),
                     ttd_nofork_s=ttd_lower_bound(jobs, cluster, throughput, fork=False))


def bound_for(policy: str, bounds: TtdBounds, *, forked: bool) -> tuple[str, float | None]:
    """("fork" | "nofork", the bound) that applies to ``policy``'s run (``forked``: it placed
    more than one copy of a job in some round)."""
    if forked or policy in FORKING_POLICIES:
        return "fork", bounds.ttd_fork_s
    return "nofork", bounds.ttd_nofork_s
