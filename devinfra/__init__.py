"""Real Kafka and MinIO on 127.0.0.1 for development and tests (``hadar infra``).

Kafka is assembled from Apache's jars on Maven Central (deploy/kafka/pom.xml) and MinIO is
built with ``go install`` at a pinned version; both are cached under ``$HADAR_CACHE``
(default ``~/.cache/hadar``), so only the first ``up`` fetches and builds. Production uses
the official images instead (deploy/). See deploy/README-dev.md.
"""

from devinfra.common import InfraError, InfraPaths
from devinfra.kafka import KafkaCluster, KafkaServer
from devinfra.minio import MINIO_VERSION, MinioServer
from devinfra.stack import (
    DevServers,
    ServerStatus,
    down,
    ensure_kafka,
    ensure_kafka_cluster,
    ensure_minio,
    env_lines,
    restart,
    status,
    stop_server,
    up,
    write_env_file,
)

__all__ = [
    "InfraError", "InfraPaths", "KafkaServer", "KafkaCluster", "MinioServer", "MINIO_VERSION", "DevServers",
    "ServerStatus", "up", "restart", "status", "down", "ensure_kafka", "ensure_kafka_cluster", "ensure_minio",
    "stop_server",
    "env_lines", "write_env_file",
]
