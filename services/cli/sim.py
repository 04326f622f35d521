"""``hadar sim``: run several policies on one trace and cluster, compare them side by side.

Writes ``OUT/summary.json``, ``OUT/report.md``, ``OUT/utilization.png``,
``OUT/jct_cdf.png`` and ``OUT/ttd_bounds.png``, and prints the comparison table. Each
policy gets a fresh instance and the identical trace, cluster, throughput model and
options. The TTD lower bounds (``services/scheduler/sim/bounds.py``) are solved once per run.

With ``--queues FILE`` (a queue file, as ``hadar queues apply`` takes) every policy runs
under those team queues (quotas, borrowing, weights; ``services/scheduler/core/queues.py``)
and the output gets a per-queue section: jobs, JCT, attained share of normalized
GPU-seconds against the weight share while every queue has demand, Jain's index and
finish-time fairness (``services/scheduler/sim/fairness.py``). Jobs take their queue from
the trace's ``queue`` column, or from ``gen:...,queues=A/B/C``: each generated job's queue
is drawn uniformly from the names (a name listed twice, twice as often) with numpy
``default_rng([seed, 1])``, apart from the draws that make the jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from shared.errors import UsageError

PLOTS = ("utilization.png", "jct_cdf.png", "ttd_bounds.png")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate scheduling policies on a job trace and compare them",
                              description=__doc__)
    p.add_argument("--cluster", required=True,
                   help="built-in (gavel-108, aws-5, lab-5, sia-64, philly-2000, ...), a YAML file, "
                        "or inline like v100:4,k80:2x4")
    p.add_argument("--trace", required=True,
                   help="CSV file, Gavel .trace file, Philly trace (timestamp,duration,num_gpus,gpu_time,cluster), "
                        "Sia/Pollux job list (name,time,application,num_replicas,"
                        "batch_size), or gen:jobs=N,rate=R,seed=S,multi_gpu=true|false"
                   "[,queues=A/B/C] (queues: job i's queue is names[k_i], k = numpy default_rng([S, 1])"
                   ".integers(len(names), size=N): uniform, a name listed twice drawn twice as often; the jobs "
                   "are those of the spec without it)")
    p.add_argument("--policies", required=True, help="comma-separated policy names, e.g. yarn-cs,gavel,hadar")
    p.add_argument("--round-s", type=float, default=360.0, help="round length in seconds (default 360)")
    p.add_argument("--seed", type=int, default=0, help="policy seed, and generator seed unless gen: gives one")
    p.add_argument("--cross-node", choices=("table", "off"), default="table",
                   help="cross-node slowdown from the table (default) or none, as Gavel's simulator")
    p.add_argument("--restart-s", default="0",
                   help="seconds lost per re-placed copy (default 0), or 'sia': each Sia application's own")
    p.add_argument("--table", choices=("auto", "gavel", "sia"), default="auto",
                   help="throughput table: Gavel's, or Sia's measured profiles (auto: Sia's for a Sia job list)")
    p.add_argument("--store-gbps", type=float, default=1.0,
                   help="object-store GB/s for HadarE consolidation (default 1.0)")
    p.add_argument("--data-plane", metavar="FILE",
                   help="charge every start, load, upload and consolidation from this measured data plane "
                        "(JSON, as benchmarks/data_plane.py writes; shared/domain/data/data_plane/ holds this "
                        "project's), instead of --restart-s and --store-gbps")
    p.add_argument("--max-rounds", type=int, default=100_000, help="stop after this many rounds per policy")
    p.add_argument("--queues", metavar="FILE", help="run every policy under the team queues of this queue file "
                   "(YAML, as for 'hadar queues apply') and report per-queue shares and fairness")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run)


def _policy_names(raw: str) -> list[str]:
    from services.scheduler.policies import POLICY_NAMES

    names = [n.strip() for n in raw.split(",") if n.strip()]
    if not names:
        raise UsageError("--policies: no policy named")
    for name in names:
        if name not in POLICY_NAMES:
            raise UsageError(f"--policies: unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")
    if len(set(names)) != len(names):
        raise UsageError("--policies: a policy is named twice")
    return names


def _is_sia_job_list(spec: str) -> bool:
    from services.scheduler.sim.sia_traces import looks_like_sia

    if spec.startswith("gen:"):
        return False
    try:
        with open(spec, encoding="utf-8") as fh:
            return looks_like_sia(fh.readline())
    except (OSError, UnicodeDecodeError):
        return False   # load_trace reports it


def run(args: argparse.Namespace) -> int:
    from services.cli.queuefile import load_queue_file
    from services.scheduler.policies import make_policy
    from services.scheduler.sim import fairness, report
    from services.scheduler.sim.bounds import ttd_bounds
    from services.scheduler.sim.cluster_spec import ClusterSpecError, parse_cluster
    from services.scheduler.sim.results import compute_results
    from services.scheduler.sim.sia_table import build_sia_throughput
    from services.scheduler.sim.sia_traces import restart_s_by_job_type
    from services.scheduler.sim.simulator import SimOptions, build_throughput, simulate
    from services.scheduler.sim.traces import TraceError, load_trace
    from shared.domain.data_plane import load_data_plane

    names = _policy_names(args.policies)
    queues = None
    if args.queues is not None:
        try:
            queues = load_queue_file(args.queues)
        except UsageError as exc:
            raise UsageError(f"--queues: {exc}") from None
    try:
        cluster = parse_cluster(args.cluster)
    except ClusterSpecError as exc:
        raise UsageError(f"--cluster: {exc}") from None
    table = args.table
    if table == "auto":
        table = "sia" if _is_sia_job_list(args.trace) else "gavel"
    cross_node = args.cross_node == "table"
    throughput = build_sia_throughput(cross_node=cross_node) if table == "sia" else build_throughput(
        cross_node=cross_node)
    try:
        jobs = load_trace(args.trace, throughput=throughput, default_seed=args.seed)
    except TraceError as exc:
        raise UsageError(f"--trace: {exc}") from None
    if queues is not None:
        unknown = sorted({queues.queue_of(j.queue) for j in jobs} - {q.name for q in queues.queues})
        if unknown:
            raise UsageError(f"--queues: the trace names queue {unknown[0]!r}, which {args.queues} does not define")
    plane = None
    if args.data_plane is not None:
        if args.restart_s != "0":
            raise UsageError("--data-plane charges restarts itself: leave --restart-s out")
        try:
            plane = load_data_plane(args.data_plane)
        except ValueError as exc:
            raise UsageError(f"--data-plane: {exc}") from None
    try:
        restart_s = 0.0 if args.restart_s == "sia" else float(args.restart_s)
        options = SimOptions(round_s=args.round_s, restart_s=restart_s, store_gbps=args.store_gbps,
                             restart_s_by_job_type=restart_s_by_job_type(jobs) if args.restart_s == "sia" else {},
                             seed=args.seed, max_rounds=args.max_rounds, queues=queues, data_plane=plane)
    except ValueError as exc:
        raise UsageError(f"--restart-s / --round-s: {exc}") from None
    policies = []
    for name in names:
        try:
            policies.append(make_policy(name))
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("services.scheduler.policies"):
                raise
            raise UsageError(f"--policies: policy {name!r} is not available in this build") from None

    results, metrics, per_queue = [], {}, {}
    for name, policy in zip(names, policies):
        started = time.perf_counter()
        observer = fairness.QueueObserver(queues) if queues is not None else None
        result = simulate(policy=policy, cluster=cluster, jobs=jobs, throughput=throughput, options=options,
                          observer=observer)
        metrics[name] = compute_results(result, throughput)
        if queues is not None and observer is not None:
            per_queue[name] = fairness.queue_fairness(result, queues, observer.rounds,
                                                      queue_of=fairness.queues_of(jobs, queues),
                                                      throughput=throughput)
        results.append(result)
        print(f"{name}: {len(result.rounds)} rounds, {metrics[name].jobs_completed}/{len(jobs)} jobs completed, "
              f"stopped: {result.stop_reason}, {time.perf_counter() - started:.1f} s", file=sys.stderr)

    summary = report.build_summary(cluster=cluster, trace=args.trace, jobs=len(jobs), metrics=metrics,
                                   bounds=ttd_bounds(jobs, cluster, throughput, first_start_s=options.first_start_s,
                                                     round_s=options.round_s),
                                   gangs_only={name: r.gangs_only for name, r in zip(names, results)},
                                   queue_config=queues, fairness=per_queue if queues is not None else None,
                                   charged=options.charges().describe())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    figures = (report.plot_utilization(results), report.plot_jct_cdf(results), report.plot_ttd_bounds(summary))
    for filename, figure in zip(PLOTS, figures):
        figure.savefig(os.path.join(args.out, filename), dpi=110)
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as fh:
        fh.write(report.render_markdown(summary, plots=PLOTS))
    print(report.format_text_table(summary["policies"]))
    return 0
