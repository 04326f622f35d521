"""What the fork TTD bound (``bounds.py``) knows about nodes: one copy of a job per node.

``check_plan`` lets a job run as several copies, but on distinct nodes: a node gives a job
at most one copy's part at a time (a copy spanning nodes counts on each of them). Crediting
every GPU-second at the job's best per-GPU rate ignores that. A lone worker is often the
most efficient per GPU, so that credit treats a 4-GPU node as four one-GPU copies of the
same job. With few jobs left, that frees GPUs the real schedule cannot free: a Transformer
(W = 8) ending alone on six 4-GPU nodes needs all 24 GPUs for 12.2 job steps/s, where
per-GPU credit reaches that rate on 12 of them.

So the fork bound's columns are per *node class* (nodes with the same GPUs; ``m`` of them),
measured in node-seconds, one copy's part per node-second:

* one-node copy of k <= min(W, node size) GPUs whose type t is on the node: k GPUs of type
  t per node-second, credited ``k / W x min(rate(t, k), b(k))``, ``b(k)`` the node's best
  slowest-of-k rate (the prefix of its types sorted by rate that first holds k GPUs);
* spanning part, for each type t on the node: ``G = min(W, node size)`` GPUs of t per
  node-second, credited ``G / W x`` t's spanning bound (``bounds._spanning``, best over n).

with the cap ``sum over a job's columns of a class <= m (T - s_j)`` (a node's slot),
which ``bounds.py`` adds as a cut like its other caps.

Every schedule that passes ``check_plan`` gives a feasible point. A one-node copy of k GPUs,
g_t of them of type t, held for a time ``d``, is ``d g_t / k`` node-seconds on column
(t, k) for each t: the node's slot is used for d, each type's GPU-seconds match, and the
credit is at least the copy's. Its rate is at most ``rate(t, k)`` for each of its types
and at most ``b(k)``. A spanning copy's part of g_t GPUs of type t on a node is
``d g_t / G`` on t's spanning column. Its slot use is at most d since ``sum_t g_t <= G``,
and its credit ``g_t / W`` x the copy's rate is at most ``g_t / W`` x t's spanning bound.
A column of k GPUs may ask for more GPUs of t than the node has; the capacity rows over the
whole cluster still hold, so the bound only gets looser there (mixed nodes), never invalid.
Columns that another column of the same (class, type) beats with no more GPUs and no less
credit are dropped, since the LP would never prefer them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.throughput import ThroughputModel


@dataclass(frozen=True, kw_only=True)
class NodeClass:
    """Nodes with the same GPUs: ``gpus`` as (type, count) sorted by type, ``nodes`` of them."""

    gpus: tuple[tuple[str, int], ...]
    nodes: int

    @property
    def size(self) -> int:
        return sum(count for _, count in self.gpus)


@dataclass(frozen=True, kw_only=True)
class NodeColumn:
    """One column of a job: ``gpus`` GPUs of ``gpu_type`` per node-second of ``node_class``
    (an index into ``node_classes``), credited ``credit`` job steps per node-second."""

    node_class: int
    gpu_type: str
    gpus: int
    credit: float


def node_classes(cluster: Cluster) -> tuple[NodeClass, ...]:
    """The cluster's nodes grouped by their GPUs, in first-seen order."""
    counts: dict[tuple[tuple[str, int], ...], int] = {}
    for node in cluster.nodes:
        key = tuple((t, len(node.indices_of(t))) for t in node.types)
        counts[key] = counts.get(key, 0) + 1
    return tuple(NodeClass(gpus=key, nodes=n) for key, n in counts.items())


def best_slowest(values: list[tuple[float, int]], n: int) -> float:
    """Largest min of value over a set of (value, GPUs) entries holding at least n GPUs."""
    held = 0
    for value, count in sorted(values, reverse=True):
        held += count
        if held >= n:
            return value
    return 0.0


def node_columns(job_type: str, workers: int, classes: tuple[NodeClass, ...], throughput: ThroughputModel,
                 spanning: dict[str, float]) -> list[NodeColumn]:
    """A job's columns (module docstring); ``spanning[t]``: the most job-copy steps/s a copy
    spanning nodes with a GPU of type t reaches (0: none can span)."""
    out: list[NodeColumn] = []
    for index, node_class in enumerate(classes):
        top = min(workers, node_class.size)
        for gpu_type, _ in node_class.gpus:
            options: list[tuple[int, float]] = []
            for k in range(1, top + 1):
                slowest = best_slowest([(throughput.rate(job_type, t, k), c) for t, c in node_class.gpus], k)
                options.append((k, k / workers * min(throughput.rate(job_type, gpu_type, k), slowest)))
            options.append((top, top / workers * spanning.get(gpu_type, 0.0)))
            best = 0.0
            for gpus, credit in sorted(options, key=lambda o: (o[0], -o[1])):
                if credit > best:
                    out.append(NodeColumn(node_class=index, gpu_type=gpu_type, gpus=gpus, credit=credit))
                    best = credit
    return out
