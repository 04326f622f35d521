"""HadarE's GPU groups: the idle GPUs of each (node, type) as a round's copies take them, and
the GPUs each job's copies held last round (where a copy is warm).

Pure bookkeeping over one round's request; no policy rule lives here (``hadare/copies``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import PlanRequest


class FreeGroups:
    """Idle GPUs by (node, type), indexed by (type, idle count) in cluster order, so a job's
    candidates are the first group of each (type, count) not on a node it already uses."""

    def __init__(self, cluster: Cluster) -> None:
        self.order = {n.node_id: i for i, n in enumerate(cluster.nodes)}
        self.idle: dict[tuple[str, str], list[int]] = {}
        self.buckets: dict[tuple[str, int], list[str]] = {}
        self.with_idle: dict[str, int] = {}      # type -> nodes with idle GPUs of it
        for n in cluster.nodes:
            for t in n.types:
                self.idle[(n.node_id, t)] = list(n.indices_of(t))
                self.with_idle[t] = self.with_idle.get(t, 0) + 1
                self.buckets.setdefault((t, len(self.idle[(n.node_id, t)])), []).append(n.node_id)

    def candidates(self, used: set[str], allowed: dict[str, int] | None,
                   held: Iterable[tuple[str, str]] = ()) -> Iterator[tuple[str, str, int]]:
        """(node, type, idle count): the groups of ``held`` with idle GPUs, then the first group
        of each (type, count), all off ``used`` and of a type with GPUs left in ``allowed``
        (None: every type)."""
        for node_id, t in sorted(held, key=lambda g: (self.order[g[0]], g[1])):
            idle = len(self.idle.get((node_id, t), ()))
            if idle and node_id not in used and (allowed is None or allowed.get(t, 0) >= 1):
                yield node_id, t, idle
        for (t, count), nodes in self.buckets.items():
            if allowed is not None and allowed.get(t, 0) < 1:
                continue
            for node_id in nodes:
                if node_id not in used:
                    yield node_id, t, count
                    break

    def nodes_with_idle(self, gpu_type: str, used: set[str], up_to: int) -> int:
        """How many nodes off ``used`` have idle GPUs of ``gpu_type``, counted up to ``up_to``:
        O(1) when there are plainly that many, else O(len(used))."""
        total = self.with_idle.get(gpu_type, 0)
        if total - len(used) >= up_to:
            return up_to
        return min(up_to, total - sum(1 for n in used if self.idle.get((n, gpu_type))))

    def has(self, node_id: str, gpu_type: str, gpus: tuple[int, ...]) -> bool:
        """Whether every GPU of ``gpus`` is idle."""
        idle = self.idle.get((node_id, gpu_type), ())
        return bool(gpus) and all(g in idle for g in gpus)

    def take(self, node_id: str, gpu_type: str, k: int, prefer: tuple[int, ...] = ()) -> list[int]:
        """k idle GPUs of the group: ``prefer`` if it is k of them, all idle; else the first k."""
        idle = self.idle[(node_id, gpu_type)]
        if len(prefer) == k and self.has(node_id, gpu_type, prefer):
            got, rest = list(prefer), [g for g in idle if g not in prefer]
        else:
            got, rest = idle[:k], idle[k:]
        self.idle[(node_id, gpu_type)] = rest
        old = self.buckets[(gpu_type, len(idle))]
        old.remove(node_id)
        if not old:
            del self.buckets[(gpu_type, len(idle))]
        if rest:
            new = self.buckets.setdefault((gpu_type, len(rest)), [])
            bisect.insort(new, node_id, key=self.order.__getitem__)
        else:
            self.with_idle[gpu_type] -= 1
        return got


def previous_gpus(request: PlanRequest) -> dict[str, dict[tuple[str, str], tuple[int, ...]]]:
    """Per job, the GPUs each of its copies held last round by (node, type), on nodes still
    in the cluster (a copy is on one node, of one type)."""
    if request.previous is None:
        return {}
    by_id = request.cluster.by_id
    out: dict[str, dict[tuple[str, str], tuple[int, ...]]] = {}
    for p in request.previous.placements:
        node = by_id.get(p.node_id)
        if node is None or not p.gpus or any(g >= len(node.gpus) for g in p.gpus):
            continue
        types = {node.gpus[g] for g in p.gpus}
        if len(types) == 1:
            out.setdefault(p.job_id, {})[(p.node_id, types.pop())] = tuple(sorted(p.gpus))
    return out
