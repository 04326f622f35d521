"""A time-indexed LP over the remaining run: which GPUs each job should train on now so
that everything ends by a cap E, each job's work as early as it can be.

Time runs from the round start. The horizon [0, E] is cut into intervals k of length L_k:
this round first (L_0 = round_s), then geometric (1, 2, 4, ... rounds, the last one cut at
E), so the far future is planned coarsely and the LP stays small (O(log(E / round_s))
intervals). On the data of ``policies/lp/model.py`` (notation there), X[j,r,k] >= 0 are the
GPU-seconds job j gets on type r in interval k::

    minimize  sum_j (w_j / R_j) sum_{r,k} m_k rho[j,r] X[j,r,k]      (m_k: middle of interval k)
    s.t.      sum_{r,k} rho[j,r] X[j,r,k] >= R_j                     every job: all work by E
              sum_j X[j,r,k] <= n_r L_k                              every type and interval
              X[j,r,k] <= cF[j,r] L_k,  sum_r X[j,r,k] <= GF_j L_k   every job, type and interval

The objective is the weighted mean *busy time* of each job's work (the average moment its
work is done), the classic LP relaxation for weighted completion time: on one pooled
machine it orders jobs as Smith's rule does, and here it also weighs which type does which
job's work. It is blind to a job's tail, so :func:`solve` can add (``completion_weight``
beta > 0) a variable C_j per job with the completion bound of every interval,

    C_j >= start_k + (sum_r rho[j,r] X[j,r,k]) / F_j                 every job and interval

(F_j: the most steps per second j can earn at once, :func:`peak_rates`), and minimize
(1 - beta) x the busy time + beta x sum_j w_j C_j. The work rows force every job to finish
by E. Output: this round's slice, X[j,r,0] / L_0 = the GPUs of type r the LP gives job j
now (fractional); the callers round it (HadarE: ``hadare/timeline.budgets``; Hadar's
critical rule: ``hadar/timeline``).

:func:`solve_until` keeps a cap E across rounds while it can be met and moves it only from
the makespan LP's T* otherwise, so T* is solved only when E is set or moved.

Above POOL_ABOVE jobs the LP runs on classes of jobs (:func:`job_classes`, :func:`pool`:
same job type, W and bucket of rounds left; summed work and caps, still a relaxation).

Cost: one makespan LP (J R + 1 variables; only when E is set or moved) and one LP with
J R K (+ J) variables and J + R K + J K (R + 2) rows; K about log2(E / round_s) + 2. HiGHS.
On failure: None, and the caller falls back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix, hstack, identity, kron, vstack

from services.scheduler.core.policy import JobState
from services.scheduler.policies.lp.highs import solve as solve_lp
from services.scheduler.policies.lp.model import Columns, NodeColumns, WorkLp, gang_rows_of, makespan, slot_rows

__all__ = ["Timeline", "intervals", "solve", "peak_rates", "solve_until", "job_classes", "pool",
           "SHARE_EPS", "POOL_ABOVE", "CLASS_BASE"]

SHARE_EPS = 1e-4     # LP noise below this is no share
POOL_ABOVE = 256     # above this many jobs, the LPs run on classes of jobs (``job_classes``)
CLASS_BASE = 4.0     # a class: jobs whose rounds left differ by less than this factor (one bucket)


def intervals(horizon_s: float, round_s: float, growth: float = 2.0) -> list[float]:
    """Lengths L_k: one round, then 1, ``growth``, ``growth``^2, ... rounds (1, 2, 4, ...),
    the last cut so they sum to ``horizon_s`` (one interval of ``horizon_s`` if it is a
    round or less)."""
    if horizon_s <= round_s:
        return [max(horizon_s, 0.0)]
    out, total, size = [round_s], round_s, round_s
    while total < horizon_s - 1e-9:
        step = min(size, horizon_s - total)
        out.append(step)
        total += step
        size *= growth
    return out


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The LP's solution: ``lengths[k]`` (seconds), ``x[j, r, k]`` GPU-seconds,
    ``spread_now[s, r]``: the GPUs of type r spread column s holds in the first interval, and
    with node columns ``copies_now[j, r]``: the copies (nodes) job j holds of type r in it
    (zeros without node columns)."""

    lengths: np.ndarray
    x: np.ndarray
    spread_now: np.ndarray
    copies_now: np.ndarray


