"""The topic retention policy covers every topic, is safe for how services rebuild state,
and deploy/stack.yml creates the topics with exactly that policy."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from shared.wire import events
from shared.wire.retention import TOPIC_CONFIGS, config_string, topic_configs
from shared.wire.topics import (
    ALL_TOPICS,
    JOBS,
    MODELS,
    NODES,
    PLACEMENTS,
    PROGRESS,
    THROUGHPUT,
)

STACK = Path(__file__).resolve().parents[2] / "deploy" / "stack.yml"
DAY_MS = 86_400_000


def test_every_topic_has_an_explicit_policy_and_others_get_the_broker_defaults() -> None:
    assert set(TOPIC_CONFIGS) == set(ALL_TOPICS)
    for topic in ALL_TOPICS:
        assert {"cleanup.policy", "retention.ms"} <= set(topic_configs(topic)), topic
    assert topic_configs("test-topic-of-a-test") == {}


def test_topics_services_rebuild_state_from_are_kept_forever() -> None:
    for topic in (JOBS, PLACEMENTS, MODELS, THROUGHPUT, NODES):
        assert topic_configs(topic)["retention.ms"] == "-1", topic


def test_no_topic_is_compacted_while_its_events_share_a_key() -> None:
    # Compaction keeps the latest record per key. A job's throughput estimates (every worker
    # count, estimated and measured) share the job id; a node's registration and heartbeats
    # share the node id: compacting either would drop state the scheduler rebuilds from.
    for topic in ALL_TOPICS:
        assert "compact" not in topic_configs(topic)["cleanup.policy"], topic
    rates = events.ThroughputEstimate.__dataclass_fields__
    assert "job_id" in rates and "node_id" in events.NodeHeartbeat.__dataclass_fields__


def test_progress_is_short_and_its_segments_roll_so_the_limit_holds() -> None:
    progress = topic_configs(PROGRESS)
    assert 0 < int(progress["retention.ms"]) <= 7 * DAY_MS
    # Retention deletes closed segments only: a segment must roll well within the limit.
    assert int(progress["segment.ms"]) < int(progress["retention.ms"])


def test_the_stack_creates_each_topic_with_the_policy() -> None:
    stack = yaml.safe_load(STACK.read_text())
    script = " ".join(stack["services"]["topics"]["command"])
    found = dict(re.findall(r"\btopic (hadar\.[a-z]+) (\S+);", script))
    assert found == {topic: config_string(topic) for topic in ALL_TOPICS}
    # Both created with it and altered to it, so a cluster from before the policy gets it too.
    alter = "kafka-configs.sh --bootstrap-server kafka:9094 --command-config $$cfg --alter --entity-type topics"
    assert alter in script
