"""Gavel's allocation LPs, solved by HiGHS (``policies/lp/highs.py``).

Notation: m jobs, n GPU types. ``rates[j, t]`` is job j's whole-job steps/s on ``sf[j]``
GPUs of type t (0 where it cannot run there, including types with fewer than ``sf[j]``
GPUs); ``gpus[t]`` the number of GPUs of type t. An allocation ``X[j, t]`` is the fraction
of time job j should run on type t. Gavel's base constraints (``Policy.get_base_constraints``
in ``scheduler/policies/policy.py``)::

    X >= 0,   sum_t X[j, t] <= 1,   sum_j sf[j] * X[j, t] <= gpus[t]

and here also ``X[j, t] = 0`` where ``rates[j, t] = 0`` (Gavel leaves those free; they add
nothing to any objective but would make a job's priority on a type it cannot use > 0).

``max_min_fairness`` mirrors ``MaxMinFairnessPolicyWithPerf.get_allocation``
(``scheduler/policies/max_min_fairness.py``)::

    maximize  min_j  rates[j] . X[j] * sf[j] / (w[j] * iso[j])

where ``iso[j] = rates[j] . X_eq[j]`` is the job's throughput under an equal share of the
cluster. Gavel obtains ``X_eq`` from ``MaxMinFairnessPolicy`` (the same LP with every rate
set to 1). One optimal point of that LP gives each job ``min(sf[j], G / m)`` GPUs' worth of
time, G the total GPUs, but the LP only fixes the minimum (Gavel's ECOS returned e.g. 1.68
and 3.21 GPUs' worth for scale factors 2 and 4 on a 40-job mix). It has many optimal points;
we take the one that spreads the share over types in proportion to their GPU counts,
``X_eq[j, t] = min(1, G / (m sf[j])) gpus[t] / G``, so normalisation does not depend on
which vertex a solver returns. Deviation: Gavel's code also passes the priority weights to
that equal-share LP, so a weight w acts as w^2; we follow the paper (unweighted equal share,
weight applied once).

A min-max LP only fixes the minimum: which optimal point the solver returns decides what
non-bottleneck jobs get (Gavel's ECOS returns an interior point; HiGHS a vertex, which can
leave GPUs unallocated). We therefore solve a second LP on the optimal face: keep every
job's normalised throughput >= z* (1 - 1e-6) and maximise the sum of normalised throughputs.

``max_sum_throughput`` mirrors ``ThroughputSumWithPerf.get_allocation``
(``scheduler/policies/max_sum_throughput.py``; the ``max_sum_throughput_perf`` policy Sia's
simulator runs as its Gavel baseline)::

    maximize  sum_j rates[j] . X[j]

over the base constraints. Gavel's code computes a per-job normalisation ``1 / sum_t
rates[j, t]`` there but does not use it: the objective is the raw sum of whole-job steps/s, so
a job with short steps weighs more than one with long steps. We follow the code. The LP has
many optimal points when jobs tie; HiGHS returns a vertex (deterministic for equal input).

``min_total_duration`` mirrors ``MinTotalDurationPolicy.get_allocation``
(``scheduler/policies/min_total_duration.py``): binary search on the makespan T in
[100 s, 1e6 s] (stopping when max < 1.05 min, widening the range x10 while nothing is
feasible) with the feasibility LP ``rates[j] . X[j] >= remaining[j] / T`` plus the base
constraints and a zero objective; returns the allocation at the smallest feasible T found.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix, hstack, vstack

from services.scheduler.policies.lp.highs import solve as solve_lp
from shared.errors import HadarError

FACE_SLACK = 1e-6          # relative slack on z* when optimising on the max-min optimal face
MIN_T, MAX_T, T_RATIO = 100.0, 1e6, 1.05   # Gavel's binary-search constants (seconds)
MAX_T_LIMIT = 1e15         # give up widening past this makespan (seconds)


class AllocationError(HadarError):
    """The allocation LP has no solution for these jobs (a bug or an impossible input)."""


def _base_constraints(sf: np.ndarray, gpus: np.ndarray) -> tuple[csr_matrix, np.ndarray]:
    """Rows for sum_t X[j,t] <= 1 and sum_j sf[j] X[j,t] <= gpus[t], X flattened row-major."""
    m, n = len(sf), len(gpus)
    jobs = np.repeat(np.arange(m), n)
    types = np.tile(np.arange(n), m)
    cols = np.arange(m * n)
    per_job = coo_matrix((np.ones(m * n), (jobs, cols)), shape=(m, m * n))
    per_type = coo_matrix((np.repeat(sf.astype(float), n), (types, cols)), shape=(n, m * n))
    return vstack([per_job, per_type]).tocsr(), np.concatenate([np.ones(m), gpus.astype(float)])


def _bounds(rates: np.ndarray) -> list[tuple[float, float]]:
    return [(0.0, 1.0 if r > 0 else 0.0) for r in rates.ravel()]


def _per_job_rows(coef: np.ndarray) -> csr_matrix:
    """Row j holds coef[j, :] at job j's columns."""
    m, n = coef.shape
    return coo_matrix((coef.ravel(), (np.repeat(np.arange(m), n), np.arange(m * n))), shape=(m, m * n)).tocsr()


