"""Which GPU types each job should train on this round: the makespan LP's type split.

The fork lower bound (``services/scheduler/sim/bounds.py``) is an LP over GPU-seconds; solved on
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
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix, hstack, vstack

from services.scheduler.core.cluster import Cluster
from services.scheduler.policies.lp.gang_cuts import GangRows, gang_rows
from services.scheduler.core.policy import JobState

SHARE_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class ForkLp:
    """The fork bound's LP data on the remaining work of ``jobs`` (notation of bounds.py),
    scaled so that the largest rate is 1: ``rho[j, r]`` credited job steps per GPU-second,
    ``rem[j]`` remaining steps, ``cap_f[j, r]`` / ``cap_g[j]`` GPUs of type r / in all a job
    may hold at once, ``count[r]`` GPUs of type r.

    Spread columns (Hadar's gangs that span nodes, ``hadar_timeline.gang_lp``; none for the
    fork LP): column s lets job ``spread_job[s]`` hold up to ``spread_cap[s, r]`` GPUs of
    each type r (0: not eligible) at ``spread_rate[s]`` steps per GPU-second on any of them,
    whatever the mix of types (a gang's rate is set by its slowest worker, not summed).

    Gangs (``gang_width``, Hadar only; empty: work is divisible): job j runs as one gang of
    ``gang_width[j]`` GPUs, all at once. The LP still lets it hold fewer (a fraction of the
    time at full width); ``gang_cuts``' rows keep gangs that cannot run side by side apart
    and tie a gang's time to what the other jobs can use."""

    types: list[str]
    rho: np.ndarray
    rem: np.ndarray
    cap_f: np.ndarray
    cap_g: np.ndarray
    count: np.ndarray
    spread_job: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))
    spread_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    spread_cap: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    gang_width: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass(frozen=True, kw_only=True)
