"""KafkaBus's interface for its consumer-group members, checked without a broker."""

from __future__ import annotations

import asyncio
import inspect
import re
from typing import ClassVar

import pytest
from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from shared.bus import BusError, KafkaBus, kafka_group
from shared.bus.kafka import KeyPartitioner
from shared.wire.topics import JOBS


def test_members_use_only_the_documented_interface() -> None:
    private = re.findall(r"\bbus\._\w+", inspect.getsource(kafka_group))
    assert private == []


def test_client_options_name_the_client_after_the_bus_and_its_role() -> None:
    bus = KafkaBus("broker:9092", source="tracker", request_timeout_ms=1234)
    assert bus.client_options("tracker-group") == {
        "bootstrap_servers": "broker:9092", "client_id": "hadar-tracker-tracker-group", "request_timeout_ms": 1234,
        "security_protocol": "PLAINTEXT"}   # and the security settings, the same for every client


async def test_a_member_of_a_bus_not_started_refuses_to_start() -> None:
    bus = KafkaBus("127.0.0.1:1")
    assert not bus.is_started
    sub = bus.subscribe([JOBS], "g")
    with pytest.raises(BusError, match="not started") as caught:
        await sub.start()
    assert not caught.value.retriable


class _Member:
    def __init__(self) -> None:
        self.stops = 0

    async def stop(self) -> None:
        self.stops += 1


async def test_stop_stops_the_registered_members_only() -> None:
    bus = KafkaBus("127.0.0.1:1")   # never started: stop() needs no broker
    kept, left = _Member(), _Member()
    bus.register(kept)  # type: ignore[arg-type]
    bus.register(left)  # type: ignore[arg-type]
    bus.unregister(left)  # type: ignore[arg-type]
    bus.unregister(left)  # type: ignore[arg-type]  # a member that stops twice
    await bus.stop()
    assert (kept.stops, left.stops) == (1, 0)


@given(st.binary(max_size=80), st.lists(st.integers(0, 99), min_size=1, max_size=12, unique=True))
def test_the_key_partitioner_picks_what_kafkas_default_does(key: bytes, partitions: list[int]) -> None:
    partitions.sort()
    remembering = KeyPartitioner()
    expected = DefaultPartitioner()(key, partitions, partitions)
    assert remembering(key, partitions, partitions) == expected
    assert remembering(key, partitions, partitions[:1]) == expected   # twice: now remembered


def test_the_key_partitioner_forgets_when_full_and_spreads_keyless_records() -> None:
    remembering = KeyPartitioner(capacity=8)
    for i in range(100):
        remembering(f"job-{i}".encode(), [0, 1, 2], [0, 1, 2])
    assert len(remembering) <= 8
    assert {remembering(None, [0, 1, 2], [1, 2]) for _ in range(200)} == {1, 2}


class _Client:
    """Stands in for an aiokafka client: records its settings, talks to no broker."""

    made: ClassVar[list[dict[str, object]]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        type(self).made.append(kwargs)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def subscribe(self, *args: object, **kwargs: object) -> None:
        pass


async def test_latency_settings_keep_publishes_durable_and_fetches_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.bus import kafka
    _Client.made = []
    for name in ("AIOKafkaProducer", "AIOKafkaAdminClient"):
        monkeypatch.setattr(kafka, name, _Client)
    monkeypatch.setattr(kafka_group, "AIOKafkaConsumer", _Client)
    bus = KafkaBus("broker:9092")
    await bus.start()
    bus.ensure_known = lambda topics: asyncio.sleep(0)  # type: ignore[method-assign]
    await bus.subscribe([JOBS], "g").start()
    producer, _admin, consumer = _Client.made
    assert (producer["acks"], producer["enable_idempotence"]) == ("all", True)   # durable, exactly once per send
    assert (producer["linger_ms"], producer["compression_type"]) == (0, None)
    assert isinstance(producer["partitioner"], KeyPartitioner)
    assert (consumer["fetch_min_bytes"], consumer["enable_auto_commit"]) == (1, False)
    await bus.stop()
