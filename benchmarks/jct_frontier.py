"""How much mean JCT a schedule can keep at a given makespan: the trade-off behind issue #11's targets.

The targets ask Hadar for TTD >= 1.17x and mean JCT >= 1.15x Gavel's on the same traces.
TTD is bounded (``services/scheduler/sim/bounds.py``); this measures what mean JCT costs as
the makespan approaches that bound, independently of any of our policies.

For one trace (single-GPU jobs, all at t=0: the target cells) and a makespan cap
``f x`` the no-fork bound, it finds the least sum of completion times over *non-preemptive
single-GPU schedules*: each job runs alone on one GPU from its start to its end, taking
``p_ij = ceil(steps_j / (rate_j on GPU i x round_s))`` rounds (a GPU is freed at a round
end, as in the simulator); restart costs are ignored. On one GPU the jobs run shortest
first, so job j in the k-th position from the last on GPU i adds k x p_ij to the sum
(Bruno, Coffman and Sethi's assignment for unrelated machines). The cap makes it a MIP
(HiGHS via scipy):

    min  sum_{j,i,k} k p_ij x_jik
    s.t. sum_{i,k} x_jik = 1 (each job once),  sum_j x_jik <= 1 (each GPU position once),
         sum_{j,k} p_ij x_jik <= floor(f x bound / round_s)   (every GPU ends by the cap),
         x binary.

``f = inf`` is the plain assignment problem (no cap). Reported per (cluster, f), over the
seeds: gavel's mean JCT / the optimum's (``jct_x``), gavel's TTD / the optimum's makespan
(``ttd_x``), and the seeds where no such schedule fits the cap.

What it is and is not: the exact optimum of that schedule family, so a policy of the
family cannot do better; it is *not* a bound for policies that preempt or move a job
between GPU types (Hadar does both, and the no-fork LP bound allows both: at f = 1.05
some traces have no non-preemptive schedule although Hadar ends within 5% of the bound).
It shows the trade-off's shape: how much of the mean JCT a makespan near the bound
leaves.

    python benchmarks/jct_frontier.py --clusters aws-5,lab-5 --seeds 1-5 --factors 1.05,1.10,1.15,1.20,inf

Last line: one JSON object {"cells": [...], "runs": [...], "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linear_sum_assignment, milp
from scipy.sparse import coo_matrix

from services.scheduler.policies import make_policy
from services.scheduler.sim.bounds import ttd_bounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.results import compute_results
from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
from services.scheduler.sim.traces import load_trace

NEVER = 10**9   # rounds of a job on a GPU that cannot run it


def processing_rounds(jobs, gpu_types: list[str], throughput, round_s: float) -> np.ndarray:
    """p[j, i]: whole rounds job j takes alone on GPU i (NEVER where its rate is 0)."""
    p = np.full((len(jobs), len(gpu_types)), NEVER, dtype=np.int64)
    for j, job in enumerate(jobs):
        for i, t in enumerate(gpu_types):
            rate = throughput.rate(job.job_type, t, 1)
            if rate > 0:
                p[j, i] = max(1, math.ceil(job.total_steps / (rate * round_s) - 1e-9))
    return p


def least_completion(p: np.ndarray, cap: int | None, *, time_limit: float) -> dict | None:
    """{"sum": least sum of completions (rounds), "makespan", "optimal"}; None: nothing fits ``cap``."""
    n, m = p.shape
    if cap is None:
        k = np.arange(1, n + 1)
        cost = (p[:, :, None] * k[None, None, :]).reshape(n, m * n).astype(float)
        rows, cols = linear_sum_assignment(cost)
        loads = np.bincount(cols // n, weights=p[rows, cols // n], minlength=m)
        return {"sum": float(cost[rows, cols].sum()), "makespan": float(loads.max()), "optimal": True}
    jj, ii, kk = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(m), np.arange(n), indexing="ij"))
    var = np.arange(jj.size)
    pij = p[jj, ii].astype(float)
    usable = pij <= cap
    cost = np.where(usable, (kk + 1) * pij, 0.0)
    rows = np.concatenate([jj, n + ii * n + kk, n + m * n + ii])
    cols = np.concatenate([var, var, var])
    vals = np.concatenate([np.ones(var.size), np.ones(var.size), pij])
    a = coo_matrix((vals, (rows, cols)), shape=(n + m * n + m, var.size)).tocsr()
    lo = np.concatenate([np.ones(n), np.zeros(m * n + m)])
    hi = np.concatenate([np.ones(n), np.ones(m * n), np.full(m, float(cap))])
    res = milp(cost, constraints=LinearConstraint(a, lo, hi), integrality=np.ones(var.size),
               bounds=Bounds(0, usable.astype(float)), options={"time_limit": time_limit})
    if res.x is None:
        return None
    x = res.x > 0.5
    loads = np.bincount(ii[x], weights=pij[x], minlength=m)
    return {"sum": float(res.fun), "makespan": float(loads.max()), "optimal": res.status == 0}


def run_trace(cluster_name: str, jobs_n: int, seed: int, factors: list[float], round_s: float,
              time_limit: float) -> list[dict]:
    throughput = build_throughput(cross_node=True)
    cluster = parse_cluster(cluster_name)
    jobs = load_trace(f"gen:jobs={jobs_n},rate=0,seed={seed},multi_gpu=false", throughput=throughput)
    bound = ttd_bounds(jobs, cluster, throughput, round_s=round_s).ttd_nofork_s
    gavel = compute_results(simulate(policy=make_policy("gavel"), cluster=cluster, jobs=jobs, throughput=throughput,
                                     options=SimOptions(round_s=round_s)), throughput)
    p = processing_rounds(jobs, [g for node in cluster.nodes for g in node.gpus], throughput, round_s)
    out = []
    for f in factors:
        cap = None if math.isinf(f) else math.floor(f * bound / round_s + 1e-9)
        got = least_completion(p, cap, time_limit=time_limit)
        row = {"cluster": cluster_name, "jobs": jobs_n, "seed": seed, "factor": f, "bound_s": bound,
               "gavel_ttd_s": gavel.ttd_s, "gavel_jct_s": gavel.jct_mean_s, "fits": got is not None}
        if got is not None:
            jct = got["sum"] * round_s / len(jobs)
            row.update(jct_mean_s=jct, makespan_s=got["makespan"] * round_s, optimal=got["optimal"],
                       jct_x=gavel.jct_mean_s / jct, ttd_x=gavel.ttd_s / (got["makespan"] * round_s))
        out.append(row)
    return out


def summarize(runs: list[dict]) -> list[dict]:
    cells = []
    keys = sorted({(r["cluster"], r["jobs"], r["factor"]) for r in runs})
    for cluster, jobs_n, f in keys:
        group = [r for r in runs if (r["cluster"], r["jobs"], r["factor"]) == (cluster, jobs_n, f)]
        fit = [r for r in group if r["fits"]]
        cells.append({"cluster": cluster, "jobs": jobs_n, "factor": f, "seeds": len(group), "fit": len(fit),
                      "jct_x": round(statistics.fmean(r["jct_x"] for r in fit), 3) if fit else None,
                      "ttd_x": round(statistics.fmean(r["ttd_x"] for r in fit), 3) if fit else None,
                      "all_optimal": all(r["optimal"] for r in fit),
                      "no_schedule_seeds": [r["seed"] for r in group if not r["fits"]]})
    return cells


def _seeds(text: str) -> list[int]:
    lo, _, hi = text.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", default="aws-5,lab-5")
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--seeds", default="1-5", help="a range, e.g. 1-5")
    parser.add_argument("--factors", default="1.05,1.10,1.15,1.20,inf",
                        help="makespan caps as multiples of the no-fork bound (inf: no cap)")
    parser.add_argument("--round-s", type=float, default=360.0)
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per MIP")
    args = parser.parse_args()
    factors = [float(x) for x in args.factors.split(",")]
    t0 = time.perf_counter()
    runs = [row for c in args.clusters.split(",") for s in _seeds(args.seeds)
            for row in run_trace(c, args.jobs, s, factors, args.round_s, args.time_limit)]
    cells = summarize(runs)
    print("| cluster | jobs | makespan cap (x bound) | mean JCT x vs gavel | TTD x vs gavel | seeds with no schedule |")
    print("|---|---|---|---|---|---|")
    for c in cells:
        jct = "n/a" if c["jct_x"] is None else f"{c['jct_x']:.3f}"
        ttd = "n/a" if c["ttd_x"] is None else f"{c['ttd_x']:.3f}"
        none = ",".join(map(str, c["no_schedule_seeds"])) or "-"
        print(f"| {c['cluster']} | {c['jobs']} | {c['factor']} | {jct} | {ttd} | {none} |")
    print(json.dumps({"cells": cells, "runs": runs, "seconds": round(time.perf_counter() - t0, 1)},
                     separators=(",", ":")))


if __name__ == "__main__":
    main()
