"""The scheduler's round loop survives failing policies and publishes, plans off the event
loop, and a forged far-ahead RoundStarted does not move its round counter (issue 12)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable

from services.scheduler.config import SchedulerConfig
from services.scheduler.core.policy import Placement, Plan, PlanRequest
from services.scheduler.live.rerun import LoggedEvent, rerun
from services.scheduler.live.service import SchedulerService
from shared.bus import BusError, MemoryBus
from shared.clock import FakeClock
from shared.wire.events import (
    Assignment,
    Event,
    GpuInfo,
    JobSpec,
    JobSubmitted,
    NodeRegistered,
    RoundStarted,
    ThroughputEstimate,
    topic_for,
)
from shared.wire.topics import ALL_TOPICS, PLACEMENTS

FAST = SchedulerConfig(policy="yarn-cs", round_s=0.2, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)


async def _seed(bus: MemoryBus, now: float, jobs: tuple[str, ...] = ("a", "b")) -> None:
    for node_id in ("n1", "n2"):
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id=node_id, gpus=(GpuInfo(index=0, type="t4"),)))
    for job_id in jobs:
        spec = JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                       iterations=10**6)
        await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        await bus.publish(ThroughputEstimate(ts=now, source="profiler", job_id=job_id, basis="estimate", workers=1,
                                          rates={"t4": 4.0}))


async def _placements(bus: MemoryBus) -> list[Event]:
    return [d.event async for d in bus.read(PLACEMENTS)]


async def _until(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


class FlakyPolicy:
    """Wraps a policy: raises on the first ``failures`` calls, records the calling thread."""

    def __init__(self, inner, failures: int) -> None:
        self.inner, self.failures, self.name = inner, failures, inner.name
        self.threads: list[int] = []

    def plan(self, request: PlanRequest) -> Plan:
        self.threads.append(threading.get_ident())
        if self.failures > 0:
            self.failures -= 1
            raise ZeroDivisionError("policy bug")
        return self.inner.plan(request)


class DoubleBookingPolicy:
    """Wraps a policy: its first ``bad`` plans give one GPU to two jobs (a policy bug that
    check_plan catches); then it plans as the wrapped policy."""

    def __init__(self, inner, bad: int) -> None:
        self.inner, self.bad, self.name = inner, bad, inner.name

    def plan(self, request: PlanRequest) -> Plan:
        if self.bad > 0:
            self.bad -= 1
            node = request.cluster.nodes[0].node_id
            return Plan(placements=tuple(Placement(job_id=j.job_id, copy=0, node_id=node, gpus=(0,))
                                         for j in request.jobs))
        return self.inner.plan(request)


class FlakyBus(MemoryBus):
    """Fails the first ``failures`` publishes of Assignments with a retriable BusError."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def _gate(self, event: Event) -> None:
        if isinstance(event, Assignment) and self.failures > 0:
            self.failures -= 1
            raise BusError("publish: broker away", retriable=True)

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        self._gate(event)   # publish goes through here too
        return await super().publish_pipelined(event, topic=topic, key=key)


