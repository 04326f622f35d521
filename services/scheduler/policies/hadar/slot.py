"""The current round of Hadar's plan: back-fill of idle GPUs and GPU indices.

Back-fill rule. GPUs the ledger leaves idle in the current slot earn nothing if left idle
and no later job can use them (the round starts now), so their opportunity cost is zero.
After the ledger's slot 0 is fixed, every active job without a slot-0 placement (waiting,
or committed only to later rounds) is taken in planning order (arrival, then job id); it
gets the option with the highest planned rate that fits in the idle GPUs, on rows chosen
by (slowest eligible type for this job, then most idle GPUs, then row order) for a spread
option and by best fit (fewest idle GPUs that still hold W) for a node option. Back-fill
is not committed to the ledger: the job's extra progress shows up as drift next round,
which releases and re-plans its schedule.

GPU indices. A row's GPUs are interchangeable for the ledger; indices are assigned at the
end: a job keeps the indices it had in the previous plan (copy 0, same node and type) when
they are still free, and takes the lowest free indices otherwise. Where a job ran in the
previous plan (:func:`held_rows`) the row choice (``dp.pick_gpus``) keeps when it may and
the GPUs are free, so a job re-planned each round does not move for nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from services.scheduler.core.cluster import Cluster
from services.scheduler.core.policy import Placement, PlanRequest, previous_parts
from services.scheduler.policies.hadar.dp import select_rows
from services.scheduler.policies.hadar.ledger import RowLayout
from services.scheduler.policies.hadar.profile import JobProfile

RowCounts = tuple[np.ndarray, np.ndarray]  # (rows, counts) of one job in one round


def backfill(idle: np.ndarray, candidates: Iterable[tuple[str, JobProfile]],
             layout: RowLayout) -> dict[str, tuple[RowCounts, str]]:
    """Fill ``idle`` (GPUs per row, modified in place) with whole gangs; job -> (rows, option)."""
    out: dict[str, tuple[RowCounts, str]] = {}
    max_cap = int(layout.row_cap.max()) + 1 if layout.rows else 1
    for job_id, prof in candidates:
        total = int(idle.sum())
        if total == 0:
            break
        if total < prof.workers:
            continue
        speed_rank = np.argsort(np.argsort(prof.per_worker, kind="stable"), kind="stable")
        for option in sorted(prof.options, key=lambda o: (-o.rate, not o.one_node)):
            allowed = option.eligible[layout.row_type]
            if option.one_node:
                pref = idle.astype(float)
            else:
                pref = speed_rank[layout.row_type] * float(max_cap) - idle
            got = select_rows(pref, idle, allowed, prof.workers, prof.tie_order, option.one_node)
            if got is not None:
                rows, counts = got
                idle[rows] -= counts
                out[job_id] = ((rows, counts), option.label)
                break
    return out


def held_rows(request: PlanRequest, layout: RowLayout) -> dict[str, RowCounts]:
    """Where each job ran in the previous round's plan (``core.policy.previous_parts``) as
    (rows, sorted indices into ``layout``; GPUs on each)."""
    index = {(node_id, gpu_type): row for row, (node_id, gpu_type, _) in enumerate(layout.keys)}
    out: dict[str, RowCounts] = {}
    for job_id, parts in previous_parts(request).items():
        rows = sorted((index[(p.node_id, p.gpu_type)], p.count) for p in parts if (p.node_id, p.gpu_type) in index)
        if rows:
            out[job_id] = (np.array([r for r, _ in rows], dtype=np.int64),
                           np.array([c for _, c in rows], dtype=np.int64))
    return out


def assign_indices(cluster: Cluster, layout: RowLayout, slot0: Sequence[tuple[str, RowCounts]],
                   previous: Iterable[Placement]) -> list[Placement]:
    """Concrete GPU indices for each job's rows in the current round (``slot0`` in plan order)."""
    prev: dict[tuple[str, str], tuple[int, ...]] = {}
    for p in previous:
        if p.copy == 0:
            prev[(p.job_id, p.node_id)] = p.gpus
    free: dict[int, set[int]] = {}
    for row, (node_id, gpu_type, _) in enumerate(layout.keys):
        free[row] = set(cluster.by_id[node_id].indices_of(gpu_type))
    wanted: list[tuple[str, int, int, list[int]]] = []
    for job_id, (rows, counts) in slot0:
        for row, count in zip(rows.tolist(), counts.tolist()):
            if count <= 0:
                continue
            node_id = layout.keys[row][0]
            kept = [g for g in prev.get((job_id, node_id), ()) if g in free[row]][:count]
            free[row].difference_update(kept)
            wanted.append((job_id, row, count, kept))
    by_job: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for job_id, row, count, kept in wanted:
        rest = sorted(free[row])[: count - len(kept)]
        if len(kept) + len(rest) < count:
            raise RuntimeError(f"row {layout.keys[row]} over-committed for {job_id}")
        free[row].difference_update(rest)
        by_job[job_id][layout.keys[row][0]].extend(kept + rest)
    placements = []
    node_order = {n: i for i, n in enumerate(layout.node_ids)}
    for job_id, _ in _unique(slot0):
        nodes: Mapping[str, list[int]] = by_job.get(job_id, {})
        for node_id in sorted(nodes, key=node_order.__getitem__):
            placements.append(Placement(job_id=job_id, copy=0, node_id=node_id, gpus=tuple(sorted(nodes[node_id]))))
    return placements


def _unique(items: Sequence[tuple[str, RowCounts]]) -> list[tuple[str, RowCounts]]:
    seen: set[str] = set()
    out = []
    for job_id, rc in items:
        if job_id not in seen:
            seen.add(job_id)
            out.append((job_id, rc))
    return out
