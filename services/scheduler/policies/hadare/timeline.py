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

The objective above is the weighted mean *busy time* of each job's work (the average moment
its work is done), the classic LP relaxation for weighted completion time: on one pooled
machine it orders jobs as Smith's rule does, and here it also weighs which type does which
job's work. It is blind to a job's tail: a job that does 90% of its work early and the
rest at E scores nearly as well as one done early, and under a tight E the long jobs that
are not critical trailed their last work to E (lab-5, 20 jobs: three jobs ending at E).
So HadarE (``completion_weight`` beta = COMPLETION_WEIGHT; Hadar's critical rule keeps
beta = 0) adds a variable C_j per job with the completion bound of every interval,

    C_j >= start_k + (sum_r rho[j,r] X[j,r,k]) / F_j                 every job and interval

(F_j: the most steps per second j can earn at once, ``peak_rates``; work in interval k
takes j at least that long, so it cannot end before), and minimizes (1 - beta) x the busy
time above + beta x sum_j w_j C_j. The bounds alone are blind inside an interval (beta = 1
left this round's split arbitrary in a prototype: mean JCT 0.46x gavel's), the busy time
orders it. 20 jobs at t=0, seeds 1-5, beta 0 / 0.5 / 0.75 / 0.9 / 0.95: mean JCT 1.57 /
1.58 / 1.61 / 1.60 / 1.58x gavel on lab-5, 1.82 / 1.83 / 1.83 / 1.80 / 1.75x on aws-5;
0.75 was also the better of 0.75 and 0.9 on seeds 6-10 (README "Forking"). The work rows
force every job to finish by E, so the makespan stays within ``slack`` of T* when the plan
is followed (up to rounding to whole GPUs and what consolidation costs, which T* leaves
out as the fork bound does).

Output: this round's slice, X[j,r,0] / L_0 = the GPUs of type r the LP gives job j now
(fractional). ``budgets`` rounds it to whole GPUs by error diffusion, the rounding error
carried from round to round (``TimelineState.credit``), and ``hadare_copies`` lets each
job's main pass use at most that on each type; its back-fill pass gives away what the
slice left idle. Rounded up each round instead, a share went to the job first in Smith's
order every round and the jobs behind it fell behind plan until E could not be met: TTD
1.054x / 1.061x the bound on lab-5 / aws-5 seed 1 at a slack of 0.03, against 1.03x now.

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
J R K (+ J) variables and J + R K + J K (R + 2) rows; K about log2(E / round_s) + 2. HiGHS.
On failure: None, and the caller falls back (HadarE: the makespan split).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import coo_matrix, csr_matrix, hstack, identity, kron, vstack

from services.scheduler.policies.hadare.split import Columns, ForkLp, gang_rows_of, makespan
from services.scheduler.core.policy import JobState, PolicyState

TIMELINE_SLACK = 0.045
COMPLETION_WEIGHT = 0.75  # beta: the objective's share of completion bounds (module docstring)
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
    # ``budgets``' rounding credit: job id (a class's first job) -> GPU type -> GPUs
    credit: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


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
          growth: float = 2.0, completion_weight: float = 0.0) -> Timeline | None:
    """The module's LP on ``lp`` over [0, ``horizon_s``] (None: no solution, e.g. a horizon
    shorter than the makespan LP's T*); ``weights``: w_j, default 1; ``growth``: of the
    interval lengths (``intervals``); ``completion_weight``: beta of the objective (0: mean
    busy time alone, as Hadar's critical rule uses it)."""
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
    objective = np.concatenate([cost.ravel(), np.zeros(n_extra)])
    if completion_weight > 0:
        a_ub, rhs, objective, upper = _with_completion_bounds(
            lp, cols, a_ub, rhs, objective, upper, lengths=lengths, weights=w, beta=completion_weight)
    res = linprog(objective, A_ub=a_ub, b_ub=np.concatenate(rhs),
                  bounds=np.column_stack([np.zeros(objective.size), upper]), method="highs")
    if res.status != 0:
        return None
    x = res.x[:nv].reshape(n_c, n_k)
    return Timeline(lengths=lengths, x=cols.per_job_type(x, (n_j, n_r)),
                    spread_now=cols.per_spread_type(x[:, 0] / lengths[0], (lp.spread_job.size, n_r)))


