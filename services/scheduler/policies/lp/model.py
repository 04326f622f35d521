"""The LP data both time-indexed LPs and the makespan LP are built from: remaining work,
rates and caps per (job, GPU type), as the fork lower bound counts them.

Notation (``services/scheduler/sim/bounds.py``; work in job steps, scaled so the largest
rate is 1): ``rho[j, r]`` credited job steps per GPU-second of job j on type r,
``rem[j]`` its remaining steps, ``cap_f[j, r]`` / ``cap_g[j]`` the GPUs of type r / in all it
may hold at once, ``count[r]`` the GPUs of type r. Users: HadarE (divisible work,
:func:`fork_lp`) and Hadar's critical rule (whole gangs, spread columns:
``policies/hadar/timeline.py``); neither is named after the other.

The makespan LP (:func:`makespan`; all jobs present now, time from now)::

    minimize T  s.t.  sum_r rho[j,r] X[j,r] >= R_j            every job
                      sum_j X[j,r] <= n_r T                    every type
                      X[j,r] <= cF[j,r] T,  sum_r X[j,r] <= GF_j T   every job

plus ``gang_cuts``' rows when jobs run as whole gangs. Solved with scipy's HiGHS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix, hstack, vstack

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import JobState
from services.scheduler.policies.lp.gang_cuts import GangRows, gang_rows

__all__ = ["WorkLp", "Columns", "gang_rows_of", "type_rates", "fork_lp", "makespan_lp", "makespan"]


@dataclass(frozen=True, kw_only=True)
class WorkLp:
    """The LP data of the remaining work of some jobs (module docstring for the notation).

    Spread columns (Hadar's gangs that span nodes, ``hadar.timeline.gang_lp``; none for the
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
    def of(cls, lp: WorkLp) -> Columns:
        j, r = np.nonzero((lp.rho > 0) & (lp.cap_f > 0))
        s, q = np.nonzero(lp.spread_cap > 0) if lp.spread_job.size else (np.zeros(0, int), np.zeros(0, int))
        keep = lp.spread_rate[s] > 0
        s, q = s[keep], q[keep]
        return cls(job=np.concatenate([j, lp.spread_job[s]]).astype(int), gpu_type=np.concatenate([r, q]).astype(int),
                   rate=np.concatenate([lp.rho[j, r], lp.spread_rate[s]]),
                   cap=np.concatenate([lp.cap_f[j, r], lp.spread_cap[s, q]]),
                   spread=np.concatenate([np.full(j.size, -1), s]).astype(int))

    def type_sets(self, lp: WorkLp) -> np.ndarray:
        """[c, r]: whether column c's option may hold GPUs of type r (its own type, or every
        type its spread column is eligible on)."""
        sets = np.zeros((self.job.size, lp.count.size), dtype=bool)
        own = self.spread < 0
        sets[np.flatnonzero(own), self.gpu_type[own]] = True
        sets[~own] = lp.spread_cap[self.spread[~own]] > 0
        return sets

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


def gang_rows_of(lp: WorkLp, cols: Columns) -> GangRows:
    """``gang_cuts``' rows for ``lp`` (none when its work is divisible)."""
    if not lp.gang_width.size:
        return gang_rows(width=lp.gang_width, members=lp.gang_width, total=float(lp.count.sum()), col_job=cols.job)
    return gang_rows(width=lp.gang_width, members=lp.cap_g / np.maximum(lp.gang_width, 1.0),
                     total=float(lp.count.sum()), col_job=cols.job, col_types=cols.type_sets(lp), count=lp.count)


def type_rates(lp: WorkLp) -> np.ndarray:
    """[j, r]: the best steps per GPU-second job j earns on type r, alone or in a spread column."""
    best = lp.rho.copy()
    if lp.spread_job.size:
        eligible = np.where(lp.spread_cap > 0, lp.spread_rate[:, None], 0.0)
        np.maximum.at(best, lp.spread_job, eligible)
    return best


def fork_lp(jobs: Sequence[JobState], cluster: Cluster,
            credited: Callable[[JobState, str, int], float]) -> WorkLp:
    """The LP data of ``jobs`` on ``cluster`` with divisible work, as forking makes it
    (``credited(job, type, k)``: a copy's job steps/s on k GPUs): ``rho[j, r]`` is the best
    of k = 1..min(W_j, the largest group of r on a node), no spread columns, no gangs."""
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
    return WorkLp(types=types, rho=rho / scale, rem=np.array([j.remaining for j in jobs], dtype=float) / scale,
                  cap_f=np.array([cap_f_of[j.workers] for j in jobs], dtype=float).reshape(len(jobs), len(types)),
                  cap_g=np.array([cap_g_of[j.workers] for j in jobs], dtype=float),
                  count=np.array([cluster.gpus_by_type.get(r, 0) for r in types], dtype=float))


def makespan_lp(lp: WorkLp,
                cols: Columns) -> tuple[np.ndarray, csr_matrix, np.ndarray, list[tuple[float, float | None]]]:
    """(cost, A_ub, b_ub, bounds) of the makespan LP over the columns, then T, then the
    gang cuts' variables (module docstring)."""
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
    if cuts.length.size:                    # X, then T, then the cuts' variables
        a_ub = hstack([a_ub, csr_matrix((a_ub.shape[0], cuts.n_extra))])
        a_ub = vstack([a_ub, hstack([cuts.x, csr_matrix(-cuts.length[:, None]), cuts.extra])]).tocsr()
        b_ub = np.concatenate([b_ub, np.zeros(cuts.length.size)])
        nv += cuts.n_extra
    cost = np.zeros(nv)
    cost[t_col] = 1.0
    return cost, a_ub, b_ub, [(0.0, None)] * nv


def makespan(lp: WorkLp) -> float | None:
    """The LP's optimal T (in the scaled units of ``lp``: seconds), None if it has none."""
    if not lp.rho.size:
        return 0.0
    cols = Columns.of(lp)
    cost, a_ub, b_ub, upper = makespan_lp(lp, cols)
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=upper, method="highs")
    return float(res.x[cols.job.size]) if res.status == 0 else None
