"""The scheduler service on MemoryBus: rounds, recovery after restart, cancellation."""

from __future__ import annotations

import asyncio

from services.scheduler.service import SchedulerService
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.events import (
    Assignment, CopyWeight, GpuInfo, JobCancelled, JobSpec, JobSubmitted, ModelConsolidated,
    NodeRegistered, RoundStarted, ThroughputEstimate,
)
from shared.topics import PLACEMENTS


async def _seed(bus: MemoryBus, clock: FakeClock) -> None:
    now = clock.time()
    for node_id, gpu in (("n1", "v100"), ("n2", "t4")):
        await bus.emit(NodeRegistered(ts=now, source="agent", node_id=node_id,
                                      gpus=(GpuInfo(index=0, type=gpu),)))
    for job_id in ("a", "b", "c"):
        spec = JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32,
                       workers=1, iterations=100)
        await bus.emit(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        await bus.emit(ThroughputEstimate(ts=now, source="profiler", job_id=job_id, basis="estimate",
                                          workers=1, rates={"v100": 10.0, "t4": 4.0}))


async def _placements(bus: MemoryBus) -> list:
    return [d.event async for d in bus.read(PLACEMENTS)]


async def _settle(predicate) -> None:
    for _ in range(300):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("scheduler did not fold the events in time")


async def test_rounds_recovery_and_cancellation():
    bus = MemoryBus()
    await bus.start()
    clock = FakeClock()
    await _seed(bus, clock)
    service = SchedulerService(bus=bus, policy="yarn-cs", round_s=10, heartbeat_s=1000, clock=clock,
                               consolidation_wait_s=0, run_rounds=False)
    await service.start()
    await _settle(lambda: len(service.state.jobs) == 3 and len(service.state.nodes) == 2
                  and len(service.state.rates) == 6)
    await service.plan_round()
    placed = {e.job_id for e in await _placements(bus) if isinstance(e, Assignment)}
    assert placed == {"a", "b"}            # FIFO on two single-GPU nodes; c waits

    # A consolidated model becomes the next round's start point.
    await bus.emit(ModelConsolidated(ts=clock.time(), source="tracker", job_id="a", round=0,
                                     key="models/a/0.safetensors", total_steps=50,
                                     copies=(CopyWeight(copy=0, steps=50, weight=1.0),)))
    await bus.emit(JobCancelled(ts=clock.time(), source="cli", job_id="b"))
    await _settle(lambda: service.state.jobs["b"].cancelled and service.state.jobs["a"].steps_done == 50)
    clock.advance(10)
    await service.plan_round()
    await service.stop()

    events = await _placements(bus)
    round1 = [e for e in events if isinstance(e, Assignment) and e.round == 1]
    assert {e.job_id for e in round1} == {"a", "c"}          # b cancelled, c takes its GPU
    a1 = next(e for e in round1 if e.job_id == "a")
    assert a1.start_from == "models/a/0.safetensors" and a1.step_budget == 50

    # A restarted scheduler re-derives both rounds identically and continues at round 2.
    again = SchedulerService(bus=bus, policy="yarn-cs", round_s=10, heartbeat_s=1000, clock=clock,
                             consolidation_wait_s=0, run_rounds=False)
    await again.start()
    assert again.next_round == 2
    assert again.state.jobs["a"].steps_done == 50
    await again.stop()
    starts = [e for e in await _placements(bus) if isinstance(e, RoundStarted)]
    assert [s.round for s in starts] == [0, 1]
    await bus.stop()