def solve(lp: WorkLp, *, round_s: float, horizon_s: float, weights: Sequence[float] | None = None,
          growth: float = 2.0, completion_weight: float = 0.0, keep: np.ndarray | None = None,
          keep_rounds: float = 0.0, keep_gpus: np.ndarray | None = None) -> Timeline | None:
    """The module's LP on ``lp`` over [0, ``horizon_s``] (None: no solution, e.g. a horizon
    shorter than the makespan LP's T*); ``weights``: w_j, default 1; ``growth``: of the
    interval lengths (``intervals``); ``completion_weight``: beta of the objective (0: mean
    busy time alone, as Hadar's critical rule uses it). ``keep[j, r]``: job j held GPUs of
    type r last round; its work there this round is valued as if done ``keep_rounds``
    rounds earlier, so that of near-equal plans the LP keeps what runs (a move costs a
    restart) instead of flipping between them from round to round. Above half a round the
    kept columns' cost this round is negative, so the LP gives such a job its held GPUs for
    the whole first interval even when less would finish it (work rows are >=): a
    round-based plan holds them for the round anyway. ``keep_gpus[j, r]`` (None: no cap):
    the GPUs of type r job j held, the most this round's work there is valued earlier on
    (a variable K_c <= X[c, 0] per kept column carries the bonus, at most ``keep_gpus``
    x L_0 per job and type); uncapped, the bonus is on every GPU of a held type, so the LP
    grows a job that held one GPU of it onto all of them, each new one a restart."""
    # the cap a hair over the horizon, so that E = now + T* stays feasible in floating point
    lengths = np.array(intervals(horizon_s * (1.0 + 1e-7) + 1e-6, round_s, growth))
    n_j, n_r = lp.rho.shape
    n_k = len(lengths)
    ends = np.cumsum(lengths)
    mids = ends - lengths / 2.0
    w = np.ones(n_j) if weights is None else np.asarray(weights, dtype=float)
    cols = Columns.of(lp)
    n_c = cols.job.size
    nv = n_c * n_k
    x_of = np.arange(nv).reshape(n_c, n_k)
    per_step = np.where(lp.rem > 0, w / np.maximum(lp.rem, 1e-300), 0.0)
    cost = (per_step[cols.job] * cols.rate)[:, None] * (mids / ends[-1])[None, :]
    bonus = None
    if keep is not None and keep_rounds > 0:
        kept = keep[cols.job, cols.gpu_type] > 0
        if keep_gpus is None:
            cost[kept, 0] -= per_step[cols.job[kept]] * cols.rate[kept] * keep_rounds * round_s / ends[-1]
        else:   # the bonus on a variable K_c <= X[c, 0], at most the held GPUs of (job, type) in all
            kc = np.flatnonzero(kept)
            bonus = (kc, per_step[cols.job[kc]] * cols.rate[kc] * keep_rounds * round_s / ends[-1], keep_gpus)
    k_i = np.tile(np.arange(n_k), n_c)
    # rows: work (n_j): -sum rate X <= -R; capacity (n_r n_k): sum X[., r, k] <= n_r L_k;
    # per job and interval (n_j n_k): sum X[j, ., k] <= GF_j L_k
    rows = np.concatenate([np.repeat(cols.job, n_k), n_j + np.repeat(cols.gpu_type, n_k) * n_k + k_i,
                           n_j + n_r * n_k + np.repeat(cols.job, n_k) * n_k + k_i])
    vals = np.concatenate([-np.repeat(cols.rate, n_k), np.ones(2 * nv)])
    a_ub = coo_matrix((vals, (rows, np.tile(x_of.ravel(), 3))), shape=(n_j + (n_r + n_j) * n_k, nv)).tocsr()
    rhs = [-lp.rem, (lp.count[:, None] * lengths[None, :]).ravel(), (lp.cap_g[:, None] * lengths[None, :]).ravel()]
    slots, slot_cap = slot_rows(lp, cols)
    if slot_cap.size:                       # per slot and interval: sum X / gpus <= cap L_k
        a_ub = vstack([a_ub, kron(slots, identity(n_k, format="csr"))]).tocsr()
        rhs.append(np.kron(slot_cap, lengths))
    cuts = gang_rows_of(lp, cols)
    n_extra = cuts.n_extra * n_k
    if cuts.length.size:                    # X[c, k] then the cuts' variables E[e, k], rows per interval
        eye = identity(n_k, format="csr")
        a_ub = vstack([hstack([a_ub, csr_matrix((a_ub.shape[0], n_extra))]),
                       hstack([kron(cuts.x, eye), kron(cuts.extra, eye)])]).tocsr()
        rhs.append(np.kron(cuts.length, lengths))
    # per column and interval: 0 <= X <= cap L_k
    upper = np.concatenate([(cols.cap[:, None] * lengths[None, :]).ravel(), np.full(n_extra, np.inf)])
    objective = np.concatenate([cost.ravel(), np.zeros(n_extra)])
    if bonus is not None and bonus[0].size:
        a_ub, rhs, objective, upper = _with_kept_gpus(cols, a_ub, rhs, objective, upper, *bonus,
                                                      first=x_of[:, 0], length=float(lengths[0]), n_r=n_r)
    if completion_weight > 0:
        a_ub, rhs, objective, upper = _with_completion_bounds(
            lp, cols, a_ub, rhs, objective, upper, lengths=lengths, weights=w, beta=completion_weight)
    res = solve_lp(objective, a_ub, np.concatenate(rhs), np.column_stack([np.zeros(objective.size), upper]))
    if not res.ok:
        return None
    x = res.x[:nv].reshape(n_c, n_k)
    copies = (cols.per_job_type(x[:, 0] * cols.weight / lengths[0], (n_j, n_r)) if cols.weight is not None
              else np.zeros((n_j, n_r)))
    return Timeline(lengths=lengths, x=cols.per_job_type(x, (n_j, n_r)),
                    spread_now=cols.per_spread_type(x[:, 0] / lengths[0], (lp.spread_job.size, n_r)),
                    copies_now=copies)


