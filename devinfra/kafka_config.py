"""The development broker's configuration files: ``server.properties`` and ``log4j2.properties``.

One broker, or one node of a three-node cluster. Every node is a combined KRaft
broker+controller with a static quorum, bound to 127.0.0.1 only, tuned for fast tests (no
initial rebalance delay, one offsets partition). Replication follows the cluster's size
(:func:`replication_properties`): a single broker replicates nothing; a cluster of three
replicates every topic -- Hadar's, the offsets and the transaction-state topics -- three
times and acknowledges a write (``acks=all``) only once two replicas have it.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path

from devinfra.broker_auth import BrokerSecurity, listener_properties
from devinfra.common import InfraError

__all__ = [
    "LOG4J2_PROPERTIES", "EXTRA_PROPERTIES", "SUPPORTED_BROKERS", "REPLICATION_FACTOR", "MIN_IN_SYNC_REPLICAS",
    "extra_properties", "kafka_properties", "replication_properties", "new_cluster_id",
]

# One broker (development), or three: the fewest that keep min.insync.replicas=2 with one lost,
# and the fewest KRaft voters that keep a quorum with one lost.
SUPPORTED_BROKERS = (1, 3)
REPLICATION_FACTOR = 3
MIN_IN_SYNC_REPLICAS = 2
EXTRA_PROPERTIES = "kafka-extra.properties"

LOG4J2_PROPERTIES = """\
# Written by `hadar infra up`: everything to the console, which goes to kafka.log.
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.controller.name = org.apache.kafka.controller
logger.controller.level = WARN
logger.raft.name = org.apache.kafka.raft
logger.raft.level = WARN
logger.statechange.name = state.change.logger
logger.statechange.level = WARN
"""


def extra_properties(run: Path) -> dict[str, str]:
    """Operator overrides of the broker config: ``key=value`` lines of
    ``{run}/kafka-extra.properties`` (``#`` comments and blank lines ignored), applied at
    every start and restart of every broker. The file is outside the servers' own
    directories, so a fresh start does not remove it. E.g. a test that needs time-based
    retention to act within seconds sets ``log.retention.check.interval.ms`` (the broker's
    default checks every 5 minutes)."""
    path = run / EXTRA_PROPERTIES
    if not path.exists():
        return {}
    found: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise InfraError(f"{path}:{number}: expected key=value, got {line!r}")
        found[key.strip()] = value.strip()
    return found


def replication_properties(brokers: int) -> dict[str, str]:
    """How a cluster of ``brokers`` replicates: every topic, Hadar's (through
    ``default.replication.factor``, which :class:`~shared.bus.kafka.KafkaBus` reads) and
    Kafka's internal ones, on all three brokers of a cluster, on the one broker otherwise."""
    if brokers not in SUPPORTED_BROKERS:
        raise InfraError(f"kafka: {brokers} brokers not supported; use one of {', '.join(map(str, SUPPORTED_BROKERS))}")
    factor, min_isr = (1, 1) if brokers == 1 else (REPLICATION_FACTOR, MIN_IN_SYNC_REPLICAS)
    return {
        "default.replication.factor": str(factor),
        "min.insync.replicas": str(min_isr),
        "offsets.topic.replication.factor": str(factor),
        "transaction.state.log.replication.factor": str(factor),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(factor),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        # A replica that was not in sync never becomes leader: an acknowledged record is never lost.
        "unclean.leader.election.enable": "false",
    }


def kafka_properties(*, port: int, controller_port: int, data_dir: Path, node_id: int = 1,
                     voters: str = "", security: BrokerSecurity | None = None,
                     extra: Mapping[str, str] | None = None) -> str:
    """One node's config: a combined KRaft node of the static quorum ``voters``
    (``id@host:port,...``; empty: a single node that votes for itself), tuned for tests
    (with ``security``: a SASL_SSL client listener and ACLs, see :mod:`.broker_auth`);
    ``extra`` entries are added last and win."""
    quorum = voters or f"{node_id}@127.0.0.1:{controller_port}"
    settings = {
        "process.roles": "broker,controller",
        "node.id": str(node_id),
        "controller.quorum.voters": quorum,
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(data_dir),
        "num.partitions": "1",
        "offsets.topic.num.partitions": "1",
        **replication_properties(len(quorum.split(","))),
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "true",
    }
    if security is not None:
        settings.update(listener_properties(security, port=port, controller_port=controller_port))
        settings["auto.create.topics.enable"] = "false"
    settings.update(extra or {})
    lines = ["# Written by `hadar infra up` for development and tests."]
    lines += [f"{name}={value}" for name, value in settings.items()]
    return "\n".join(lines) + "\n"


def new_cluster_id(random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> str:
    """A Kafka cluster id as ``StorageTool random-uuid`` makes one (without starting a JVM):
    16 random bytes, URL-safe base64 without padding, never starting with '-'."""
    while True:
        text = base64.urlsafe_b64encode(random_bytes(16)).decode().rstrip("=")
        if not text.startswith("-"):
            return text
