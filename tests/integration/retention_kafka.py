"""A private Kafka broker for tests whose topics lose old segments to retention.

Its own run directory (a shared broker may hold topics created before the retention
policy existed), checking retention every 500 ms (``kafka-extra.properties``; the
broker's default is every 5 minutes). Import :func:`private_bootstrap` into a test module
to use it as that module's fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from devinfra import InfraError, InfraPaths, ensure_kafka, stop_server
from devinfra.kafka import EXTRA_PROPERTIES

__all__ = ["private_bootstrap", "set_retention"]


@pytest.fixture(scope="module")
def private_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    paths = InfraPaths(cache=InfraPaths.from_env().cache, run=Path(tmp_path_factory.mktemp("retention")) / "run")
    paths.run.mkdir(parents=True, exist_ok=True)
    (paths.run / EXTRA_PROPERTIES).write_text("# retention acts within a second\nlog.retention.check.interval.ms=500\n")
    try:
        server, _ = ensure_kafka(paths)
    except InfraError as exc:
        pytest.skip(f"kafka could not start: {exc}")
    try:
        yield server.bootstrap
    finally:
        stop_server(paths, "kafka")


async def set_retention(bootstrap: str, topics: tuple[str, ...], retention_ms: int) -> None:
    """Give ``topics`` delete-cleanup with ``retention_ms``, in segments of an hour of record time."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, t, configs={
            "cleanup.policy": "delete", "retention.ms": str(retention_ms), "segment.ms": "3600000"}) for t in topics])
    finally:
        await admin.close()
