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

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix, hstack, vstack

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import JobState
from services.scheduler.policies.lp.gang_cuts import GangRows, gang_rows
from services.scheduler.policies.lp.highs import solve as solve_lp

__all__ = ["WorkLp", "NodeColumns", "Columns", "gang_rows_of", "slot_rows", "type_rates", "fork_lp", "makespan_lp",
           "makespan"]


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
    and tie a gang's time to what the other jobs can use.

    Nodes (``nodes``, HadarE only; None: no such rows): a job has at most one copy on a node,
    so its columns are those of :class:`NodeColumns` instead of one per (job, type)."""

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
    nodes: NodeColumns | None = None


@dataclass(frozen=True, kw_only=True)
class NodeColumns:
    """A forked job's columns when a node holds one copy of it (``sim/bound_forks.py`` for
    the bound's form): column c is a copy of ``gpus[c]`` GPUs of type ``gpu_type[c]`` for job
    ``job[c]``, earning ``rate[c]`` steps per GPU-second, on a node of the job's *slot*
    ``slot[c]``; a job's columns of slot s use at most ``cap[s]`` nodes at once, so at most
    ``sum_c X_c / gpus[c] <= cap[s] T``. A slot is the nodes with c GPUs of a type (c < W),
    or with at least W of it: a node of several types is one slot per type, which loosens
    the rows there (a copy per type) but never cuts a plan of HadarE's copies (each on one
    node and one type).
    Without these rows a job whose lone worker is the most efficient was credited that rate
    on every GPU of every node: an 8-GPU Transformer on six 4-GPU nodes 22.0 job steps/s,
    where one copy per node reaches 12.2, so the LP planned it last. Columns and slots are in
    job order, and a job's slots are numbered consecutively."""

    job: np.ndarray
    gpu_type: np.ndarray
    rate: np.ndarray
    gpus: np.ndarray
    slot: np.ndarray
    cap: np.ndarray         # per slot
    slot_job: np.ndarray    # per slot: its job


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
    slot: np.ndarray | None = None     # node columns (``WorkLp.nodes``): the column's slot
    weight: np.ndarray | None = None   # and the nodes it holds per GPU: 1 / its GPUs

    @classmethod
    def of(cls, lp: WorkLp) -> Columns:
        if lp.nodes is not None:
            n = lp.nodes
            cap = np.minimum(lp.cap_f[n.job, n.gpu_type], n.cap[n.slot] * n.gpus)
            return cls(job=n.job.astype(int), gpu_type=n.gpu_type.astype(int), rate=n.rate.astype(float),
                       cap=cap.astype(float), spread=np.full(n.job.size, -1), slot=n.slot.astype(int),
                       weight=1.0 / n.gpus)
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


def slot_rows(lp: WorkLp, cols: Columns) -> tuple[csr_matrix, np.ndarray]:
    """(A, cap): the node rows ``A X <= cap x time``, one per slot of two or more columns
    (none without nodes). A slot of one column of g GPUs needs no row: the column's own
    bound, at most cap x g GPUs at once, is that row (so a one-worker job, whose one slot per
    type is every node holding the type, adds no rows)."""
    if lp.nodes is None or cols.slot is None or cols.weight is None:
        return csr_matrix((0, cols.job.size)), np.zeros(0)
    shared = np.flatnonzero(np.bincount(cols.slot, minlength=lp.nodes.cap.size) >= 2)
    row_of = np.full(lp.nodes.cap.size, -1)
    row_of[shared] = np.arange(shared.size)
    mine = np.flatnonzero(row_of[cols.slot] >= 0)
    a = coo_matrix((cols.weight[mine], (row_of[cols.slot[mine]], mine)), shape=(shared.size, cols.job.size))
    return a.tocsr(), lp.nodes.cap[shared].astype(float)


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


