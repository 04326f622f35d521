"""Retention settings for the tests whose topics lose old segments (their broker is the
``private_bootstrap`` fixture of ``tests/integration/conftest.py``)."""

from __future__ import annotations

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

__all__ = ["set_retention"]


async def set_retention(bootstrap: str, topics: tuple[str, ...], retention_ms: int) -> None:
    """Give ``topics`` delete-cleanup with ``retention_ms``, in segments of an hour of record time."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, t, configs={
            "cleanup.policy": "delete", "retention.ms": str(retention_ms), "segment.ms": "3600000"}) for t in topics])
    finally:
        await admin.close()
