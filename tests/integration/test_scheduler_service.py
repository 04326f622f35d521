"""The scheduler service on MemoryBus: rounds, recovery after restart, cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.rerun import LoggedEvent, rerun
from services.scheduler.live.service import SchedulerService
from services.scheduler.policies import PolicyChoice
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.wire.events import (
    Assignment,
    CopyFinished,
    CopyWeight,
    GpuInfo,
    JobCancelled,
    JobCompleted,
    JobSpec,
    JobSubmitted,
    ModelConsolidated,
    NodeRegistered,
    RoundStarted,
    ThroughputEstimate,
    UserCode,
)
from shared.wire.topics import PLACEMENTS

YARN = SchedulerConfig(policy="yarn-cs", round_s=10, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)


async def _seed(bus: MemoryBus, clock: FakeClock) -> None:
    now = clock.time()
    for node_id, gpu in (("n1", "v100"), ("n2", "t4")):
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id=node_id,
                                      gpus=(GpuInfo(index=0, type=gpu),)))
    for job_id in ("a", "b", "c"):
        spec = JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32,
                       workers=1, iterations=100)
        await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        await bus.publish(ThroughputEstimate(ts=now, source="profiler", job_id=job_id, basis="estimate",
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
    service = SchedulerService(bus=bus, config=YARN, clock=clock, run_rounds=False)
    await service.start()
    await _settle(lambda: len(service.state.jobs) == 3 and len(service.state.nodes) == 2
                  and len(service.state.rates) == 6)
    await service.plan_round()
    placed = {e.job_id for e in await _placements(bus) if isinstance(e, Assignment)}
    assert placed == {"a", "b"}            # FIFO on two single-GPU nodes; c waits

    # A consolidated model becomes the next round's start point.
    await bus.publish(ModelConsolidated(ts=clock.time(), source="tracker", job_id="a", round=0,
                                     key="models/a/0.safetensors", total_steps=50,
                                     copies=(CopyWeight(copy=0, steps=50, weight=1.0),)))
    await bus.publish(JobCancelled(ts=clock.time(), source="cli", job_id="b"))
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
    again = SchedulerService(bus=bus, config=YARN, clock=clock, run_rounds=False)
    await again.start()
    assert again.next_round == 2
    assert again.state.jobs["a"].steps_done == 50
    await again.stop()
    starts = [e for e in await _placements(bus) if isinstance(e, RoundStarted)]
    assert [s.round for s in starts] == [0, 1]
    await bus.stop()


async def _log(bus: MemoryBus) -> list[LoggedEvent]:
    items = []
    for topic in ("hadar.jobs", "hadar.nodes", "hadar.throughput", "hadar.progress", "hadar.models",
                  "hadar.placements"):
        items += [LoggedEvent(topic=d.topic, partition=d.partition, offset=d.offset, event=d.event)
                  async for d in bus.read(topic)]
    return items


async def test_rounds_describe_themselves_and_rerun_without_flags():
    """A round decided with non-default options and seed re-derives from the log alone; the
    same log re-run with the policy's defaults differs (so the options really mattered)."""
    bus = MemoryBus()
    await bus.start()
    clock = FakeClock()
    now = clock.time()
    for node_id in ("n1", "n2"):
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id=node_id, gpus=(GpuInfo(index=0, type="t4"),)))
    for i, (job_id, workers) in enumerate((("a", 1), ("wide", 2), ("b", 1))):   # FIFO: wide blocks b
        spec = JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32,
                       workers=workers, iterations=100)
        await bus.publish(JobSubmitted(ts=now + i, source="cli", job=spec, submitted_at=now + i))
        await bus.publish(ThroughputEstimate(ts=now, source="profiler", job_id=job_id, basis="estimate",
                                          workers=workers, rates={"t4": 4.0}))
    strict = SchedulerConfig(policy="yarn-cs", policy_options={"skip_blocked_head": False}, seed=11,
                             round_s=10, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=strict, clock=clock, run_rounds=False)
    await service.start()
    await _settle(lambda: len(service.state.jobs) == 3 and len(service.state.nodes) == 2)
    for _ in range(2):
        await service.plan_round()
        clock.advance(10)
    await service.stop()

    placements = await _placements(bus)
    started = [e for e in placements if isinstance(e, RoundStarted)]
    assert [(s.policy, s.policy_options, s.seed, s.round_s, s.heartbeat_s) for s in started] == \
        [("yarn-cs", '{"skip_blocked_head":false}', 11, 10.0, 1000.0)] * 2
    assert {e.job_id for e in placements if isinstance(e, Assignment)} == {"a"}   # b waits behind wide

    checks = list(rerun(await _log(bus)))
    assert [c.round for c in checks] == [0, 1] and all(c.matches for c in checks)
    assert all(c.request.seed == 11 for c in checks)
    what_if = list(rerun(await _log(bus), override=PolicyChoice(name="yarn-cs")))
    assert not what_if[0].matches and ("b", 0, "n2", (0,)) in what_if[0].rederived

    # Restarted with other options: recovery still re-derives the recorded rounds with their
    # own settings, and the next round is planned afresh with the new ones.
    relaxed = SchedulerService(bus=bus, config=YARN, clock=clock, run_rounds=False)
    await relaxed.start()
    assert relaxed.next_round == 2 and relaxed.previous is None
    await relaxed.plan_round()
    await relaxed.stop()
    last = [e for e in await _placements(bus) if isinstance(e, RoundStarted)][-1]
    assert (last.round, last.policy_options, last.seed) == (2, "{}", 0)
    assert all(c.matches for c in rerun(await _log(bus)))
    await bus.stop()


