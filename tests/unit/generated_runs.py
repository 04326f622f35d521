"""One policy on one of Gavel's generated traces (single- or multi-GPU jobs), all jobs at t=0: its metrics and the
trace's lower bounds (the whole-run checks of the timeline tests)."""

from __future__ import annotations

from services.scheduler.policies import make_policy
from services.scheduler.sim.bounds import TtdBounds, ttd_bounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.results import PolicyResults, compute_results
from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
from services.scheduler.sim.traces import load_trace


def run_generated(policy: str, cluster: str, *, jobs: int, seed: int, multi_gpu: bool = False,
                  **options) -> tuple[PolicyResults, TtdBounds]:
    throughput = build_throughput(cross_node=True)
    trace = load_trace(f"gen:jobs={jobs},rate=0,seed={seed},multi_gpu={str(multi_gpu).lower()}",
                       throughput=throughput)
    result = simulate(policy=make_policy(policy, **options), cluster=parse_cluster(cluster), jobs=trace,
                      throughput=throughput, options=SimOptions(round_s=360.0))
    return compute_results(result, throughput), ttd_bounds(trace, parse_cluster(cluster), throughput, round_s=360.0)
