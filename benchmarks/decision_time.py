"""Decision time of one planning round for hadar, hadare and gavel at scale.

Builds ``--jobs`` active jobs from Gavel's generator (multi-GPU traces: scale factor
1/2/4/8 w.p. .70/.10/.15/.05, job type redrawn until it has a measurement at that scale;
steps = duration x V100 rate at that scale, duration 60*10^U(1.5,3) s w.p. .8 else
60*10^U(3,4) s) on ``--nodes`` nodes of 8 GPUs, each GPU's type drawn uniformly from
k80/p100/v100, and times ``plan()`` on the round in which every job is planned (no
previous plan). Runs on one core (BLAS threads pinned to 1 before numpy loads) and
reports the process CPU time of each ``plan()`` call, which is its time on one core and,
unlike wall time, does not grow when other processes share the machine (stderr also shows
wall times). Last output line: one JSON object {"jobs", "nodes", "hadar_ms_p50",
"hadare_ms_p50", "gavel_ms_p50"} (a policy that is missing or fails reports null; see
stderr). With ``--queues FILE`` jobs go to the file's queues in turn and each policy is
also timed on the same request without queues, call by call alternated with the queued
one, as ``<policy>_ms_p50_without_queues``: the mechanism's cost as a ratio measured on the
same machine state, and the mechanism's own CPU time (the queued plan less the time inside
the policy's ``plan()`` calls on each queue's partition) as ``<policy>_mechanism_ms_p50``.

    .venv/bin/python benchmarks/decision_time.py --jobs 2000 --nodes 1000
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

from services.cli.queuefile import load_queue_file
from services.scheduler.core.cluster import Cluster, Node
from services.scheduler.core.policy import JobState, Plan, PlanRequest, Policy, check_plan, forks
from services.scheduler.core.queues import plan_with_queues
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.policies import (
    UnknownPolicy,
    make_policy,
    parse_scoped_policy_option,
)
from services.scheduler.sim.simulator import default_model_bytes

GPU_TYPES = ("k80", "p100", "v100")
SCALES = (1, 2, 4, 8)
SCALE_P = (0.70, 0.10, 0.15, 0.05)


def gavel_jobs(n: int, throughput: ThroughputModel, rng: np.random.Generator) -> tuple[JobState, ...]:
    types = throughput.job_types
    jobs = []
    for i in range(n):
        scale = int(rng.choice(SCALES, p=SCALE_P))
        while True:
            job_type = types[int(rng.integers(len(types)))]
            if scale in throughput.scales(job_type, "v100"):
                break
        if rng.random() < 0.8:
            duration = 60 * 10 ** rng.uniform(1.5, 3)
        else:
            duration = 60 * 10 ** rng.uniform(3, 4)
        steps = max(1, int(duration * throughput.rate(job_type, "v100", scale)))
        jobs.append(JobState(job_id=f"job{i:05d}", job_type=job_type, workers=scale, total_steps=steps,
                             arrival_s=float(rng.uniform(0, 3600)), model_bytes=default_model_bytes(job_type)))
    return tuple(jobs)


def mixed_cluster(n: int, rng: np.random.Generator, gpus_per_node: int = 8) -> Cluster:
    nodes = tuple(Node(node_id=f"n{i:04d}", gpus=tuple(GPU_TYPES[k] for k in rng.integers(3, size=gpus_per_node)))
                  for i in range(n))
    return Cluster(name=f"mixed-{n}", nodes=nodes)


class _Timed:
    """The policy, counting the CPU seconds spent in its own ``plan()`` (``inside``)."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self.name, self.inside = policy, policy.name, 0.0
        self.forks = forks(policy)

    def plan(self, request: PlanRequest) -> Plan:
        start = time.process_time()
        try:
            return self.policy.plan(request)
        finally:
            self.inside += time.process_time() - start


def time_policy(name: str, request: PlanRequest, repeats: int, options: dict | None = None) -> list[float] | None:
    """Median CPU ms of ``repeats`` plans of ``request``; with queues, also of the same request
    without them, alternated call by call so both see the same machine (the second), and of
    the mechanism alone in the queued plans (the third)."""
    try:
        policy = _Timed(make_policy(name, **(options or {})))
    except Exception as exc:  # the policy module may not exist yet
        print(f"{name}: unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    variants = [("", request)]
    if request.queues is not None:
        variants.append((" without queues", replace(request, queues=None)))
    samples: dict[str, list[float]] = {label: [] for label, _ in variants}
    walls: dict[str, list[float]] = {label: [] for label, _ in variants}
    plans = {}
    mechanism: list[float] = []
    for _ in range(repeats):
        for label, req in variants:
            policy.inside = 0.0
            start, wall = time.process_time(), time.perf_counter()
            plans[label] = plan_with_queues(policy, req)   # policy.plan(req) itself when there are no queues
            samples[label].append((time.process_time() - start) * 1e3)
            walls[label].append((time.perf_counter() - wall) * 1e3)
            if label == "":
                mechanism.append(samples[label][-1] - policy.inside * 1e3)
    for label, req in variants:
        plan = plans[label]
        check_plan(req, plan)
        placed = len({p.job_id for p in plan.placements})
        print(f"{name}{label}: cpu ms {[round(s, 1) for s in samples[label]]}, "
              f"wall ms {[round(s, 1) for s in walls[label]]}; jobs placed {placed}/{len(req.jobs)}, "
              f"GPUs used {sum(len(p.gpus) for p in plan.placements)}/{req.cluster.total_gpus}", file=sys.stderr)
    if request.queues is not None:
        print(f"{name} mechanism: cpu ms {[round(s, 1) for s in mechanism]}", file=sys.stderr)
    return [statistics.median(samples[label]) for label, _ in variants] + [statistics.median(mechanism)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="hadar,hadare,gavel")
    parser.add_argument("--queues", default=None, metavar="FILE",
                        help="plan under these team queues (a queue file); jobs go to them in turn, by index")
    parser.add_argument("--policy-option", action="append", default=[], metavar="POLICY:KEY=VALUE",
                        help="a constructor option for one policy, e.g. hadar:critical_rule=laxity (repeatable)")
    args = parser.parse_args(argv)
    options: dict[str, dict] = {}
    for text in args.policy_option:
        try:
            name, key, value = parse_scoped_policy_option(text)
        except UnknownPolicy as exc:
            parser.error(str(exc))
        options.setdefault(name, {})[key] = value
    rng = np.random.default_rng(args.seed)
    throughput = ThroughputModel.from_gavel_table()
    cluster = mixed_cluster(args.nodes, rng)
    jobs = gavel_jobs(args.jobs, throughput, rng)
    queues = load_queue_file(args.queues) if args.queues else None
    if queues is not None:
        names = [q.name for q in queues.queues]
        jobs = tuple(replace(j, queue=names[i % len(names)]) for i, j in enumerate(jobs))
    request = PlanRequest(round=0, now_s=3600.0, round_s=360.0, cluster=cluster, jobs=jobs,
                        throughput=throughput, seed=args.seed, queues=queues)
    result: dict[str, float | int | str | None] = {"jobs": args.jobs, "nodes": args.nodes, "queues": args.queues}
    for name in ("hadar", "hadare", "gavel"):
        p50s = time_policy(name, request, args.repeats, options.get(name)) if name in args.policies.split(",") else None
        result[f"{name}_ms_p50"] = None if p50s is None else round(p50s[0], 1)
        if queues is not None:
            result[f"{name}_ms_p50_without_queues"] = None if p50s is None else round(p50s[1], 1)
            result[f"{name}_mechanism_ms_p50"] = None if p50s is None else round(p50s[2], 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
