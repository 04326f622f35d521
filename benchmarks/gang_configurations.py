"""What running gangs whole costs over the fluid LPs: a configuration LP of whole gangs.

Hadar's planning LP (``policies/lp/model.makespan`` on ``hadar/timeline.gang_lp``) and the
no-fork bound (``sim/bounds.py``) are fluid: a gang may hold part of its W GPUs for part of
the time, and cuts keep gangs that cannot share a set of types apart. On Sia's streams, 4 to
16 GPUs wide on 64, that is loose. This measures by how much, at the scheduler's own rates.

With every job present at once (a workload's jobs all moved to its first arrival), a
*configuration* is a set of gangs, each on one of its placement options (``hadar/profile``:
a type on one node, or a spread over a set of types at its planned rate), that fits the
cluster's GPU counts: for every set S of types, the gangs whose options use only types in S
need at most the GPUs of S (Hall's condition, which is exact for types; nodes are left out).
The configuration LP shares time among configurations::

    minimize  sum_c t_c   s.t.  sum_c rate_j(c) t_c >= steps_j  (every job),  t >= 0

solved by column generation (HiGHS: the master by ``linprog``, the pricing -- the
configuration of most dual value -- as a MIP by ``milp``). Each iteration also gives
Farley's lower bound on the LP (master value / the best configuration's dual value), so an
unfinished run reports a range.

What it is and is not: whole gangs at each option's *planned* rate, which is a lower bound
for every placement of that option, and no node packing, no restarts, free preemption. So
it is neither a bound for the simulator (a placement may beat its planned rate) nor a
schedule (nodes may not hold it): it is the fluid LP's own rate model with gangs whole,
and the gap to Hadar's T* on the same rates is what wholeness alone costs.

    PYTHONPATH=. python benchmarks/gang_configurations.py [--workloads 1,2] [--apps imagenet]
        [--cluster sia-64] [--max-iterations 1000]

Last line: one JSON object {"rows": [...], "seconds"}.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from benchmarks.sia_philly import at_first_arrival, workload_path
from services.scheduler.core.policy import JobState
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies.hadar.ledger import RowLayout
from services.scheduler.policies.hadar.profile import ProfileBook
from services.scheduler.policies.hadar.timeline import gang_lp
from services.scheduler.policies.lp.model import makespan
from services.scheduler.sim.bounds import ttd_bounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.sia_table import build_sia_throughput
from services.scheduler.sim.traces import TraceJob, load_trace

TOL = 1e-6
GAP = 1e-4        # relative: converged within it (HiGHS's own MIP gap)
SMOOTHING = 0.8   # Wentges' alpha: the pricing duals' weight on those of the best bound so far


@dataclass(frozen=True, kw_only=True)
class GangOption:
    """One way to run a gang whole: the type indices it may use and its steps per second."""

    types: frozenset[int]
    rate: float


@dataclass(frozen=True, kw_only=True)
class ConfigurationLp:
    """``value``: the master's optimum at the last iteration (seconds); ``lower``: the best
    lower bound on the LP found (within GAP of ``value`` when ``converged``); ``columns``:
    configurations generated."""

    value: float
    lower: float
    iterations: int
    columns: int
    converged: bool


def fits(chosen: Sequence[tuple[int, frozenset[int]]], count: Sequence[float]) -> bool:
    """Whether gangs of (W, types) can all hold W GPUs at once: Hall's condition on every
    set of types."""
    n_types = len(count)
    for size in range(1, n_types + 1):
        for subset in itertools.combinations(range(n_types), size):
            inside = frozenset(subset)
            need = sum(width for width, types in chosen if types <= inside)
            if need > sum(count[r] for r in subset) + TOL:
                return False
    return True


@contextlib.contextmanager
def _stdout_muted() -> Iterator[None]:
    """File descriptor 1 to /dev/null: scipy's HiGHS prints a debug line to it from C++ on
    some MIPs (``HighsMipSolverData::transformNewIntegerFeasibleSolution``), a hundred per
    workload, through ``disp=False``."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def configuration_lp(widths: Sequence[int], options: Sequence[Sequence[GangOption]], steps: Sequence[float],
                     count: Sequence[float], *, max_iterations: int = 300, floor: float = 0.0,
                     smoothing: float = SMOOTHING) -> ConfigurationLp:
    """The module's LP for gangs of ``widths[j]`` GPUs with ``options[j]`` and ``steps[j]``
    of work on types of ``count[r]`` GPUs. Every job needs an option that fits alone.
    ``floor``: a known lower bound on the LP (a fluid relaxation's), kept in ``lower``.

    Prices at duals smoothed toward those of the best lower bound so far (Wentges): plain
    column generation tails off on 160 gangs (300 iterations left workload 1 between 34,379
    and 48,518 s). Any duals pi >= 0 give a lower bound, pi . steps / (the most any
    configuration earns at pi), read off the pricing MIP's dual bound so that its gap
    cannot overstate it."""
    n_jobs, n_types = len(widths), len(count)
    var = [(j, o) for j in range(n_jobs) for o in options[j] if o.rate > 0 and fits([(widths[j], o.types)], count)]
    if {j for j, _ in var} != set(range(n_jobs)):
        raise ValueError("a job has no option that fits the cluster")
    subsets = [frozenset(s) for k in range(1, n_types + 1) for s in itertools.combinations(range(n_types), k)]
    cap = np.array([[widths[j] if o.types <= s else 0 for j, o in var] for s in subsets], dtype=float)
    cap_rhs = np.array([sum(count[r] for r in s) for s in subsets], dtype=float)
    one = np.zeros((n_jobs, len(var)))
    for v, (j, _) in enumerate(var):
        one[j, v] = 1.0
    rate = np.array([o.rate for _, o in var])
    job_of = np.array([j for j, _ in var])
    rows = [LinearConstraint(cap, -np.inf, cap_rhs), LinearConstraint(one, -np.inf, 1.0)]

    def price(duals: np.ndarray) -> tuple[np.ndarray, float]:
        """(the configuration of most value at ``duals``, an upper bound on that value)."""
        with _stdout_muted():
            got = milp(-(duals[job_of] * rate), constraints=rows, integrality=np.ones(len(var)), bounds=Bounds(0, 1))
        if got.x is None:
            raise RuntimeError(f"pricing MIP: {got.message}")
        column = np.zeros(n_jobs)
        np.add.at(column, job_of[got.x > 0.5], rate[got.x > 0.5])
        return column, max(float(-got.mip_dual_bound), float(-got.fun))

    work = np.asarray(steps, dtype=float)
    columns = [np.eye(n_jobs)[j] * rate[job_of == j].max() for j in range(n_jobs)]
    lower, centre = floor, None
    value = float("inf")
    for iteration in range(1, max_iterations + 1):
        a = np.array(columns).T
        master = linprog(np.ones(a.shape[1]), A_ub=-a, b_ub=-work, bounds=(0, None), method="highs")
        if master.status != 0:
            raise RuntimeError(f"master LP: {master.message}")
        value = float(master.fun)
        duals = -master.ineqlin.marginals
        for at in ([smoothing * centre + (1 - smoothing) * duals] if centre is not None else []) + [duals]:
            column, most = price(at)
            if most > 0 and float(at @ work) / most > lower:
                lower, centre = float(at @ work) / most, at
            if float(duals @ column) > 1.0 + GAP:     # improves the master: add it
                columns.append(column)
                break
        if value <= lower * (1.0 + GAP):
            return ConfigurationLp(value=value, lower=min(lower, value), iterations=iteration, columns=len(columns),
                                   converged=True)
    return ConfigurationLp(value=value, lower=min(lower, value), iterations=max_iterations, columns=len(columns),
                           converged=False)