def equal_share_throughputs(rates: np.ndarray, sf: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """iso[j]: job j's throughput under an equal share of the cluster (see module docstring)."""
    m = len(sf)
    total = float(gpus.sum())
    time_share = np.minimum(1.0, total / (m * sf.astype(float)))
    x_eq = time_share[:, None] * (gpus[None, :] / total)
    iso: np.ndarray = (rates * x_eq).sum(axis=1)
    return iso


def max_min_fairness(rates: np.ndarray, sf: np.ndarray, weights: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """X for Gavel's max_min_fairness_perf. Every job must have some positive rate."""
    m, n = rates.shape
    if m == 0:
        return np.zeros((0, n))
    iso = equal_share_throughputs(rates, sf, gpus)
    if np.any(iso <= 0):
        raise AllocationError("every job needs a positive rate on some type")
    coef = rates * (sf / (weights * iso))[:, None]
    base, base_rhs = _base_constraints(sf, gpus)
    bounds = _bounds(rates)
    # Stage 1: variables [X, z]; maximise z subject to z <= coef[j] . X[j].
    fair = _per_job_rows(-coef)
    a_ub = vstack([hstack([fair, csr_matrix(np.ones((m, 1)))]),
                   hstack([base, csr_matrix((base.shape[0], 1))])]).tocsr()
    b_ub = np.concatenate([np.zeros(m), base_rhs])
    c = np.zeros(m * n + 1)
    c[-1] = -1.0
    res = solve_lp(c, a_ub, b_ub, bounds + [(0.0, None)])
    if not res.ok:
        raise AllocationError(f"max-min LP failed: {res.message}")
    z_star = float(res.x[-1])
    # Stage 2: on the optimal face, maximise the total normalised throughput.
    a_ub2 = vstack([fair, base]).tocsr()
    b_ub2 = np.concatenate([np.full(m, -z_star * (1 - FACE_SLACK)), base_rhs])
    res2 = solve_lp(-coef.ravel(), a_ub2, b_ub2, bounds)
    x = res2.x if res2.ok else res.x[:-1]
    allocation: np.ndarray = np.clip(x.reshape(m, n), 0.0, 1.0)
    return allocation


def max_sum_throughput(rates: np.ndarray, sf: np.ndarray, gpus: np.ndarray) -> np.ndarray:
    """X for Gavel's max_sum_throughput_perf: the most total steps/s the cluster can give.

    Identical jobs (equal rates and scale factor) get identical allocations: the LP is solved
    over classes of them, a class of k jobs having k times one job's time to spend
    (``sum_t Y[c, t] <= k``), and each member gets ``Y[c] / k``. This is an optimal point
    (averaging optimal points of a symmetric LP stays optimal), the one an interior-point
    solver such as Gavel's ECOS returns for a symmetric problem; a simplex vertex would
    instead pick arbitrary members to run full time and starve the rest.
    """
    m, n = rates.shape
    if m == 0:
        return np.zeros((0, n))
    classes: dict[tuple[float, tuple[float, ...]], list[int]] = {}
    for j in range(m):
        classes.setdefault((float(sf[j]), tuple(rates[j].tolist())), []).append(j)
    members = list(classes.values())
    c_rates = np.array([rates[group[0]] for group in members]).reshape(len(members), n)
    c_sf = np.array([sf[group[0]] for group in members], dtype=float)
    sizes = np.array([len(group) for group in members], dtype=float)
    base, base_rhs = _base_constraints(c_sf, gpus)
    base_rhs[:len(members)] = sizes
    bounds = [(0.0, size if r > 0 else 0.0) for size, row in zip(sizes, c_rates) for r in row]
    res = solve_lp(-c_rates.ravel(), base, base_rhs, bounds)
    if not res.ok:
        raise AllocationError(f"max-sum-throughput LP failed: {res.message}")
    y = res.x.reshape(len(members), n)
    allocation = np.zeros((m, n))
    for c, group in enumerate(members):
        allocation[group] = y[c] / sizes[c]
    clipped: np.ndarray = np.clip(allocation, 0.0, 1.0)
    return clipped


def _feasible_at(rates: np.ndarray, remaining: np.ndarray, makespan: float, base: csr_matrix,
                 base_rhs: np.ndarray, bounds: list[tuple[float, float]]) -> np.ndarray | None:
    m, n = rates.shape
    a_ub = vstack([_per_job_rows(-rates), base]).tocsr()
    b_ub = np.concatenate([-remaining / makespan, base_rhs])
    res = solve_lp(np.zeros(m * n), a_ub, b_ub, bounds)
    return res.x.reshape(m, n) if res.ok else None


def min_total_duration(rates: np.ndarray, sf: np.ndarray, remaining: np.ndarray,
                       gpus: np.ndarray) -> tuple[np.ndarray, float]:
    """(X, T) for Gavel's min_total_duration_perf: the smallest T found that every job can meet."""
    m, n = rates.shape
    if m == 0:
        return np.zeros((0, n)), 0.0
    if np.any(rates.max(axis=1) <= 0):
        raise AllocationError("every job needs a positive rate on some type")
    base, base_rhs = _base_constraints(sf, gpus)
    bounds = _bounds(rates)
    lo, hi, ceiling = MIN_T, MAX_T, MAX_T
    best: tuple[np.ndarray, float] | None = None
    while best is None:
        while T_RATIO * lo < hi:
            mid = (lo + hi) / 2.0
            x = _feasible_at(rates, remaining, mid, base, base_rhs, bounds)
            if x is not None:
                best, hi = (x, mid), mid
            else:
                lo = mid
        if best is None:
            if ceiling >= MAX_T_LIMIT:
                raise AllocationError("no makespan up to 1e15 s is feasible")
            lo, hi, ceiling = ceiling, ceiling * 10.0, ceiling * 10.0
    x, makespan = best
    return np.clip(x, 0.0, 1.0), makespan
