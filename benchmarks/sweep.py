"""Workload sweep: every policy against Gavel and against the lower bound, over job counts.

Grid (each axis a flag, so a subset can be run): policies gavel, gavel-makespan, tiresias,
yarn-cs, hadar, hadare; job counts 5/10/20/40; job mixes ``single`` (every job 1 GPU) and
``multi`` (Gavel's scale factors 1/2/4/8 w.p. .70/.10/.15/.05); arrivals ``zero`` (all at
t=0, the paper's batch) and ``spread`` (Poisson, ``--rate`` jobs per hour); clusters aws-5,
lab-5, aws-5-multi, lab-5-multi (``services/scheduler/sim/cluster_spec.py``) and gavel-108;
``--seeds`` seeds from ``--first-seed`` (1). One task = one (cluster, mix, arrivals, jobs,
seed) trace, run under every policy (``--policy-option`` passes constructor options), with
its LP lower bounds (``services/scheduler/sim/bounds.py``); tasks run in a process pool of
``--workers``.

Per cell (cluster, mix, arrivals, jobs, policy), over the seeds:
* ``ttd_x``, ``jct_x``: gavel's TTD (mean JCT) / the policy's, mean over the seeds where both
  completed the same jobs (ratios of runs that completed different jobs are meaningless);
* ``over_bound``: the policy's TTD / the bound that applies to it (fork bound for runs that
  forked, else no-fork), mean and max over the seeds it completed;
* ``done``: seeds in which the policy completed every job.

Output: a markdown table (``--out``/sweep.md), PNG plots of TTD ratio and TTD/bound against
job count (``--out``/sweep_<cluster>_<mix>_<arrivals>.png), and as the last stdout line one
JSON object {"cells": [...], "violations": [...], "seconds"}; ``violations`` lists every run
whose TTD beat its bound (there must be none).

    python benchmarks/sweep.py --workers 1 --out sweep-out
    python benchmarks/sweep.py --clusters aws-5,lab-5 --jobs 20 --mixes single --arrivals zero
    python benchmarks/sweep.py --from-rows a/rows.json,b/rows.json --out merged   # merge subsets
    python benchmarks/sweep.py --policies hadar --policy-option hadar:critical_slack=0.03 ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from services.scheduler.policies import parse_scoped_policy_option

POLICIES = ("gavel", "gavel-makespan", "tiresias", "yarn-cs", "hadar", "hadare")
CLUSTERS = ("aws-5", "lab-5", "aws-5-multi", "lab-5-multi", "gavel-108")
JOBS = (5, 10, 20, 40)
MIXES = ("single", "multi")
ARRIVALS = ("zero", "spread")
BOUND_TOLERANCE = 1e-6   # TTD below bound x (1 - this) is a violation


@dataclass(frozen=True, kw_only=True)
class Task:
    cluster: str
    mix: str
    arrivals: str
    jobs: int
    seed: int
    rate: float
    round_s: float
    policies: tuple[str, ...]
    options: tuple[tuple[str, str, object], ...] = ()   # (policy, option, value) from --policy-option

    @property
    def trace(self) -> str:
        rate = 0 if self.arrivals == "zero" else self.rate
        return f"gen:jobs={self.jobs},rate={rate},seed={self.seed},multi_gpu={str(self.mix == 'multi').lower()}"


def run_task(task: Task) -> list[dict]:
    """Every policy on the task's trace: one row per policy."""
    from services.scheduler.policies import make_policy
    from services.scheduler.sim.bounds import bound_for, ttd_bounds
    from services.scheduler.sim.cluster_spec import parse_cluster
    from services.scheduler.sim.results import compute_results
    from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
    from services.scheduler.sim.traces import load_trace

    throughput = build_throughput(cross_node=True)
    cluster = parse_cluster(task.cluster)
    jobs = load_trace(task.trace, throughput=throughput)
    options = SimOptions(round_s=task.round_s)
    bounds = ttd_bounds(jobs, cluster, throughput, first_start_s=options.first_start_s, round_s=options.round_s)
    rows = []
    for name in task.policies:
        t0 = time.process_time()
        opts = {key: value for policy, key, value in task.options if policy == name}
        result = simulate(policy=make_policy(name, **opts), cluster=cluster, jobs=jobs, throughput=throughput,
                          options=options)
        m = compute_results(result, throughput)
        kind, bound = bound_for(name, bounds, gangs_only=result.gangs_only)
        rows.append({"cluster": task.cluster, "mix": task.mix, "arrivals": task.arrivals, "jobs": task.jobs,
                     "seed": task.seed, "policy": name, "ttd_s": m.ttd_s, "jct_mean_s": m.jct_mean_s,
                     "completed": m.jobs_completed, "total": m.jobs_total,
                     "unfinished": sorted(u.job_id for u in m.unfinished), "bound_kind": kind,
                     "bound_s": bound, "cpu_s": round(time.process_time() - t0, 2)})
    return rows