def fork_lp(jobs: Sequence[JobState], cluster: Cluster, credited: Callable[[JobState, str, int], float], *,
            nodes: bool = False) -> WorkLp:
    """The LP data of ``jobs`` on ``cluster`` with divisible work, as forking makes it
    (``credited(job, type, k)``: a copy's job steps/s on k GPUs): ``rho[j, r]`` is the best
    of k = 1..min(W_j, the largest group of r on a node), no spread columns, no gangs; with
    ``nodes``, the columns are :class:`NodeColumns` (one copy of a job per node)."""
    types = list(cluster.types)
    per_node = np.array([[sum(1 for g in n.gpus if g == r) for r in types] for n in cluster.nodes])   # (nodes, R)
    per_node = per_node.reshape(len(cluster.nodes), len(types))
    largest = per_node.max(axis=0, initial=0)
    steps = [[[credited(j, r, k) for k in range(1, min(j.workers, int(largest[i])) + 1)] for i, r in enumerate(types)]
             for j in jobs]
    rho = np.array([[max((s / k for k, s in enumerate(row, 1)), default=0.0) for row in by_type] for by_type in steps])
    rho = rho.reshape(len(jobs), len(types))
    sizes = np.array([n.size for n in cluster.nodes])
    widths = sorted({j.workers for j in jobs})
    cap_f_of = {w: np.minimum(w, per_node).sum(axis=0) for w in widths}
    cap_g_of = {w: float(np.minimum(w, sizes).sum()) for w in widths}
    scale = max(float(np.max(rho, initial=0.0)), 1e-12)
    return WorkLp(types=types, rho=rho / scale, rem=np.array([j.remaining for j in jobs], dtype=float) / scale,
                  cap_f=np.array([cap_f_of[j.workers] for j in jobs], dtype=float).reshape(len(jobs), len(types)),
                  cap_g=np.array([cap_g_of[j.workers] for j in jobs], dtype=float),
                  count=np.array([cluster.gpus_by_type.get(r, 0) for r in types], dtype=float),
                  nodes=_node_columns([j.workers for j in jobs], steps, per_node, scale) if nodes else None)


def _node_columns(widths: Sequence[int], steps: Sequence[Sequence[Sequence[float]]], per_node: np.ndarray,
                  scale: float) -> NodeColumns:
    """``NodeColumns`` of jobs of ``widths`` whose copies of k GPUs of type r make
    ``steps[j][r][k - 1]`` job steps/s, on nodes holding ``per_node[n, r]`` GPUs of type r.
    Per job and type, a slot per count c < W of nodes with exactly c GPUs of it and one for
    nodes with W or more; a copy of k GPUs is kept only if it earns more than every smaller one."""
    cols: list[tuple[int, int, float, int, int]] = []
    caps: list[int] = []
    slot_job: list[int] = []
    # per type: how many nodes hold exactly c GPUs of it, c = 1..; a job of width w has a slot
    # per c < w and one for the nodes with w or more
    held_counts = [np.bincount(per_node[:, r], minlength=1) for r in range(per_node.shape[1])]

    @functools.cache
    def slots_of(w: int, r: int) -> tuple[tuple[int, int], ...]:
        counts = held_counts[r]
        below = [(c, int(counts[c])) for c in range(1, min(w, counts.size)) if counts[c]]
        wide = int(counts[w:].sum())
        return tuple(below + ([(w, wide)] if wide else []))

    for j, w in enumerate(widths):
        for r in range(per_node.shape[1]):
            for c, nodes in slots_of(w, r):
                best = 0.0
                for k in range(1, c + 1):
                    value = steps[j][r][k - 1]
                    if value > best:
                        cols.append((j, r, value / k / scale, k, len(caps)))
                        best = value
                if best > 0:
                    caps.append(nodes)
                    slot_job.append(j)
    arr = np.array(cols, dtype=float).reshape(len(cols), 5)
    return NodeColumns(job=arr[:, 0].astype(int), gpu_type=arr[:, 1].astype(int), rate=arr[:, 2],
                       gpus=arr[:, 3], slot=arr[:, 4].astype(int), cap=np.array(caps, dtype=float),
                       slot_job=np.array(slot_job, dtype=int))


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
    slots, slot_cap = slot_rows(lp, cols)
    if slot_cap.size:                       # per slot: sum X / gpus - cap T <= 0
        a_ub = vstack([a_ub, hstack([slots, csr_matrix(-slot_cap[:, None])])]).tocsr()
        b_ub = np.concatenate([b_ub, np.zeros(slot_cap.size)])
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
    res = solve_lp(cost, a_ub, b_ub, upper)
    return float(res.x[cols.job.size]) if res.ok else None