async def test_an_idle_scheduler_places_a_new_job_in_its_first_round() -> None:
    """From idle, the first round waits (briefly) for the new job's estimate: planned before
    it, the job would wait a whole round (minutes in production) on an idle cluster. The
    estimate follows the submission as the profiler's answer does, a moment later."""
    bus = MemoryBus()
    await bus.start()
    config = SchedulerConfig(policy="yarn-cs", round_s=30, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config)
    await service.start()
    try:
        now = time.time()
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="t4"),)))
        await _settle(lambda: "n1" in service.state.nodes)
        spec = JobSpec(job_id="late-rate", user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                       iterations=100)
        await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        await asyncio.sleep(0.3)
        await bus.publish(ThroughputEstimate(ts=time.time(), source="profiler", job_id="late-rate",
                                             basis="estimate", workers=1, rates={"t4": 4.0}))
        for _ in range(100):
            if any(isinstance(e, RoundStarted) for e in await _placements(bus)):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        placed = [(e.round, e.job_id) for e in await _placements(bus) if isinstance(e, Assignment)]
        assert placed == [(0, "late-rate")]
    finally:
        await service.stop()
        await bus.stop()


async def _rounds_and_placements(bus: MemoryBus, *, rounds: int) -> list:
    for _ in range(100):
        events = await _placements(bus)
        if sum(isinstance(e, RoundStarted) for e in events) >= rounds:
            await asyncio.sleep(0.2)   # the round's assignments follow its RoundStarted
            return await _placements(bus)
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {rounds} rounds started within 5 s (rounds are 30 s)")


async def test_a_round_that_placed_nothing_ends_when_its_jobs_get_estimates() -> None:
    """A scheduler that starts before its profiler plans its first round with unrated jobs
    and places nothing. The first estimate, a moment later, ends that round; the next one
    waits the moment the profiler takes to rate the other job too, then places both: waiting
    out the round would idle the whole cluster (6 minutes by default)."""
    bus = MemoryBus()
    await bus.start()
    now = time.time()
    for node in ("n1", "n2"):
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id=node, gpus=(GpuInfo(index=0, type="t4"),)))
    for job_id in ("first", "second"):
        spec = JobSpec(job_id=job_id, user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                       iterations=100)
        await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
    config = SchedulerConfig(policy="yarn-cs", round_s=30, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config)
    await service.start()
    try:
        events = await _rounds_and_placements(bus, rounds=1)
        assert not [e for e in events if isinstance(e, Assignment)]   # round 0: no estimate, nothing placed
        for job_id in ("first", "second"):
            await bus.publish(ThroughputEstimate(ts=time.time(), source="profiler", job_id=job_id,
                                                 basis="estimate", workers=1, rates={"t4": 4.0}))
            await asyncio.sleep(0.5)
        events = await _rounds_and_placements(bus, rounds=2)
        assert sorted((e.round, e.job_id) for e in events if isinstance(e, Assignment)) == [
            (1, "first"), (1, "second")]
        first, second = (e for e in events if isinstance(e, RoundStarted))
        assert second.started_at < first.ends_at
        # The empty round offered its GPUs only until the next round started.
        offered_s = second.started_at - first.started_at + (second.ends_at - second.started_at)
        assert service.state.allocation_utilization() == pytest.approx(
            (second.ends_at - second.started_at) / offered_s)
    finally:
        await service.stop()
        await bus.stop()