def summarize(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(cells, violations) from the per-run rows (rules in the module docstring)."""
    runs: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        runs[(r["cluster"], r["mix"], r["arrivals"], r["jobs"], r["seed"])][r["policy"]] = r
    acc: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    violations = []
    for key, by_policy in runs.items():
        gavel = by_policy.get("gavel")
        for name, r in by_policy.items():
            cell = acc[key[:4] + (name,)]
            cell["seeds"].append(key[4])
            if r["ttd_s"] is None:
                continue
            cell["done"].append(key[4])
            if r["bound_s"]:
                over = r["ttd_s"] / r["bound_s"]
                cell["over"].append(over)
                if over < 1 - BOUND_TOLERANCE:
                    violations.append({k: r[k] for k in ("cluster", "mix", "arrivals", "jobs", "seed", "policy")}
                                      | {"over_bound": over})
            if gavel is not None and gavel["ttd_s"] is not None and gavel["unfinished"] == r["unfinished"]:
                cell["ttd_x"].append(gavel["ttd_s"] / r["ttd_s"])
                cell["jct_x"].append(gavel["jct_mean_s"] / r["jct_mean_s"])
    cells = []
    for (cluster, mix, arrivals, jobs, policy), c in sorted(acc.items()):
        def mean(v: list) -> float | None:
            return round(statistics.fmean(v), 3) if v else None
        cells.append({"cluster": cluster, "mix": mix, "arrivals": arrivals, "jobs": jobs, "policy": policy,
                      "seeds": len(c["seeds"]), "done": len(c["done"]), "ttd_x": mean(c["ttd_x"]),
                      "jct_x": mean(c["jct_x"]), "n_x": len(c["ttd_x"]), "over_bound": mean(c["over"]),
                      "over_bound_max": round(max(c["over"]), 3) if c["over"] else None})
    return cells, violations


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def markdown(cells: list[dict], policies: tuple[str, ...]) -> str:
    """One row per (cluster, mix, arrivals, jobs); per policy ``TTDx / JCTx / TTD:bound``."""
    by_row: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for c in cells:
        by_row[(c["cluster"], c["mix"], c["arrivals"], c["jobs"])][c["policy"]] = c
    head = "| cluster | mix | arrivals | jobs | " + " | ".join(policies) + " |"
    lines = [head, "|" + "---|" * (4 + len(policies))]
    for key, row in by_row.items():
        parts = []
        for p in policies:
            c = row.get(p)
            if c is None:
                parts.append("")
                continue
            done = "" if c["done"] == c["seeds"] else f" ({c['done']}/{c['seeds']} done)"
            parts.append(f"{_fmt(c['ttd_x'])} / {_fmt(c['jct_x'])} / {_fmt(c['over_bound'])}{done}")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def plot(cells: list[dict], out: str, policies: tuple[str, ...]) -> list[str]:
    """One PNG per (cluster, mix, arrivals): TTD ratio vs gavel and TTD / bound against jobs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for c in cells:
        groups[(c["cluster"], c["mix"], c["arrivals"])].append(c)
    paths = []
    for (cluster, mix, arrivals), group in sorted(groups.items()):
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for p in policies:
            pts = sorted((c["jobs"], c["ttd_x"], c["over_bound"]) for c in group if c["policy"] == p)
            if not pts:
                continue
            left.plot([j for j, x, _ in pts if x is not None], [x for _, x, _ in pts if x is not None],
                      marker="o", label=p)
            right.plot([j for j, _, b in pts if b is not None], [b for _, _, b in pts if b is not None],
                       marker="o", label=p)
        left.set(xlabel="jobs", ylabel="TTD ratio (gavel / policy)", title=f"{cluster} {mix} {arrivals}")
        right.set(xlabel="jobs", ylabel="TTD / lower bound", title="distance to the bound (1 = optimal)")
        right.axhline(1.0, color="grey", linewidth=0.8)
        left.legend(fontsize=7)
        fig.tight_layout()
        name = re.sub(r"[^A-Za-z0-9.-]+", "-", os.path.basename(cluster)).strip("-")   # a YAML path or inline spec
        path = os.path.join(out, f"sweep_{name}_{mix}_{arrivals}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _list(text: str, cast=str) -> tuple:
    return tuple(cast(x.strip()) for x in text.split(",") if x.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--jobs", default=",".join(map(str, JOBS)))
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--arrivals", default=",".join(ARRIVALS))
    parser.add_argument("--seeds", type=int, default=5, help="seeds FIRST..FIRST+N-1")
    parser.add_argument("--first-seed", type=int, default=1, help="FIRST (default 1)")
    parser.add_argument("--rate", type=float, default=2.0, help="jobs per hour for spread arrivals")
    parser.add_argument("--round-s", type=float, default=360.0)
    parser.add_argument("--workers", type=int, default=1, help="processes (1: run in this process)")
    parser.add_argument("--out", default="sweep-out", help="folder for sweep.md, rows.json and the PNGs")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY:KEY=VALUE",
                        help="an option for one policy's constructor, e.g. hadar:critical_slack=0.03 "
                        "(repeatable; VALUE is JSON when it parses)")
    parser.add_argument("--from-rows", default="", help="comma-separated rows.json files of earlier runs: "
                        "summarize them together instead of running anything")
    args = parser.parse_args()
    policies = _list(args.policies)
    options = [parse_scoped_policy_option(text) for text in args.policy_option]
    if "gavel" not in policies:
        policies = ("gavel",) + policies     # every ratio is against gavel
    tasks = [Task(cluster=c, mix=m, arrivals=a, jobs=j, seed=s, rate=args.rate, round_s=args.round_s,
                  policies=policies, options=tuple(options))
             for c in _list(args.clusters) for m in _list(args.mixes) for a in _list(args.arrivals)
             for j in _list(args.jobs, int) for s in range(args.first_seed, args.first_seed + args.seeds)]
    t0 = time.perf_counter()
    rows: list[dict] = []
    if args.from_rows:
        tasks = []
        for path in _list(args.from_rows):
            with open(path) as f:
                rows.extend(json.load(f))
        rows = list({(r["cluster"], r["mix"], r["arrivals"], r["jobs"], r["seed"], r["policy"]): r
                     for r in rows}.values())   # one row per run
        policies = tuple(p for p in POLICIES if any(r["policy"] == p for r in rows))
    elif args.workers <= 1:
        for task in tasks:
            rows.extend(run_task(task))
    else:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            for got in pool.map(run_task, tasks):
                rows.extend(got)
    cells, violations = summarize(rows)
    os.makedirs(args.out, exist_ok=True)
    table = markdown(cells, policies)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write("Cells: TTD ratio vs gavel / mean-JCT ratio vs gavel / TTD over its bound (means over seeds)\n\n")
        f.write(table + "\n")
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f)
    plots = plot(cells, args.out, policies)
    print(table)
    traces = len({(r["cluster"], r["mix"], r["arrivals"], r["jobs"], r["seed"]) for r in rows})
    print(f"{traces} traces, {len(rows)} runs, {len(violations)} bound violations, plots: {len(plots)}")
    print(json.dumps({"cells": cells, "violations": violations, "seconds": round(time.perf_counter() - t0, 1)},
                     separators=(",", ":")))


if __name__ == "__main__":
    main()
