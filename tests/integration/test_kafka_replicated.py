"""A three-broker Kafka (``hadar infra up --brokers 3``) loses no acknowledged record (issue 28).

The cluster runs in a private run directory for this module; every topic is replicated on
all three brokers with ``min.insync.replicas=2``, and the project's :class:`KafkaBus`
publishes with ``acks=all`` and idempotence. Each test uses its own one-partition topic,
so one broker leads everything the test writes, and starts with all three brokers up
(the fixture restarts any a previous test left dead).

* The leader SIGKILLed mid-stream: producing goes on (the publish in flight waits, none
  fails) and resumes within :data:`RESUME_LIMIT_S` -- the controller fences the dead
  broker after ``broker.session.timeout.ms`` (Kafka's default, 9 s) and elects a new
  leader from the in-sync replicas -- and every acknowledged record is read back.
* Two brokers SIGKILLed (the leader left alone, with no controller quorum): a publish is
  never acknowledged (aiokafka keeps retrying it: it is still pending, or it fails); once
  one broker is back, publishing resumes -- the pending ones complete -- and every
  acknowledged record is there.

Each test prints what it measured (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from devinfra import InfraError, InfraPaths, KafkaCluster, ensure_kafka_cluster, stop_server
from devinfra.common import is_running
from devinfra.kafka import KafkaServer, fetch_kafka, find_java, restart_kafka
from shared.bus.base import BusError
from shared.bus.kafka import KafkaBus
from shared.wire.events import JobCancelled
from tests.required import unavailable

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

RECORDS = 200            # acknowledged before the fault, and as many after it
RESUME_LIMIT_S = 30.0    # session timeout (9 s) + election, with room for a loaded machine
OUTAGE_TIMEOUT_MS = 5_000   # the bus's request timeout while two are dead
OUTAGE_WAIT_S = 2 * OUTAGE_TIMEOUT_MS / 1000   # how long the outage's publishes are watched
OUTAGE_ATTEMPTS = 3


@pytest.fixture(scope="module")
def cluster_paths(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InfraPaths]:
    """A run directory holding a three-broker cluster for this module, stopped at its end."""
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=tmp_path_factory.mktemp("replicated") / "run")
    try:
        try:
            ensure_kafka_cluster(paths, brokers=3)
        except InfraError as exc:
            unavailable(f"a three-broker kafka could not start: {exc}")
        yield paths
    finally:
        stop_server(paths, "kafka")


@pytest.fixture
def cluster(cluster_paths: InfraPaths) -> KafkaCluster:
    """All three brokers up: any a previous test killed are restarted with their data."""
    return ensure_kafka_cluster(cluster_paths, brokers=3)[0]


@dataclass(frozen=True, kw_only=True)
class Producer:
    """Publishes JobCancelled events one after another and keeps what was acknowledged when."""

    bus: KafkaBus
    topic: str
    acknowledged: list[str] = field(default_factory=list)
    acknowledged_at: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def event(self) -> JobCancelled:
        return JobCancelled(ts=time.time(), source="replication-test", job_id=f"j{uuid.uuid4().hex[:12]}")

    async def publish(self, count: int) -> None:
        for _ in range(count):
            event = self.event()
            try:
                await self.bus.publish(event, topic=self.topic)
            except BusError as exc:
                self.failures.append(str(exc))
                continue
            self.acknowledged.append(event.id)
            self.acknowledged_at.append(time.monotonic())

    async def consumed(self) -> list[str]:
        return [delivery.event.id async for delivery in self.bus.read(self.topic)]


async def leader_in_sync(bootstrap: str, topic: str, *, replicas: int = 3, within_s: float = 30.0) -> int:
    """The node id leading partition 0 of ``topic`` once all ``replicas`` are in sync."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + within_s
        while True:
            (described,) = await admin.describe_topics([topic])
            partitions = described["partitions"]
            if partitions and len(partitions[0]["isr"]) == replicas and partitions[0]["leader"] >= 0:
                return int(partitions[0]["leader"])
            assert time.monotonic() < deadline, f"{topic} not in sync on {replicas} brokers: {partitions}"
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


