"""Reproduce the Hadar/HadarE paper's ratios against Gavel in the simulator.

For each cluster, runs ``gavel``, ``hadar`` and ``hadare`` on the same traces (several
seeds of Gavel's generator) and reports the ratios the paper reports: TTD and mean JCT as
gavel / policy, CRU as policy / gavel, each as the mean over seeds with its range. A
ratio of a trace where either run left a job unfinished is left out (``completed`` says
how many jobs each policy finished). Also per policy TTD / its lower bound
(``services/scheduler/sim/bounds.py``: no-fork for gavel and hadar, fork for hadare), and the
most a policy's TTD ratio could be on that trace, gavel's TTD / the policy's bound
(``*_ttd_ceiling``): a paper factor above it cannot be reproduced under this model.

Trace shaped like the paper's evaluation: a batch of jobs submitted together (rate 0)
drawn from Gavel's job distribution (its job types, durations 60*10^U(1.5,3) s w.p. 0.8
else 60*10^U(3,4) s); single-GPU jobs on the 5-node clusters, whose nodes have one GPU
each, and Gavel's multi-GPU mix on gavel-108. Last line: one JSON object.

    python benchmarks/paper_ratios.py [--seeds 5] [--jobs 20] [--gavel108-jobs 100]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from services.scheduler.policies import make_policy
from services.scheduler.sim.bounds import bound_for, ttd_bounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.results import compute_results
from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
from services.scheduler.sim.traces import load_trace

POLICIES = ("gavel", "hadar", "hadare")
PAPER = {  # ratios against Gavel reported by the paper (aws-5 / lab-5)
    "aws-5": {"hadar_ttd": 1.17, "hadare_cru": 1.56, "hadare_ttd": 1.79, "hadare_jct": 2.23},
    "lab-5": {"hadar_ttd": 1.16, "hadare_cru": 1.62, "hadare_ttd": 2.12, "hadare_jct": 2.76},
}


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def run_cluster(cluster_name: str, traces: list[str], round_s: float) -> dict:
    cluster = parse_cluster(cluster_name)
    throughput = build_throughput(cross_node=True)
    keys = ("hadar_ttd", "hadar_cru", "hadar_jct", "hadare_ttd", "hadare_cru", "hadare_jct",
            "hadar_ttd_ceiling", "hadare_ttd_ceiling", "gavel_over_bound", "hadar_over_bound", "hadare_over_bound")
    ratios: dict[str, list[float]] = {k: [] for k in keys}
    completed: dict[str, int] = dict.fromkeys(POLICIES, 0)
    total = 0
    for spec in traces:
        jobs = load_trace(spec, throughput=throughput)
        total += len(jobs)
        bounds = ttd_bounds(jobs, cluster, throughput, round_s=round_s)
        metrics, bound = {}, {}
        for name in POLICIES:
            result = simulate(policy=make_policy(name), cluster=cluster, jobs=jobs, throughput=throughput,
                              options=SimOptions(round_s=round_s))
            metrics[name] = compute_results(result, throughput)
            completed[name] += metrics[name].jobs_completed
            bound[name] = bound_for(name, bounds, gangs_only=result.gangs_only)[1]
        g = metrics["gavel"]
        found: dict[str, float | None] = {"gavel_over_bound": _ratio(g.ttd_s, bound["gavel"])}
        for name in ("hadar", "hadare"):
            m = metrics[name]
            same = {u.job_id for u in m.unfinished} == {u.job_id for u in g.unfinished}
            found[f"{name}_ttd"] = _ratio(g.ttd_s, m.ttd_s)
            found[f"{name}_cru"] = _ratio(m.cru, g.cru) if same else None
            found[f"{name}_jct"] = _ratio(g.jct_mean_s, m.jct_mean_s) if same else None
            found[f"{name}_ttd_ceiling"] = _ratio(g.ttd_s, bound[name])
            found[f"{name}_over_bound"] = _ratio(m.ttd_s, bound[name])
        for key, value in found.items():
            if value is not None:
                ratios[key].append(value)
    return {"traces": traces, "jobs": total, "completed": completed,
            "ratios": {k: {"n": len(v), "mean": round(statistics.fmean(v), 3), "min": round(min(v), 3),
                           "max": round(max(v), 3)} for k, v in ratios.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=20, help="jobs per trace on the 5-node clusters")
    parser.add_argument("--gavel108-jobs", type=int, default=100)
    parser.add_argument("--round-s", type=float, default=360.0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    out = {}
    for name in ("aws-5", "lab-5"):
        traces = [f"gen:jobs={args.jobs},rate=0,seed={s},multi_gpu=false" for s in range(1, args.seeds + 1)]
        out[name] = run_cluster(name, traces, args.round_s)
    if args.gavel108_jobs:
        traces = [f"gen:jobs={args.gavel108_jobs},rate=0,seed={s},multi_gpu=true" for s in range(1, 3)]
        out["gavel-108"] = run_cluster("gavel-108", traces, args.round_s)
    print(f"{'cluster':10} {'ratio':18} {'ours mean':>9} {'(min-max)':>15} {'n':>3} {'paper':>6}")
    for cluster, res in out.items():
        for key, r in res["ratios"].items():
            paper = PAPER.get(cluster, {}).get(key)
            spread = f"({r['min']:.2f}-{r['max']:.2f})"
            paper_text = "" if paper is None else f"{paper:.2f}"
            print(f"{cluster:10} {key:18} {r['mean']:9.2f} {spread:>15} {r['n']:>3} {paper_text:>6}")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
