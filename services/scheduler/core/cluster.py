"""The cluster as the policies see it: nodes, each with GPUs of known types.

Pure data. Parsing of cluster names, inline specs and YAML files lives in
``clusters.py``; this module only defines the records.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from shared.persistence.codec import snapshot_type


@snapshot_type("core.Node", formerly="services.scheduler.cluster.Node")
@dataclass(frozen=True, kw_only=True)
class Node:
    """One machine. ``gpus[i]`` is the catalog type (lower case, e.g. ``v100``) of GPU index i."""

    node_id: str
    gpus: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("Node.node_id: must not be empty")
        if not self.gpus:
            raise ValueError(f"Node {self.node_id}: has no GPUs")

    @property
    def size(self) -> int:
        return len(self.gpus)

    def indices_of(self, gpu_type: str) -> tuple[int, ...]:
        return self._indices.get(gpu_type, ())

    @cached_property
    def _indices(self) -> dict[str, tuple[int, ...]]:
        """GPU indices by type (computed once: policies ask every round, for every node)."""
        found: dict[str, list[int]] = {}
        for i, t in enumerate(self.gpus):
            found.setdefault(t, []).append(i)
        return {t: tuple(indices) for t, indices in found.items()}

    @cached_property
    def types(self) -> tuple[str, ...]:
        return tuple(sorted(self._indices))


@snapshot_type("core.Cluster", formerly="services.scheduler.cluster.Cluster")
@dataclass(frozen=True, kw_only=True)
class Cluster:
    name: str
    nodes: tuple[Node, ...]

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError(f"cluster {self.name}: duplicate node id")

    @cached_property
    def by_id(self) -> dict[str, Node]:
        return {n.node_id: n for n in self.nodes}

    @cached_property
    def gpus_by_type(self) -> dict[str, int]:
        """Number of GPUs of each type, over all nodes (sorted by type name)."""
        counts = Counter(t for n in self.nodes for t in n.gpus)
        return dict(sorted(counts.items()))

    @property
    def types(self) -> tuple[str, ...]:
        return tuple(self.gpus_by_type)

    @property
    def total_gpus(self) -> int:
        return sum(n.size for n in self.nodes)
