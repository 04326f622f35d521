"""Memory of the scheduler's and the tracker's state over a day of a 100-node cluster.

Feeds ``--events`` (default 1,000,000) events, in the order a day produces them, to a
fresh :class:`~services.scheduler.live.state.SchedulerState` or
:class:`~services.tracker.state.TrackerState` (the pure folds each service keeps in
memory; bus and HTTP add a constant) and samples the process's resident memory every
10% of the stream. The day: ``--nodes`` nodes with one GPU each, heartbeats every 5 s,
rounds of 360 s with one copy per node, Progress every 30 s per copy, CopyFinished and a
ModelConsolidated per job per round, and jobs of 2-6 rounds arriving to keep every node
busy. Heartbeats fill the stream up to ``--events``. Events are built before the fold is
measured, so their cost is not counted; RSS is read from /proc/self/status.

Goal (issue 12): flat after warm-up, i.e. RSS at the end minus RSS after the first 10%
of the stream <= 50 MB. Last line: one JSON object.

    .venv/bin/python benchmarks/state_growth.py --state scheduler
    .venv/bin/python benchmarks/state_growth.py --state tracker
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Iterator

from services.scheduler.live.state import SchedulerState
from shared.bus.rejection import Rejected
from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    Event,
    GpuInfo,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeHeartbeat,
    NodeRegistered,
    Progress,
    RoundStarted,
)

T0 = 1_750_000_000.0
ROUND_S = 360.0
HEARTBEAT_S = 5.0


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def day(nodes: int, events: int) -> Iterator[Event]:
    """A day's events in time order (see the module docstring); stops after ``events``."""
    emitted = 0
    node_ids = [f"n{i:03d}" for i in range(nodes)]
    for n in node_ids:
        yield NodeRegistered(ts=T0, source="agent", node_id=n, gpus=(GpuInfo(index=0, type="v100"),))
        emitted += 1
    running: dict[str, tuple[JobSpec, int, int]] = {}   # node -> (job, rounds left, steps done)
    job_seq = heartbeat_seq = 0
    r = 0
    while emitted < events:
        start = T0 + r * ROUND_S
        for n in node_ids:                               # new jobs for idle nodes
            if n not in running:
                job_seq += 1
                spec = JobSpec(job_id=f"job-{job_seq:06d}", user="bench", model="resnet", dataset="digits",
                               batch_size=32, workers=1, iterations=100 * (2 + job_seq % 5))
                yield JobSubmitted(ts=start, source="cli", job=spec, submitted_at=start)
                running[n] = (spec, 2 + job_seq % 5, 0)
        yield RoundStarted(ts=start, source="scheduler", round=r, policy="hadare", started_at=start,
                           ends_at=start + ROUND_S, nodes=tuple(node_ids), assignments=len(node_ids))
        for n, (spec, _, _) in running.items():
            yield Assignment(ts=start, source="scheduler", round=r, job=spec, copy=0, node_id=n, gpus=(0,),
                             gpu_type="v100", world_size=1, ranks=(0,), step_budget=100, deadline=start + ROUND_S)
        emitted += 1 + len(running) * 2
        for tick in range(int(ROUND_S / HEARTBEAT_S)):   # heartbeats and progress through the round
            now = start + tick * HEARTBEAT_S
            for n in node_ids:
                heartbeat_seq += 1
                yield NodeHeartbeat(ts=now, source="agent", node_id=n, seq=heartbeat_seq)
            emitted += nodes
            if tick % 6 == 0:
                for n, (spec, _, _) in running.items():
                    steps = tick * 100 // int(ROUND_S / HEARTBEAT_S)
                    yield Progress(ts=now, source="agent", job_id=spec.job_id, round=r, copy=0, node_id=n,
                                   gpu_type="v100", workers=1, steps_round=steps, steps_total=steps,
                                   samples_per_s=3200.0, loss=1.0)
                emitted += len(running)
            if emitted >= events:
                return
        end = start + ROUND_S
        for n in list(running):
            spec, left, done = running[n]
            yield CopyFinished(ts=end, source="agent", job_id=spec.job_id, round=r, copy=0, node_id=n,
                               status="ok", steps_round=100, gpu_type="v100",
                               checkpoint=checkpoint_key(spec.job_id, r, 0, node=n))
            yield ModelConsolidated(ts=end + 1, source="tracker", job_id=spec.job_id, round=r,
                                    key=model_key(spec.job_id, r), total_steps=done + 100,
                                    copies=(CopyWeight(copy=0, steps=100, weight=1.0),))
            emitted += 2
            if left <= 1:
                yield JobCompleted(ts=end + 2, source="tracker", job_id=spec.job_id, final_key=final_key(spec.job_id),
                                   total_steps=done + 100, jct_s=end + 2 - T0, completed_at=end + 2)
                emitted += 1
                del running[n]
            else:
                running[n] = (spec, left - 1, done + 100)
        r += 1


def make_state(name: str, unbounded: bool):
    if name == "scheduler":
        if unbounded:
            return SchedulerState(seen_window=sys.maxsize, rounds_kept=sys.maxsize, finished_kept=sys.maxsize)
        return SchedulerState()
    from services.tracker.state import TrackerState
    return TrackerState()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", choices=("scheduler", "tracker"), default="scheduler")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--unbounded", action="store_true",
                        help="scheduler: remember every id and round, as before the bound (for comparison)")
    args = parser.parse_args(argv)
    stream = list(day(args.nodes, args.events))
    gc.collect()
    base = rss_mb()
    state = make_state(args.state, args.unbounded)
    samples = []
    step = max(1, len(stream) // 10)
    rejected = 0
    t0 = time.perf_counter()
    for i, event in enumerate(stream, 1):
        try:
            state.apply(event)
        except Rejected:
            rejected += 1
        if i % step == 0 or i == len(stream):
            gc.collect()
            samples.append((i, round(rss_mb() - base, 1)))
            print(f"{i:>9} events: state +{samples[-1][1]:.1f} MB", file=sys.stderr)
    seconds = time.perf_counter() - t0
    warm = samples[0][1]
    result = {"state": args.state + ("-unbounded" if args.unbounded else ""), "events": len(stream),
              "nodes": args.nodes, "rejected": rejected,
              "rss_after_warmup_mb": warm, "rss_end_mb": samples[-1][1],
              "growth_after_warmup_mb": round(samples[-1][1] - warm, 1),
              "us_per_event": round(seconds / len(stream) * 1e6, 2)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
