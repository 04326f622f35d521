"""How a three-broker cluster and a four-drive MinIO are recorded and named, without starting either."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from devinfra import InfraError, InfraPaths, KafkaCluster, KafkaServer, MinioServer, status, up
from devinfra.kafka import kafka_node_names, load_kafka_cluster

VOTERS = "1@127.0.0.1:11,2@127.0.0.1:12,3@127.0.0.1:13"


def record(paths: InfraPaths, node_id: int, *, voters: str = VOTERS) -> KafkaServer:
    name = "kafka" if node_id == 1 else f"kafka-{node_id}"
    server = KafkaServer(pid=0, port=9090 + node_id, controller_port=10 + node_id, run_dir=str(paths.run / name),
                         cluster_id="c", node_id=node_id, voters=voters)
    paths.state_file(name).parent.mkdir(parents=True)
    paths.state_file(name).write_text(json.dumps(asdict(server)))
    return server


def test_a_cluster_is_recorded_node_by_node_and_its_bootstrap_lists_every_broker(tmp_path: Path) -> None:
    paths = InfraPaths(cache=tmp_path / "cache", run=tmp_path / "run")
    assert load_kafka_cluster(paths) == ()
    recorded = tuple(record(paths, node_id) for node_id in (1, 2, 3))
    assert load_kafka_cluster(paths) == recorded
    assert KafkaCluster(brokers=recorded).bootstrap == "127.0.0.1:9091,127.0.0.1:9092,127.0.0.1:9093"
    assert [b.name for b in recorded] == kafka_node_names(paths) == ["kafka", "kafka-2", "kafka-3"]
    assert [line.name for line in status(paths)] == ["kafka", "kafka-2", "kafka-3", "minio"]
    assert all(line.state == "stopped" for line in status(paths)[:3])


def test_a_missing_node_and_another_size_are_refused_in_one_line(tmp_path: Path) -> None:
    paths = InfraPaths(cache=tmp_path / "cache", run=tmp_path / "run")
    record(paths, 1)
    with pytest.raises(InfraError, match="records node 1 of 3 brokers but not kafka-2"):
        load_kafka_cluster(paths)
    record(paths, 2)
    record(paths, 3)
    with pytest.raises(InfraError, match=r"holds 3 broker\(s\), not 1; `hadar infra down` before"):
        up(paths, brokers=1)


def test_four_drives_are_four_directories_that_minio_expands_itself(tmp_path: Path) -> None:
    server = MinioServer(pid=0, port=1, console_port=2, run_dir=str(tmp_path), access_key="a", secret_key="s",
                         drives=4)
    assert server.drive_dirs == [tmp_path / "data" / f"drive{n}" for n in range(1, 5)]
    assert server.server_args == [f"{tmp_path}/data/drive{{1...4}}"]
    single = MinioServer(pid=0, port=1, console_port=2, run_dir=str(tmp_path), access_key="a", secret_key="s")
    assert single.drive_dirs == [tmp_path / "data"] and single.server_args == [str(tmp_path / "data")]
