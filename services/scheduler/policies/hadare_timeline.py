"""Which GPUs each job should train on this round: a time-indexed LP up to a makespan cap.

Why. HadarE has two goals that pull apart. Mean JCT wants the pooled cluster given to the
job with the least remaining work first (Smith's order: forking makes work divisible, so
that rule is optimal for it). TTD wants every GPU type kept for the jobs efficient on
it (``hadare_split``'s makespan split): without it the short jobs finish early on the fast
GPUs and the long jobs that crawl on a slow type are left alone with it at the end. Smith's
order alone ends 10-20% over the fork bound; the makespan split alone delays short jobs
that share a type with long ones (lab-5 mean JCT 1.15x gavel against 1.70x in Smith's
order). One LP gives both: finish everything by a cap close to the optimal makespan, and
among the schedules that do, the one that does each job's work earliest.

LP (jobs present now, notation of ``hadare_split``/bounds.py, time from the round start).
T* is the makespan LP's optimum on the remaining work; the cap is E = (1 + slack) T*. The
horizon [0, E] is cut into intervals k of length L_k: this round first (L_0 = round_s),
then geometric (1, 2, 4, ... rounds, the last one cut at E), so the far future is planned
coarsely and the LP stays small (O(log(E / round_s)) intervals). X[j,r,k] >= 0 are the
GPU-seconds job j gets on type r in interval k::

    minimize  sum_j (w_j / R_j) sum_{r,k} m_k rho[j,r] X[j,r,k]      (m_k: middle of interval k)
    s.t.      sum_{r,k} rho[j,r] X[j,r,k] >= R_j                     every job: all work by E
              sum_j X[j,r,k] <= n_r L_k                              every type and interval
              X[j,r,k] <= cF[j,r] L_k,  sum_r X[j,r,k] <= GF_j L_k   every job, type and interval

The objective is the weighted mean *busy time* of each job's work (the average moment its
work is done), the classic LP relaxation for weighted completion time: on one pooled machine
it orders jobs as Smith's rule does, and here it also weighs which type does which job's
work. The work rows force every job to finish by E, so the makespan stays within ``slack``
of T* when the plan is followed (up to rounding to whole GPUs and what consolidation costs,
which T* leaves out as the fork bound does).

Output: this round's slice, X[j,r,0] / L_0 = the GPUs of type r the LP gives job j now
(fractional). ``hadare_copies`` lets each job's main pass use at most the ceiling of that
on each type (``budgets``); its back-fill pass gives away what the slice left idle.

The LP is re-solved every round on the remaining work, so the plan adapts to what actually
happened (arrivals, rounding, consolidation time). E itself is kept (``TimelineState``,
``target_end_s``): it moves only when jobs arrive or when it can no longer be met. Re-set
from each round's T*, the slack was spent again every round and TTD drifted 5-6% over the
bound at a slack of 0.01.

Above POOL_ABOVE jobs the LP runs on classes of jobs (``job_classes``, ``pool``: same job
type, W and bucket of rounds left; summed work and caps, still a relaxation), and a
class's GPUs go to its jobs in planning order. Hadar's critical rule
(``hadar_timeline``) uses the same LP without forking, plus spread columns for gangs that
span nodes and ``gang_cuts``' rows for whole gangs (``ForkLp``; HadarE's fork LP has neither).

Cost: one makespan LP (J R + 1 variables; only when E is set or moved) and one LP with
J R K variables and J + R K + J K (R + 1) rows; K about log2(E / round_s) + 2. HiGHS. On
failure: None, and the caller falls back (HadarE: the makespan split).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix, hstack, identity, kron, vstack

from services.scheduler.policies.hadare_split import Columns, ForkLp, gang_rows_of, makespan
from services.scheduler.policy import JobState, PolicyState

TIMELINE_SLACK = 0.03
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
class TimelineState(PolicyState):
    """HadarE's books between rounds: the target end E (absolute seconds, the simulator's or
    the service's clock) and the jobs it was set for, so that E moves only when jobs arrive
    or when it can no longer be met."""

    end_s: float
    job_ids: frozenset[str] = frozenset()


def target_end_s(best_s: float, *, now_s: float, previous: TimelineState | None, job_ids: frozenset[str],
                 slack: float = TIMELINE_SLACK) -> float:
    """E for this round, from T* (``best_s``, seconds from now) and the previous state:
    now + (1 + slack) T* the first round, raised to that when a job arrived since and it is
    later, otherwise kept; never before now + T* (when E can no longer be met, the plan is
    makespan-optimal from then on). Keeping E is what stops the slack compounding: re-set
    every round, each round's slack would be spent again and TTD drift past the cap."""
    fresh = now_s + (1.0 + slack) * best_s
    if previous is None:
        end = fresh
    elif job_ids - previous.job_ids:
        end = max(previous.end_s, fresh)
    else:
        end = previous.end_s
    return max(end, now_s + best_s)


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """The LP's solution: ``lengths[k]`` (seconds), ``x[j, r, k]`` GPU-seconds and
    ``spread_now[s, r]``: the GPUs of type r spread column s holds in the first interval."""

    lengths: np.ndarray
    x: np.ndarray
    spread_now: np.ndarray


