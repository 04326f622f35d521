"""Hadar's makespan target and critical jobs: least-laxity planning of the longest work.

The earlier rule, ``Hadar(critical_rule="laxity")``; the default is ``hadar/timeline``,
which sees the contention between long jobs for the fast types that this rule does not.

Why. The utility (``hadar/prices.InverseSlowdown``) values a job by its slowdown, so a job
of hundreds of rounds loses almost nothing per round of delay and its value per
GPU-round is the lowest of all: planned by density it waits behind every shorter job and
alone sets the makespan (TTD). Planning it first from round 0 fixes TTD but takes the
fast GPUs from the short jobs for the whole run, and mean JCT falls to Gavel's.

Formulation. ``n_j = ceil(R_j / (s_j round_s))`` is the rounds job j still needs on its
fastest option (R_j remaining steps, s_j that option's planned rate). No schedule ends
before ``round + max_j n_j``. The policy keeps a *target end round* E (in its state):

* set to ``round + ceil((1 + slack) max(max_j n_j, T_cap))`` the first round, where T_cap
  (``capacity_rounds``) is an LP lower bound on the rounds the GPUs need for all the
  remaining work at the planned rates (it counts that jobs compete for the fast types);
* raised to ``round + ceil((1 + slack) max(n_j, T_cap))`` when a job j arrived since the
  previous plan and that is later; otherwise kept, so it does not drift later while jobs
  wait;
* raised to ``round + max_j n_j`` when a job can no longer make it (E then is tight: that
  job is the makespan).

The laxity of job j is ``E - round - n_j``: the rounds it may still wait or run slower
and finish by E. A job is *critical* when its laxity is at most ``margin`` rounds. Critical
jobs are planned before all others (most rounds needed first, then arrival, then id) and
re-planned every round, so their schedule always starts at slot 0 on the cheapest option
the (still empty) ledger offers: their fastest. Everyone else is planned by density as
before and uses the fast GPUs until the long jobs' laxity runs out; the long jobs then
run without a break and finish by about E. The ``slack`` is the share of the makespan
bound the policy is willing to give up for mean JCT. Measured (README "Results", issue 11):
no slack reaches TTD >= 1.17x and mean JCT >= 1.15x Gavel together on aws-5 / lab-5;
``benchmarks/jct_frontier.py`` shows the best non-preemptive schedule at the makespan the
TTD target needs keeps about 1.2x (aws-5) but only about 1.15x (lab-5). Packing the jobs
backward from E by type (a contention-aware laxity) and an LP home type per job were
tried and cost more JCT than they gained TTD.

Assumptions: rates are the planned (lower-bound) rates, so a critical job running on its
fastest option does not finish later than planned; critical jobs together fit the
fastest GPUs (when they do not, the later ones take slower options, miss E and E moves
to the new bound); arrivals are not known in advance (E only grows with them).

Guarantees of ``target_end`` and ``critical_jobs``: pure functions; ``critical_jobs``
returns ids in planning order, never a job without work or feasible option, at most
``limit`` ids (bounding the extra planning per round).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy.sparse import coo_matrix

from services.scheduler.core.policy import JobState
from services.scheduler.policies.hadar.profile import JobProfile
from services.scheduler.policies.lp.highs import solve as solve_lp

CRITICAL_SLACK = 0.05      # slack: share of the makespan bound given to shorter jobs
CRITICAL_MARGIN = 1        # margin: rounds of laxity at which a job becomes critical
CRITICAL_LIMIT = 64        # limit: at most this many critical jobs per round
POOL_ABOVE = 256           # T_cap pools jobs by (type, W) above this many jobs


def rounds_needed(job: JobState, profile: JobProfile, round_s: float) -> int:
    """n_j: rounds of job j's remaining work on its fastest option (0 if none or no work)."""
    rate = profile.best_rate * round_s
    if job.remaining <= 0 or rate <= 0:
        return 0
    return max(1, math.ceil(job.remaining / rate - 1e-9))


def target_end(need: Mapping[str, int], new: Sequence[str], *, round_: int, previous: int | None,
               slack: float = CRITICAL_SLACK, capacity: float = 0.0) -> int:
    """E for this round from n_j (``need``), the ids of jobs new since the last plan, the
    previous E (None the first round) and T_cap (``capacity``, rounds from now; pass it when
    ``previous`` is None or ``new`` is not empty). Never below ``round_ + max n_j``."""
    longest = max(need.values(), default=0)
    bound = round_ + longest
    if previous is None:
        return round_ + math.ceil((1.0 + slack) * max(longest, capacity) - 1e-9)
    target = previous
    if new:
        newest = max((need.get(job_id, 0) for job_id in new), default=0)
        target = max(target, round_ + math.ceil((1.0 + slack) * max(newest, capacity) - 1e-9))
    return max(target, bound)