def _with_kept_gpus(cols: Columns, a_ub: csr_matrix, rhs: list[np.ndarray], objective: np.ndarray,
                    upper: np.ndarray, kept: np.ndarray, value: np.ndarray, held: np.ndarray, *, first: np.ndarray,
                    length: float, n_r: int) -> tuple[csr_matrix, list[np.ndarray], np.ndarray, np.ndarray]:
    """The LP with the keep bonus on at most the GPUs a job held of a type: a variable K per
    kept column c (``kept``) earning ``value[c]`` with K <= X[c, first interval] (``first[c]``:
    its variable) and, per (job, type), sum K <= ``held[j, r]`` x ``length``."""
    n_b, n_x = kept.size, a_ub.shape[1]
    pairs, pair_of = np.unique(cols.job[kept] * n_r + cols.gpu_type[kept], return_inverse=True)
    link = hstack([coo_matrix((-np.ones(n_b), (np.arange(n_b), first[kept])), shape=(n_b, n_x)),
                   identity(n_b, format="csr")])
    per_pair = hstack([csr_matrix((pairs.size, n_x)),
                       coo_matrix((np.ones(n_b), (pair_of, np.arange(n_b))), shape=(pairs.size, n_b))])
    a_ub = vstack([hstack([a_ub, csr_matrix((a_ub.shape[0], n_b))]), link, per_pair]).tocsr()
    return (a_ub, [*rhs, np.zeros(n_b), held.ravel()[pairs] * length], np.concatenate([objective, -value]),
            np.concatenate([upper, np.full(n_b, np.inf)]))