def solve(lp: ForkLp, *, round_s: float, horizon_s: float, weights: Sequence[float] | None = None,
          growth: float = 2.0) -> Timeline | None:
    """The module's LP on ``lp`` over [0, ``horizon_s``] (None: no solution, e.g. a horizon
    shorter than the makespan LP's T*); ``weights``: w_j, default 1; ``growth``: of the
    interval lengths (``intervals``)."""
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
    k_i = np.tile(np.arange(n_k), n_c)
    # rows: work (n_j): -sum rate X <= -R; capacity (n_r n_k): sum X[., r, k] <= n_r L_k;
    # per job and interval (n_j n_k): sum X[j, ., k] <= GF_j L_k
    rows = np.concatenate([np.repeat(cols.job, n_k), n_j + np.repeat(cols.gpu_type, n_k) * n_k + k_i,
                           n_j + n_r * n_k + np.repeat(cols.job, n_k) * n_k + k_i])
    vals = np.concatenate([-np.repeat(cols.rate, n_k), np.ones(2 * nv)])
    a_ub = coo_matrix((vals, (rows, np.tile(x_of.ravel(), 3))), shape=(n_j + (n_r + n_j) * n_k, nv)).tocsr()
    rhs = [-lp.rem, (lp.count[:, None] * lengths[None, :]).ravel(), (lp.cap_g[:, None] * lengths[None, :]).ravel()]
    cuts = gang_rows_of(lp, cols)
    n_extra = cuts.n_extra * n_k
    if n_extra:                             # X[c, k] then the cuts' variables E[e, k], rows per interval
        eye = identity(n_k, format="csr")
        a_ub = vstack([hstack([a_ub, csr_matrix((a_ub.shape[0], n_extra))]),
                       hstack([kron(cuts.x, eye), kron(cuts.extra, eye)])]).tocsr()
        rhs.append(np.kron(cuts.length, lengths))
    # per column and interval: 0 <= X <= cap L_k
    upper = np.concatenate([(cols.cap[:, None] * lengths[None, :]).ravel(), np.full(n_extra, np.inf)])
    res = linprog(np.concatenate([cost.ravel(), np.zeros(n_extra)]), A_ub=a_ub, b_ub=np.concatenate(rhs),
                  bounds=np.column_stack([np.zeros(nv + n_extra), upper]), method="highs")
    if res.status != 0:
        return None
    x = res.x[:nv].reshape(n_c, n_k)
    return Timeline(lengths=lengths, x=cols.per_job_type(x, (n_j, n_r)),
                    spread_now=cols.per_spread_type(x[:, 0] / lengths[0], (lp.spread_job.size, n_r)))


