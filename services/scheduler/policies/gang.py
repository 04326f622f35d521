"""Job-level gang placement shared by the baselines (YARN-CS, Tiresias, Gavel).

A baseline decides per job: all ``W`` workers of ONE GPU type, or nothing (copy 0 only).
Policies first choose, by counting GPUs per type, which jobs run on which type; this
module then picks the concrete GPUs. Guarantees:

* ``usable_types``: a type is usable by a job when the job has a positive rate on ``W``
  GPUs of it and the cluster has at least ``W`` of it. A job with no usable type is
  INFEASIBLE for every job-level policy.
* ``assign_gangs``: a job that ran last round on exactly ``W`` GPUs of the type it gets
  now keeps those GPUs (no migration; Gavel's lease extension). Every other job is placed
  largest first on as few nodes as possible: the node with the fewest free GPUs of the
  type that still holds all ``W`` (best fit); otherwise the nodes with the most free GPUs,
  the last one chosen by best fit for what is left. Ties go to cluster node order, GPU
  indices ascending. If the per-type counts the policy chose fit the cluster, placement
  never fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import JobState, Placement, Plan, PlanRequest


@dataclass(frozen=True, kw_only=True)
class GangRequest:
    """Run ``job_id`` on ``workers`` GPUs of ``gpu_type`` this round."""

    job_id: str
    gpu_type: str
    workers: int


def usable_types(request: PlanRequest, job: JobState) -> tuple[str, ...]:
    """GPU types (sorted by name) on which the whole job can run: rate > 0 and >= W GPUs."""
    counts = request.cluster.gpus_by_type
    return tuple(t for t, n in counts.items()
                 if n >= job.workers and request.throughput.rate(job.job_type, t, job.workers) > 0)


def infeasible_detail(request: PlanRequest, job: JobState) -> str:
    counts = ", ".join(f"{t}:{n}" for t, n in request.cluster.gpus_by_type.items())
    return f"no GPU type runs W={job.workers} {job.job_type!r} (cluster {counts}; zero rate or too few GPUs)"


def previous_gangs(previous: Plan | None) -> dict[str, tuple[Placement, ...]]:
    """Copy-0 placements of the previous plan, by job."""
    if previous is None:
        return {}
    return {job_id: tuple(parts) for (job_id, copy), parts in previous.copies().items() if copy == 0}


def gang_type(cluster: Cluster, parts: Sequence[Placement]) -> str | None:
    """The single GPU type of a placement, or None if it mixes types or names unknown GPUs."""
    types: set[str] = set()
    for p in parts:
        node = cluster.by_id.get(p.node_id)
        if node is None or any(not 0 <= g < node.size for g in p.gpus):
            return None
        types.update(node.gpus[g] for g in p.gpus)
    return types.pop() if len(types) == 1 else None


class _FreeGPUs:
    """Free GPU indices per (node, type) while one plan is being built."""

    def __init__(self, cluster: Cluster) -> None:
        self._order = {n.node_id: i for i, n in enumerate(cluster.nodes)}
        self._free: dict[str, dict[str, list[int]]] = {}
        for node in cluster.nodes:
            per_type: dict[str, list[int]] = {}
            for i, t in enumerate(node.gpus):
                per_type.setdefault(t, []).append(i)
            self._free[node.node_id] = per_type

    def take_exact(self, parts: Sequence[Placement]) -> bool:
        wanted = [(p.node_id, g) for p in parts for g in p.gpus]
        for node_id, g in wanted:
            node_free = self._free.get(node_id)
            if node_free is None or not any(g in idx for idx in node_free.values()):
                return False
        for node_id, g in wanted:
            for idx in self._free[node_id].values():
                if g in idx:
                    idx.remove(g)
        return True

    def take_consolidated(self, job_id: str, gpu_type: str, workers: int) -> tuple[Placement, ...]:
        avail = [(len(per[gpu_type]), self._order[nid], nid)
                 for nid, per in self._free.items() if per.get(gpu_type)]
        fitting = sorted(a for a in avail if a[0] >= workers)
        chosen: list[tuple[str, int]] = []
        if fitting:
            chosen.append((fitting[0][2], workers))
        else:
            by_size = sorted(avail, key=lambda a: (-a[0], a[1]))
            left = workers
            while by_size and left > by_size[0][0]:
                n, _, nid = by_size.pop(0)
                chosen.append((nid, n))
                left -= n
            last = sorted(a for a in by_size if a[0] >= left)
            if not last:
                raise RuntimeError(f"{job_id}: {workers} x {gpu_type} do not fit; the policy over-counted")
            chosen.append((last[0][2], left))
        placements = []
        for nid, n in sorted(chosen, key=lambda c: self._order[c[0]]):
            idx = self._free[nid][gpu_type]
            gpus, self._free[nid][gpu_type] = tuple(idx[:n]), idx[n:]
            placements.append(Placement(job_id=job_id, copy=0, node_id=nid, gpus=gpus))
        return tuple(placements)


def assign_gangs(cluster: Cluster, requests: Sequence[GangRequest],
                 previous: Mapping[str, Sequence[Placement]]) -> dict[str, tuple[Placement, ...]]:
    """Concrete GPUs for each request (see module docstring); ``previous`` from previous_gangs()."""
    free = _FreeGPUs(cluster)
    placed: dict[str, tuple[Placement, ...]] = {}
    for req in requests:
        parts = previous.get(req.job_id)
        if (parts and gang_type(cluster, parts) == req.gpu_type
                and sum(len(p.gpus) for p in parts) == req.workers and free.take_exact(parts)):
            placed[req.job_id] = tuple(parts)
    rest = [r for r in requests if r.job_id not in placed]
    for req in sorted(rest, key=lambda r: -r.workers):  # stable: keeps the policy's order on ties
        placed[req.job_id] = free.take_consolidated(req.job_id, req.gpu_type, req.workers)
    return placed


def sequential_gangs(cluster: Cluster, requests: Sequence[GangRequest],
                     previous: Mapping[str, Sequence[Placement]]) -> dict[str, tuple[Placement, ...]]:
    """Concrete GPUs the way Sia's gavel.py assigns workers (``schedule_jobs_on_workers``).

    Per GPU type, GPUs are numbered node by node in cluster order and a pointer walks them
    once. Jobs go by scale factor, largest first (ties: request order); for each scale factor,
    first every job whose previous GPUs are of this type, exactly W, none taken yet keeps
    them; then every other job of that scale factor takes the next free GPUs at the
    pointer, which may split it across nodes. A smaller job's previous GPUs can be taken by
    a larger one before it is considered, so it moves: Sia's simulator restarts it. Never
    fails when the per-type counts fit the cluster.
    """
    placed: dict[str, tuple[Placement, ...]] = {}
    for gpu_type in sorted({r.gpu_type for r in requests}):
        order = [(n.node_id, g) for n in cluster.nodes for g, t in enumerate(n.gpus) if t == gpu_type]
        taken: set[tuple[str, int]] = set()
        pointer = 0
        mine = sorted((r for r in requests if r.gpu_type == gpu_type), key=lambda r: -r.workers)
        for size in sorted({r.workers for r in mine}, reverse=True):
            same = [r for r in mine if r.workers == size]
            for req in same:
                parts = previous.get(req.job_id)
                gpus = {(p.node_id, g) for p in parts for g in p.gpus} if parts else set()
                if (parts and gang_type(cluster, parts) == gpu_type and len(gpus) == size
                        and not gpus & taken):
                    placed[req.job_id] = tuple(parts)
                    taken |= gpus
            for req in same:
                if req.job_id in placed:
                    continue
                chosen: list[tuple[str, int]] = []
                while len(chosen) < size and pointer < len(order):
                    if order[pointer] not in taken:
                        chosen.append(order[pointer])
                        taken.add(order[pointer])
                    pointer += 1
                if len(chosen) < size:
                    raise RuntimeError(f"{req.job_id}: {size} x {gpu_type} do not fit; the policy over-counted")
                by_node: dict[str, list[int]] = {}
                for node_id, g in chosen:
                    by_node.setdefault(node_id, []).append(g)
                placed[req.job_id] = tuple(Placement(job_id=req.job_id, copy=0, node_id=node_id, gpus=tuple(g))
                                           for node_id, g in by_node.items())
    return placed


def free_counts(cluster: Cluster) -> dict[str, int]:
    """GPUs per type, as a mutable working copy for count-based selection."""
    return dict(cluster.gpus_by_type)