def _with_completion_bounds(lp: ForkLp, cols: Columns, a_ub, rhs: list, objective: np.ndarray, upper: np.ndarray, *,
                            lengths: np.ndarray, weights: np.ndarray, beta: float):
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


def peak_rates(lp: ForkLp, cols: Columns) -> np.ndarray:
    """[j]: the most steps per second job j can earn at once, F_j: its columns filled best
    rate first within each type's GPUs and its cap_g (greedy is optimal: the limits nest,
    columns within types within the job)."""
    out = np.zeros(lp.rem.size)
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


def solve_until(lp: ForkLp, *, kept_end: float | None, new_end: Callable[[float], float],
                horizon_of: Callable[[float], float], round_s: float, weights: Sequence[float] | None = None,
                growth: float = 2.0, completion_weight: float = 0.0) -> tuple[float | None, Timeline | None]:
    """(E, plan) for this round, E in the caller's units (``horizon_of(E)``: seconds from
    now to it). The LP runs up to the kept E (None: E must be set or moved) while it still
    has a solution; else up to ``new_end(T*)``, T* from the makespan LP, which is thus
    solved only when E is set or moved. (None, None) when the makespan LP has no solution;
    (E, None) when the timeline LP has none."""
    if kept_end is not None and horizon_of(kept_end) > 0:
        plan = solve(lp, round_s=round_s, horizon_s=horizon_of(kept_end), weights=weights, growth=growth,
                     completion_weight=completion_weight)
        if plan is not None:
            return kept_end, plan
    best = makespan(lp)
    if best is None:
        return None, None
    end = new_end(best)
    return end, solve(lp, round_s=round_s, horizon_s=horizon_of(end), weights=weights, growth=growth,
                      completion_weight=completion_weight)


def budgets(share: np.ndarray, groups: Sequence[Sequence[int]], cap_f: np.ndarray, *, count: np.ndarray,
            credit: np.ndarray, finishing: np.ndarray) -> tuple[list[dict[int, int]], np.ndarray]:
    """(whole GPUs per type index for each job, the credit to carry), from the LP's fractional
    ``share[c, r]`` of each group c (one job, or a pooled class whose jobs are listed in
    planning order) and the ``credit[c, r]`` carried from the last round.

    Error diffusion per type: a group is due its share plus its credit (noise below
    SHARE_EPS, and any credit on a type the LP no longer gives it, dropped); each gets the
    whole part of what it is due, then the type's spare GPUs go one each to the largest
    remainders, groups the LP ends this round (``finishing``) first; what it was due and
    not given (or given beyond) is carried, within +-1. Never more GPUs of a type than
    ``count[r]``. A group's GPUs go to its jobs in turn, each taking at most what it can
    hold of each type (``cap_f[j, r]``)."""
    n_c, n_r = share.shape
    cap = np.array([cap_f[list(g)].sum(axis=0) for g in groups]).reshape(n_c, n_r)
    wanted = share > SHARE_EPS
    due = np.where(wanted, np.maximum(share + credit, 0.0), 0.0)
    given = np.zeros((n_c, n_r))
    for r in range(n_r):
        left = float(count[r])
        for c in sorted(range(n_c), key=lambda c: (not finishing[c], -due[c, r], c)):
            given[c, r] = min(math.floor(due[c, r] + SHARE_EPS), cap[c, r], left)
            left -= given[c, r]
        rest = [c for c in range(n_c) if due[c, r] - given[c, r] > SHARE_EPS and given[c, r] < cap[c, r]]
        for c in sorted(rest, key=lambda c: (not finishing[c], given[c, r] - due[c, r], c))[:max(int(left), 0)]:
            given[c, r] += 1
    out: list[dict[int, int]] = [{} for _ in range(cap_f.shape[0])]
    for c, group in enumerate(groups):
        left_c = given[c].copy()
        for j in group:
            if not left_c.any():
                break
            take = np.minimum(left_c, cap_f[j])
            out[j] = {int(r): int(take[r]) for r in np.flatnonzero(take > 0)}
            left_c -= take
    return out, np.where(wanted, np.clip(due - given, -1.0, 1.0), 0.0)


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