def solve_until(lp: ForkLp, *, kept_end: float | None, new_end: Callable[[float], float],
                horizon_of: Callable[[float], float], round_s: float, weights: Sequence[float] | None = None,
                growth: float = 2.0) -> tuple[float | None, Timeline | None]:
    """(E, plan) for this round, E in the caller's units (``horizon_of(E)``: seconds from
    now to it). The LP runs up to the kept E (None: E must be set or moved) while it still
    has a solution; else up to ``new_end(T*)``, T* from the makespan LP, which is thus
    solved only when E is set or moved. (None, None) when the makespan LP has no solution;
    (E, None) when the timeline LP has none."""
    if kept_end is not None and horizon_of(kept_end) > 0:
        plan = solve(lp, round_s=round_s, horizon_s=horizon_of(kept_end), weights=weights, growth=growth)
        if plan is not None:
            return kept_end, plan
    best = makespan(lp)
    if best is None:
        return None, None
    end = new_end(best)
    return end, solve(lp, round_s=round_s, horizon_s=horizon_of(end), weights=weights, growth=growth)


def budgets(share: np.ndarray, groups: Sequence[Sequence[int]], cap_f: np.ndarray) -> list[dict[int, int]]:
    """Whole GPUs per type index for each job, from the LP's fractional ``share[c, r]`` of
    each group c (one job, or a pooled class whose jobs are listed in planning order):
    the share rounded up (noise below SHARE_EPS dropped), then handed to the group's jobs
    in turn, each taking at most what it can hold of each type (``cap_f[j, r]``)."""
    out: list[dict[int, int]] = [{} for _ in range(cap_f.shape[0])]
    for c, group in enumerate(groups):
        left = np.where(share[c] > SHARE_EPS, np.ceil(share[c] - SHARE_EPS), 0.0)
        for j in group:
            if not left.any():
                break
            take = np.minimum(left, cap_f[j])
            out[j] = {int(r): int(take[r]) for r in np.flatnonzero(take > 0)}
            left -= take
    return out


def job_classes(jobs: Sequence[JobState], rounds: Callable[[JobState], float]) -> list[list[JobState]]:
    """Jobs grouped for a pooled LP: same job type, W and bucket of ``rounds(job)`` (rounds
    left at its best rate) in powers of CLASS_BASE; in order of first member."""
    out: dict[tuple[str, int, int], list[JobState]] = {}
    for j in jobs:
        bucket = int(math.floor(math.log(max(rounds(j), 1.0), CLASS_BASE)))
        out.setdefault((j.job_type, j.workers, bucket), []).append(j)
    return list(out.values())


def pool(lp: ForkLp, groups: Sequence[Sequence[int]]) -> ForkLp:
    """``lp`` with the rows of each group (indices into its jobs, all with one rho and the
    same spread columns: one job type and W) summed: one job of their summed work and caps.
    Every schedule of the jobs is one of the pooled job, so the LP stays a relaxation of
    the same kind."""
    first = [g[0] for g in groups]
    spread = [(c, s) for c, g in enumerate(groups) for s in np.flatnonzero(lp.spread_job == g[0])]
    members = np.array([len(groups[c]) for c, _ in spread], dtype=float)
    picked = np.array([s for _, s in spread], dtype=int)
    return ForkLp(types=lp.types, rho=lp.rho[first], rem=np.array([lp.rem[list(g)].sum() for g in groups]),
                  cap_f=np.array([lp.cap_f[list(g)].sum(axis=0) for g in groups]).reshape(len(groups), -1),
                  cap_g=np.array([lp.cap_g[list(g)].sum() for g in groups]), count=lp.count,
                  spread_job=np.array([c for c, _ in spread], dtype=int), spread_rate=lp.spread_rate[picked],
                  spread_cap=(lp.spread_cap[picked] * members[:, None]).reshape(len(spread), lp.rho.shape[1]),
                  gang_width=lp.gang_width[first] if lp.gang_width.size else lp.gang_width)
