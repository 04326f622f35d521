"""The dev broker's config: operator overrides from kafka-extra.properties are added last and win;
a cluster of three replicates every topic, Kafka's own included."""

from __future__ import annotations

from pathlib import Path

import pytest

from devinfra import InfraError
from devinfra.kafka import EXTRA_PROPERTIES, extra_properties, kafka_properties
from devinfra.kafka_config import replication_properties


def _settings(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_extra_properties_are_added_and_win(tmp_path: Path) -> None:
    assert extra_properties(tmp_path) == {}
    (tmp_path / EXTRA_PROPERTIES).write_text(
        "# tuned for a retention test\n\nlog.retention.check.interval.ms = 500\nnum.partitions=3\n")
    extra = extra_properties(tmp_path)
    assert extra == {"log.retention.check.interval.ms": "500", "num.partitions": "3"}
    settings = _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path, extra=extra))
    assert settings["log.retention.check.interval.ms"] == "500" and settings["num.partitions"] == "3"
    assert _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path))["num.partitions"] == "1"


def test_a_malformed_line_is_refused_with_its_place(tmp_path: Path) -> None:
    (tmp_path / EXTRA_PROPERTIES).write_text("ok=1\nnot a setting\n")
    with pytest.raises(InfraError, match=r"kafka-extra.properties:2"):
        extra_properties(tmp_path)


def test_a_cluster_of_three_replicates_every_topic_three_times_and_acknowledges_on_two(tmp_path: Path) -> None:
    voters = "1@127.0.0.1:11,2@127.0.0.1:12,3@127.0.0.1:13"
    settings = _settings(kafka_properties(port=1, controller_port=12, data_dir=tmp_path, node_id=2, voters=voters))
    assert settings["node.id"] == "2" and settings["controller.quorum.voters"] == voters
    for name in ("default.replication.factor", "offsets.topic.replication.factor",
                 "transaction.state.log.replication.factor", "share.coordinator.state.topic.replication.factor"):
        assert settings[name] == "3", name
    for name in ("min.insync.replicas", "transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr"):
        assert settings[name] == "2", name
    single = _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path))
    assert single["controller.quorum.voters"] == "1@127.0.0.1:2"
    assert single["default.replication.factor"] == single["min.insync.replicas"] == "1"


def test_only_one_or_three_brokers_are_offered() -> None:
    assert replication_properties(1)["default.replication.factor"] == "1"
    with pytest.raises(InfraError, match="2 brokers not supported"):
        replication_properties(2)


def test_the_secured_broker_makes_every_connection_log_in_again_each_reauth_window(tmp_path: Path) -> None:
    """So a revoked login's open connection is cut within REAUTH_MS; an operator's (or the
    tests') kafka-extra.properties may shorten it, and wins."""
    from devinfra.broker_auth import REAUTH_MS, BrokerSecurity
    from shared.security.credentials import Secrets
    from shared.security.principals import ADMIN
    security = BrokerSecurity(secrets=Secrets(kafka={ADMIN: "p" * 32}, s3={}), ca_file=tmp_path / "ca.pem",
                              server_pem=tmp_path / "server.pem")
    secured = _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path, security=security))
    assert secured["connections.max.reauth.ms"] == str(REAUTH_MS) and 0 < REAUTH_MS <= 600_000
    assert "connections.max.reauth.ms" not in _settings(kafka_properties(port=1, controller_port=2, data_dir=tmp_path))
    shorter = kafka_properties(port=1, controller_port=2, data_dir=tmp_path, security=security,
                               extra={"connections.max.reauth.ms": "8000"})
    assert _settings(shorter)["connections.max.reauth.ms"] == "8000"
