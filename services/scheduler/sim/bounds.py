"""Lower bounds on the time to drain a trace (TTD) that no policy can beat in the simulator.

TTD is measured as in ``metrics.py``: from the first arrival ``a_0`` to the last
completion. Two bounds: the *fork* bound holds for every plan that passes ``check_plan``
(copies of a job on distinct nodes, each of at most W workers); the *no-fork* bound for
runs in which every placed job runs as one copy of exactly its W workers (a gang, as
Hadar and the baselines place them). The simulator says which runs were gang-only;
HadarE (``FORKING_POLICIES``) and any run that was not are held to the fork bound.

Notation, for a trace on a cluster:

* job j: arrival ``a_j`` (``s_j = a_j - a_0``), W_j workers, work ``w_j`` = ``total_steps``
  job steps (``shared.domain.progress``), job type ``t_j``; GPU type r: ``n_r`` GPUs; ``N`` GPUs
  in all; ``rate(t, r, n)`` a copy's own steps/s (``throughput.py``). Copy sizes a job may
  have: ``K_j = {1..min(W_j, N)}`` (fork) or ``{W_j}`` if ``W_j <= N`` (gang; else none).
* A copy of n workers steps at ``min over its types of rate(t_j, r, n)``, times the
  cross-node factor if it spans nodes, and is credited ``n / W_j`` of that per step. The
  factor is the minimum over the copy's types that the table has both entries for at n
  of ``min(1, unconsolidated / consolidated)``, or ``default_cross_node`` if it has none;
  so it is at most ``f(r, n)`` for each of its types r: r's own table ratio, else the
  largest of ``default_cross_node`` and the other cluster types' ratios at n; 1 with
  ``cross_node=False``. A copy with a GPU of type r thus runs at most at
  ``q(r, n) = rate(t_j, r, n) * (1 if a node holding r has >= n GPUs, else f(r, n))``. A model
  whose spanning rates come from measured shapes (Sia's table) states its own bound instead of
  ``rate * f`` (``ThroughputModel.spanning_bound``): then ``q`` is the larger of the one-node
  rate (where a node holds n) and that bound.
* Per-GPU rate ``rho[j,r] = max_{n in K_j} q(r, n) / W_j``: a copy of n is credited at
  most that per GPU of type r it holds, so the job steps a job is credited are at most
  ``sum_r rho[j,r] * (GPU-seconds of r it held)``; restarts, consolidation and rounds only
  take time away. Taking the best n matters: per GPU, a gang may step faster than a single
  worker or (across nodes) much slower.
* Best single copy ``R1_j = max_{n in K_j} max(M1_j(n), MS_j(n)) * n / W_j``: ``M1`` the best
  copy on one node (largest ``min_{r in S} rate(t_j, r, n)`` over sets S of the node's
  types holding n of its GPUs: the prefix of its types sorted by rate that first holds n),
  ``MS`` the same over the whole cluster with ``rate * f`` in place of ``rate`` (a spanning
  copy: ``min rate * min f <= min (rate * f)``).
* Best forked job ``RF_j = sum over nodes of the node's best part of one copy``: copies
  of one job are on distinct nodes (a spanning copy counts on each), so a node gives a job
  one copy's part, at most the larger of ``max_{k <= min(W_j, node size)} k / W_j x`` the
  node's best slowest-of-k rate at k, and ``min(W_j, node size)`` GPUs each credited the
  spanning bound of its type / W_j (``best_fork_rate``).
* GPUs of type r a job may hold at once: ``c1[j,r] = min(W_j, n_r)`` (one copy), or
  ``cF[j,r] = sum over nodes of min(W_j, GPUs of type r on the node)`` (forked); in all:
  ``G1_j = W_j`` or ``GF_j = sum over nodes of min(W_j, node size)``.

The bound is the optimum T of the LP over GPU-seconds ``X[j,r] >= 0`` (solved as the
share ``y[j,r] = X[j,r] * rho[j,r] / w_j`` of job j's work done on type r; per level and
type for a gang in the no-fork bound, below)::

    minimize T  subject to
      sum_r rho[j,r] X[j,r] >= w_j                         every job (its work)
      sum_{j: s_j >= s} X[j,r] <= n_r (T - s)              every arrival offset s, type r
      X[j,r] <= c[j,r] (T - s_j),  sum_r X[j,r] <= G_j (T - s_j)   every job
      T >= s_j + w_j / R_j                                 every job

with (K, c, G, R) = (gang, c1, G1, R1) for the no-fork bound and (fork, cF, GF, RF) for the
fork bound. In the no-fork bound a gang's GPU-seconds are split further by
*level* (``bound_gangs``): a GPU of type r in a gang whose slowest type is k earns
``rho[j,k]``, and rows keep gangs too wide to share a set of types from overlapping on it
(two 10-GPU gangs on 16 A100s take turns there); those rows, like the caps, are added only
where the solution breaks them. In the fork bound the columns are per node class instead
(``bound_forks``): node-seconds of one copy's part of k GPUs, credited at most that copy's
rate x k / W_j, with a cap per (job, node class) of the class's nodes in place of
``X[j,r] <= cF[j,r] (T - s_j)``; a node holds one copy of a job, so it is not credited as
several lone workers at once. Every schedule of the kind a bound covers gives a feasible point (X =
GPU-seconds each job held while active, T = its TTD): jobs arriving at s or later only run
in [a_0 + s, a_0 + T], and a job never holds more GPUs, nor trains faster, than the caps
say. A job that no copy can move (R_j = 0) makes the bound ``None``: no finite TTD exists.
An empty trace has bound 0.

*First starts* (``first_start_s``, what the simulator's charges take from every copy at its
first placement: ``SimOptions.first_start_s``). A job's first copy loses ``d_j`` seconds on the
GPUs it holds before it trains, and nothing makes that start cheaper, so the bound charges
each job once: its work is done in ``[a_0 + s_j + d_j, a_0 + T]`` (``s_j + d_j`` replaces
``s_j`` in its rows above), and ``E[j,r] >= 0`` GPU-seconds of type r with ``sum_r E[j,r] >=
g_j d_j`` (``g_j`` = W_j for a gang, 1 for the fork bound, whose least copy is one GPU) join
the capacity rows of every offset ``s <= s_j``. Restarts after the first, waits for a round
boundary, consolidation and upload are not charged: a policy may avoid them.

*Whole rounds* (``round_s``, no-fork only): a gang holds its GPUs until the round ends, so
each job holds at least its rounds' worth (``bound_rounds``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies.lp.highs import solve as solve_lp
from services.scheduler.sim import bound_gangs, bound_rounds
from services.scheduler.sim.bound_forks import best_slowest, node_classes, node_columns
from services.scheduler.sim.traces import TraceJob

FORKING_POLICIES = frozenset({"hadare"})


@dataclass(frozen=True, kw_only=True)
class TtdBounds:
    ttd_fork_s: float | None      # valid for every plan that passes check_plan
    ttd_nofork_s: float | None    # valid for runs where every job runs as one W-worker copy


def _sizes(workers: int, cluster: Cluster, *, gang: bool) -> range:
    if gang:
        return range(workers, workers + 1) if workers <= cluster.total_gpus else range(0)
    return range(1, min(workers, cluster.total_gpus) + 1)


def _ratio(job_type: str, gpu_type: str, n: int, throughput: ThroughputModel) -> float | None:
    cons = throughput.rates.get((job_type, gpu_type, n))
    unc = throughput.unconsolidated.get((job_type, gpu_type, n))
    return min(1.0, unc / cons) if cons and unc is not None else None


def span_factor(job_type: str, gpu_type: str, n: int, cluster: Cluster, throughput: ThroughputModel) -> float:
    """``f``: the most a copy of n workers spanning nodes with a ``gpu_type`` GPU keeps of its rate."""
    if not throughput.cross_node:
        return 1.0
    own = _ratio(job_type, gpu_type, n, throughput)
    if own is not None:
        return own
    others = [x for t in cluster.types if (x := _ratio(job_type, t, n, throughput)) is not None]
    return max([throughput.default_cross_node, *others])


def per_gpu_rate(job_type: str, workers: int, gpu_type: str, cluster: Cluster, throughput: ThroughputModel, *,
                 gang: bool = False) -> float:
    """``rho``: the most job steps/s one GPU of ``gpu_type`` can be credited (module docstring)."""
    biggest = max((node.size for node in cluster.nodes if gpu_type in node.gpus), default=0)
    best = 0.0
    for n in _sizes(workers, cluster, gang=gang):
        if n <= biggest:
            best = max(best, throughput.rate(job_type, gpu_type, n))
        best = max(best, _spanning(job_type, gpu_type, n, cluster, throughput))
    return best / workers


def _spanning(job_type: str, gpu_type: str, n: int, cluster: Cluster, throughput: ThroughputModel) -> float:
    """The most a copy of n workers spanning nodes with a ``gpu_type`` GPU steps per second."""
    if len(cluster.nodes) < 2:
        return 0.0
    bound = throughput.spanning_bound(job_type, gpu_type, n)
    if bound is not None:
        return bound
    return throughput.rate(job_type, gpu_type, n) * span_factor(job_type, gpu_type, n, cluster, throughput)


def best_copy_rate(job_type: str, workers: int, cluster: Cluster, throughput: ThroughputModel, *,
                   gang: bool = False) -> float:
    """``R1``: the most job steps/s one copy can be credited (of exactly W workers if ``gang``)."""
    best = 0.0
    for n in _sizes(workers, cluster, gang=gang):
        one_node = max((best_slowest([(throughput.rate(job_type, t, n), len(node.indices_of(t)))
                                      for t in node.types], n)
                        for node in cluster.nodes if node.size >= n), default=0.0)
        spanning = 0.0
        if len(cluster.nodes) > 1:
            spanning = best_slowest([(_spanning(job_type, t, n, cluster, throughput), c)
                                  for t, c in cluster.gpus_by_type.items()], n)
        best = max(best, max(one_node, spanning) * n / workers)
    return best


def best_fork_rate(job_type: str, workers: int, cluster: Cluster, throughput: ThroughputModel) -> float:
    """``RF``: the most job steps/s a job's copies together can be credited. A job's copies
    are on distinct nodes (a spanning copy counts on each), so a node gives it at most one
    copy's part, its best ``bound_forks`` column. (Crediting each GPU of a node its type's
    best per-GPU rate, as ``rho`` does, counted a 4-GPU node four single-GPU copies:
    Transformer (batch size 32), W = 8, on six 4-GPU nodes, 22.0 steps/s where one copy per
    node reaches 12.2.)"""
    classes = node_classes(cluster)
    best = [0.0] * len(classes)
    for column in node_columns(job_type, workers, classes, throughput, _spans(job_type, workers, cluster, throughput)):
        best[column.node_class] = max(best[column.node_class], column.credit)
    return sum(c.nodes * b for c, b in zip(classes, best, strict=True))


def _spans(job_type: str, workers: int, cluster: Cluster, throughput: ThroughputModel) -> dict[str, float]:
    """Per type t, the most steps/s a copy of the job spanning nodes with a GPU of t reaches."""
    top = min(workers, cluster.total_gpus)
    return {t: max((_spanning(job_type, t, n, cluster, throughput) for n in range(2, top + 1)), default=0.0)
            for t in cluster.types}


def _total_cap(workers: int, cluster: Cluster, *, fork: bool) -> int:
    """``G``: the GPUs a job of W workers may hold at once (its caps per slot: ``_columns``)."""
    return sum(min(workers, node.size) for node in cluster.nodes) if fork else workers


def _best_rates(jobs: Sequence[TraceJob], cluster: Cluster, throughput: ThroughputModel, *,
                fork: bool) -> np.ndarray:
    """The best rate R_j (RF or R1) per job; computed once per (job type, W)."""
    memo = {key: best_fork_rate(*key, cluster, throughput) if fork
            else best_copy_rate(*key, cluster, throughput, gang=True)
            for key in {(j.job_type, j.workers) for j in jobs}}
    return np.array([memo[(j.job_type, j.workers)] for j in jobs], dtype=float)


def ttd_lower_bound(jobs: Sequence[TraceJob], cluster: Cluster, throughput: ThroughputModel, *,
                    fork: bool, first_start_s: Callable[[str], float] | None = None,
                    round_s: float | None = None) -> float | None:
    """The LP bound of the module docstring, seconds from the first arrival (None: unbounded);
    ``first_start_s``: seconds a job of a type loses at its first placement (None: nothing);
    ``round_s``: the run's round length, for the no-fork bound's whole rounds (None: not charged).

    The capacity rows ``sum_{j: s_j >= s} X[j,r] <= n_r (T - s)`` are written with a
    cumulative variable per (distinct arrival offset s_k, type r), ``C[k,r] >= C[k+1,r] +
    sum_{j: s_j = s_k} X[j,r]`` and ``C[k,r] <= n_r (T - s_k)``: the same feasible (X, T), in
    O(jobs x types) nonzeros instead of O(jobs^2 x types), so a trace of 80,000 jobs fits.

    The per-job caps (``X[j,r] <= c[j,r] (T - s_j)``, ``sum_r X[j,r] <= G_j (T - s_j)``) are
    added as cuts: the LP is solved without them, every cap the solution breaks is added, and
    it is solved again until none is broken. The result is the full LP's optimum (a point
    optimal for fewer rows and feasible for all of them is optimal for all), where few caps
    ever bind: the fork bound of the whole Philly trace holds 4 x 82,248 cap rows, and the
    LP with all of them did not finish in 15 min.
    """
    if not jobs:
        return 0.0
    types = cluster.types
    n_types = len(types)
    a0 = min(j.arrival_s for j in jobs)
    arrived = np.array([j.arrival_s - a0 for j in jobs])
    start = np.array([first_start_s(j.job_type) if first_start_s is not None else 0.0 for j in jobs])
    if (start < 0).any():
        raise ValueError("first_start_s must be >= 0")
    offsets = arrived + start                # a job trains from its first start's end
    work = np.array([float(j.total_steps) for j in jobs])
    best = _best_rates(jobs, cluster, throughput, fork=fork)
    if (best <= 0).any():
        return None
    n_jobs = len(jobs)
    widths = np.array([j.workers for j in jobs])
    starts = bool(start.any())
    levels, inverse = np.unique(np.concatenate([offsets, arrived]) if starts else offsets, return_inverse=True)
    group, start_group = inverse[:n_jobs], inverse[n_jobs:]
    n_levels = len(levels)
    columns, slot_cap = _columns(jobs, cluster, throughput, fork=fork)
    col_job, col_type = columns.job, columns.gpu_type
    n_x = col_job.size
    t_col = n_x                              # y[c] (share of its job's work), then T
    c_base = t_col + 1                       # C[k, r] at c_base + k * n_types + r
    e_base = c_base + n_levels * n_types     # E[k, r]: first starts of the jobs arriving at level k, if any
    z_base = e_base + (n_levels * n_types if starts else 0)   # Z[i]: GPU-seconds past T, i-th whole-rounds row
    coef = work[col_job] / columns.rate      # units (GPU- or node-seconds) all of its job's work takes there
    gpu_coef = coef * columns.gpus           # and GPU-seconds of its type
    chosen, least = (bound_rounds.held_at_least(work / best, start, widths, gpu_coef, col_job, round_s)
                     if round_s and not fork else (np.zeros(0, dtype=int), np.zeros(0)))
    n_base = z_base + chosen.size            # then D[k] of each (type set, width) row in force
    counts = np.array([cluster.gpus_by_type[t] for t in types], dtype=float)
    by_workers = {j.workers: _total_cap(j.workers, cluster, fork=fork) for j in jobs}
    total = np.array([by_workers[job.workers] for job in jobs], dtype=float)

    fixed = _Rows()
    # work: -sum_c y[c] <= -1
    fixed.add(col_job, np.arange(n_x), -np.ones(n_x), -np.ones(n_jobs))
    # cumulative: seconds y (group k, type r) [+ E[k,r]] + C[k+1,r] - C[k,r] <= 0, one row per (k, r)
    kr = np.arange(n_levels * n_types)
    k_of, r_of = kr // n_types, kr % n_types
    nxt = k_of + 1 < n_levels
    rows = [group[col_job] * n_types + col_type, kr, kr[nxt]]
    cols = [np.arange(n_x), c_base + kr, c_base + kr[nxt] + n_types]
    vals = [gpu_coef, -np.ones(len(kr)), np.ones(int(nxt.sum()))]
    if starts:
        rows, cols, vals = rows + [kr], cols + [e_base + kr], vals + [np.ones(len(kr))]
    fixed.add(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), np.zeros(len(kr)))
    # capacity: C[k,r] - n_r T <= -n_r s_k
    fixed.add(np.concatenate([kr, kr]), np.concatenate([c_base + kr, np.full(len(kr), t_col)]),
              np.concatenate([np.ones(len(kr)), -counts[r_of]]), -counts[r_of] * levels[k_of])
    if starts:
        # first starts: -sum_r E[k,r] <= -(GPU-seconds the first starts of the jobs arriving at level k hold)
        held = np.bincount(start_group, weights=start * (1.0 if fork else widths), minlength=n_levels)
        fixed.add(k_of, e_base + kr, -np.ones(len(kr)), -held)
    upper = np.full(n_base, np.inf)          # Z[i] <= W round_s; the rest unbounded above
    if chosen.size and round_s:
        fixed.add(*bound_rounds.rows(chosen, least, n_jobs=n_jobs, col_job=col_job, gpu_coef=gpu_coef,
                                     z_base=z_base, gpus=float(counts.sum()), round_s=round_s))
        upper[z_base + np.arange(chosen.size)] = widths[chosen] * round_s

    n_slots = slot_cap.shape[1]
    pairs, pair_of = np.unique(col_job * n_slots + columns.slot, return_inverse=True)
    pair_job, pair_cap = pairs // n_slots, slot_cap[pairs // n_slots, pairs % n_slots]
    pair_in = np.zeros(len(pairs), dtype=bool)
    job_in = np.zeros(n_jobs, dtype=bool)
    sets = [] if fork else bound_gangs.candidates(col_job, columns.mask, widths, counts, widths >= 2)
    set_in = np.zeros(len(sets), dtype=bool)
    while True:
        cuts = _Rows(fixed)
        # per job and slot (type, or node class): its columns' units there - cap T <= -cap s_j
        chosen = np.flatnonzero(pair_in)
        members = np.flatnonzero(pair_in[pair_of])
        cuts.add(np.concatenate([np.searchsorted(chosen, pair_of[members]), np.arange(len(chosen))]),
                 np.concatenate([members, np.full(len(chosen), t_col)]),
                 np.concatenate([coef[members], -pair_cap[chosen]]), -pair_cap[chosen] * offsets[pair_job[chosen]])
        # per job: GPU-seconds of all its columns - G_j T <= -G_j s_j
        chosen = np.flatnonzero(job_in)
        members = np.flatnonzero(job_in[col_job])
        cuts.add(np.concatenate([np.searchsorted(chosen, col_job[members]), np.arange(len(chosen))]),
                 np.concatenate([members, np.full(len(chosen), t_col)]),
                 np.concatenate([gpu_coef[members], -total[chosen]]), -total[chosen] * offsets[chosen])
        # per (type set, width) in force, bound_gangs: D[k] >= D[k+1] + gang time of group k there,
        # D[k] <= fit (T - s_k)
        for b, row in enumerate(sets[i] for i in np.flatnonzero(set_in)):
            d = n_base + b * n_levels + np.arange(n_levels)
            inside = np.flatnonzero(row.weight > 0)
            cuts.add(np.concatenate([group[col_job[inside]], np.arange(n_levels), np.arange(n_levels - 1)]),
                     np.concatenate([inside, d, d[1:]]),
                     np.concatenate([coef[inside] * row.weight[inside], -np.ones(n_levels), np.ones(n_levels - 1)]),
                     np.zeros(n_levels))
            cuts.add(np.concatenate([np.arange(n_levels)] * 2), np.concatenate([d, np.full(n_levels, t_col)]),
                     np.concatenate([np.ones(n_levels), np.full(n_levels, -float(row.fit))]), -row.fit * levels)
        n_cols = n_base + n_levels * int(set_in.sum())
        lower = np.zeros(n_cols)
        lower[t_col] = float(np.max(offsets + work / best))
        cost = np.zeros(n_cols)
        cost[t_col] = 1.0
        res = solve_lp(cost, cuts.matrix(n_cols), cuts.bounds(),
                       np.column_stack([lower, np.concatenate([upper, np.full(n_cols - n_base, np.inf)])]))
        if not res.ok:
            raise RuntimeError(f"TTD bound LP failed: {res.message}")
        t_end = float(res.x[t_col])
        units = coef * res.x[:n_x]
        seconds = units * columns.gpus                                  # X[c], GPU-seconds
        room = t_end - offsets
        held = np.bincount(pair_of, weights=units, minlength=len(pairs))
        new_pairs = (held - pair_cap * room[pair_job] > _SLACK * (1 + pair_cap * t_end)) & ~pair_in
        held = np.bincount(col_job, weights=seconds, minlength=n_jobs)
        new_jobs = (held - total * room > _SLACK * (1 + total * t_end)) & ~job_in
        new_sets = np.array([not set_in[i] and bound_gangs.violated(row, seconds, group[col_job], levels, t_end,
                                                                    _SLACK)
                             for i, row in enumerate(sets)], dtype=bool)
        if not new_pairs.any() and not new_jobs.any() and not new_sets.any():
            return t_end
        pair_in |= new_pairs
        job_in |= new_jobs
        set_in |= new_sets


@dataclass(frozen=True, kw_only=True)
class _Columns:
    """The LP's columns, one entry per column."""

    job: np.ndarray         # its job's index
    gpu_type: np.ndarray    # its GPU type's index
    rate: np.ndarray        # job steps credited per unit: a GPU-second, or a node-second (fork)
    gpus: np.ndarray        # GPUs of its type per unit
    slot: np.ndarray        # its cap within its job: a type (no-fork), or a node class (fork)
    mask: np.ndarray        # bit mask of its type set (``bound_gangs``)


