"""Team queues: does every policy under the queue mechanism give three teams their weights,
and what does that cost in JCT and time to drain?

Three queues, ``light``, ``medium`` and ``heavy``, weights 1, 2 and 3 (weight shares 1/6,
1/3, 1/2), on Gavel-generator traces (``gen:``, ``services/scheduler/sim/traces.py``) whose
jobs get a queue from ``queues=light/medium/medium/heavy/heavy/heavy`` (``--assign
weighted``, the default: each queue's expected work proportional to its weight, so no queue
runs dry long before the others) or ``queues=light/medium/heavy`` (``--assign uniform``).
Per (policy, seed) the same trace runs three times:

* ``none``: without queues (the policy alone, as ``hadar sim`` without ``--queues``);
* ``quota``: quotas proportional to the weights, type by type (largest remainders; on the
  default cluster 2/4/6 of each of V100, P100, K80), no borrowing limit;
* ``weights``: no quotas, weights only (every GPU is lent by fair share).

Per policy and variant, means over the seeds (``services/scheduler/sim/fairness.py``):
each queue's attained share of normalized GPU-seconds while all queues have an active job
(``share``) and while every queue asks for at least its weight share of the GPUs
(``backlogged``), as share / weight share; Jain's index of those ratios; ``dev``: the
largest |ratio - 1| over the queues (goal: <= 0.05); and the cost of fairness, mean JCT and
TTD of the variant over the same trace's without queues, minus 1 (goal for hadar with
quotas: < 0.05). ``gavel`` (heterogeneity-aware max-min fairness, LAS) is the fairness
baseline: the ``none`` rows of the table give its own shares, measured on the same queues.
With ``--assign weighted`` each queue's demand is itself in proportion to its weight, so
the all-active shares come out near the weights even without queues (``none``); the
backlogged shares are the ones that tell a mechanism that enforces the weights from
demand that happens to match them.

Output: a table on stdout and in ``--out``/queues.md, every run in ``--out``/rows.json, and
as the last stdout line one JSON object {"policies": [...], "goals": {...}, "seconds"}.

    python benchmarks/queues.py --workers 2 --out queues-out        # the default run
    python benchmarks/queues.py --policies hadar,gavel --seeds 1 --assign uniform
    python benchmarks/queues.py --policies hadar,gavel --seeds 1 --jobs 120

Default cluster: ``v100:12,p100:12,k80:12``, a third of gavel-108 (36 single-GPU nodes):
240 of Gavel's single-GPU jobs at 8 per hour keep all three queues backlogged for tens of
hours there, where on gavel-108 itself that takes about three times the jobs (and Hadar's
rounds cost with them). The default run, ``python benchmarks/queues.py --workers 2 --out
queues-out``, took 6 min 12 s (12 min 10 s of CPU, Hadar's 6 runs 406 s of it) on 2 shared
cores at load average ~1.5.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

POLICIES = ("gavel", "gavel-makespan", "tiresias", "yarn-cs", "hadar", "hadare")
QUEUES = (("light", 1), ("medium", 2), ("heavy", 3))
VARIANTS = ("none", "quota", "weights")
SLOW = {"hadar": 0, "hadare": 1}   # run first, so the pool is not left waiting on them
GOAL_DEV, GOAL_COST = 0.05, 0.05


@dataclass(frozen=True, kw_only=True)
class Task:
    policy: str
    variant: str
    seed: int
    cluster: str
    jobs: int
    rate: float
    multi_gpu: bool
    assign: str
    round_s: float

    @property
    def trace(self) -> str:
        names = [name for name, w in QUEUES for _ in range(w if self.assign == "weighted" else 1)]
        return (f"gen:jobs={self.jobs},rate={self.rate},seed={self.seed},multi_gpu={str(self.multi_gpu).lower()},"
                f"queues={'/'.join(names)}")


def queue_config(variant: str, gpus_by_type: dict[str, int]):
    """The variant's QueueConfig (None for ``none``): quotas split type by type in proportion
    to the weights, largest remainders first (ties: the queue listed first)."""
    from shared.wire.queues import QueueConfig, QueueSpec

    if variant == "none":
        return None
    total = sum(w for _, w in QUEUES)
    quota: dict[str, dict[str, int]] = {name: {} for name, _ in QUEUES}
    if variant == "quota":
        for gpu_type, count in sorted(gpus_by_type.items()):
            exact = {name: count * w / total for name, w in QUEUES}
            given = {name: int(x) for name, x in exact.items()}
            order = sorted(exact, key=lambda n: -(exact[n] - given[n]))
            for name in order[:count - sum(given.values())]:
                given[name] += 1
            for name, n in given.items():
                if n:
                    quota[name][gpu_type] = n
    return QueueConfig(queues=tuple(QueueSpec(name=name, weight=float(w), quota=quota[name]) for name, w in QUEUES),
                       default_queue=QUEUES[0][0])


def run_task(task: Task) -> dict:
    from services.scheduler.policies import make_policy
    from services.scheduler.sim.cluster_spec import parse_cluster
    from services.scheduler.sim.fairness import QueueObserver, queue_fairness, queues_of
    from services.scheduler.sim.results import compute_results
    from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
    from services.scheduler.sim.traces import load_trace

    t0 = time.process_time()
    throughput = build_throughput(cross_node=True)
    cluster = parse_cluster(task.cluster)
    jobs = load_trace(task.trace, throughput=throughput)
    config = queue_config(task.variant, dict(cluster.gpus_by_type))
    measure = config or queue_config("weights", dict(cluster.gpus_by_type))   # shares of a run without queues
    observer = QueueObserver(measure)
    result = simulate(policy=make_policy(task.policy), cluster=cluster, jobs=jobs, throughput=throughput,
                      options=SimOptions(round_s=task.round_s, queues=config), observer=observer)
    m = compute_results(result, throughput)
    fair = queue_fairness(result, measure, observer.rounds, queue_of=queues_of(jobs, measure), throughput=throughput)
    return {"policy": task.policy, "variant": task.variant, "seed": task.seed, "ttd_s": m.ttd_s,
            "jct_mean_s": m.jct_mean_s, "completed": m.jobs_completed, "total": m.jobs_total,
            "fairness": fair.as_dict(), "cpu_s": round(time.process_time() - t0, 1)}


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict], policies: tuple[str, ...]) -> list[dict]:
    """Per (policy, variant): mean share ratios, Jain, dev and the costs (module docstring)."""
    by: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        by[(r["policy"], r["variant"])][r["seed"]] = r
    out = []
    for policy in policies:
        base = by.get((policy, "none"), {})
        for variant in VARIANTS:
            runs = by.get((policy, variant))
            if not runs:
                continue
            cell: dict = {"policy": policy, "variant": variant, "seeds": len(runs),
                          "completed": sum(r["completed"] for r in runs.values()),
                          "total": sum(r["total"] for r in runs.values())}
            for kind, key in (("share", "share_ratio"), ("backlogged", "backlogged_ratio")):
                ratios = {q: _mean([r["fairness"]["queues"][q][key] for r in runs.values()
                                    if r["fairness"]["queues"][q][key] is not None]) for q, _ in QUEUES}
                cell[kind] = ratios
                cell[f"{kind}_dev"] = (max(abs(x - 1) for x in ratios.values())
                                       if all(x is not None for x in ratios.values()) else None)
                jain_key = "jain" if kind == "share" else "backlogged_jain"
                cell[f"{kind}_jain"] = _mean([r["fairness"][jain_key] for r in runs.values()
                                              if r["fairness"][jain_key] is not None])
            cell["backlogged_h"] = _mean([r["fairness"]["backlogged_s"] / 3600 for r in runs.values()])
            cell["contended_h"] = _mean([r["fairness"]["contended_s"] / 3600 for r in runs.values()])
            cell["jct_mean_h"] = _mean([r["jct_mean_s"] / 3600 for r in runs.values() if r["jct_mean_s"]])
            cell["ttd_h"] = _mean([r["ttd_s"] / 3600 for r in runs.values() if r["ttd_s"]])
            for metric in ("jct_mean_s", "ttd_s"):
                # only seeds where both runs completed every job (else the ratio compares other jobs)
                costs = [r[metric] / base[s][metric] - 1 for s, r in runs.items()
                         if s in base and r[metric] and base[s][metric] and r["completed"] == r["total"]
                         and base[s]["completed"] == base[s]["total"]]
                cell[f"{metric.split('_')[0]}_cost"] = _mean(costs)
            out.append(cell)
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def table(cells: list[dict]) -> str:
    """One row per (policy, variant): share ratios (all active | backlogged), Jain, costs."""
    names = [q for q, _ in QUEUES]
    head = ["policy", "variant", *(f"{q} x" for q in names), "dev", "Jain", *(f"{q} xB" for q in names), "devB",
            "JainB", "backlog h", "JCT h", "TTD h", "JCT cost", "TTD cost", "done"]
    rows = [head]
    for c in cells:
        rows.append([c["policy"], c["variant"], *(_f(c["share"][q]) for q in names), _f(c["share_dev"], "{:.3f}"),
                     _f(c["share_jain"], "{:.3f}"), *(_f(c["backlogged"][q]) for q in names),
                     _f(c["backlogged_dev"], "{:.3f}"), _f(c["backlogged_jain"], "{:.3f}"),
                     _f(c["backlogged_h"], "{:.1f}"),
                     _f(c["jct_mean_h"]), _f(c["ttd_h"]), _f(c["jct_cost"], "{:+.1%}"), _f(c["ttd_cost"], "{:+.1%}"),
                     f"{c['completed']}/{c['total']}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def goals(cells: list[dict]) -> dict:
    """Which cells meet the goals: shares within GOAL_DEV of the weights (both measures), and
    hadar's cost with quotas under GOAL_COST."""
    queued = [c for c in cells if c["variant"] != "none"]
    hadar = next((c for c in cells if c["policy"] == "hadar" and c["variant"] == "quota"), None)
    return {"shares_within_5pct": sorted(f"{c['policy']}/{c['variant']}" for c in queued
                                         if c["share_dev"] is not None and c["share_dev"] <= GOAL_DEV),
            "backlogged_within_5pct": sorted(f"{c['policy']}/{c['variant']}" for c in queued
                                             if c["backlogged_dev"] is not None and c["backlogged_dev"] <= GOAL_DEV),
            "hadar_quota_cost_ok": None if hadar is None or hadar["jct_cost"] is None or hadar["ttd_cost"] is None
            else hadar["jct_cost"] < GOAL_COST and hadar["ttd_cost"] < GOAL_COST}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seeds", type=int, default=2, help="seeds FIRST..FIRST+N-1")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=240, help="jobs per trace")
    parser.add_argument("--rate", type=float, default=8.0, help="arrivals per hour (0: all at t=0)")
    parser.add_argument("--cluster", default="v100:12,p100:12,k80:12", help="a hadar sim --cluster value")
    parser.add_argument("--multi-gpu", action="store_true", help="Gavel's multi-GPU scale factors")
    parser.add_argument("--assign", choices=("weighted", "uniform"), default="weighted")
    parser.add_argument("--round-s", type=float, default=360.0)
    parser.add_argument("--workers", type=int, default=2, help="processes (1: run in this process)")
    parser.add_argument("--out", default="queues-out")
    args = parser.parse_args()
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    tasks = [Task(policy=p, variant=v, seed=s, cluster=args.cluster, jobs=args.jobs, rate=args.rate,
                  multi_gpu=args.multi_gpu, assign=args.assign, round_s=args.round_s)
             for p in policies for v in VARIANTS for s in range(args.first_seed, args.first_seed + args.seeds)]
    tasks.sort(key=lambda t: SLOW.get(t.policy, len(SLOW)))
    t0 = time.perf_counter()
    if args.workers <= 1:
        rows = [run_task(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            rows = list(pool.map(run_task, tasks))
    cells = summarize(rows, policies)
    text = table(cells)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "queues.md"), "w") as f:
        f.write(f"Trace {tasks[0].trace if tasks else ''} (seeds {args.first_seed}..), cluster {args.cluster}\n\n")
        f.write("```\n" + text + "\n```\n")
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f)
    print(text)
    print("x: share / weight share while all queues have an active job; xB: while every queue is backlogged; "
          "dev: max |x - 1|; cost: the variant's mean JCT / TTD over the run without queues, minus 1")
    print(json.dumps({"policies": cells, "goals": goals(cells), "seconds": round(time.perf_counter() - t0, 1)},
                     separators=(",", ":")))


if __name__ == "__main__":
    main()
