"""The ``junk`` fault of ``benchmarks/faults.py``: records that are no events, and events that
are false, across every topic (issue 13 item 5)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from benchmarks.fault_harness import Cluster
from benchmarks.fault_scenarios import first_progress
from shared.bus import KafkaBus
from shared.wire.events import (
    CopyFinished,
    CopyWeight,
    Event,
    JobCompleted,
    ModelConsolidated,
    NodeHeartbeat,
    Progress,
    RoundStarted,
    ThroughputEstimate,
)
from shared.wire.topics import ALL_TOPICS

__all__ = ["junk"]


def junk(c: Cluster, timeout_s: float, count: int = 1000, seed: int = 0, *, wait: bool = True) -> float:
    """``count`` records across every topic: random bytes, msgpack that is no event, and
    well-formed events that are false (forged round numbers, keys, copies, rates); mid-round
    once the system made progress, or at once (``wait=False``)."""
    if wait:
        first_progress(c, timeout_s)
    c.struck()
    asyncio.run(_publish_junk(c, count, random.Random(seed)))
    return time.time()


async def _publish_junk(c: Cluster, count: int, rng: random.Random) -> None:
    import msgpack

    bus = KafkaBus(c.bootstrap, source="forger")
    await bus.start()
    try:
        job = c.job_ids[0]
        node = c.workload.agents[0][0]
        now = time.time()
        forged: list[Callable[[int], Event]] = [
            lambda i: RoundStarted(ts=now, source="forger", round=10**6 + i, policy="hadare", started_at=now,
                                   ends_at=now + 10),
            lambda i: CopyFinished(ts=now, source="forger", job_id=job, round=i % 5, copy=7, node_id=node,
                                   status="ok", steps_round=10**6,
                                   checkpoint=f"checkpoints/{job}/{i % 5}/{node}/9.safetensors"),
            lambda i: ModelConsolidated(ts=now, source="forger", job_id=job, round=i % 5,
                                        key=f"models/{job}/forged-{i}.safetensors", total_steps=10**6,
                                        copies=(CopyWeight(copy=0, steps=1, weight=1.0),)),
            lambda i: JobCompleted(ts=now, source="forger", job_id=job, final_key=f"models/{job}/forged.safetensors",
                                   total_steps=10**6, jct_s=1.0, completed_at=now),
            lambda i: NodeHeartbeat(ts=now, source="forger", node_id=f"ghost-{i}", seq=i),
            lambda i: ThroughputEstimate(ts=now, source="forger", job_id=job, basis="measured", workers=1,
                                         rates={"t4": 1e9}),
            lambda i: Progress(ts=now, source="forger", job_id=job, round=i % 5, copy=0, node_id=node,
                               gpu_type="t4", workers=1, steps_round=10**7, steps_total=10**7,
                               samples_per_s=1e12, loss=0.0),
        ]
        for i in range(count):
            kind = i % 3
            if kind == 0:
                topic = ALL_TOPICS[i % len(ALL_TOPICS)]
                await bus.write_raw(topic, job, rng.randbytes(rng.randint(0, 300)))
            elif kind == 1:
                topic = ALL_TOPICS[i % len(ALL_TOPICS)]
                body = {"type": rng.choice(["Assignment", "JobSubmitted", "Nope"]), "v": rng.randint(0, 9),
                        "id": "x" * rng.randint(0, 40), "junk": rng.random()}
                await bus.write_raw(topic, job, msgpack.packb(body))
            else:
                try:
                    event = forged[i % len(forged)](i)
                except Exception:
                    continue
                c.forged_ids.add(event.id)
                await bus.publish(event)
    finally:
        await bus.stop()