def _columns(jobs: Sequence[TraceJob], cluster: Cluster, throughput: ThroughputModel, *,
             fork: bool) -> tuple[_Columns, np.ndarray]:
    """(the columns, each job's cap per slot: ``[j, slot]``): per usable type, or per level
    for a gang (``bound_gangs``), in GPU-seconds for the no-fork bound; per node class, copy
    size and type, in node-seconds, for the fork bound (``bound_forks``). Built once per
    (job type, W)."""
    types = cluster.types
    index = {t: r for r, t in enumerate(types)}
    classes = node_classes(cluster)
    by_key: dict[tuple[str, int], list[int]] = {}
    for i, job in enumerate(jobs):
        by_key.setdefault((job.job_type, job.workers), []).append(i)
    parts: list[list[np.ndarray]] = []
    caps = np.zeros((len(jobs), len(classes) if fork else len(types)))
    for (job_type, workers), members in by_key.items():
        template: list[tuple[int, float, int, int, int]]   # (type, rate, GPUs, slot, mask)
        if fork:
            template = [(index[c.gpu_type], c.credit, c.gpus, c.node_class, 1 << index[c.gpu_type])
                        for c in node_columns(job_type, workers, classes, throughput,
                                              _spans(job_type, workers, cluster, throughput))]
            caps[members] = [c.nodes for c in classes]
        else:
            rho = np.array([per_gpu_rate(job_type, workers, t, cluster, throughput, gang=True) for t in types])
            template = [(r, rate, 1, r, mask) for r, rate, mask in bound_gangs.level_columns(rho, gang=workers >= 2)]
            caps[members] = [min(workers, cluster.gpus_by_type[t]) for t in types]
        idx = np.array(members)
        parts.append([np.repeat(idx, len(template)), *(np.tile([t[k] for t in template], len(idx)) for k in range(5))])
    joined = [np.concatenate([p[k] for p in parts]) for k in range(6)]
    return _Columns(job=joined[0].astype(int), gpu_type=joined[1].astype(int), rate=joined[2].astype(float),
                    gpus=joined[3].astype(float), slot=joined[4].astype(int), mask=joined[5].astype(np.int64)), caps