async def test_a_round_that_placed_nothing_ends_when_a_node_joins_and_not_on_a_heartbeat() -> None:
    """The same when the jobs had no GPU: the first node to register starts the next round.
    A node already in the cluster registering again changes nothing, so the round runs on."""
    bus = MemoryBus()
    await bus.start()
    now = time.time()
    spec = JobSpec(job_id="gang", user="u", model="resnet", dataset="digits", batch_size=32, workers=2,
                   iterations=100)
    await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
    await bus.publish(ThroughputEstimate(ts=now, source="profiler", job_id="gang", basis="estimate", workers=2,
                                         rates={"t4": 4.0}))
    config = SchedulerConfig(policy="yarn-cs", round_s=30, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config)
    await service.start()
    try:
        await _rounds_and_placements(bus, rounds=1)
        one_gpu = NodeRegistered(ts=time.time(), source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="t4"),))
        await bus.publish(one_gpu)
        events = await _rounds_and_placements(bus, rounds=2)   # a node joined: round 1 at once, still too small
        assert not [e for e in events if isinstance(e, Assignment)]
        await bus.publish(one_gpu)
        await asyncio.sleep(1.5)
        assert sum(isinstance(e, RoundStarted) for e in await _placements(bus)) == 2
        await bus.publish(NodeRegistered(ts=time.time(), source="agent", node_id="n2",
                                         gpus=(GpuInfo(index=0, type="t4"),)))
        events = await _rounds_and_placements(bus, rounds=3)
        assert sorted((e.round, e.node_id) for e in events if isinstance(e, Assignment)) == [(2, "n1"), (2, "n2")]
    finally:
        await service.stop()
        await bus.stop()


async def _evaluations(bus: MemoryBus, count: int) -> list[Assignment]:
    for _ in range(100):
        placed = [e for e in await _placements(bus) if isinstance(e, Assignment) and e.evaluation]
        if len(placed) >= count:
            return placed
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {count} evaluation copies were placed")


async def test_an_idle_scheduler_still_evaluates_the_final_model_of_a_completed_user_job() -> None:
    """The last job completing leaves the cluster idle, yet its final model (user code) still
    needs its evaluation copy: the scheduler plans a round for it alone, once more after a
    try without a metric, and no more once one reports it; replay re-derives every round."""
    bus = MemoryBus()
    await bus.start()
    config = SchedulerConfig(policy="yarn-cs", round_s=0.5, heartbeat_s=1000, late_copy_s=0, consolidation_wait_s=0)
    service = SchedulerService(bus=bus, config=config)
    await service.start()
    try:
        now = time.time()
        await bus.publish(NodeRegistered(ts=now, source="agent", node_id="n1", gpus=(GpuInfo(index=0, type="t4"),)))
        spec = JobSpec(job_id="mine", user="alice", model="user", dataset="-", batch_size=32, workers=1,
                       iterations=100, code=UserCode(digest="a" * 64, size=1, entrypoint="train.py"))
        await bus.publish(JobSubmitted(ts=now, source="cli", job=spec, submitted_at=now))
        await bus.publish(JobCompleted(ts=now, source="tracker", job_id="mine",
                                       final_key="models/mine/final.safetensors", total_steps=100, jct_s=0.0,
                                       completed_at=now))
        (first,) = await _evaluations(bus, 1)
        assert (first.job_id, first.start_from, first.node_id) == ("mine", "models/mine/final.safetensors", "n1")
        await asyncio.sleep(1.5)   # three more rounds' time: the try is in flight, nothing is re-placed
        assert len(await _evaluations(bus, 1)) == 1

        def report(a: Assignment, **outcome: object) -> CopyFinished:
            return CopyFinished(ts=time.time(), source="agent/n1", job_id="mine", round=a.round, copy=0,
                                node_id="n1", steps_round=0, evaluation=True, **outcome)  # type: ignore[arg-type]

        await bus.publish(report(first, status="failed", reason="the script crashed"))
        second = (await _evaluations(bus, 2))[1]
        await bus.publish(report(second, status="ok", metric_name="accuracy", start_metric=0.9))
        await asyncio.sleep(1.5)
        assert len(await _evaluations(bus, 1)) == 2
        assert service.state.jobs["mine"].final_metric == 0.9
        assert all(c.matches for c in rerun(await _log(bus)))
    finally:
        await service.stop()
        await bus.stop()
