"""Topics KafkaBus creates carry the retention policy (shared/wire/retention.py), on a real broker;
and a scheduler restarted from a state snapshot after retention deleted the records before
it decides as one that never stopped.

The broker is this module's own, in a private run directory: a shared broker may hold
topics created before the policy existed, and this one checks retention every 500 ms
(``kafka-extra.properties``; the broker's default is every 5 minutes).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from services.scheduler.config import SchedulerConfig
from services.scheduler.live.rerun import assignment_decision
from services.scheduler.live.scripted_cluster import ScriptedCluster
from services.scheduler.live.service import SchedulerService
from shared.bus import Bus, MemoryBus
from shared.bus.kafka import KafkaBus
from shared.clock import FakeClock
from shared.domain.layout import snapshot_key
from shared.store import LocalStore
from shared.wire.events import Assignment, JobSubmitted
from shared.wire.retention import topic_configs
from shared.wire.topics import ALL_TOPICS, JOBS, MODELS, NODES, PLACEMENTS, THROUGHPUT
from tests.integration.retention_kafka import set_retention

pytestmark = pytest.mark.kafka
UNKNOWN_TOPIC = 3


async def described(bootstrap: str, topics: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """Each topic's configs; waits (10 s at most) for topics just created to be known."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(50):
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, topic) for topic in topics])
            resources = [r for response in responses for r in response.resources]
            if all(r[0] != UNKNOWN_TOPIC for r in resources):
                break
            await asyncio.sleep(0.2)
    finally:
        await admin.close()
    found: dict[str, dict[str, str]] = {}
    for error_code, message, _type, name, entries in resources:
        assert error_code == 0, f"{name}: error {error_code} {message}"
        found[name] = {entry[0]: entry[1] for entry in entries}
    return found


async def test_topics_are_created_with_their_retention_policy(private_bootstrap: str) -> None:
    bus = KafkaBus(private_bootstrap, source="retention-test")
    await bus.start()
    try:
        await bus.ensure_topics()
        await bus.ensure_topics(["a-test-topic"])
    finally:
        await bus.stop()
    configs = await described(private_bootstrap, (*ALL_TOPICS, "a-test-topic"))
    for topic in ALL_TOPICS:
        wanted = topic_configs(topic)
        assert wanted and {name: configs[topic][name] for name in wanted} == wanted, topic
    assert configs["a-test-topic"]["retention.ms"] == "604800000"  # not ours: broker default


ROUND_S = 60.0
DAY_S = 86_400.0
SHORT_LIVED = (JOBS, NODES, THROUGHPUT, MODELS, PLACEMENTS)   # what the scheduler reads back


async def _old_jobs_left(bus: Bus, ids: set[str]) -> int:
    return len([d async for d in bus.read(JOBS) if isinstance(d.event, JobSubmitted) and d.event.job.job_id in ids])


async def _play(service: SchedulerService, cluster: ScriptedCluster, clock: FakeClock, rounds: range,
                *, fed: bool = False) -> None:
    """Plan ``rounds``; ``fed``: the first round's inputs are already published."""
    for r in rounds:
        if not (fed and r == rounds.start):
            kept = service.state.rounds.get(r - 1)
            await cluster.before_round(r, list(kept.assignments) if kept is not None else [])
        async with asyncio.timeout(60):
            while service.records_folded < cluster.published:
                await asyncio.sleep(0.02)
        await service.plan_round()
        clock.advance(ROUND_S)


async def _decisions(bus: Bus, first: int) -> dict[int, tuple]:
    found: dict[int, list[Assignment]] = {}
    async for d in bus.read(PLACEMENTS):
        if isinstance(d.event, Assignment) and d.event.round >= first:
            found.setdefault(d.event.round, []).append(d.event)
    return {r: assignment_decision(a) for r, a in sorted(found.items())}


async def _reference(start: float, rounds_before: int, rounds_after: int) -> dict[int, tuple]:
    """The same script on a MemoryBus, one scheduler that never stops."""
    bus, clock = MemoryBus(), FakeClock(start=start)
    await bus.start()
    service = SchedulerService(bus=bus, config=_config("ref"), clock=clock, run_rounds=False)
    await service.start()
    cluster = ScriptedCluster(bus=bus, clock=clock, job_every=1, steps_per_copy=15)
    await _play(service, cluster, clock, range(rounds_before))
    clock.advance(10 * DAY_S)
    await _play(service, cluster, clock, range(rounds_before, rounds_before + rounds_after))
    await service.stop()
    return await _decisions(bus, 0)


def _config(group: str) -> SchedulerConfig:
    return SchedulerConfig(policy="hadar", round_s=ROUND_S, heartbeat_s=ROUND_S, consolidation_wait_s=0,
                           group=group, snapshot_every=3)


@pytest.mark.slow
async def test_after_retention_deleted_old_segments_a_restart_from_a_snapshot_decides_identically(
        private_bootstrap: str, tmp_path: Path) -> None:
    # Rounds 0-5 happen "ten days ago" (record timestamps from the fake clock); the snapshot
    # after round 5 covers them. Retention of one day then deletes their segments, and the
    # scheduler restarted from the snapshot plans rounds 6-9 on records from now only.
    start = time.time() - 10 * DAY_S - 3600
    clock = FakeClock(start=start)
    bus = KafkaBus(private_bootstrap, partitions=3, clock=clock, source="retention-restart")
    store = LocalStore(tmp_path / "store")
    await bus.start()
    await store.start()
    try:
        await bus.ensure_topics()
        first = SchedulerService(bus=bus, config=_config("retention-sched"), clock=clock, run_rounds=False,
                                 store=store)
        await first.start()
        cluster = ScriptedCluster(bus=bus, clock=clock, job_every=1, steps_per_copy=15)
        await _play(first, cluster, clock, range(6))
        before = await _decisions(bus, 0)
        ran = list(first.state.rounds[5].assignments)
        await first.stop()
        submitted = [d async for d in bus.read(JOBS) if isinstance(d.event, JobSubmitted)]
        assert len(submitted) == 6

        await set_retention(private_bootstrap, SHORT_LIVED, int(DAY_S * 1000))
        clock.advance(10 * DAY_S)
        await cluster.before_round(6, ran)     # records from now: the old segments roll and are due
        ids = {d.event.job.job_id for d in submitted}
        async with asyncio.timeout(60):       # a whole-log restart would now forget jobs
            while await _old_jobs_left(bus, ids) == len(ids):
                await asyncio.sleep(0.5)

        again = SchedulerService(bus=bus, config=_config("retention-sched"), clock=clock, run_rounds=False,
                                 store=store)
        await again.start()
        assert again.recovery["snapshot"] == snapshot_key("retention-sched", 2)   # the 2nd: after round 5
        assert again.next_round == 6 and again.recovery["rounds_rederived"] == 0
        assert set(again.state.jobs) >= ids    # the snapshot still knows them
        await _play(again, cluster, clock, range(6, 10), fed=True)
        after = await _decisions(bus, 6)
        await again.stop()
    finally:
        await bus.stop()
    reference = await _reference(start, 6, 4)
    assert {r: d for r, d in reference.items() if r < 6} == {r: d for r, d in before.items() if r < 6}
    assert {r: d for r, d in reference.items() if r >= 6} == after
    assert any(after.values())
