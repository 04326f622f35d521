"""Which GPU types each job should train on this round: the makespan LP's type split.

The fork lower bound (``services/scheduler/bounds.py``) is an LP over GPU-seconds; solved on
the *remaining* work of the active jobs at the round start, its optimum says how a
makespan-optimal run divides each GPU type among the jobs. HadarE's priced pass lets a job
use only the types this split gives it (its back-fill pass may use any), so jobs that
are efficient on a slow type are kept for it instead of finishing early on the fast types
and leaving the slow ones to jobs that crawl there at the end.

Ties. The LP has many optimal splits; a second LP picks, among those within ``slack`` of
the optimal T (default 1%), the one that minimises sum_j u_j sum_r X[j,r] with u_j the
job's urgency (Smith's ratio, normalised): the jobs first in line get the types on which
their work takes the fewest GPU-seconds, the others take up the rest.

LP (all jobs present now, s_j = 0; notation of bounds.py, work in job steps)::

    minimize T  s.t.  sum_r rho[j,r] X[j,r] >= R_j            every job
                      sum_j X[j,r] <= n_r T                    every type
                      X[j,r] <= cF[j,r] T,  sum_r X[j,r] <= GF_j T   every job

rho[j,r] = the best credited job steps per GPU-second of j on type r over copy sizes
k = 1..min(W_j, largest r group on a node); cF, GF as in bounds.py. Result: for each job,
the types r with X[j,r] > SHARE_EPS x its GPU-seconds (a job with none keeps every type
it can run on). Solved with scipy's HiGHS; on failure every job keeps every type.
Cost: two LPs with J x R + 1 variables and J + R + J x R rows per round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix

from services.scheduler.cluster import Cluster
from services.scheduler.policy import JobState

SHARE_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class ForkLp:
    """The fork bound's LP data on the remaining work of ``jobs`` (notation of bounds.py),
    scaled so that the largest rate is 1: ``rho[j, r]`` credited job steps per GPU-second,
    ``rem[j]`` remaining steps, ``cap_f[j, r]`` / ``cap_g[j]`` GPUs of type r / in all a job
    may hold at once, ``count[r]`` GPUs of type r."""

    types: list[str]
    rho: np.ndarray
    rem: np.ndarray
    cap_f: np.ndarray
    cap_g: np.ndarray
    count: np.ndarray


def fork_lp(jobs: Sequence[JobState], cluster: Cluster,
            credited: Callable[[JobState, str, int], float]) -> ForkLp:
    """The LP data of ``jobs`` on ``cluster`` (``credited(job, type, k)``: a copy's job steps/s)."""
    types = list(cluster.types)
    largest = {r: max((len(n.indices_of(r)) for n in cluster.nodes), default=0) for r in types}   # O(nodes R)
    rho = np.array([[max((credited(j, r, k) / k for k in range(1, min(j.workers, largest[r]) + 1)), default=0.0)
                     for r in types] for j in jobs]).reshape(len(jobs), len(types))
    per_node = np.array([[sum(1 for g in n.gpus if g == r) for r in types] for n in cluster.nodes])   # (nodes, R)
    sizes = np.array([n.size for n in cluster.nodes])
    widths = sorted({j.workers for j in jobs})
    cap_f_of = {w: np.minimum(w, per_node).sum(axis=0) for w in widths}
    cap_g_of = {w: float(np.minimum(w, sizes).sum()) for w in widths}
    scale = max(float(np.max(rho, initial=0.0)), 1e-12)
    return ForkLp(types=types, rho=rho / scale, rem=np.array([j.remaining for j in jobs], dtype=float) / scale,
                  cap_f=np.array([cap_f_of[j.workers] for j in jobs], dtype=float).reshape(len(jobs), len(types)),
                  cap_g=np.array([cap_g_of[j.workers] for j in jobs], dtype=float),
                  count=np.array([cluster.gpus_by_type.get(r, 0) for r in types], dtype=float))


def _makespan_lp(lp: ForkLp):
    """(cost, A_ub, b_ub, bounds) of the makespan LP over X[j,r] then T (module docstring)."""
    n_j, n_r = lp.rho.shape
    nv = n_j * n_r + 1                      # X[j,r] row-major, then T
    x_of = np.arange(n_j * n_r).reshape(n_j, n_r)
    t_col = nv - 1
    jj = np.repeat(np.arange(n_j), n_r)
    # rows: work (n_j): -sum_r rho X <= -R; capacity (n_r): sum_j X[j,r] - n_r T <= 0;
    # per job (n_j): sum_r X - GF T <= 0; per job and type (n_j n_r): X - cF T <= 0
    r_work, r_cap, r_job, r_pair = 0, n_j, n_j + n_r, 2 * n_j + n_r
    row_i = np.concatenate([r_work + jj, r_cap + np.tile(np.arange(n_r), n_j), r_cap + np.arange(n_r),
                            r_job + jj, r_job + np.arange(n_j), r_pair + x_of.ravel(), r_pair + x_of.ravel()])
    col_i = np.concatenate([x_of.ravel(), x_of.ravel(), np.full(n_r, t_col), x_of.ravel(), np.full(n_j, t_col),
                            x_of.ravel(), np.full(n_j * n_r, t_col)])
    vals = np.concatenate([-lp.rho.ravel(), np.ones(n_j * n_r), -lp.count, np.ones(n_j * n_r), -lp.cap_g,
                           np.ones(n_j * n_r), -lp.cap_f.ravel()])
    a_ub = coo_matrix((vals, (row_i, col_i)), shape=(r_pair + n_j * n_r, nv)).tocsr()
    b_ub = np.concatenate([-lp.rem, np.zeros(n_r + n_j + n_j * n_r)])
    cost = np.zeros(nv)
    cost[-1] = 1.0
    upper = [(0.0, 0.0 if lp.rho[i, r] <= 0 else None) for i in range(n_j) for r in range(n_r)] + [(0.0, None)]
    return cost, a_ub, b_ub, upper


def makespan(lp: ForkLp) -> float | None:
    """The LP's optimal T (in the scaled units of ``lp``: seconds), None if it has none."""
    if not lp.rho.size:
        return 0.0
    cost, a_ub, b_ub, upper = _makespan_lp(lp)
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
    return float(res.x[-1]) if res.status == 0 else None


def type_split(jobs: Sequence[JobState], cluster: Cluster,
               credited: Callable[[JobState, str, int], float], *,
               urgency: Sequence[float] | None = None, slack: float = 0.0) -> dict[str, set[str]]:
    """job id -> the GPU types the makespan LP gives it (see module docstring)."""
    if not jobs or not cluster.types:
        return {}
    lp = fork_lp(jobs, cluster, credited)
    types, rho = lp.types, lp.rho
    n_j, n_r = rho.shape
    cost, a_ub, b_ub, upper = _makespan_lp(lp)
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
    if res.status == 0 and urgency is not None:
        # among splits within (1 + slack) of the optimal T: fewest GPU-seconds for urgent jobs
        weights = np.asarray(urgency, dtype=float)
        weights = weights / max(float(weights.max()), 1e-300)
        second = np.concatenate([np.repeat(weights, n_r), [0.0]])
        upper[-1] = (0.0, float(res.x[-1]) * (1.0 + slack))
        again = linprog(second, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
        if again.status == 0:
            res = again
    everything = {j.job_id: {r for r, v in zip(types, rho[i]) if v > 0} for i, j in enumerate(jobs)}
    if res.status != 0:
        return everything
    x = res.x[:-1].reshape(n_j, n_r)
    out = {}
    for i, j in enumerate(jobs):
        total = x[i].sum()
        got = {types[r] for r in range(n_r) if x[i, r] > SHARE_EPS * max(total, 1e-12)}
        out[j.job_id] = got or everything[j.job_id]
    return out
