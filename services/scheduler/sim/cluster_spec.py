"""Cluster descriptions: built-in names, inline specs and YAML files -> ``Cluster``.

``parse_cluster(spec)`` accepts, in this order of precedence:

* a built-in name (``BUILTIN_CLUSTERS``):

  - ``gavel-108``: Gavel's simulated cluster, 36 V100 + 36 P100 + 36 K80, one GPU per node.
  - ``aws-5``: the Hadar/HadarE paper's 5-node AWS cluster of V100, K80 and T4. The paper's
    exact instance mix is not available to us; we chose two p3.2xlarge (1x V100 each), two
    p2.xlarge (1x K80 each) and one g4dn.xlarge (1x T4) -- one GPU per instance, as those
    instance shapes have.
  - ``lab-5``: the paper's lab cluster, one node each of Titan RTX, T4, T400, RTX 3090, A2000.
  - ``aws-5-multi``: aws-5's types on multi-GPU nodes, for multi-GPU job mixes: two
    p3.8xlarge-like nodes of 4x V100, two p2.8xlarge of 8x K80 and one g4dn.12xlarge of 4x T4
    (28 GPUs). Our choice, not the paper's.
  - ``lab-5-multi``: lab-5's types, four of each per node (20 GPUs). Our choice.
  - ``sia-64``: Sia's (SOSP'23) default simulated cluster (``sia-simulator/simulator_config.py``
    in siasosp23/artifacts): 6 AWS g4dn.12xlarge nodes of 4x T4, 3 nodes of 8x RTX 2080 Ti and
    2 DGX-A100 nodes of 8x A100 (64 GPUs), the types of Sia's measured profiles.
  - ``sia-64x2``, ``sia-64x4``, ``sia-64x8``: every node count of sia-64 times 2, 4 or 8
    (Sia's ``--cluster_scale``), 128 to 512 GPUs.
  - ``philly-2000``: 2,000 GPUs of Gavel's table's three types on 8-GPU nodes, for replaying
    Philly's whole trace (``philly_traces.py``): 84 nodes of V100, 84 of P100 and 82 of K80.
    Our choice: about the size of Philly's own GPU fleet (Jeon et al. report about 2,490
    GPUs over its virtual clusters), in the types the throughput table measures.

* a path to a YAML file ``{name, nodes: [{id, gpus: {type: count}}]}``; a node's GPUs are
  indexed in the order its mapping lists the types;
* an inline spec, comma-separated ``type:count`` (``count`` single-GPU nodes) or
  ``type:NxM`` (``N`` nodes of ``M`` GPUs), e.g. ``v100:4,p100:4,k80:4`` or ``v100:2x4``.

GPU type names are the lower-case keys of the catalog (``shared.domain.gpus.GPU_TYPES``). Node ids are deterministic:
built-ins and inline specs name nodes ``<type>-<i>``, numbering each type from 0 in spec
order. Every error is a ``ClusterSpecError`` with a one-line message.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from services.scheduler.core.cluster import Cluster, Node
from shared.domain.gpus import (
    GPU_TYPES,  # the lower-case catalog keys a cluster may name
)
from shared.errors import UsageError

_INLINE_ENTRY = re.compile(r"^(?P<type>[a-z0-9]+):(?:(?P<nodes>\d+)x(?P<size>\d+)|(?P<count>\d+))$")


class ClusterSpecError(UsageError):
    """A cluster name, inline spec or YAML file that cannot be used (one-line message)."""


def _check_type(gpu_type: str, where: str) -> None:
    if gpu_type not in GPU_TYPES:
        raise ClusterSpecError(f"{where}: unknown GPU type {gpu_type!r}; valid: {', '.join(GPU_TYPES)}")


def _typed_nodes(name: str, groups: list[tuple[str, int, int]]) -> Cluster:
    """Nodes from (type, node count, GPUs per node) groups, ids ``<type>-<i>`` per type."""
    next_index: dict[str, int] = {}
    nodes = []
    for gpu_type, count, size in groups:
        for _ in range(count):
            i = next_index.get(gpu_type, 0)
            next_index[gpu_type] = i + 1
            nodes.append(Node(node_id=f"{gpu_type}-{i}", gpus=(gpu_type,) * size))
    return Cluster(name=name, nodes=tuple(nodes))


def gavel_108() -> Cluster:
    return _typed_nodes("gavel-108", [("v100", 36, 1), ("p100", 36, 1), ("k80", 36, 1)])


def aws_5() -> Cluster:
    # p3.2xlarge x2 (V100), p2.xlarge x2 (K80), g4dn.xlarge x1 (T4).
    return _typed_nodes("aws-5", [("v100", 2, 1), ("k80", 2, 1), ("t4", 1, 1)])


def lab_5() -> Cluster:
    return _typed_nodes("lab-5", [(t, 1, 1) for t in ("titanrtx", "t4", "t400", "rtx3090", "a2000")])


def aws_5_multi() -> Cluster:
    # p3.8xlarge x2 (4x V100), p2.8xlarge x2 (8x K80), g4dn.12xlarge x1 (4x T4).
    return _typed_nodes("aws-5-multi", [("v100", 2, 4), ("k80", 2, 8), ("t4", 1, 4)])


def lab_5_multi() -> Cluster:
    return _typed_nodes("lab-5-multi", [(t, 1, 4) for t in ("titanrtx", "t4", "t400", "rtx3090", "a2000")])


SIA_SCALES = (2, 4, 8)


def sia_64(scale: int = 1) -> Cluster:
    """Sia's default cluster with every node count times ``scale`` (>= 1)."""
    if scale < 1:
        raise ValueError("scale must be >= 1")
    name = "sia-64" if scale == 1 else f"sia-64x{scale}"
    return _typed_nodes(name, [("t4", 6 * scale, 4), ("rtx2080ti", 3 * scale, 8), ("a100", 2 * scale, 8)])


