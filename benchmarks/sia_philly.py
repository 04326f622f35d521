"""Sia's eight Philly-derived workloads on sia-64, beside what Sia's own simulator reports.

Runs each policy on ``shared/domain/data/sia/workloads/philly/workload-{1..8}.csv`` with
Sia's measured throughput table (``services/scheduler/sim/sia_table.py``), its work rule
(``sia_work.py``) and, by default, its per-application restart time on every change of
placement (``--restart sia``; ``none`` charges nothing; ``plane`` charges every start, load,
upload and consolidation from the measured data plane ``--data-plane``,
``shared/domain/data_plane.py``), at 360 s rounds. Prints per workload
mean JCT, p99 JCT, makespan (last completion) and restarts per job beside
``reference_philly.csv`` (Sia's simulator, its Gavel baseline: ``max_sum_throughput_perf``),
then per policy the means over workloads of those, GPU-hours held and TTD over its lower bound
(``services/scheduler/sim/bounds.py``: no-fork for gang-only runs, fork otherwise), and of ours /
reference. Last line: one JSON object. ``--arrivals zero`` moves every job to its workload's
first arrival (and solves the bounds on that): what is then left between a policy and its
bound is not for want of knowing what will arrive.

Policies are registered names: ``gavel-throughput`` is max_sum_throughput_perf in our Gavel
round mechanism (the one checked against Gavel's own simulator), ``gavel-throughput-sia`` the
same LP driven the way Sia's gavel.py drives it (``services/scheduler/policies/gavel/policy.py``).

    python benchmarks/sia_philly.py [--policies gavel-throughput,gavel-throughput-sia]
        [--workloads 1,2,...,8] [--cluster sia-64] [--round-s 360] [--restart sia|none|plane]
        [--data-plane shared/domain/data/data_plane/dev-vm-minio.json] [--arrivals trace|zero]
        [--policy-option POLICY:KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from dataclasses import replace
from importlib import resources
from typing import Any

import numpy as np

from services.scheduler.policies import make_policy, parse_scoped_policy_option
from services.scheduler.sim.bounds import TtdBounds, bound_for, ttd_bounds
from services.scheduler.sim.cluster_spec import parse_cluster
from services.scheduler.sim.sia_table import build_sia_throughput
from services.scheduler.sim.sia_traces import restart_s_by_job_type
from services.scheduler.sim.simulator import RoundObservation, SimOptions, SimResult, simulate
from services.scheduler.sim.traces import TraceJob, load_trace
from shared.domain.data_plane import DataPlane, load_data_plane

METRICS = ("jct_mean_s", "jct_p99_s", "makespan_s", "restarts_mean")


def workload_path(i: int) -> str:
    return str(resources.files("shared.domain").joinpath(f"data/sia/workloads/philly/workload-{i}.csv"))


def reference() -> dict[str, dict[str, float]]:
    text = resources.files("shared.domain").joinpath("data/sia/reference_philly.csv").read_text(encoding="utf-8")
    return {row["workload"]: {m: float(row[m]) for m in METRICS}
            for row in csv.DictReader(text.splitlines()) if row["policy"] == "gavel"}


class RestartCounter:
    """Restarts per job as Sia counts them: every placement on a new set of GPUs but the first."""

    def __init__(self) -> None:
        self.placed: dict[str, int] = {}
        self._last_round = -2
        self._gpus: dict[str, frozenset[tuple[str, int]]] = {}

    def __call__(self, obs: RoundObservation) -> None:
        previous = self._gpus if obs.request.round == self._last_round + 1 else {}
        gpus: dict[str, set[tuple[str, int]]] = {}
        for (job_id, _copy), parts in obs.plan.copies().items():
            gpus.setdefault(job_id, set()).update((p.node_id, g) for p in parts for g in p.gpus)
        now = {job_id: frozenset(held) for job_id, held in gpus.items()}
        for job_id, held in now.items():
            if previous.get(job_id) != held:
                self.placed[job_id] = self.placed.get(job_id, 0) + 1
        self._gpus, self._last_round = now, obs.request.round

    def mean_restarts(self, jobs: int) -> float:
        return sum(max(0, n - 1) for n in self.placed.values()) / jobs if jobs else 0.0


def metrics_of(result: SimResult, restarts: RestartCounter, bound_s: float | None) -> dict[str, float | None]:
    done = [j for j in result.jobs if j.completion_s is not None]
    jcts = [j.completion_s - j.arrival_s for j in done if j.completion_s is not None]
    last = max((j.completion_s for j in done if j.completion_s is not None), default=None)
    first = min((j.arrival_s for j in result.jobs), default=0.0)
    ttd = last - first if last is not None else None
    return {
        "completed": len(done),
        "jct_mean_s": statistics.fmean(jcts) if jcts else None,
        "jct_p99_s": float(np.percentile(jcts, 99)) if jcts else None,
        "makespan_s": last,
        "restarts_mean": restarts.mean_restarts(len(result.jobs)),
        "gpu_hours": sum(j.gpu_s for j in result.jobs) / 3600.0,
        "ttd_s": ttd,
        "bound_s": bound_s,
        "ttd_over_bound": ttd / bound_s if ttd is not None and bound_s else None,
    }


def sim_options(jobs: tuple[TraceJob, ...], *, round_s: float, restart: str, plane: DataPlane | None) -> SimOptions:
    return SimOptions(round_s=round_s, restart_s_by_job_type=restart_s_by_job_type(jobs) if restart == "sia" else {},
                      data_plane=plane if restart == "plane" else None)


def run_one(policy_name: str, jobs: tuple[TraceJob, ...], *, cluster_name: str, options: SimOptions,
            bounds: TtdBounds | None, policy_options: dict[str, Any] | None = None) -> dict[str, float | None]:
    throughput = build_sia_throughput()
    restarts = RestartCounter()
    result = simulate(policy=make_policy(policy_name, **(policy_options or {})), cluster=parse_cluster(cluster_name),
                      jobs=jobs, throughput=throughput, options=options, observer=restarts)
    bound = bound_for(policy_name, bounds, gangs_only=result.gangs_only)[1] if bounds is not None else None
    return metrics_of(result, restarts, bound)


def at_first_arrival(jobs: tuple[TraceJob, ...]) -> tuple[TraceJob, ...]:
    """``jobs`` with every arrival moved to the earliest: the same work known from the start."""
    first = min(j.arrival_s for j in jobs)
    return tuple(replace(j, arrival_s=first) for j in jobs)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if len(known) == len(values) and known else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="gavel-throughput,gavel-throughput-sia")
    parser.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--cluster", default="sia-64")
    parser.add_argument("--round-s", type=float, default=360.0)
    parser.add_argument("--restart", choices=("sia", "none", "plane"), default="sia")
    parser.add_argument("--data-plane", default=str(resources.files("shared.domain").joinpath(
        "data/data_plane/dev-vm-minio.json")), help="with --restart plane: the measured data plane")
    parser.add_argument("--arrivals", choices=("trace", "zero"), default="trace",
                        help="zero: every job arrives with the workload's first (nothing is unknown to an "
                             "online policy; Sia's reference figures then do not apply)")
    parser.add_argument("--bounds", action=argparse.BooleanOptionalAction, default=True,
                        help="solve the TTD lower bounds per workload (about 5 s each)")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY:KEY=VALUE",
                        help="an option for one policy's constructor, e.g. hadare:node_slots=true (repeatable)")
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    scoped: dict[str, dict[str, Any]] = {}
    for policy, key, value in (parse_scoped_policy_option(text) for text in args.policy_option):
        scoped.setdefault(policy, {})[key] = value
    workloads = [int(w) for w in args.workloads.split(",")]
    ref = reference()
    throughput = build_sia_throughput()
    cluster = parse_cluster(args.cluster)
    plane = load_data_plane(args.data_plane) if args.restart == "plane" else None
    first = load_trace(workload_path(workloads[0]), throughput=throughput)
    charged = sim_options(first, round_s=args.round_s, restart=args.restart, plane=plane).charges().describe()
    print(f"charged: {charged}")
    if args.arrivals == "zero":
        print("arrivals: every job at its workload's first arrival; the reference columns do not apply")
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for i in workloads:
        jobs = load_trace(workload_path(i), throughput=throughput)
        if args.arrivals == "zero":
            jobs = at_first_arrival(jobs)
        options = sim_options(jobs, round_s=args.round_s, restart=args.restart, plane=plane)
        bounds = (ttd_bounds(jobs, cluster, throughput, first_start_s=options.first_start_s, round_s=args.round_s)
                  if args.bounds else None)
        for name in policies:
            t = time.perf_counter()
            got = run_one(name, jobs, cluster_name=args.cluster, options=options, bounds=bounds,
                          policy_options=scoped.get(name))
            want = ref[f"workload-{i}"]
            ratio = {m: (value / want[m] if (value := got[m]) is not None and want[m] else None) for m in METRICS}
            rows.append({"workload": i, "policy": name, **got, "reference": want, "ratio": ratio,
                         "wall_s": round(time.perf_counter() - t, 2)})
    print(f"{'wl':>3} {'policy':<22} " + " ".join(f"{m:>22}" for m in METRICS) + "   ours / Sia's Gavel, ratio")
    for row in rows:
        cells = " ".join(f"{_fmt(row[m]) + ' / ' + _fmt(row['reference'][m]):>17} {row['ratio'][m] or 0:4.2f}"
                         for m in METRICS)
        print(f"{row['workload']:>3} {row['policy']:<22} {cells}")
    summary: dict[str, dict[str, float | None]] = {}
    keys = (*METRICS, "gpu_hours", "ttd_over_bound")
    print(f"\nmean over workloads {', '.join(map(str, workloads))}")
    ratio_heads = " ".join(f"{m + '/ref':>18}" for m in METRICS)
    print(f"{'policy':<22} " + " ".join(f"{k:>14}" for k in keys) + " " + ratio_heads)
    for name in policies:
        mine = [r for r in rows if r["policy"] == name]
        summary[name] = {k: _mean([r[k] for r in mine]) for k in keys}
        summary[name].update({f"{m}_ratio": _mean([r["ratio"][m] for r in mine]) for m in METRICS})
        print(f"{name:<22} " + " ".join(f"{_fmt(summary[name][k]):>14}" for k in keys) + " "
              + " ".join(f"{_fmt(summary[name][m + '_ratio']):>18}" for m in METRICS))
    sia_ref = {k: _mean([ref[f"workload-{i}"][k] for i in workloads]) for k in METRICS}
    print(f"{'(Sia: gavel)':<22} " + " ".join(f"{_fmt(sia_ref[k]):>14}" for k in METRICS))
    out = {"benchmark": "sia_philly", "cluster": args.cluster, "round_s": args.round_s, "restart": args.restart,
           "arrivals": args.arrivals, "charged": charged,
           "workloads": workloads, "summary": summary, "reference_mean": sia_ref, "rows": rows,
           "wall_s": round(time.perf_counter() - started, 1)}
    print(json.dumps(out, separators=(",", ":")))


if __name__ == "__main__":
    main()
