"""What HadarE's budgeted (main) pass may take each round: per job, the GPUs of each type and,
where the time-indexed LP says, the size of its copies there.

The rule lives in ``hadare/copies`` (module docstring, rules 2 and 3); this module only
solves the LP (``hadare/timeline`` for its cap E and its rounding) or, when that fails or
``split="makespan"``, the makespan split (``hadare/split``), and reads the budgets off it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.scheduler.core.policy import JobState, PlanRequest, previous_state
from services.scheduler.policies.hadare.split import type_split
from services.scheduler.policies.hadare.timeline import TimelineState, budgets, target_end_s
from services.scheduler.policies.lp.model import fork_lp
from services.scheduler.policies.lp.timeline import POOL_ABOVE, SHARE_EPS, job_classes, pool, solve_until

EPS = 1e-9

Credited = Callable[[JobState, str, int], float]   # credited(job, gpu type, k): a copy's job steps/s
Held = Mapping[str, Mapping[tuple[str, str], tuple[int, ...]]]   # job id -> (node, type) -> GPUs its copy held


@dataclass(frozen=True, kw_only=True)
class MainPass:
    """``gpus``: job id -> GPU type -> the GPUs its main pass may take; ``copy_sizes``: job id
    -> GPU type -> the GPUs per copy the LP planned it there (its GPUs of the type in the
    LP's first interval over its copies there, rounded up; a pooled class's jobs its mean
    copy; none without node columns or from the makespan split); ``state``: what to carry
    to the next round (None: the makespan split)."""

    gpus: Mapping[str, Mapping[str, int]]
    copy_sizes: Mapping[str, Mapping[str, int]]
    state: TimelineState | None


def main_pass_budgets(request: PlanRequest, order: Sequence[JobState], credited: Credited,
                      speed: Mapping[str, float], *, split: str, slack: float, completion_weight: float,
                      node_slots: bool, held: Held, keep_rounds: float) -> MainPass:
    """The time-indexed LP's slice of this round (``split="timeline"``; on classes of jobs
    above POOL_ABOVE jobs), or every GPU of the types the makespan split gives each job
    (``"makespan"``, or when an LP fails). ``order``: the jobs in planning order; ``speed``:
    each job's pooled rate; ``held``: the GPUs each job's copies held last round by (node,
    type), whose work this round the LP values ``keep_rounds`` earlier, on at most that
    many GPUs of each type (``lp/timeline.solve``'s ``keep_gpus``)."""
    if split == "timeline" and order:
        got = _timeline(request, order, credited, speed, slack=slack, completion_weight=completion_weight,
                        held=held, node_slots=node_slots, keep_rounds=keep_rounds)
        if got is not None:
            return got
    cluster = request.cluster
    types = type_split(list(order), cluster, credited, urgency=[speed[j.job_id] / j.remaining for j in order],
                       slack=slack)
    return MainPass(gpus={job_id: {t: cluster.gpus_by_type[t] for t in got} for job_id, got in types.items()},
                    copy_sizes={}, state=None)


def _timeline(request: PlanRequest, order: Sequence[JobState], credited: Credited, speed: Mapping[str, float], *,
              slack: float, completion_weight: float, held: Held, node_slots: bool,
              keep_rounds: float) -> MainPass | None:
    """``main_pass_budgets`` by the time-indexed LP; None if an LP fails. The makespan LP
    is solved only when E must be set or moved (first round, arrivals, E missed)."""
    full = fork_lp(order, cluster := request.cluster, credited, nodes=node_slots)
    if len(order) > POOL_ABOVE:
        at = {j.job_id: i for i, j in enumerate(order)}
        def rounds(j: JobState) -> float:
            return j.remaining / max(speed[j.job_id] * request.round_s, EPS)
        groups = [[at[j.job_id] for j in g] for g in job_classes(order, rounds)]
        lp = pool(full, groups)
    else:
        groups, lp = [[i] for i in range(len(order))], full
    now, weights = request.now_s, [sum(max(order[i].priority, EPS) for i in g) for g in groups]
    ids = frozenset(j.job_id for j in request.jobs)
    previous = previous_state(request, TimelineState)
    tindex = {t: r for r, t in enumerate(cluster.types)}
    keep_gpus = np.zeros(lp.rho.shape)    # GPUs held per (class, type); its types are the kept ones
    for c, group in enumerate(groups):
        for i in group:
            for (_, t), gpus in held.get(order[i].job_id, {}).items():
                keep_gpus[c, tindex[t]] += len(gpus)
    end, plan = solve_until(
        lp, kept_end=previous.end_s if previous is not None and not ids - previous.job_ids else None,
        new_end=lambda best: target_end_s(best, now_s=now, previous=previous, job_ids=ids, slack=slack),
        horizon_of=lambda e: e - now, round_s=request.round_s, weights=weights, completion_weight=completion_weight,
        keep=keep_gpus, keep_rounds=keep_rounds, keep_gpus=keep_gpus)
    if end is None or plan is None:
        return None
    types, keys = cluster.types, [order[g[0]].job_id for g in groups]
    carried = previous.credit if previous is not None else {}
    credit = np.array([[carried.get(key, {}).get(t, 0.0) for t in types] for key in keys]).reshape(len(keys), -1)
    later = plan.x[:, :, 1:].sum(axis=(1, 2))
    share = plan.x[:, :, 0] / plan.lengths[0]
    size = np.where(plan.copies_now > SHARE_EPS, np.ceil(share / np.maximum(plan.copies_now, SHARE_EPS) - 1e-6), 0.0)
    got, credit = budgets(share, groups, full.cap_f, count=full.count, credit=credit,
                          finishing=later <= 1e-6 * np.maximum(plan.x.sum(axis=(1, 2)), EPS))
    kept = {key: {t: float(credit[c, r]) for r, t in enumerate(types) if credit[c, r]} for c, key in enumerate(keys)}
    return MainPass(
        gpus={j.job_id: {types[r]: n for r, n in got[i].items()} for i, j in enumerate(order)},
        copy_sizes={order[i].job_id: {types[r]: int(size[c, r]) for r in range(len(types)) if size[c, r] >= 1}
                    for c, group in enumerate(groups) for i in group},
        state=TimelineState(end_s=end, job_ids=ids, credit={key: v for key, v in kept.items() if v}))
