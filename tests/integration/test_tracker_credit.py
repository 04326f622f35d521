"""A job is never credited more than its iterations (issue 17 item 3: "a 300-iteration job
reported total_steps 368").

How it happened: the scheduler budgets a round from the last *announced* total, so a round
planned before the previous round's model was announced (``consolidation_wait_s`` ran out)
gets the whole remainder again; both rounds train and both were credited in full. The
tracker is the only place that knows the exact total when it credits, so it clips: a
round's credit is at most what the job has left (docs/architecture.md "Work accounting").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from safetensors.numpy import save

from services.tracker.service import TrackerConfig, TrackerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.domain.layout import checkpoint_key
from shared.store import LocalStore
from shared.wire.events import (
    Assignment,
    CopyFinished,
    Event,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    RoundStarted,
)
from shared.wire.topics import MODELS

T0 = 1_700_000_000.0


@pytest.fixture
async def memory_bus() -> AsyncIterator[MemoryBus]:
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    yield bus
    await bus.stop()


async def run_round(bus: MemoryBus, store: LocalStore, job: JobSpec, round_: int, *, budget: int, steps: int,
                    workers: int = 1) -> None:
    started = T0 + 360 * round_
    await bus.publish(RoundStarted(ts=started, source="scheduler", round=round_, policy="hadare",
                                started_at=started, ends_at=started + 360, assignments=1))
    await bus.publish(Assignment(ts=started, source="scheduler", round=round_, job=job, copy=0, node_id="n0",
                              gpus=tuple(range(workers)), gpu_type="V100", world_size=workers,
                              ranks=tuple(range(workers)), step_budget=budget, deadline=started + 360))
    key = checkpoint_key(job.job_id, round_, 0, node="n0")
    await store.put(key, save({"w": np.full((4,), float(round_), dtype=np.float32)}))
    await bus.publish(CopyFinished(ts=started + 350, source="agent/n0", job_id=job.job_id, round=round_, copy=0,
                                node_id="n0", status="ok", steps_round=steps, checkpoint=key))


async def wait_models(bus: MemoryBus, job_id: str, predicate, timeout_s: float = 20.0) -> list[Event]:
    deadline = time.monotonic() + timeout_s
    while True:
        events = [d.event async for d in bus.read(MODELS) if getattr(d.event, "job_id", None) == job_id]
        if predicate(events):
            return events
        assert time.monotonic() < deadline, f"timed out; hadar.models has {events}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("workers", [1, 4])
async def test_a_round_planned_on_a_stale_total_is_credited_only_what_the_job_had_left(
        memory_bus: MemoryBus, local_store: LocalStore, workers: int) -> None:
    job = JobSpec(job_id=f"j-credit-{workers}", user="alice", model="resnet-8", dataset="digits", batch_size=32,
                  workers=workers, iterations=300)
    await memory_bus.publish(JobSubmitted(ts=T0 - 10, source="cli", job=job, submitted_at=T0 - 10))
    service = TrackerService(bus=memory_bus, store=local_store, clock=FakeClock(T0 + 1000),
                             config=TrackerConfig(group="tracker-credit", tick_s=0.05, finish_timeout_s=3600))
    await service.start()
    try:
        # Round 0 stops at its deadline after 200 of 300 steps; round 1 was planned before round
        # 0's model was announced, so its budget is the whole job again, and it does 168 steps.
        await run_round(memory_bus, local_store, job, 0, budget=300, steps=200, workers=workers)
        await wait_models(memory_bus, job.job_id, lambda es: any(isinstance(e, ModelConsolidated) for e in es))
        await run_round(memory_bus, local_store, job, 1, budget=300, steps=168, workers=workers)
        events = await wait_models(memory_bus, job.job_id, lambda es: any(isinstance(e, JobCompleted) for e in es))
    finally:
        await service.stop()
    totals = [e.total_steps for e in events if isinstance(e, ModelConsolidated)]
    (done,) = [e for e in events if isinstance(e, JobCompleted)]
    assert totals == [200, 300] and done.total_steps == 300
    # The copies' own steps are still reported as trained: the clip is in the credit only.
    last = [e for e in events if isinstance(e, ModelConsolidated)][-1]
    assert [c.steps for c in last.copies] == [168]


async def test_a_restarted_tracker_rebuilds_the_clipped_credit(memory_bus: MemoryBus,
                                                               local_store: LocalStore) -> None:
    job = JobSpec(job_id="j-credit-restart", user="alice", model="resnet-8", dataset="digits", batch_size=32,
                  workers=1, iterations=300)
    await memory_bus.publish(JobSubmitted(ts=T0 - 10, source="cli", job=job, submitted_at=T0 - 10))
    config = TrackerConfig(group="tracker-credit-restart", tick_s=0.05, finish_timeout_s=3600)
    first = TrackerService(bus=memory_bus, store=local_store, clock=FakeClock(T0 + 1000), config=config)
    await first.start()
    try:
        await run_round(memory_bus, local_store, job, 0, budget=300, steps=250)
        await wait_models(memory_bus, job.job_id, lambda es: any(isinstance(e, ModelConsolidated) for e in es))
        await run_round(memory_bus, local_store, job, 1, budget=300, steps=120)
        await wait_models(memory_bus, job.job_id, lambda es: any(isinstance(e, JobCompleted) for e in es))
    finally:
        await first.stop()
    second = TrackerService(bus=memory_bus, store=local_store, clock=FakeClock(T0 + 1100), config=config)
    await second.start()
    try:
        assert second.state.consolidated_steps(job.job_id) == 300
    finally:
        await second.stop()