class HoldingBus(MemoryBus):
    """Kafka's idempotent producer during an outage: records are accepted and neither
    acknowledged nor failed while ``holding``; :meth:`release` writes what it held (the
    broker is back) and acknowledges it. ``publish`` waits likewise."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = True
        self.held: list[tuple[Event, asyncio.Future[tuple[int, int]]]] = []

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        if self.holding and topic_for(event) == PLACEMENTS:
            ack: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
            self.held.append((event, ack))
            return ack
        return await super().publish_pipelined(event, topic=topic, key=key)

    async def release(self) -> None:
        self.holding = False
        for event, ack in self.held:
            ack.set_result(await (await super().publish_pipelined(event)))


async def test_a_failing_policy_does_not_kill_the_round_loop_and_runs_off_the_event_loop():
    bus = MemoryBus()
    await bus.start()
    await _seed(bus, time.time())
    service = SchedulerService(bus=bus, config=FAST)
    flaky = FlakyPolicy(service.policy, failures=2)
    service.policy = flaky
    await service.start()
    try:
        await _until(lambda: service.next_round >= 2)
        assert service.health()["ok"], service.health()
        failures = service.registry.get_sample_value("hadar_scheduler_round_failures_total", {"stage": "plan"})
        assert failures == 2
        assert threading.get_ident() not in flaky.threads     # plan() ran in a worker thread
    finally:
        await service.stop()
        await bus.stop()


async def test_a_plan_that_breaks_an_invariant_is_never_published_and_the_round_is_retried():
    bus = MemoryBus()
    await bus.start()
    await _seed(bus, time.time())
    service = SchedulerService(bus=bus, config=FAST)
    service.policy = DoubleBookingPolicy(service.policy, bad=2)
    await service.start()
    try:
        await _until(lambda: service.next_round >= 2)
        failures = service.registry.get_sample_value("hadar_scheduler_round_failures_total", {"stage": "invalid_plan"})
        assert failures == 2
        assignments = [e for e in await _placements(bus) if isinstance(e, Assignment)]
        used = [(a.round, a.node_id, g) for a in assignments for g in a.gpus]
        assert len(used) == len(set(used)), "a GPU given twice in one round was published"
        rounds = sorted({e.round for e in await _placements(bus) if isinstance(e, RoundStarted)})
        assert rounds == list(range(len(rounds)))     # no round number skipped by the refusals
    finally:
        await service.stop()
        await bus.stop()


async def test_a_publish_failure_is_retried_and_the_round_is_published_whole_once():
    bus = FlakyBus(failures=3)
    await bus.start()
    await _seed(bus, time.time())
    service = SchedulerService(bus=bus, config=SchedulerConfig(policy="yarn-cs", round_s=5, heartbeat_s=1000,
                                                               late_copy_s=0, consolidation_wait_s=0))
    await service.start()
    try:
        await _until(lambda: any(len(r.assignments) == 2 for r in service.state.rounds.values()))
    finally:
        await service.stop()
    assert bus.failures == 0
    events = await _placements(bus)
    first = min(e.round for e in events if isinstance(e, Assignment))
    placed = [e for e in events if e.round == first]
    assert sum(isinstance(e, RoundStarted) for e in placed) == 1
    assert sorted(e.job_id for e in placed if isinstance(e, Assignment)) == ["a", "b"]
    assert len({e.id for e in events}) == len(events)
    await bus.stop()


async def test_a_forged_far_ahead_round_does_not_move_the_round_counter():
    bus = MemoryBus()
    await bus.start()
    clock = FakeClock()
    await _seed(bus, clock.time())
    config = SchedulerConfig(policy="yarn-cs", round_s=10, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config, clock=clock, run_rounds=False)
    await service.start()
    await _until(lambda: len(service.state.jobs) == 2 and len(service.state.rates) == 2)
    for _ in range(2):
        await service.plan_round()
        clock.advance(10)
    await service.stop()
    await bus.publish(RoundStarted(ts=clock.time(), source="scheduler", round=10**6, policy="yarn-cs",
                                started_at=clock.time(), ends_at=clock.time() + 10))

    again = SchedulerService(bus=bus, config=config, clock=clock, run_rounds=False)
    await again.start()
    assert again.next_round == 2
    await again.stop()
    log = [LoggedEvent(topic=d.topic, partition=d.partition, offset=d.offset, event=d.event)
           for topic in ALL_TOPICS async for d in bus.read(topic)]
    checks = list(rerun(log))
    assert [c.round for c in checks if c.matches] == [0, 1]
    forged = [c for c in checks if c.round == 10**6]
    assert len(forged) == 1 and "out of sequence" in (forged[0].error or "")
    await bus.stop()


async def test_a_forged_model_announcement_is_dead_lettered_and_the_loop_goes_on():
    from shared.domain.layout import model_key
    from shared.wire.events import CopyWeight, DeadLetter, ModelConsolidated
    from shared.wire.topics import DEADLETTER, MODELS

    bus = MemoryBus()
    await bus.start()
    clock = FakeClock()
    await _seed(bus, clock.time())
    config = SchedulerConfig(policy="yarn-cs", round_s=10, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config, clock=clock, run_rounds=False)
    await service.start()
    try:
        await _until(lambda: len(service.state.jobs) == 2 and len(service.state.rates) == 2)
        await service.plan_round()
        forged = ModelConsolidated(ts=clock.time(), source="tracker", job_id="a", round=0,
                                   key="models/victim/final.safetensors", total_steps=10**6,
                                   copies=(CopyWeight(copy=0, steps=1, weight=-3.0),))
        real = ModelConsolidated(ts=clock.time(), source="tracker", job_id="a", round=0, key=model_key("a", 0),
                                 total_steps=50, copies=(CopyWeight(copy=0, steps=50, weight=1.0),))
        await bus.publish(forged)
        await bus.publish(real)
        await _until(lambda: service.state.jobs["a"].steps_done == 50)
        assert service.state.jobs["a"].model_key == model_key("a", 0)
        letters = [d.event async for d in bus.read(DEADLETTER)]
        assert len(letters) == 1 and isinstance(letters[0], DeadLetter) and letters[0].topic == MODELS
        assert "key" in letters[0].reason
        assert service.registry.get_sample_value("hadar_scheduler_events_rejected_total",
                                                 {"type": "ModelConsolidated"}) == 1
        assert service.health()["ok"]
    finally:
        await service.stop()
        await bus.stop()


async def test_a_round_whose_publish_the_broker_holds_is_given_up_at_its_end_and_the_loop_goes_on():
    """A broker away for minutes: the client holds the records, a publish neither fails nor
    returns. The round is given up at its end (RoundFailed, stage publish) instead of
    blocking the round loop until the broker is back; the loop plans again once it is."""
    bus = HoldingBus()
    await bus.start()
    await _seed(bus, time.time())
    service = SchedulerService(bus=bus, config=SchedulerConfig(policy="yarn-cs", round_s=0.5, heartbeat_s=1000,
                                                               late_copy_s=0, consolidation_wait_s=0))
    await service.start()
    try:
        def failures() -> float:
            return service.registry.get_sample_value("hadar_scheduler_round_failures_total",
                                                     {"stage": "publish"}) or 0.0
        await _until(lambda: failures() >= 1, timeout_s=15.0)
        held_rounds = {e.round for e, _ in bus.held if isinstance(e, RoundStarted)}
        await bus.release()
        await _until(lambda: any(len(r.assignments) == 2 for r in service.state.rounds.values()), timeout_s=15.0)
        assert service.health()["ok"], service.health()
        # What the client held is written once the broker is back: a held round's number is
        # never used again for another plan.
        rounds = [e.round for e in await _placements(bus) if isinstance(e, RoundStarted)]
        assert held_rounds and held_rounds <= set(rounds)
        assert len(rounds) == len(set(rounds)), rounds
    finally:
        await service.stop()
        await bus.stop()


class SlowAckBus(MemoryBus):
    """Acknowledges every record after ``ack_s`` of real time, as a real broker does."""

    def __init__(self, ack_s: float) -> None:
        super().__init__()
        self.ack_s = ack_s

    async def publish(self, event: Event, *, topic: str | None = None, key: str | None = None) -> tuple[int, int]:
        # The test's own publishes (its inputs) are acknowledged at once; the scheduler's
        # pipelined placements slowly.
        return await (await super().publish_pipelined(event, topic=topic, key=key))

    async def publish_pipelined(self, event: Event, *, topic: str | None = None,
                                key: str | None = None) -> Awaitable[tuple[int, int]]:
        where = await (await super().publish_pipelined(event, topic=topic, key=key))

        async def later() -> tuple[int, int]:
            await asyncio.sleep(self.ack_s)
            return where
        return asyncio.ensure_future(later())


async def test_a_fake_clock_does_not_make_a_slow_acknowledgement_look_like_the_round_end():
    """Under a FakeClock (replay, simulation-style tests) the wait for a real acknowledgement
    is real time: the fake clock's sleep jumped the clock past the round's end while a real
    broker took 10 ms to acknowledge (test_topic_retention on Kafka failed so)."""
    bus = SlowAckBus(ack_s=0.6)
    await bus.start()
    clock = FakeClock(start=time.time())
    await _seed(bus, clock.time())
    service = SchedulerService(bus=bus, config=SchedulerConfig(policy="yarn-cs", round_s=60, heartbeat_s=1000,
                                                               late_copy_s=0, consolidation_wait_s=0),
                               clock=clock, run_rounds=False)
    await service.start()
    try:
        await service.plan_round()
        assert service.next_round == 1
        assert len(service.state.rounds[0].assignments) == 2
    finally:
        await service.stop()
        await bus.stop()
