"""The topic names are a wire contract: producers outside this repository write to them."""

from __future__ import annotations

import pytest

from shared.wire import topics
from shared.wire.events import EVENT_TYPES


def test_topic_names_are_pinned() -> None:
    # Literal on purpose: renaming a topic strands every outside producer and consumer.
    assert (topics.JOBS, topics.NODES, topics.THROUGHPUT, topics.PROGRESS, topics.PLACEMENTS,
            topics.MODELS, topics.QUEUES, topics.LEADERSHIP, topics.DEADLETTER) == (
        "hadar.jobs", "hadar.nodes", "hadar.throughput", "hadar.progress", "hadar.placements",
        "hadar.models", "hadar.queues", "hadar.leadership", "hadar.deadletter")
    assert tuple(sorted((
        "hadar.jobs", "hadar.nodes", "hadar.throughput", "hadar.progress", "hadar.placements",
        "hadar.models", "hadar.queues", "hadar.leadership", "hadar.deadletter"))) == topics.ALL_TOPICS


def test_every_event_type_has_exactly_its_topic() -> None:
    assert set(topics.TOPIC_OF_TYPE) == set(EVENT_TYPES)
    assert set(topics.TOPIC_OF_TYPE.values()) == set(topics.ALL_TOPICS)
    assert topics.event_types_on([topics.MODELS]) == {"ModelConsolidated", "RoundAbandoned", "JobCompleted"}
    assert topics.event_types_on(topics.ALL_TOPICS) == set(EVENT_TYPES)


def test_event_types_on_rejects_unknown_topics() -> None:
    with pytest.raises(ValueError, match="not a Hadar topic"):
        topics.event_types_on([topics.JOBS, "jobs"])