class Columns:
    """The LP's variables, one per (job, type) pair a job may hold GPUs of (rho > 0, cap > 0),
    then one per (spread column, eligible type): each earns ``rate`` steps per GPU-second for
    ``job`` on GPUs of ``gpu_type``, at most ``cap`` GPUs at once; ``spread``: the spread
    column it belongs to (-1: none)."""

    job: np.ndarray
    gpu_type: np.ndarray
    rate: np.ndarray
    cap: np.ndarray
    spread: np.ndarray

    @classmethod
    def of(cls, lp: ForkLp) -> Columns:
        j, r = np.nonzero((lp.rho > 0) & (lp.cap_f > 0))
        s, q = np.nonzero(lp.spread_cap > 0) if lp.spread_job.size else (np.zeros(0, int), np.zeros(0, int))
        keep = lp.spread_rate[s] > 0
        s, q = s[keep], q[keep]
        return cls(job=np.concatenate([j, lp.spread_job[s]]).astype(int), gpu_type=np.concatenate([r, q]).astype(int),
                   rate=np.concatenate([lp.rho[j, r], lp.spread_rate[s]]),
                   cap=np.concatenate([lp.cap_f[j, r], lp.spread_cap[s, q]]),
                   spread=np.concatenate([np.full(j.size, -1), s]).astype(int))

    def per_spread_type(self, values: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """``values[c]`` of the spread columns' variables summed into [spread column, type]."""
        out = np.zeros(shape)
        mine = self.spread >= 0
        np.add.at(out, (self.spread[mine], self.gpu_type[mine]), values[mine])
        return out

    def per_job_type(self, values: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """``values[c, ...]`` summed into [job, type, ...] (GPU-seconds a job holds of a type)."""
        out = np.zeros(shape + values.shape[1:])
        np.add.at(out, (self.job, self.gpu_type), values)
        return out


def gang_rows_of(lp: ForkLp, cols: Columns) -> GangRows:
    """``gang_cuts``' rows for ``lp`` (none when its work is divisible)."""
    return gang_rows(width=lp.gang_width, members=lp.cap_g / np.maximum(lp.gang_width, 1.0) if lp.gang_width.size
                     else lp.gang_width, total=float(lp.count.sum()), col_job=cols.job)


def type_rates(lp: ForkLp) -> np.ndarray:
    """[j, r]: the best steps per GPU-second job j earns on type r, alone or in a spread column."""
    best = lp.rho.copy()
    if lp.spread_job.size:
        eligible = np.where(lp.spread_cap > 0, lp.spread_rate[:, None], 0.0)
        np.maximum.at(best, lp.spread_job, eligible)
    return best


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


def _makespan_lp(lp: ForkLp, cols: Columns):
    """(cost, A_ub, b_ub, bounds) of the makespan LP over the columns then T (module docstring)."""
    n_j, n_r = lp.rho.shape
    n_c = cols.job.size
    nv = n_c + 1                            # one variable per column, then T
    c_i = np.arange(n_c)
    t_col = nv - 1
    # rows: work (n_j): -sum rate X <= -R; capacity (n_r): sum X - n_r T <= 0;
    # per job (n_j): sum X - GF T <= 0; per column (n_c): X - cap T <= 0
    r_cap, r_job, r_col = n_j, n_j + n_r, 2 * n_j + n_r
    row_i = np.concatenate([cols.job, r_cap + cols.gpu_type, r_cap + np.arange(n_r), r_job + cols.job,
                            r_job + np.arange(n_j), r_col + c_i, r_col + c_i])
    col_i = np.concatenate([c_i, c_i, np.full(n_r, t_col), c_i, np.full(n_j, t_col), c_i, np.full(n_c, t_col)])
    vals = np.concatenate([-cols.rate, np.ones(n_c), -lp.count, np.ones(n_c), -lp.cap_g, np.ones(n_c), -cols.cap])
    a_ub = coo_matrix((vals, (row_i, col_i)), shape=(r_col + n_c, nv)).tocsr()
    b_ub = np.concatenate([-lp.rem, np.zeros(n_r + n_j + n_c)])
    cuts = gang_rows_of(lp, cols)
    if cuts.n_extra:                        # X, then T, then the cuts' variables
        a_ub = hstack([a_ub, csr_matrix((a_ub.shape[0], cuts.n_extra))])
        a_ub = vstack([a_ub, hstack([cuts.x, csr_matrix(-cuts.length[:, None]), cuts.extra])]).tocsr()
        b_ub = np.concatenate([b_ub, np.zeros(cuts.length.size)])
        nv += cuts.n_extra
    cost = np.zeros(nv)
    cost[t_col] = 1.0
    return cost, a_ub, b_ub, [(0.0, None)] * nv


def makespan(lp: ForkLp) -> float | None:
    """The LP's optimal T (in the scaled units of ``lp``: seconds), None if it has none."""
    if not lp.rho.size:
        return 0.0
    cols = Columns.of(lp)
    cost, a_ub, b_ub, upper = _makespan_lp(lp, cols)
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
    return float(res.x[cols.job.size]) if res.status == 0 else None


def type_split(jobs: Sequence[JobState], cluster: Cluster,
               credited: Callable[[JobState, str, int], float], *,
               urgency: Sequence[float] | None = None, slack: float = 0.0) -> dict[str, set[str]]:
    """job id -> the GPU types the makespan LP gives it (see module docstring)."""
    if not jobs or not cluster.types:
        return {}
    lp = fork_lp(jobs, cluster, credited)
    types, rho = lp.types, lp.rho
    n_j, n_r = rho.shape
    cols = Columns.of(lp)
    cost, a_ub, b_ub, upper = _makespan_lp(lp, cols)
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
    if res.status == 0 and urgency is not None:
        # among splits within (1 + slack) of the optimal T: fewest GPU-seconds for urgent jobs
        weights = np.asarray(urgency, dtype=float)
        weights = weights / max(float(weights.max()), 1e-300)
        n_c = cols.job.size
        second = np.concatenate([weights[cols.job], np.zeros(cost.size - n_c)])
        upper[n_c] = (0.0, float(res.x[n_c]) * (1.0 + slack))
        again = linprog(second, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
        if again.status == 0:
            res = again
    everything = {j.job_id: {r for r, v in zip(types, rho[i]) if v > 0} for i, j in enumerate(jobs)}
    if res.status != 0:
        return everything
    x = cols.per_job_type(res.x[:cols.job.size], (n_j, n_r))
    out = {}
    for i, j in enumerate(jobs):
        total = x[i].sum()
        got = {types[r] for r in range(n_r) if x[i, r] > SHARE_EPS * max(total, 1e-12)}
        out[j.job_id] = got or everything[j.job_id]
    return out