def critical_jobs(jobs: Sequence[JobState], need: Mapping[str, int], *, round_: int, target: int,
                  margin: int = CRITICAL_MARGIN, limit: int = CRITICAL_LIMIT) -> list[str]:
    """Ids of the jobs with laxity ``target - round_ - n_j <= margin`` and work left, in
    planning order (most rounds needed first, then arrival, then job id)."""
    chosen = [j for j in jobs if need.get(j.job_id, 0) > 0 and target - round_ - need[j.job_id] <= margin]
    chosen.sort(key=lambda j: (-need[j.job_id], j.arrival_s, j.job_id))
    return [j.job_id for j in chosen[:limit]]


def capacity_rounds(gpu_rounds: np.ndarray, workers: np.ndarray, capacity: np.ndarray) -> float:
    """T_cap: least rounds in which the GPUs can do the remaining work, an LP relaxation.

    ``gpu_rounds[j, r]``: GPU-rounds of type r that job j's remaining work takes on type r
    alone (+inf: r cannot run it); ``workers[j]`` = W_j; ``capacity[r]`` = GPUs of type r.
    Variables y[j, r] >= 0 (share of j's work done on r) and T::

        min T  s.t.  sum_r y[j,r] = 1 (>= 1)                 every job
                     sum_j y[j,r] gpu_rounds[j,r] <= C_r T    every type
                     sum_r y[j,r] gpu_rounds[j,r] / W_j <= T  every job (W_j GPUs at a time)

    A schedule at the planned rates is a feasible point, so T_cap is a lower bound on its
    makespan in rounds (0 for no jobs). O(J R) to build; HiGHS solves it.
    """
    n_jobs, n_types = gpu_rounds.shape
    if n_jobs == 0:
        return 0.0
    usable = np.isfinite(gpu_rounds) & (gpu_rounds > 0)
    g = np.where(usable, gpu_rounds, 0.0)
    t_col = n_jobs * n_types
    jj, rr = np.nonzero(usable)
    var = jj * n_types + rr
    rows = [jj, n_jobs + rr, n_jobs + n_types + jj, n_jobs + np.arange(n_types), n_jobs + n_types + np.arange(n_jobs)]
    cols = [var, var, var, np.full(n_types, t_col), np.full(n_jobs, t_col)]
    vals = [-np.ones(var.size), g[jj, rr], g[jj, rr] / workers[jj], -capacity.astype(float), -np.ones(n_jobs)]
    a_ub = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                      shape=(2 * n_jobs + n_types, t_col + 1)).tocsr()
    b_ub = np.concatenate([-np.ones(n_jobs), np.zeros(n_types + n_jobs)])
    bounds: list[tuple[float, float | None]] = [(0.0, None if u else 0.0) for u in usable.ravel().tolist()]
    bounds.append((0.0, None))
    cost = np.zeros(t_col + 1)
    cost[t_col] = 1.0
    res = solve_lp(cost, a_ub, b_ub, bounds)
    if not res.ok:
        return 0.0       # no bound: the single-job bound stands alone
    return float(res.x[t_col])


def job_capacity_rounds(jobs: Sequence[JobState], profiles: Mapping[str, JobProfile], need: Mapping[str, int], *,
                        types: np.ndarray, caps: np.ndarray, round_s: float) -> float:
    """``capacity_rounds`` for the jobs with ``need`` > 0, from their per-worker rates per
    type (``JobProfile.per_worker``); ``types``/``caps``: each row's type index and GPUs.

    Above POOL_ABOVE jobs, the jobs of one (job type, W) are pooled into one job of their
    summed work and summed W: a relaxation (any schedule of the jobs is one of the pool), so
    still a lower bound, and the LP has at most one row per class (2,000 jobs: ~100 rows).
    """
    active = [j for j in jobs if need.get(j.job_id, 0) > 0]
    if not active:
        return 0.0
    if len(active) > POOL_ABOVE:
        pools: dict[tuple[str, int], list[JobState]] = {}
        for j in active:
            pools.setdefault((j.job_type, j.workers), []).append(j)
        groups = list(pools.values())
    else:
        groups = [[j] for j in active]
    per_worker = np.array([profiles[g[0].job_id].per_worker for g in groups])
    remaining = np.array([sum(j.remaining for j in g) for g in groups])
    workers = np.array([sum(j.workers for j in g) for g in groups], dtype=float)
    with np.errstate(divide="ignore"):
        gpu_rounds = np.where(per_worker > 0, remaining[:, None] / (per_worker * round_s), np.inf)
    capacity = np.bincount(types, weights=caps, minlength=per_worker.shape[1])
    return capacity_rounds(gpu_rounds, workers, capacity)
