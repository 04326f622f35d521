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
(``hadar_timeline``) uses the same LP without forking.

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
from scipy.sparse import coo_matrix

from services.scheduler.policies.hadare_split import ForkLp, makespan
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
    """The LP's solution: ``lengths[k]`` (seconds) and ``x[j, r, k]`` GPU-seconds."""

    lengths: np.ndarray
    x: np.ndarray


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
    live = lp.rem > 0
    nv = n_j * n_r * n_k
    x_of = np.arange(nv).reshape(n_j, n_r, n_k)
    cost = np.zeros((n_j, n_r, n_k))
    cost[live] = (w[live] / lp.rem[live])[:, None, None] * lp.rho[live][:, :, None] * (mids / ends[-1])[None, None, :]
    rows, cols, vals, rhs = [], [], [], []
    row = 0
    # work: -sum_{r,k} rho X <= -R
    rows.append(np.repeat(np.arange(n_j), n_r * n_k))
    cols.append(x_of.ravel())
    vals.append(-np.repeat(lp.rho.ravel(), n_k))
    rhs.append(-lp.rem)
    row += n_j
    # capacity: sum_j X[j,r,k] <= n_r L_k
    rows.append(row + np.tile(np.arange(n_r * n_k), n_j))
    cols.append(x_of.ravel())
    vals.append(np.ones(nv))
    rhs.append((lp.count[:, None] * lengths[None, :]).ravel())
    row += n_r * n_k
    # per job and interval: sum_r X[j,r,k] <= GF_j L_k
    rows.append(row + (np.arange(n_j)[:, None, None] * n_k + np.arange(n_k)[None, None, :]
                       + np.zeros((1, n_r, 1), dtype=int)).ravel())
    cols.append(x_of.ravel())
    vals.append(np.ones(nv))
    rhs.append((lp.cap_g[:, None] * lengths[None, :]).ravel())
    row += n_j * n_k
    a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(row, nv)).tocsr()
    # per job, type and interval: 0 <= X <= cF L_k (0 where the type cannot run the job)
    upper = lp.cap_f[:, :, None] * lengths[None, None, :] * (lp.rho > 0)[:, :, None]
    res = linprog(cost.ravel(), A_ub=a_ub, b_ub=np.concatenate(rhs),
                  bounds=np.column_stack([np.zeros(nv), upper.ravel()]), method="highs")
    if res.status != 0:
        return None
    return Timeline(lengths=lengths, x=res.x.reshape(n_j, n_r, n_k))


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
    """``lp`` with the rows of each group (indices into its jobs, all with one rho) summed:
    one job of their summed work and caps. Every schedule of the jobs is one of the pooled
    job, so the LP stays a relaxation of the same kind."""
    first = [g[0] for g in groups]
    return ForkLp(types=lp.types, rho=lp.rho[first], rem=np.array([lp.rem[list(g)].sum() for g in groups]),
                  cap_f=np.array([lp.cap_f[list(g)].sum(axis=0) for g in groups]).reshape(len(groups), -1),
                  cap_g=np.array([lp.cap_g[list(g)].sum() for g in groups]), count=lp.count)