def kill(broker: KafkaServer) -> None:
    os.killpg(broker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_running(broker.pid, broker.marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not is_running(broker.pid, broker.marker)


async def test_the_leader_killed_loses_no_acknowledged_record_and_producing_resumes(
        cluster: KafkaCluster) -> None:
    topic = f"replicated-{uuid.uuid4().hex[:8]}"
    bus = KafkaBus(cluster.bootstrap, partitions=1, source="replication-test")
    await bus.start()
    try:
        await bus.ensure_topics([topic])
        leader = await leader_in_sync(cluster.bootstrap, topic)
        producer = Producer(bus=bus, topic=topic)
        await producer.publish(RECORDS)
        (victim,) = [broker for broker in cluster.brokers if broker.node_id == leader]
        killed_at = time.monotonic()
        await asyncio.to_thread(kill, victim)
        await producer.publish(RECORDS)
        resumed_s = producer.acknowledged_at[RECORDS] - killed_at
        new_leader = await leader_in_sync(cluster.bootstrap, topic, replicas=2)
        consumed = await producer.consumed()
    finally:
        await bus.stop()
    lost = set(producer.acknowledged) - set(consumed)
    print(f"\nleader {victim.name} SIGKILLed: {len(producer.acknowledged)} acknowledged, {len(lost)} lost, "
          f"{len(producer.failures)} publishes failed, {len(consumed) - len(set(consumed))} duplicates; "
          f"producing resumed {resumed_s:.1f}s after the kill on new leader node {new_leader}")
    assert not lost, f"{len(lost)} acknowledged records lost"
    assert len(producer.acknowledged) == 2 * RECORDS, producer.failures[:3]
    assert new_leader != leader
    assert resumed_s < RESUME_LIMIT_S


async def test_with_two_brokers_dead_nothing_is_acknowledged_until_one_returns(
        cluster: KafkaCluster, cluster_paths: InfraPaths) -> None:
    topic = f"replicated-{uuid.uuid4().hex[:8]}"
    bus = KafkaBus(cluster.bootstrap, partitions=1, source="replication-test", request_timeout_ms=OUTAGE_TIMEOUT_MS)
    await bus.start()
    pending: list[asyncio.Task[None]] = []
    try:
        await bus.ensure_topics([topic])
        leader = await leader_in_sync(cluster.bootstrap, topic)
        producer = Producer(bus=bus, topic=topic)
        await producer.publish(RECORDS)
        # The leader stays: it takes each record into its log, but with acks=all it must not
        # acknowledge one that fewer than min.insync.replicas brokers hold.
        followers = [broker for broker in cluster.brokers if broker.node_id != leader]
        for broker in followers:
            await asyncio.to_thread(kill, broker)
        outage = Producer(bus=bus, topic=topic)
        outage_began = time.monotonic()
        attempts = [asyncio.create_task(outage.publish(1)) for _ in range(OUTAGE_ATTEMPTS)]
        _, still_waiting = await asyncio.wait(attempts, timeout=OUTAGE_WAIT_S)
        pending.extend(still_waiting)   # waiting for replicas: not acknowledged either
        outage_s = time.monotonic() - outage_began
        assert outage.acknowledged == [], "a publish was acknowledged with two of three brokers dead"

        returning = followers[0]
        restart_began = time.monotonic()
        lib, java = fetch_kafka(cluster_paths), find_java()
        await asyncio.to_thread(restart_kafka, cluster_paths, lib, java, returning)
        restarted_s = time.monotonic() - restart_began
        after = Producer(bus=bus, topic=topic)
        while not after.acknowledged:
            assert time.monotonic() - restart_began < 2 * RESUME_LIMIT_S, after.failures[-3:]
            await after.publish(1)
        resumed_s = time.monotonic() - restart_began
        await after.publish(RECORDS)
        await asyncio.gather(*pending)
        consumed = await producer.consumed()
    finally:
        for task in pending:
            task.cancel()
        await bus.stop()
    acknowledged = producer.acknowledged + after.acknowledged + outage.acknowledged
    lost = set(acknowledged) - set(consumed)
    print(f"\ntwo brokers SIGKILLed: {OUTAGE_ATTEMPTS} concurrent publishes watched for {outage_s:.1f}s: "
          f"{len(outage.failures)} failed and {len(pending)} still pending, 0 acknowledged; "
          f"{returning.name} restarted in {restarted_s:.1f}s, publishing resumed {resumed_s:.1f}s after "
          f"the restart began; {len(acknowledged)} acknowledged in all, {len(lost)} lost")
    assert not lost, f"{len(lost)} acknowledged records lost"
    assert len(outage.failures) + len(pending) == OUTAGE_ATTEMPTS
