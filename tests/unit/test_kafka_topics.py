"""KafkaBus's admin requests, checked without a broker: the cluster's replication factor is
what topics get, and a request that hits a dead broker is tried again on a fresh view."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import NodeNotReadyError, UnknownError

from shared.bus import kafka_topics
from shared.bus.kafka_topics import admin_request, cluster_replication_factor


class _Client:
    def __init__(self) -> None:
        self.refreshes = 0

    async def force_metadata_update(self) -> bool:
        self.refreshes += 1
        return True


class _Admin:
    """Answers DescribeCluster and DescribeConfigs as a broker whose ``default.replication.factor``
    is ``factor``; the first ``dead`` requests fail as if sent to a dead broker."""

    def __init__(self, *, factor: str = "3", code: int = 0, dead: int = 0) -> None:
        self._client = _Client()
        self.factor, self.code, self.dead = factor, code, dead

    async def describe_cluster(self) -> dict[str, Any]:
        if self.dead:
            self.dead -= 1
            raise NodeNotReadyError("node 3 is not ready")
        return {"brokers": [{"node_id": 2}]}

    async def describe_configs(self, resources: list[Any]) -> list[Any]:
        entries = [("default.replication.factor", self.factor, True, 4, False, [])]
        return [SimpleNamespace(resources=[(self.code, "", 4, resources[0].name, entries)])]


@pytest.fixture(autouse=True)
def _no_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_topics, "ADMIN_FIRST_DELAY_S", 0.0)


async def test_topics_get_the_cluster_s_default_replication_factor() -> None:
    assert await cluster_replication_factor(_Admin(factor="3")) == 3  # type: ignore[arg-type]
    assert await cluster_replication_factor(_Admin(factor="1")) == 1  # type: ignore[arg-type]


async def test_a_principal_that_may_not_read_the_configs_gets_factor_one() -> None:
    admin = _Admin(code=kafka_topics.CLUSTER_AUTHORIZATION_FAILED)
    assert await cluster_replication_factor(admin) == 1  # type: ignore[arg-type]


async def test_a_dead_broker_is_tried_past_on_a_fresh_view_of_the_cluster() -> None:
    admin = _Admin(dead=2)
    assert await cluster_replication_factor(admin) == 3  # type: ignore[arg-type]
    assert admin._client.refreshes == 2


async def test_retries_end_and_an_answer_that_is_not_retriable_is_not_retried() -> None:
    admin = _Admin(dead=kafka_topics.ADMIN_ATTEMPTS)
    with pytest.raises(NodeNotReadyError):
        await admin_request(admin, admin.describe_cluster)  # type: ignore[arg-type]
    calls = 0

    async def refused() -> None:
        nonlocal calls
        calls += 1
        raise UnknownError("no")

    with pytest.raises(UnknownError):
        await admin_request(admin, refused)  # type: ignore[arg-type]
    assert calls == 1