def philly_2000() -> Cluster:
    return _typed_nodes("philly-2000", [("v100", 84, 8), ("p100", 84, 8), ("k80", 82, 8)])


BUILTIN_CLUSTERS: Mapping[str, Callable[[], Cluster]] = {
    "gavel-108": gavel_108,
    "aws-5": aws_5,
    "lab-5": lab_5,
    "aws-5-multi": aws_5_multi,
    "lab-5-multi": lab_5_multi,
    "sia-64": sia_64,
    **{f"sia-64x{k}": functools.partial(sia_64, k) for k in SIA_SCALES},
    "philly-2000": philly_2000,
}


def parse_inline(spec: str) -> Cluster:
    """``v100:4,p100:2x4`` -> 4 single-V100 nodes and 2 nodes of 4 P100s."""
    groups: list[tuple[str, int, int]] = []
    for raw in spec.split(","):
        entry = raw.strip().lower()
        m = _INLINE_ENTRY.match(entry)
        if m is None:
            raise ClusterSpecError(
                f"cluster spec {spec!r}: entry {raw.strip()!r} is not type:count or type:NODESxGPUS")
        _check_type(m["type"], f"cluster spec {spec!r}")
        if m["count"] is not None:
            count, size = int(m["count"]), 1
        else:
            count, size = int(m["nodes"]), int(m["size"])
        if count < 1 or size < 1:
            raise ClusterSpecError(f"cluster spec {spec!r}: entry {raw.strip()!r} has a zero count")
        groups.append((m["type"], count, size))
    return _typed_nodes(spec, groups)


def cluster_from_mapping(data: Any, *, source: str, default_name: str) -> Cluster:
    """A cluster from the parsed YAML document ``{name, nodes: [{id, gpus: {type: count}}]}``."""
    if not isinstance(data, dict):
        raise ClusterSpecError(f"{source}: expected a mapping with 'nodes'")
    unknown = set(data) - {"name", "nodes"}
    if unknown:
        raise ClusterSpecError(f"{source}: unknown key {sorted(unknown)[0]!r} (expected name, nodes)")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ClusterSpecError(f"{source}: 'name' must be a non-empty string")
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ClusterSpecError(f"{source}: 'nodes' must be a non-empty list")
    nodes: list[Node] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_nodes):
        where = f"{source}: nodes[{i}]"
        if not isinstance(raw, dict) or set(raw) != {"id", "gpus"}:
            raise ClusterSpecError(f"{where}: expected exactly the keys 'id' and 'gpus'")
        node_id = raw["id"]
        if not isinstance(node_id, str) or not node_id:
            raise ClusterSpecError(f"{where}: 'id' must be a non-empty string")
        if node_id in seen:
            raise ClusterSpecError(f"{where}: duplicate node id {node_id!r}")
        seen.add(node_id)
        gpus = raw["gpus"]
        if not isinstance(gpus, dict) or not gpus:
            raise ClusterSpecError(f"{where} ({node_id}): 'gpus' must be a non-empty mapping type: count")
        expanded: list[str] = []
        for gpu_type, count in gpus.items():
            if not isinstance(gpu_type, str):
                raise ClusterSpecError(f"{where} ({node_id}): GPU type {gpu_type!r} is not a string")
            _check_type(gpu_type, f"{where} ({node_id})")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ClusterSpecError(f"{where} ({node_id}): count of {gpu_type} must be a positive integer")
            expanded.extend([gpu_type] * count)
        nodes.append(Node(node_id=node_id, gpus=tuple(expanded)))
    return Cluster(name=name, nodes=tuple(nodes))


def load_cluster_file(path: str) -> Cluster:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ClusterSpecError(f"{path}: cannot read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else "invalid YAML"
        raise ClusterSpecError(f"{path}: invalid YAML ({first_line})") from None
    stem = os.path.splitext(os.path.basename(path))[0]
    return cluster_from_mapping(data, source=path, default_name=stem)


def parse_cluster(spec: str) -> Cluster:
    """The cluster a ``--cluster`` value names (see module docstring). Raises ClusterSpecError."""
    spec = spec.strip()
    if not spec:
        raise ClusterSpecError("empty cluster spec")
    builtin = BUILTIN_CLUSTERS.get(spec)
    if builtin is not None:
        return builtin()
    if spec.endswith((".yaml", ".yml")) or os.path.isfile(spec):
        return load_cluster_file(spec)
    if ":" not in spec:
        raise ClusterSpecError(
            f"unknown cluster {spec!r}; valid: {', '.join(BUILTIN_CLUSTERS)}, a YAML file, "
            "or an inline spec like v100:4,k80:2x4")
    return parse_inline(spec)
