"""Topics KafkaBus creates carry the retention policy (shared/retention.py), on a real broker.

The broker is this module's own, in a private run directory: a shared broker may hold
topics created before the policy existed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from shared.bus.kafka import KafkaBus
from shared.infra import InfraError, InfraPaths, ensure_kafka, stop_server
from shared.retention import topic_configs
from shared.topics import ALL_TOPICS

pytestmark = pytest.mark.kafka
UNKNOWN_TOPIC = 3


@pytest.fixture(scope="module")
def private_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=Path(tmp_path_factory.mktemp("retention")) / "run")
    try:
        server, _ = ensure_kafka(paths)
    except InfraError as exc:
        pytest.skip(f"kafka could not start: {exc}")
    try:
        yield server.bootstrap
    finally:
        stop_server(paths, "kafka")


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
