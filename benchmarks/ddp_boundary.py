"""Round boundary of a DDP copy: kept warm (same rank set) against new processes each round.

One agent (MemoryBus, LocalStore) with ``--ranks`` CPU devices runs one ``--ranks``-rank
copy (gloo) for ``--rounds`` rounds in each of two phases, side by side in one run:

* ``kept``: the same GPUs and rank set every round: the ranks keep their processes and
  process group, and reload the start model in place;
* ``respawn``: the rank-to-GPU mapping rotates every round (a changed rank set): every
  rank is a new process (spawn, imports, model build, rendezvous) -- what every DDP
  round cost before warm DDP copies.

Each round starts from the previous round's checkpoint. Per phase it reports the time from
the Assignment to rank 0's first training step (the agent's
``hadar_agent_copy_start_seconds``) and the wall time per round (Assignment to
CopyFinished), median over the rounds after the phase's first. Last output line: one JSON
object with ``kept_start_s``, ``respawn_start_s``, ``kept_round_s``, ``respawn_round_s``.

Usage::

    python benchmarks/ddp_boundary.py [--rounds 4] [--ranks 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.agent.daemon.discovery import cpu_devices
from services.agent.daemon.service import AgentConfig, AgentDaemon
from services.agent.protocol import StoreTarget
from shared.bus import MemoryBus
from shared.runtime.logging import configure_logging
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Hyperparameters,
    JobSpec,
    RoundStarted,
)
from shared.wire.topics import PROGRESS

NODE = "bench"


def start_seconds(agent: AgentDaemon) -> tuple[float, float]:
    """(sum, count) of the agent's copy start histogram, both labels."""
    total, count = 0.0, 0.0
    for warm in ("true", "false"):
        labels = {"node": NODE, "emulated": "false", "warm": warm}
        total += agent.registry.get_sample_value("hadar_agent_copy_start_seconds_sum", labels) or 0.0
        count += agent.registry.get_sample_value("hadar_agent_copy_start_seconds_count", labels) or 0.0
    return total, count


async def run(args: argparse.Namespace) -> dict[str, float]:
    bus = MemoryBus()
    await bus.start()
    results: dict[str, list[tuple[float, float]]] = {"kept": [], "respawn": []}
    with tempfile.TemporaryDirectory(prefix="hadar-ddp-bench-") as tmp:
        agent = AgentDaemon(AgentConfig(node_id=NODE, progress_s=1.0, heartbeat_s=1.0, stop_timeout_s=20.0,
                                        spare_workers=0),
                            bus=bus, store=StoreTarget.local(tmp), devices=cpu_devices(args.ranks))
        finished = bus.subscribe([PROGRESS], "bench")
        await finished.start()
        await agent.start()
        spec = JobSpec(job_id="ddp-bench", user="bench", model=args.model, dataset=args.dataset, batch_size=32,
                       workers=args.ranks, iterations=10**9, hyper=Hyperparameters(optimizer="sgd", lr=0.05, seed=7))
        start_from, r = None, 0
        try:
            for phase in ("kept", "respawn"):
                for i in range(args.rounds + 1):
                    shift = i % args.ranks if phase == "respawn" else 0
                    gpus = tuple((g + shift) % args.ranks for g in range(args.ranks))
                    before = start_seconds(agent)
                    t0 = time.time()
                    await bus.publish(RoundStarted(ts=t0, source="bench", round=r, policy="hadar", started_at=t0,
                                                ends_at=t0 + 600))
                    await bus.publish(Assignment(ts=t0, source="bench", round=r, job=spec, copy=0, node_id=NODE,
                                              gpus=gpus, gpu_type="cpu", world_size=args.ranks,
                                              ranks=tuple(range(args.ranks)), step_budget=args.steps,
                                              deadline=t0 + 600, start_from=start_from))
                    while True:
                        delivery = await anext(finished)
                        await delivery.ack()
                        event = delivery.event
                        if isinstance(event, CopyFinished) and event.round == r:
                            break
                    if event.status != "ok":
                        raise SystemExit(f"round {r} ({phase}) failed: {event.reason}")
                    wall = time.time() - t0
                    after = start_seconds(agent)
                    start = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                    print(f"{phase:8s} round {r:2d} gpus {gpus}: start {start:6.2f} s, round {wall:6.2f} s",
                          flush=True)
                    if i > 0:   # the phase's first round changes the rank set from the last phase
                        results[phase].append((start, wall))
                    start_from, r = event.checkpoint, r + 1
        finally:
            await agent.stop()
            await finished.stop()
            await bus.stop()
    return {f"{phase}_{what}_s": round(statistics.median(v[k] for v in rows), 3)
            for phase, rows in results.items() for k, what in ((0, "start"), (1, "round"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds measured per phase (after its first)")
    parser.add_argument("--ranks", type=int, default=2, help="DDP ranks (CPU devices) of the copy")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round")
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--dataset", default="digits")
    args = parser.parse_args()
    configure_logging("bench", level="WARNING")
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
