"""``/healthz`` latency while the live scheduler plans a 2,000-job round on 1,000 nodes.

Feeds a real :class:`SchedulerService` (MemoryBus, its HTTP endpoint on loopback) the
events of ``--nodes`` 8-GPU nodes (k80/p100/v100 drawn uniformly) and ``--jobs`` jobs from
Gavel's generator with the Gavel table's rates, then plans ``--rounds`` rounds while a
client polls ``/healthz`` every 10 ms. Side by side, in one run: ``thread`` is the
service's own ``plan_round`` (the policy runs in a worker thread); ``on-loop`` calls the
same policy on the event loop, as the scheduler did before, for contrast. The client is a
separate process (its requests go out on time even while the service's loop is blocked);
latencies are wall-clock, so note whether the machine was quiet. Last line: one JSON object.

    .venv/bin/python benchmarks/healthz_during_round.py --jobs 2000 --nodes 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decision_time import gavel_jobs, mixed_cluster

from services.scheduler.config import SchedulerConfig
from services.scheduler.core.throughput import ThroughputModel
from services.scheduler.live.rounds import RoundTiming, build_request
from services.scheduler.live.service import SchedulerService
from shared.bus import MemoryBus
from shared.runtime.service import HttpEndpoint
from shared.wire.events import (
    GpuInfo,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    ThroughputEstimate,
)


async def feed(bus: MemoryBus, args: argparse.Namespace, now: float) -> None:
    rng = np.random.default_rng(args.seed)
    table = ThroughputModel.from_gavel_table()
    for node in mixed_cluster(args.nodes, rng).nodes:
        await bus.publish(NodeRegistered(ts=now, source="bench", node_id=node.node_id,
                                      gpus=tuple(GpuInfo(index=i, type=t) for i, t in enumerate(node.gpus))))
    for job in gavel_jobs(args.jobs, table, rng):
        spec = JobSpec(job_id=job.job_id, user="bench", model="resnet", dataset="digits", batch_size=32,
                       workers=job.workers, iterations=job.total_steps)
        await bus.publish(JobSubmitted(ts=now, source="bench", job=spec, submitted_at=now - job.arrival_s))
        rates = {t: table.rate(job.job_type, t, job.workers) for t in ("k80", "p100", "v100")}
        await bus.publish(ThroughputEstimate(ts=now, source="bench", job_id=job.job_id, basis="estimate",
                                          workers=job.workers, rates={t: r for t, r in rates.items() if r > 0},
                                          model_bytes=job.model_bytes))


def poll(url: str, stop, out) -> None:
    """In a child process: GET ``url`` every 10 ms until ``stop`` is set; latencies to ``out``."""
    latencies = []
    while not stop.is_set():
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as response:
            response.read()
        latencies.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.01)
    out.put(latencies)


async def measure(service: SchedulerService, url: str, mode: str, rounds: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    poller = ctx.Process(target=poll, args=(url, stop, out), daemon=True)
    poller.start()
    await asyncio.sleep(2.0)   # the child starts and polls an idle service first
    decision = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        if mode == "thread":
            await service.plan_round()
        else:   # the pre-fix path: the policy on the event loop
            timing = RoundTiming(round=service.next_round, started_at=time.time(), round_s=360.0, heartbeat_s=1e6)
            service.policy.plan(build_request(service.state, timing, None, 0))
            await asyncio.sleep(0)
        decision.append((time.perf_counter() - t0) * 1e3)
    await asyncio.sleep(0.5)
    stop.set()
    latencies = await asyncio.to_thread(out.get)
    await asyncio.to_thread(poller.join)
    ordered = sorted(latencies)
    return {"polls": len(ordered), "p50_ms": round(statistics.median(ordered), 1),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
            "max_ms": round(ordered[-1], 1), "round_ms_mean": round(statistics.mean(decision), 1)}


async def main_async(args: argparse.Namespace) -> dict:
    bus = MemoryBus(source="bench")
    await bus.start()
    await feed(bus, args, time.time())
    config = SchedulerConfig(policy=args.policy, round_s=360.0, heartbeat_s=1e6, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config, run_rounds=False)
    http = HttpEndpoint(service, host="127.0.0.1", port=0)
    await http.start()
    await service.start()
    while len(service.state.rates) < args.jobs or len(service.state.nodes) < args.nodes:
        await asyncio.sleep(0.1)
    url = f"http://127.0.0.1:{http.port}/healthz"
    result = {"jobs": args.jobs, "nodes": args.nodes, "policy": args.policy}
    for mode in ("thread", "on-loop"):
        result[mode] = await measure(service, url, mode, args.rounds)
        print(f"{mode:8} {result[mode]}", file=sys.stderr)
    await service.stop()
    await http.stop()
    await bus.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--policy", default="hadare")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
