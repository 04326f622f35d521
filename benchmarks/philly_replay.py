"""The whole Philly trace (82,247 jobs, 109 days) replayed on philly-2000, one policy per process.

Trace and job rule: ``services/scheduler/sim/philly_traces.py`` (types drawn with ``--seed``,
work from each job's Philly run time on a P100). Cluster: ``philly-2000`` (84 x 8 V100,
84 x 8 P100, 82 x 8 K80). Gavel's throughput table, 360 s rounds, no restart charge -- or,
with ``--data-plane FILE``, every start, load, upload and consolidation charged from that
measured data plane (``shared/domain/data_plane.py``).

Each policy runs in its own child process, so that its peak memory (``ru_maxrss``) is its own;
``--parallel`` children at a time (default 1: decision times are then not shared with a
sibling). Per policy: jobs completed, mean / p99 JCT, makespan (first arrival to last
completion), cluster utilization over it, decision time per round (p50, p95, max, and p95 as a
fraction of the round), rounds simulated, simulator wall time and peak memory. ``--bound``
also solves the no-fork and fork TTD lower bounds (``bounds.py``) in the parent. Prints one
line per policy as it finishes, then one JSON object as the last line.

    python benchmarks/philly_replay.py [--policies yarn-cs,tiresias,gavel,gavel-makespan,hadar,hadare]
        [--parallel 1] [--seed 0] [--days D] [--bound] [--data-plane FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from services.scheduler.policies import make_policy, parse_scoped_policy_option
from services.scheduler.sim.bounds import ttd_bounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.results import completed_jcts_s, compute_results, span_s
from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
from services.scheduler.sim.traces import TraceJob, load_trace
from shared.domain.data_plane import load_data_plane

POLICIES = ("yarn-cs", "tiresias", "gavel", "gavel-makespan", "hadar", "hadare")
CLUSTER = "philly-2000"
ROUND_S = 360.0


def trace_path() -> str:
    return str(resources.files("shared.domain").joinpath("data/philly/philly.csv"))


def jobs_of(seed: int, days: float | None) -> tuple[TraceJob, ...]:
    jobs = load_trace(trace_path(), throughput=build_throughput(), default_seed=seed)
    return jobs if days is None else tuple(j for j in jobs if j.arrival_s < days * 86_400)


def replay(policy: str, seed: int, days: float | None, plane_path: str | None = None,
           options: dict[str, Any] | None = None) -> dict[str, Any]:
    throughput = build_throughput()
    plane = load_data_plane(plane_path) if plane_path is not None else None
    jobs = jobs_of(seed, days)
    cluster = parse_cluster(CLUSTER)
    started = time.perf_counter()
    result = simulate(policy=make_policy(policy, **(options or {})), cluster=cluster, jobs=jobs, throughput=throughput,
                      options=SimOptions(round_s=ROUND_S, seed=seed, data_plane=plane))
    wall = time.perf_counter() - started
    metrics = compute_results(result, throughput)   # JCT mean, span (makespan), utilization
    jcts = np.array(completed_jcts_s(result))
    decisions = np.array([r.decision_ms for r in result.rounds])
    return {
        "policy": policy, "options": options or {}, "jobs": len(jobs), "completed": metrics.jobs_completed,
        "stop": result.stop_reason,
        "gangs_only": result.gangs_only, "jct_mean_s": metrics.jct_mean_s,
        "jct_p99_s": float(np.percentile(jcts, 99)) if len(jcts) else None,
        "makespan_s": span_s(result), "utilization": metrics.cru,
        "decision_ms_p50": float(np.percentile(decisions, 50)),
        "decision_ms_p95": float(np.percentile(decisions, 95)),
        "decision_ms_max": float(decisions.max()),
        "decision_p95_of_round": float(np.percentile(decisions, 95)) / (ROUND_S * 1000.0),
        "rounds": len(result.rounds), "wall_s": wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }


def _line(row: dict[str, Any]) -> str:
    def hours(x: float | None) -> str:
        return "-" if x is None else f"{x / 3600:,.2f} h"
    named = row["policy"] + "".join(f" {k}={v}" for k, v in row["options"].items())
    return (f"{named}: {row['completed']}/{row['jobs']} done ({row['stop']}); "
            f"mean JCT {hours(row['jct_mean_s'])}, "
            f"p99 {hours(row['jct_p99_s'])}, makespan {row['makespan_s'] / 86_400:.2f} d, "
            f"utilization {row['utilization']:.3f}; decision p50/p95/max {row['decision_ms_p50']:.1f}/"
            f"{row['decision_ms_p95']:.1f}/{row['decision_ms_max']:.1f} ms (p95 {row['decision_p95_of_round']:.2%} "
            f"of the round); {row['rounds']} rounds in {row['wall_s']:.0f} s, peak {row['peak_rss_mib']:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--days", type=float, default=None, help="only jobs arriving in the first D days")
    parser.add_argument("--bound", action="store_true", help="also solve the TTD lower bounds")
    parser.add_argument("--data-plane", default=None, help="charge moves from this measured data plane (JSON)")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY:KEY=VALUE",
                        help="an option for one policy's constructor, e.g. hadar:seat_gangs=false (repeatable)")
    args = parser.parse_args(argv)
    scoped: dict[str, dict[str, Any]] = {}
    for policy, key, value in (parse_scoped_policy_option(text) for text in args.policy_option):
        scoped.setdefault(policy, {})[key] = value
    plane = load_data_plane(args.data_plane) if args.data_plane is not None else None
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    started = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for row in pool.map(replay, names, [args.seed] * len(names), [args.days] * len(names),
                            [args.data_plane] * len(names), [scoped.get(n) for n in names]):
            print(_line(row), flush=True)
            rows.append(row)
    out: dict[str, Any] = {"cluster": CLUSTER, "round_s": ROUND_S, "seed": args.seed, "days": args.days,
                           "charged": SimOptions(data_plane=plane).charges().describe(),
                           "policies": rows, "total_wall_s": time.perf_counter() - started}
    if args.bound:
        t = time.perf_counter()
        bounds = ttd_bounds(jobs_of(args.seed, args.days), parse_cluster(CLUSTER), build_throughput(),
                            first_start_s=SimOptions(round_s=ROUND_S, data_plane=plane).first_start_s,
                            round_s=ROUND_S)
        out.update(ttd_nofork_s=bounds.ttd_nofork_s, ttd_fork_s=bounds.ttd_fork_s, bound_wall_s=time.perf_counter() - t)
        print(f"TTD bounds: no-fork {bounds.ttd_nofork_s}, fork {bounds.ttd_fork_s} "
              f"({out['bound_wall_s']:.0f} s)", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