def _with_completion_bounds(lp: WorkLp, cols: Columns, a_ub: csr_matrix, rhs: list[np.ndarray], objective: np.ndarray,
                            upper: np.ndarray, *, lengths: np.ndarray, weights: np.ndarray,
                            beta: float) -> tuple[csr_matrix, list[np.ndarray], np.ndarray, np.ndarray]:
    """The LP with a variable C_j per job that can run and its rows C_j >= start_k +
    (work of j in k) / F_j for every interval k; the objective becomes (1 - beta) x mean
    busy time + beta x sum_j w_j C_j (both over E, as the busy-time cost is)."""
    n_k = lengths.size
    ends = np.cumsum(lengths)
    peak = peak_rates(lp, cols)
    live = np.flatnonzero((lp.rem > 0) & (peak > 0))
    at = np.full(lp.rem.size, -1)
    at[live] = np.arange(live.size)
    mine = np.flatnonzero(at[cols.job] >= 0)
    n_x, n_rows = objective.size, live.size * n_k
    # row (live job i, interval k): sum_{c of j} rate_c / F_j X[c, k] - C_i <= -start_k
    rows = np.repeat(at[cols.job[mine]] * n_k, n_k) + np.tile(np.arange(n_k), mine.size)
    on_x = coo_matrix((np.repeat(cols.rate[mine] / peak[cols.job[mine]], n_k),
                       (rows, (mine[:, None] * n_k + np.arange(n_k)[None, :]).ravel())), shape=(n_rows, n_x))
    on_c = coo_matrix((-np.ones(n_rows), (np.arange(n_rows), np.repeat(np.arange(live.size), n_k))),
                      shape=(n_rows, live.size))
    a_ub = vstack([hstack([a_ub, csr_matrix((a_ub.shape[0], live.size))]), hstack([on_x, on_c])]).tocsr()
    rhs = [*rhs, -np.tile(ends - lengths, live.size)]
    objective = np.concatenate([(1.0 - beta) * objective, beta * weights[live] / ends[-1]])
    return a_ub, rhs, objective, np.concatenate([upper, np.full(live.size, np.inf)])


def peak_rates(lp: WorkLp, cols: Columns) -> np.ndarray:
    """[j]: the most steps per second job j can earn at once, F_j: its columns filled best
    rate first within each type's GPUs and its cap_g (greedy is optimal: the limits nest,
    columns within types within the job); with node columns, each slot's nodes at the slot's
    best copy."""
    out = np.zeros(lp.rem.size)
    if lp.nodes is not None:            # a node of each slot at its best copy
        n = lp.nodes
        per_slot = np.zeros(n.cap.size)
        np.maximum.at(per_slot, n.slot, n.rate * n.gpus)
        np.add.at(out, n.slot_job, per_slot * n.cap)
        return out
    for j in range(lp.rem.size):
        mine = np.flatnonzero(cols.job == j)
        free, left = lp.count.astype(float), float(lp.cap_g[j])
        for c in mine[np.argsort(-cols.rate[mine], kind="stable")]:
            take = min(cols.cap[c], free[cols.gpu_type[c]], left)
            if take > 0:
                out[j] += take * cols.rate[c]
                free[cols.gpu_type[c]] -= take
                left -= take
    return out


def solve_until(lp: WorkLp, *, kept_end: float | None, new_end: Callable[[float], float],
                horizon_of: Callable[[float], float], round_s: float, weights: Sequence[float] | None = None,
                growth: float = 2.0, completion_weight: float = 0.0, keep: np.ndarray | None = None,
                keep_rounds: float = 0.0, keep_gpus: np.ndarray | None = None) -> tuple[float | None, Timeline | None]:
    """(E, plan) for this round, E in the caller's units (``horizon_of(E)``: seconds from
    now to it). The LP runs up to the kept E (None: E must be set or moved) while it still
    has a solution; else up to ``new_end(T*)``, T* from the makespan LP, which is thus
    solved only when E is set or moved. (None, None) when the makespan LP has no solution;
    (E, None) when the timeline LP has none."""
    if kept_end is not None and horizon_of(kept_end) > 0:
        plan = solve(lp, round_s=round_s, horizon_s=horizon_of(kept_end), weights=weights, growth=growth,
                     completion_weight=completion_weight, keep=keep, keep_rounds=keep_rounds, keep_gpus=keep_gpus)
        if plan is not None:
            return kept_end, plan
    best = makespan(lp)
    if best is None:
        return None, None
    end = new_end(best)
    return end, solve(lp, round_s=round_s, horizon_s=horizon_of(end), weights=weights, growth=growth,
                      completion_weight=completion_weight, keep=keep, keep_rounds=keep_rounds, keep_gpus=keep_gpus)


