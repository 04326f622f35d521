"""Cluster specs: built-ins, inline forms, YAML files and the errors they raise."""

from __future__ import annotations

import pytest

from services.scheduler.sim.cluster_spec import (
    BUILTIN_CLUSTERS,
    GPU_TYPES,
    ClusterSpecError,
    parse_cluster,
)


def test_gavel_108_has_36_single_gpu_nodes_of_each_type() -> None:
    cluster = parse_cluster("gavel-108")
    assert cluster.name == "gavel-108"
    assert cluster.gpus_by_type == {"k80": 36, "p100": 36, "v100": 36}
    assert len(cluster.nodes) == 108 and all(n.size == 1 for n in cluster.nodes)
    assert {"v100-0", "v100-35", "p100-0", "k80-35"} <= set(cluster.by_id)


def test_aws_5_mixes_v100_k80_t4_single_gpu_instances() -> None:
    cluster = parse_cluster("aws-5")
    assert len(cluster.nodes) == 5 and all(n.size == 1 for n in cluster.nodes)
    assert set(cluster.types) == {"v100", "k80", "t4"}
    assert [n.node_id for n in cluster.nodes] == ["v100-0", "v100-1", "k80-0", "k80-1", "t4-0"]


def test_lab_5_has_one_node_of_each_lab_gpu() -> None:
    cluster = parse_cluster("lab-5")
    assert cluster.gpus_by_type == dict.fromkeys(("a2000", "rtx3090", "t4", "t400", "titanrtx"), 1)
    assert [n.node_id for n in cluster.nodes] == ["titanrtx-0", "t4-0", "t400-0", "rtx3090-0", "a2000-0"]


@pytest.mark.parametrize("name", sorted(BUILTIN_CLUSTERS))
def test_builtins_use_catalog_types_and_are_deterministic(name: str) -> None:
    assert set(parse_cluster(name).types) <= set(GPU_TYPES)
    assert parse_cluster(name) == parse_cluster(name)


def test_inline_count_means_single_gpu_nodes() -> None:
    cluster = parse_cluster("v100:4,p100:4,k80:4")
    assert len(cluster.nodes) == 12
    assert [n.node_id for n in cluster.nodes[:4]] == ["v100-0", "v100-1", "v100-2", "v100-3"]
    assert all(n.gpus == (n.node_id.split("-")[0],) for n in cluster.nodes)


def test_inline_nodes_x_gpus_and_mixed_entries_number_per_type() -> None:
    cluster = parse_cluster("v100:2x4, k80:1, v100:1")
    assert [(n.node_id, n.gpus) for n in cluster.nodes] == [
        ("v100-0", ("v100",) * 4), ("v100-1", ("v100",) * 4), ("k80-0", ("k80",)), ("v100-2", ("v100",))]
    assert cluster.total_gpus == 10


@pytest.mark.parametrize("spec, fragment", [
    ("v100:0", "zero count"),
    ("v100:2x0", "zero count"),
    ("v100:x4", "is not type:count"),
    ("v100", "unknown cluster"),
    ("rtx9999:2", "unknown GPU type 'rtx9999'"),
    ("v100:2,,k80:1", "is not type:count"),
    ("", "empty cluster spec"),
])
def test_bad_inline_specs_raise_one_line_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ClusterSpecError, match=fragment) as info:
        parse_cluster(spec)
    assert "\n" not in str(info.value)


def test_yaml_file_keeps_node_ids_and_gpu_order(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mixed\nnodes:\n"
                    "  - id: box-a\n    gpus: {v100: 2, t4: 1}\n"
                    "  - id: box-b\n    gpus: {a100: 1}\n")
    cluster = parse_cluster(str(path))
    assert cluster.name == "mixed"
    assert [(n.node_id, n.gpus) for n in cluster.nodes] == [("box-a", ("v100", "v100", "t4")), ("box-b", ("a100",))]


def test_yaml_name_defaults_to_file_stem(tmp_path) -> None:
    path = tmp_path / "rack7.yml"
    path.write_text("nodes:\n  - id: n0\n    gpus: {k80: 1}\n")
    assert parse_cluster(str(path)).name == "rack7"


@pytest.mark.parametrize("body, fragment", [
    ("nodes: []\n", "'nodes' must be a non-empty list"),
    ("- 1\n", "expected a mapping"),
    ("nodes:\n  - id: a\n    gpus: {v100: 1}\n  - id: a\n    gpus: {v100: 1}\n", "duplicate node id 'a'"),
    ("nodes:\n  - id: a\n    gpus: {v100: 0}\n", "positive integer"),
    ("nodes:\n  - id: a\n    gpus: {V100: 1}\n", "unknown GPU type 'V100'"),
    ("nodes:\n  - id: a\n", "exactly the keys"),
    ("nodes:\n  - id: a\n    gpus: {}\n", "non-empty mapping"),
    ("racks: 3\nnodes:\n  - id: a\n    gpus: {v100: 1}\n", "unknown key 'racks'"),
    ("nodes: [\n", "invalid YAML"),
])
def test_bad_yaml_raises_one_line_errors_naming_the_file(tmp_path, body: str, fragment: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ClusterSpecError, match=fragment) as info:
        parse_cluster(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_yaml_file_is_an_error(tmp_path) -> None:
    with pytest.raises(ClusterSpecError, match="cannot read"):
        parse_cluster(str(tmp_path / "absent.yaml"))
