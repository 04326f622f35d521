"""Fixtures of the bus contract suites: each test runs on MemoryBus and on KafkaBus."""

from __future__ import annotations

import time

import pytest

from shared.clock import FakeClock


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    if request.param == "kafka":
        return "kafka", request.getfixturevalue("kafka_bootstrap")
    return "memory", None


@pytest.fixture
def clock() -> FakeClock:
    # Ten minutes in the past: Kafka rejects record timestamps far in the future.
    return FakeClock(start=round(time.time()) - 600.0)
