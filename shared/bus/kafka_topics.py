"""The admin requests of :class:`~shared.bus.kafka.KafkaBus`: creating topics (the partitions
it asks for, each topic's configs from the topic table, :mod:`shared.wire.retention`, and a
replication factor) and describing them, each tried again across a dead broker.

Dead brokers: aiokafka's admin client sends each request to a broker picked at random from
its view of the cluster, which it refreshes only every few minutes; with one of three brokers
dead, a third of the requests would fail. :func:`admin_request` tries a request that fails
retriably again on a fresh view (the controller drops a dead broker from it once its session
times out, 9 s by default).

Replication: unless the bus is given a factor, a topic is replicated as the cluster's
``default.replication.factor`` says -- as Kafka replicates the topics it creates itself --
read once from a live broker (DescribeConfigs). aiokafka speaks CreateTopics v3, which needs
an explicit factor; v4's "the broker's default" is out of its reach. So a single broker
replicates once, ``hadar infra up --brokers 3`` three times, and a production cluster as its
operator configured it, with no setting in any service. Surviving a broker also takes the
broker's ``min.insync.replicas`` >= 2, which applies to every topic (none overrides it).

A principal that may not read the cluster's configs (a secured service) gets factor 1; it may
not create topics either (only the admin does, ``hadar infra secure-init``), so it only
ever learns that the topic exists or is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code

from shared.bus.base import BusError, bus_error
from shared.bus.settings import KafkaSecurity
from shared.wire.retention import topic_configs

__all__ = ["create_topics", "cluster_replication_factor", "topic_exists", "admin_request"]

T = TypeVar("T")
ADMIN_ATTEMPTS = 6
ADMIN_FIRST_DELAY_S = 0.2

log = structlog.get_logger(__name__)
TOPIC_ALREADY_EXISTS = 36
UNKNOWN_TOPIC = 3
TOPIC_AUTHORIZATION_FAILED = 29
CLUSTER_AUTHORIZATION_FAILED = 31
DEFAULT_REPLICATION_FACTOR = "default.replication.factor"


async def cluster_replication_factor(admin: AIOKafkaAdminClient) -> int:
    """The cluster's ``default.replication.factor``, as a live broker reports it (1 when
    this principal may not read it; see the module doc)."""
    try:
        cluster = await admin_request(admin, admin.describe_cluster)
        broker = str(cluster["brokers"][0]["node_id"])
        resource = ConfigResource(ConfigResourceType.BROKER, broker, configs={DEFAULT_REPLICATION_FACTOR: None})
        (response,) = await admin_request(admin, lambda: admin.describe_configs([resource]))
    except (TimeoutError, KafkaError, OSError, IndexError) as exc:
        raise bus_error(f"read the cluster's {DEFAULT_REPLICATION_FACTOR}", exc) from exc
    for code, message, _, _, entries in (resource[:5] for resource in response.resources):
        if code in (CLUSTER_AUTHORIZATION_FAILED, TOPIC_AUTHORIZATION_FAILED):
            return 1
        if code:
            error = for_code(code)
            raise BusError(f"read the cluster's {DEFAULT_REPLICATION_FACTOR}: {error.__name__}: {message}",
                           retriable=bool(error.retriable))
        for name, value, *_ in entries:
            if name == DEFAULT_REPLICATION_FACTOR and str(value).isdigit() and int(value) >= 1:
                return int(value)
    raise BusError(f"read the cluster's {DEFAULT_REPLICATION_FACTOR}: broker {broker} did not report it",
                   retriable=True)


async def create_topics(admin: AIOKafkaAdminClient, names: Sequence[str], *, partitions: int,
                        replication_factor: int, security: KafkaSecurity) -> None:
    """Create every topic of ``names`` that does not exist yet; a topic this principal may not
    create is fine if it exists (an admin created it), else a non-retriable BusError."""
    request = [NewTopic(t, partitions, replication_factor, topic_configs=topic_configs(t)) for t in names]
    try:
        response = await admin_request(admin, lambda: admin.create_topics(request))
    except (TimeoutError, KafkaError, OSError) as exc:
        raise bus_error("create topics", exc) from exc
    for topic, code, message in (e[:3] for e in response.topic_errors):
        if code == TOPIC_AUTHORIZATION_FAILED:
            exists = await topic_exists(admin, topic)
            if exists is None:
                # Not even visible to this principal: nothing to ensure. Using it anyway
                # fails at the broker (TopicAuthorizationFailedError on publish/read).
                log.debug("bus.topic_not_visible", topic=topic, principal=security.describe())
                continue
            if exists:
                continue   # only an admin creates topics (least privilege); it did
            raise BusError(f"create topic {topic}: not authorized as {security.describe()} and the "
                           "topic does not exist (an admin creates topics: `hadar infra secure-init`)",
                           retriable=False)
        if code not in (0, TOPIC_ALREADY_EXISTS):
            error = for_code(code)
            raise BusError(f"create topic {topic}: {error.__name__}: {message}", retriable=bool(error.retriable))


async def topic_exists(admin: AIOKafkaAdminClient, topic: str) -> bool | None:
    """Whether ``topic`` exists; ``None`` when this principal may not even describe it."""
    try:
        (described,) = await admin_request(admin, lambda: admin.describe_topics([topic]))
    except (TimeoutError, KafkaError, OSError):
        return False
    if described["error_code"] == TOPIC_AUTHORIZATION_FAILED:
        return None
    return not described["error_code"] and bool(described["partitions"])


async def admin_request(admin: AIOKafkaAdminClient, request: Callable[[], Awaitable[T]]) -> T:
    """``request()``, tried again (with back-off, up to :data:`ADMIN_ATTEMPTS` times, about 6 s
    in all) on a fresh view of the cluster while it fails with a retriable Kafka error: a
    dead broker, a connection lost, a request timed out (see the module doc)."""
    delay = ADMIN_FIRST_DELAY_S
    for attempt in range(1, ADMIN_ATTEMPTS + 1):
        try:
            return await request()
        except KafkaError as exc:
            if attempt == ADMIN_ATTEMPTS or not getattr(exc, "retriable", False):
                raise
        await asyncio.sleep(delay)
        delay *= 2
        client: Any = admin._client  # aiokafka exposes no public refresh of the admin's metadata
        with contextlib.suppress(KafkaError, OSError, TimeoutError):
            await client.force_metadata_update()
    raise AssertionError("unreachable")
