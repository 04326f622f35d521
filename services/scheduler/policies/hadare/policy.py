"""HadarE: jobs forked into copies on different nodes, averaged at each round's end.

Default (``fork="first-class"``): copies are planned as units every round by
``hadare/copies.plan_copies`` (its docstring has the rule: Smith's order on the pooled
cluster, each job's GPUs this round from the time-indexed LP of ``lp/timeline``
(``split="timeline"``) or its types from the makespan LP of ``hadare/split``
(``split="makespan"``), marginal steps net of the consolidation cost of
``shared.domain.fork_cost``, then a back-fill pass).

``fork="leftover"`` (the earlier behaviour, kept for comparison): the primary plan is
Hadar's (``hadar.Hadar``: ledger, back-fill, copy 0 of each placed job, the ledger as policy
state). Then the GPUs still idle this round are handed out as extra copies:

* A copy of job j runs on ONE node, on k <= W_j GPUs of one type of that node, at
  ``rate(job, type, k)``; copies train independently and their weights are averaged at the
  round end, so k need not be the gang size. A job has at most n copies (n = number of
  nodes) and at most one per node: no copy on a node its copy 0 (which may span nodes) or
  another copy already uses. Every copy's steps count toward the job's total; the
  simulator charges the consolidation time of rounds with more than one copy.
* Rule: idle GPU groups (node, type) are visited in cluster order, types by name. For a
  group with a idle GPUs, every eligible job j scores
  ``min(1, e_j / rem_j)``, where e_j = rate(job, type, k) x k / W_j x round_s with
  k = min(W_j, a) is the job steps a copy there would be credited this round (each step of
  a copy on k of W workers is k/W of a job step: ``shared.domain.progress``) and rem_j the job's
  remaining steps minus what its
  copies so far (copy 0 included) are expected to make this round: the job for which those
  GPUs are fastest relative to the work it has left. The best score wins (ties: more
  remaining work, then planning order); it takes the fewest GPUs of the group that reach
  min(e_j, rem_j) steps, and the group is offered again while GPUs remain.
* A job that had no copy 0 gets index 0 for its first copy (it is then simply placed).

Polynomial: O(groups x copies-per-group x jobs), vectorized over jobs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from services.scheduler.core.policy import Placement, Plan, PlanRequest, copy_rate
from services.scheduler.policies.hadar.policy import Hadar
from services.scheduler.policies.hadare.copies import (
    PRICE_SHARE,
    SPLIT_SLACK,
    CopyCost,
    plan_copies,
)
from services.scheduler.policies.hadare.timeline import (
    COMPLETION_WEIGHT,
    TIMELINE_SLACK,
)
from shared.domain.fork_cost import DEFAULT_STORE_GBPS
from shared.wire.events import DEFAULT_OPTIMIZER_SLOTS

EPS = 1e-9


FORK_MODES = ("first-class", "leftover")
SPLITS = ("timeline", "makespan")


class HadarE:
    """The ``hadare`` policy.

    Options: ``fork`` -- ``"first-class"`` (default): the copies of every job are planned as
    units each round, leftovers back-filled by the same rule (``hadare/copies.plan_copies``);
    ``"leftover"``: Hadar's plan (its options pass through) plus copies on the GPUs it
    leaves idle, the earlier behaviour. ``store_gbps`` and ``optimizer_slots``: what
    consolidation costs (``shared.domain.fork_cost``; match ``hadar sim --store-gbps``).
    ``split``: ``"timeline"`` (default) or ``"makespan"``, how the first-class mode picks
    each job's GPUs (``hadare/copies`` rule 2); ``timeline_slack``: the share of the
    optimal makespan the timeline may give up for mean JCT (default 0.045);
    ``completion_weight``: the timeline objective's share of completion bounds, in [0, 1)
    (``hadare/timeline``; default 0.75, 0: mean busy time alone). ``node_slots``: the
    timeline LP holds a job to one copy per node (``lp/model.NodeColumns``), as its copies
    are (default); False credits each GPU its best per-GPU rate, which plans a job whose
    lone worker is the most efficient last, as if it could run a copy on every GPU (README
    "Known limits", the gang-heavy trace).
    """

    name = "hadare"
    forks = True   # copies use GPUs beyond a job's W: the queue mechanism lends it spare ones
    mixes_types = True   # a job's workers may run on several GPU types at once (the queue cover may split them)

    def __init__(self, *, fork: str = "first-class", store_gbps: float = DEFAULT_STORE_GBPS,
                 optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS, price_share: float = PRICE_SHARE,
                 split_slack: float = SPLIT_SLACK, split: str = "timeline",
                 timeline_slack: float = TIMELINE_SLACK, completion_weight: float = COMPLETION_WEIGHT,
                 node_slots: bool = True, **options: Any) -> None:
        if fork not in FORK_MODES:
            raise ValueError(f"fork must be one of {', '.join(FORK_MODES)}")
        if options and fork != "leftover":   # only leftover mode's Hadar takes more; never ignore a typo
            raise ValueError(f"unknown option(s) for hadare: {', '.join(sorted(options))}")
        if split not in SPLITS or not timeline_slack >= 0 or not 0 <= completion_weight < 1:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; timeline_slack must be >= 0; "
                             "completion_weight in [0, 1)")
        if not store_gbps > 0 or optimizer_slots < 0 or price_share < 0:
            raise ValueError("store_gbps must be > 0, optimizer_slots >= 0, price_share >= 0")
        self.mode = fork
        self.cost = CopyCost(store_gbps=float(store_gbps), optimizer_slots=int(optimizer_slots))
        self.price_share = float(price_share)
        self.split_slack = float(split_slack)
        self.split = split
        self.timeline_slack = float(timeline_slack)
        self.completion_weight = float(completion_weight)
        self.node_slots = bool(node_slots)
        # Leftover mode's primary plans without critical-first (``hadar/critical``): copies already
        # speed up the long jobs, and with it mean JCT fell (aws-5, 20 jobs, seeds 1-5: 1.54x -> 1.30x gavel).
        self.primary = Hadar(**({"critical": False} | options)) if fork == "leftover" else None

    def plan(self, request: PlanRequest) -> Plan:
        if self.primary is not None:
            return fork(request, self.primary.plan(request))
        return plan_copies(request, self.cost, self.price_share, self.split_slack, self.split, self.timeline_slack,
                           self.completion_weight, node_slots=self.node_slots)


def fork(request: PlanRequest, base: Plan) -> Plan:
    """``base`` plus copies on the GPUs it leaves idle (rules in the module docstring).

    Input: the request and the primary policy's plan for it (Hadar's).

    Output: every placement of ``base`` unchanged and in order, then the extra copies; a
    job that got one leaves ``waiting`` and has ``forked_copies`` in ``explain``;
    ``state`` is ``base.state`` untouched. ``base`` itself when nothing is forked.

    Guarantees: an extra copy uses only GPUs ``base`` left idle, on one node, of one
    type, at most W of them. A job never has two copies on one node (counting every node
    its copies span) nor more copies than the cluster has nodes, and gets none once the
    copies it has are expected to finish its remaining steps this round. Copy numbers
    continue after the job's highest in ``base``. Hence the result passes ``check_plan``
    whenever ``base`` does. Deterministic.

    Cost: O(J T K) to tabulate rates (J job types, T GPU types, K GPUs on the largest
    node), then one scoring pass over the m jobs per copy placed: O(c m) for c copies,
    c at most the number of idle GPUs.
    """
    jobs = sorted(request.jobs, key=lambda j: (j.arrival_s, j.job_id))
    if not jobs or not request.cluster.nodes:
        return base
    index = {j.job_id: i for i, j in enumerate(jobs)}
    cluster, tp, round_s = request.cluster, request.throughput, request.round_s
    types = cluster.types
    job_types = sorted({j.job_type for j in jobs})
    max_k = max(n.size for n in cluster.nodes)
    # rate_tab[job type, gpu type, k] = worker-steps per round of a copy on k GPUs of that type
    # (its steps x k); a job of W workers is credited rate_tab / W job steps
    rate_tab = np.array([[[tp.rate(jt, t, k) * k * round_s for k in range(max_k + 1)] for t in types]
                         for jt in job_types])
    jt = np.array([job_types.index(j.job_type) for j in jobs])
    workers = np.array([j.workers for j in jobs])
    rem = np.array([j.remaining for j in jobs], dtype=float)
    copies = np.zeros(len(jobs), dtype=np.int64)
    next_copy = np.zeros(len(jobs), dtype=np.int64)
    on_node: dict[str, set[int]] = defaultdict(set)
    used: set[tuple[str, int]] = set()
    for (job_id, copy), parts in base.copies().items():
        i = index[job_id]
        rem[i] -= copy_rate(request, jobs[i], parts) * round_s
        copies[i] += 1
        next_copy[i] = max(next_copy[i], copy + 1)
        for p in parts:
            on_node[p.node_id].add(i)
            used.update((p.node_id, g) for g in p.gpus)
    limit = len(cluster.nodes)
    extra: list[Placement] = []
    forked: dict[str, int] = defaultdict(int)
    tindex = {t: r for r, t in enumerate(types)}
    for node in cluster.nodes:
        for gpu_type in node.types:
            idle = [g for g in node.indices_of(gpu_type) if (node.node_id, g) not in used]
            r = tindex[gpu_type]
            while idle:
                i, k = _best_copy(rate_tab[:, r, :], jt, workers, rem, copies, on_node[node.node_id], limit, len(idle))
                if i < 0:
                    break
                gpus, idle = idle[:k], idle[k:]
                job_id = jobs[i].job_id
                extra.append(Placement(job_id=job_id, copy=int(next_copy[i]), node_id=node.node_id,
                                       gpus=tuple(gpus)))
                rem[i] -= rate_tab[jt[i], r, k] / workers[i]
                copies[i] += 1
                next_copy[i] += 1
                forked[job_id] += 1
                on_node[node.node_id].add(i)
    if not extra:
        return base
    explain = {job_id: dict(info) for job_id, info in base.explain.items()}
    for job_id, n in forked.items():
        explain.setdefault(job_id, {})["forked_copies"] = n
    waiting = tuple(w for w in base.waiting if w.job_id not in forked)
    return Plan(placements=base.placements + tuple(extra), waiting=waiting, state=base.state, explain=explain)


def _best_copy(rates: np.ndarray, jt: np.ndarray, workers: np.ndarray, rem: np.ndarray, copies: np.ndarray,
               on_node: set[int], limit: int, idle: int) -> tuple[int, int]:
    """(job, GPUs) for the next copy on a group of ``idle`` GPUs, or (-1, 0) if none fits.

    ``rates[job type, k]`` = worker-steps per round of a copy on k GPUs of the group's type.
    """
    k = np.minimum(workers, idle)
    steps = rates[jt, k] / workers
    valid = (rem > EPS) & (copies < limit) & (steps > EPS)
    if on_node:
        valid[list(on_node)] = False
    if not valid.any():
        return -1, 0
    score = np.where(valid, np.minimum(1.0, steps / np.maximum(rem, EPS)), -1.0)
    tied = np.flatnonzero(score == score.max())
    i = int(tied[np.argmax(rem[tied])])
    target = min(steps[i], rem[i])
    enough = np.flatnonzero(rates[jt[i], 1: k[i] + 1] / workers[i] >= target - EPS)
    return i, int(enough[0]) + 1 if enough.size else int(k[i])