def job_classes(jobs: Sequence[JobState], rounds: Callable[[JobState], float]) -> list[list[JobState]]:
    """Jobs grouped for a pooled LP: same job type, W and bucket of ``rounds(job)`` (rounds
    left at its best rate) in powers of CLASS_BASE; in order of first member."""
    out: dict[tuple[str, int, int], list[JobState]] = {}
    for j in jobs:
        bucket = math.floor(math.log(max(rounds(j), 1.0), CLASS_BASE))
        out.setdefault((j.job_type, j.workers, bucket), []).append(j)
    return list(out.values())


def pool(lp: WorkLp, groups: Sequence[Sequence[int]]) -> WorkLp:
    """``lp`` with the rows of each group (indices into its jobs, all with one rho and the
    same spread columns: one job type and W) summed: one job of their summed work and caps.
    Every schedule of the jobs is one of the pooled job, so the LP stays a relaxation of
    the same kind."""
    first = [g[0] for g in groups]
    nodes = _pooled_nodes(lp.nodes, groups) if lp.nodes is not None else None
    spread = [(c, s) for c, g in enumerate(groups) for s in np.flatnonzero(lp.spread_job == g[0])]
    members = np.array([len(groups[c]) for c, _ in spread], dtype=float)
    picked = np.array([s for _, s in spread], dtype=int)
    return WorkLp(types=lp.types, rho=lp.rho[first], rem=np.array([lp.rem[list(g)].sum() for g in groups]),
                  cap_f=np.array([lp.cap_f[list(g)].sum(axis=0) for g in groups]).reshape(len(groups), -1),
                  cap_g=np.array([lp.cap_g[list(g)].sum() for g in groups]), count=lp.count,
                  spread_job=np.array([c for c, _ in spread], dtype=int), spread_rate=lp.spread_rate[picked],
                  spread_cap=(lp.spread_cap[picked] * members[:, None]).reshape(len(spread), lp.rho.shape[1]),
                  gang_width=lp.gang_width[first] if lp.gang_width.size else lp.gang_width, nodes=nodes)


def _pooled_nodes(nodes: NodeColumns, groups: Sequence[Sequence[int]]) -> NodeColumns:
    """The node columns of each group's first job, for the group; a slot's nodes times the
    group's jobs (a slot's nodes depend on W and the cluster alone; each job holds a copy per
    node, so together as many copies as they are)."""
    jobs = np.arange(int(max(nodes.job.max(initial=-1), nodes.slot_job.max(initial=-1))) + 2)
    col_at, slot_at = np.searchsorted(nodes.job, jobs), np.searchsorted(nodes.slot_job, jobs)   # in job order
    parts, caps, owners, base = [], [], [], 0
    for c, g in enumerate(groups):
        mine = np.arange(col_at[g[0]], col_at[g[0] + 1])
        first_slot, n_slots = int(slot_at[g[0]]), int(slot_at[g[0] + 1] - slot_at[g[0]])
        parts.append((np.full(mine.size, c), nodes.gpu_type[mine], nodes.rate[mine], nodes.gpus[mine],
                      base + nodes.slot[mine] - first_slot))
        caps.append(nodes.cap[first_slot:first_slot + n_slots] * len(g))   # same W and cluster: the same slots
        owners.append(np.full(n_slots, c))
        base += n_slots
    joined = [np.concatenate([p[i] for p in parts]) if parts else np.zeros(0) for i in range(5)]
    return NodeColumns(job=joined[0].astype(int), gpu_type=joined[1].astype(int), rate=joined[2].astype(float),
                       gpus=joined[3].astype(float), slot=joined[4].astype(int),
                       cap=np.concatenate(caps) if caps else np.zeros(0),
                       slot_job=np.concatenate(owners).astype(int) if owners else np.zeros(0, dtype=int))