def _states(jobs: Sequence[TraceJob]) -> list[JobState]:
    return [JobState(job_id=j.job_id, job_type=j.job_type, workers=j.workers, total_steps=j.total_steps)
            for j in jobs]


@dataclass(frozen=True, kw_only=True)
class Row:
    """One workload's figures, in seconds from the first arrival."""

    workload: int
    jobs: int
    configuration: ConfigurationLp
    fluid_t_star_s: float
    nofork_bound_s: float

    def line(self) -> str:
        c = self.configuration
        state = "converged" if c.converged else "not converged"
        return (f"workload {self.workload}: {self.jobs} jobs, whole gangs {c.lower:,.0f}-{c.value:,.0f} s "
                f"({state}, {c.iterations} iterations); x{c.lower / self.fluid_t_star_s:.3f}-"
                f"{c.value / self.fluid_t_star_s:.3f} Hadar's fluid T* ({self.fluid_t_star_s:,.0f} s), "
                f"x{c.lower / self.nofork_bound_s:.3f}-{c.value / self.nofork_bound_s:.3f} the no-fork bound "
                f"({self.nofork_bound_s:,.0f} s)")


def measure(workload: int, jobs: Sequence[TraceJob], cluster_name: str, throughput: ThroughputModel, *,
            max_iterations: int) -> Row:
    """The configuration LP, Hadar's fluid T* and the no-fork bound on ``jobs`` (all present
    at once)."""
    cluster = parse_cluster(cluster_name)
    layout = RowLayout.of(cluster)
    book = ProfileBook(throughput, types=layout.types, row_type=layout.row_type, row_cap=layout.row_cap)
    count = np.bincount(layout.row_type, weights=layout.row_cap, minlength=len(layout.types))
    states = _states(jobs)
    profiles = {s.job_id: book.get(s.job_type, s.workers) for s in states}
    options = [[GangOption(types=frozenset(np.flatnonzero(o.eligible).tolist()), rate=float(o.rate))
                for o in profiles[s.job_id].options] for s in states]
    fluid = makespan(gang_lp(states, profiles, count))
    if fluid is None:
        raise RuntimeError(f"workload {workload}: Hadar's makespan LP has no solution")
    # whole gangs meet every row of the fluid LP (type counts and gang cuts, both valid for
    # them; it has no node rows) at the same rates, so its T* is a floor
    got = configuration_lp([s.workers for s in states], options, [s.total_steps for s in states], count.tolist(),
                           max_iterations=max_iterations, floor=fluid)
    bound = ttd_bounds(tuple(jobs), cluster, throughput).ttd_nofork_s
    if bound is None:
        raise RuntimeError(f"workload {workload}: no no-fork bound (a job no gang can run)")
    return Row(workload=workload, jobs=len(jobs), configuration=got, fluid_t_star_s=fluid, nofork_bound_s=bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="1,2")
    parser.add_argument("--apps", default="", help="comma-separated applications to keep (default: all)")
    parser.add_argument("--cluster", default="sia-64")
    parser.add_argument("--max-iterations", type=int, default=1000)
    args = parser.parse_args()
    apps = {a.strip() for a in args.apps.split(",") if a.strip()}
    started = time.perf_counter()
    rows = []
    throughput = build_sia_throughput()
    for w in (int(x) for x in args.workloads.split(",")):
        jobs = at_first_arrival(load_trace(workload_path(w), throughput=throughput))
        if apps:
            jobs = tuple(j for j in jobs if j.job_type.split()[0] in apps)
        row = measure(w, jobs, args.cluster, throughput, max_iterations=args.max_iterations)
        rows.append(row)
        print(row.line(), flush=True)
    print(json.dumps({"benchmark": "gang_configurations", "cluster": args.cluster,
                      "rows": [asdict(r) for r in rows], "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