_SLACK = 1e-7   # relative excess over a cap that counts as breaking it (HiGHS's own tolerance)


class _Rows:
    """Rows of ``A_ub x <= b_ub`` in COO blocks; a copy starts with another's rows."""

    def __init__(self, base: _Rows | None = None) -> None:
        self.blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = list(base.blocks) if base else []
        self.rhs: list[np.ndarray] = list(base.rhs) if base else []
        self.count: int = base.count if base else 0

    def add(self, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, bound: np.ndarray) -> None:
        self.blocks.append((rows + self.count, cols, vals))
        self.rhs.append(bound)
        self.count += len(bound)

    def matrix(self, n_cols: int) -> csr_matrix:
        rows, cols, vals = (np.concatenate([b[i] for b in self.blocks]) for i in range(3))
        return coo_matrix((vals, (rows, cols)), shape=(self.count, n_cols)).tocsr()

    def bounds(self) -> np.ndarray:
        return np.concatenate(self.rhs)


def ttd_bounds(jobs: Sequence[TraceJob], cluster: Cluster, throughput: ThroughputModel, *,
               first_start_s: Callable[[str], float] | None = None, round_s: float | None = None) -> TtdBounds:
    """Both bounds; ``first_start_s``: the run's ``SimOptions.first_start_s`` (None: no charge);
    ``round_s``: its round length (None: whole rounds not charged)."""
    return TtdBounds(ttd_fork_s=ttd_lower_bound(jobs, cluster, throughput, fork=True, first_start_s=first_start_s),
                     ttd_nofork_s=ttd_lower_bound(jobs, cluster, throughput, fork=False,
                                                  first_start_s=first_start_s, round_s=round_s))


def bound_for(policy: str, bounds: TtdBounds, *, gangs_only: bool) -> tuple[str, float | None]:
    """("fork" | "nofork", the bound) that applies to ``policy``'s run; ``gangs_only``: every
    job it placed ran as one copy of exactly W workers (``SimResult.gangs_only``)."""
    if gangs_only and policy not in FORKING_POLICIES:
        return "nofork", bounds.ttd_nofork_s
    return "fork", bounds.ttd_fork_s
