"""HadarE's first-class forking: each round, how many copies of each job, on which nodes.

A copy of job j runs on ONE node, on k <= W_j GPUs of one type there, at its own rate
s = ``rate(job, type, k)``; it is credited c = s x k / W_j job steps per second
(``shared.domain.progress``). Copies add their credited rates; a job with n > 1 copies trains
only ``round_s - cons(n)`` seconds of the round, ``cons`` being what consolidating them
costs the live system (``shared.domain.fork_cost.consolidation_s``: n uploads, n downloads and one
write of weights + optimizer state through ``store_gbps``; the job's ``JobState.model_bytes``
and ``optimizer_slots`` -- stated by the profiler live, taken from the workload in the
simulator, so both charge the same -- with the policy's ``optimizer_slots`` where the job
states none; a job of unknown size, 0 bytes, is charged nothing). So a set C of copies makes

    steps(C) = min(R_j, sum_{c in C} c x (round_s - cons(|C|)))

this round (R_j the job's remaining steps), and the marginal value of one more copy g is
``gain(C, g) = steps(C + g) - steps(C)``: it can be negative (the consolidation slows
every copy down) or zero (the job is already expected to finish).

Rule (one round at a time, no reservation of future rounds):

1. Order. Jobs are taken in Smith's order for the forked cluster: by R_j / (w_j x F_j)
   ascending (w_j priority, F_j = the credited rate j would get with one copy on every
   node, each on its best type), ties by arrival then job id: the weighted
   shortest-remaining-processing-time rule on the pooled cluster, which minimises weighted
   mean completion time when work is divisible -- as forking makes it.
2. Types and GPUs. A job's main pass may use, of each GPU type, at most the GPUs the
   time-indexed LP gives it this round (``split="timeline"``, the default:
   ``hadare/timeline``, its columns a copy of k GPUs per node as the copies are
   (``node_slots``, default; ``lp/model.NodeColumns``): every job done by a target end E
   within ``timeline_slack`` of the optimal makespan, each job's work as early as that
   allows; the round's fractional share rounded to whole GPUs by error diffusion, what a
   job was due and not given carried to the next round, a job the LP ends this round
   served first, so a job about to finish is not kept waiting by a sliver; of near-equal
   plans it keeps what runs, a job's work this round on the types its copies ran on last
   round valued KEEP_ROUNDS earlier, as Hadar's timeline rule does, since every move is a
   restart: on Sia's eight workloads mean JCT 2,714 -> 2,137 s, restarts per job 2.79 ->
   2.10, makespan +2%; the gavel traces unchanged; on at most the GPUs its copies held of
   each type, since 2026-12-07: valued on every GPU of a held type, the LP grew a job
   that held one GPU of it onto all of them, each new one a restart, while jobs it was
   not ahead of waited -- mean JCT 1,923 -> 1,871 s, TTD / fork bound 1.237 -> 1.221).
   ``split="makespan"`` (the earlier rule,
   and the fallback when an LP fails): only the GPU types the makespan LP gives it
   (``hadare/split.type_split``: the fork lower bound's LP on the remaining work, ties
   broken toward giving the jobs first in line their fastest types, within
   ``split_slack`` of the optimal makespan). Without either, short jobs that are as fast
   on a slow type as on a fast one finish early on the fast GPUs, and the long jobs that
   crawl on the slow type are left alone with it at the end (TTD 10-17% over the bound
   on aws-5 / lab-5). The makespan split alone holds TTD within 5% but delays the short
   jobs that share a type with long ones (lab-5 mean JCT 1.15x gavel); the timeline
   holds both (README "Forking").
3. Copies. Each job, in turn (in the main pass narrowest W first, then in Smith's order:
   the LP's GPUs per type are the same whoever goes first, but a narrow job needs a GPU on
   each of many nodes where a wide one may take its share anywhere; ``_pass_order``),
   adds copies one at a time: among the node/type groups it
   may use with free GPUs, on nodes it has no copy on, the one with the largest value
   per GPU net of the group's price (``price_share``, default 0: off; ties: a group one
   of its copies ran on last round, then cluster order); it stops when
   no group gains (gain <= 0: the job is expected to finish, or consolidating one more
   copy costs more than it trains) or it has n copies (n = the number of nodes).
   k = min(W_j, free GPUs of the group), then the fewest of them that give the same gain.
   In the budgeted pass k is also at most the size of the copies the LP planned for the
   job on the type, where that smaller copy earns more per GPU: the LP credits each GPU at
   its column's rate (with ``node_slots``, a copy of that size on each of several nodes),
   and a budget of two GPUs taken as one copy of two on one node, where a lone worker is
   more efficient, earns less than the LP planned (gang-heavy trace, seed 3: a 2-GPU
   Transformer, the longest job, on 2-GPU copies at 0.63x the per-GPU rate of lone
   workers; with ``node_slots`` hadare 1.129x -> 1.049x its fork bound). The planned size
   is the job's GPUs of the type in the LP's first interval over its copies there
   (``Timeline.copies_now``), rounded up; it holds when fewer nodes are free than the LP
   planned copies on (the rest of the budget is left to the back-fill, where other jobs
   run it at their own best size): sized to use the budget up on the free nodes, the
   longest job of the gang-heavy trace's seed 4 (an 8-GPU Transformer) ran copies of 2-3
   V100s at 0.63x the per-GPU rate of the lone workers the LP planned, and 1- and 2-GPU
   jobs that the bound runs on V100s ran on K80s (Sia's eight workloads: mean JCT 1,975
   -> 1,929 s, TTD the same). Without node columns the LP plans no sizes, and the budget
   spread evenly over the nodes with idle GPUs of the type the job has no copy on stands
   in for them.
   Moves: a copy on exactly the GPUs a copy of the job held last round (whatever its
   number) is warm; any other restarts and trains ``JobState.restart_s`` less (0:
   unknown, taken as free). On a group where the job ran, the size it had there is a
   candidate beside k, and the one that trains the job more is taken, a restart's loss
   spread over the rounds the job has left at that rate (paid once, then kept); the value
   per GPU is net of that spread loss. Sia's eight workloads with Sia's restarts: mean
   JCT 2,046 -> 1,945 s, restarts per job 2.05 -> 1.51, TTD / bound 1.34 -> 1.30 (counted
   over this round alone, the last two were 1.42 and 1.39: copies stayed small while the
   LP grew the long jobs); without restarts every figure is the same.
   Warm copies first (``_keep_warm``): before any job of the budgeted pass adds a copy,
   each job keeps every copy whose GPUs are all idle, that its budget of the type covers,
   at least the size the LP planned there, and that trains it this round at least as
   much as a copy of the planned size that restarts -- only where a move costs. Otherwise
   a narrower job, earlier in the pass, took one of those GPUs by cluster order and the
   copy restarted elsewhere: a third of the times a job lost the GPUs one of its copies
   held on Sia's workloads 1-4, its budget covered them. Sia's eight workloads with Sia's
   restarts: mean JCT 1,929 -> 1,923 s, makespan 48,572 -> 48,031 s, restarts per job
   2.08 -> 1.96, TTD / bound 1.251 -> 1.237; without restarts the same, with the data
   plane's (about a second) 1,465 -> 1,463 s. Kept whatever its size (a copy smaller than
   the LP's plan blocks the job's growth on that node), the makespan rose 9%: 1.36x the
   bound (measured before the LP's sizes).
   Value: the copy's comparative efficiency c_j(r, k) / (k c_j(best type, 1)); price of
   type r: ``price_share x`` the best such efficiency on r among the next n jobs in line
   (an option, kept for experiments: on aws-5 / lab-5 it traded mean JCT for little TTD).
4. Back-fill: a second pass of the same rule with every type allowed and every price 0
   hands out what the main pass left idle, so no GPU idles while a copy would still gain
   (net of the consolidation it adds) for some job.

State: ``hadare/timeline.TimelineState`` (the target end E and the jobs it was set for)
with ``split="timeline"``, else None.

Guarantees: every copy is on one node, of one type, with 1..W_j GPUs that no other copy
uses; a job has at most one copy per node, at most n copies, and none it is not expected to
gain from; copy numbers are 0, 1, ... in the order added. Every active job is placed or
waiting (PRIORITY: the GPUs went to jobs ahead of it; INFEASIBLE: no GPU type gives it a
positive rate). Deterministic. Cost: O(J x copies x groups) per round.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.core.policy import (
    JobState,
    Placement,
    Plan,
    PlanRequest,
    Wait,
    WaitCode,
)
from services.scheduler.policies.hadare.budgets import Credited, main_pass_budgets
from services.scheduler.policies.hadare.groups import FreeGroups, previous_gpus
from services.scheduler.policies.hadare.timeline import COMPLETION_WEIGHT, TIMELINE_SLACK
from shared.domain.fork_cost import DEFAULT_STORE_GBPS, consolidation_s
from shared.domain.progress import credited_steps
from shared.wire.events import DEFAULT_OPTIMIZER_SLOTS

EPS = 1e-9
KEEP_ROUNDS = 1.0
PRICE_SHARE = 0.0
SPLIT_SLACK = 0.01
WINDOW = 1.0

@dataclass(frozen=True, kw_only=True)
class CopyCost:
    """How consolidation is charged: the object store's bandwidth and the optimizer's state."""

    store_gbps: float = DEFAULT_STORE_GBPS
    optimizer_slots: int = DEFAULT_OPTIMIZER_SLOTS

    def seconds(self, model_bytes: int, copies: int, optimizer_slots: int | None = None) -> float:
        """Consolidating ``copies`` copies of a ``model_bytes`` model; ``optimizer_slots``
        None: this cost's own."""
        slots = self.optimizer_slots if optimizer_slots is None else optimizer_slots
        return consolidation_s(model_bytes, copies, store_gbps=self.store_gbps, optimizer_slots=slots)


@dataclass(kw_only=True)
class _Job:
    job: JobState
    rates: list[float] = field(default_factory=list)   # credited rates of its copies so far
    nodes: set[str] = field(default_factory=set)
    held: Mapping[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)  # last round's copies' GPUs
    warm_rate: float = 0.0                              # summed credited rate of its warm copies
    cold: list[tuple[float, float]] = field(default_factory=list)   # (credited rate, seconds lost) of the others

    def place(self, node_id: str, gpus: Sequence[int], rate: float, lost: float) -> Placement:
        """Its next copy, on ``gpus`` of ``node_id`` at (credited rate, seconds it restarts)."""
        placement = Placement(job_id=self.job.job_id, copy=len(self.rates), node_id=node_id, gpus=tuple(gpus))
        self.add(rate, lost)
        self.nodes.add(node_id)
        return placement

    def add(self, rate: float, lost: float) -> None:
        self.rates.append(rate)
        if lost > 0:
            self.cold.append((rate, lost))
        else:
            self.warm_rate += rate

    def _trained(self, train: float) -> float:
        """Its copies' job steps if each trains ``train`` seconds less its own restart; O(cold copies)."""
        return self.warm_rate * train + sum(r * max(0.0, train - x) for r, x in self.cold)

    def _train_s(self, copies: int, round_s: float, cost: CopyCost) -> float:
        return max(0.0, round_s - cost.seconds(self.job.model_bytes, copies, self.job.optimizer_slots))

    def steps(self, round_s: float, cost: CopyCost) -> float:
        """Job steps this round of its copies, each training the round less the consolidation
        of them all and its own restart."""
        return min(self.job.remaining, self._trained(self._train_s(len(self.rates), round_s, cost)))

    def one_more(self, round_s: float, cost: CopyCost) -> Callable[[float, float], float]:
        """``steps`` of this state's copies and one more at (credited rate, seconds it loses):
        the others' part is summed once (their training time depends only on the count), so
        each candidate costs O(1) however many copies the job has."""
        train = self._train_s(len(self.rates) + 1, round_s, cost)
        base = self._trained(train)
        remaining = self.job.remaining
        return lambda rate, lost: min(remaining, base + rate * max(0.0, train - lost))


def plan_copies(request: PlanRequest, cost: CopyCost = CopyCost(), price_share: float = PRICE_SHARE,
                split_slack: float = SPLIT_SLACK, split: str = "timeline",
                timeline_slack: float = TIMELINE_SLACK, completion_weight: float = COMPLETION_WEIGHT, *,
                node_slots: bool) -> Plan:
    """The round's copies by the module's rule (placements, waiting, explain; no state)."""
    cluster, tp, round_s = request.cluster, request.throughput, request.round_s
    free = FreeGroups(cluster)

    @functools.cache
    def rate_of(job_type: str, workers: int, gpu_type: str, k: int) -> float:
        return credited_steps(tp.rate(job_type, gpu_type, k), copy_workers=k, job_workers=workers) if k else 0.0

    def credited(job: JobState, gpu_type: str, k: int) -> float:
        return rate_of(job.job_type, job.workers, gpu_type, k)

    shapes: dict[tuple[tuple[str, int], ...], int] = {}   # node composition -> how many nodes
    for n in cluster.nodes:
        shape = tuple((t, len(n.indices_of(t))) for t in n.types)
        shapes[shape] = shapes.get(shape, 0) + 1

    @functools.cache
    def pooled_of(job_type: str, workers: int) -> float:
        return sum(count * max((rate_of(job_type, workers, t, min(workers, c)) for t, c in shape), default=0.0)
                   for shape, count in shapes.items())

    def pooled(job: JobState) -> float:
        return pooled_of(job.job_type, job.workers)

    jobs = sorted(request.jobs, key=lambda j: (j.arrival_s, j.job_id))
    speed = {j.job_id: pooled(j) for j in jobs}
    runnable = [j for j in jobs if j.remaining > EPS and speed[j.job_id] > EPS]
    order = sorted(runnable, key=lambda j: j.remaining / (max(j.priority, EPS) * speed[j.job_id]))
    # ratio on r: a job's credited rate per GPU on type r over its best type's (its comparative
    # efficiency there); best[r][i]: the best ratio on r among the WINDOW x n jobs after position i
    top = {j.job_id: max([EPS] + [credited(j, r, 1) for r in cluster.types]) for j in order}
    window = max(1, int(WINDOW * len(cluster.nodes)))
    best: dict[str, list[float]] = {}
    for r in cluster.types if price_share > 0 else ():
        ratios = [credited(j, r, 1) / top[j.job_id] for j in order]
        best[r] = [max(ratios[i + 1: i + 1 + window], default=0.0) for i in range(len(order))] + [0.0]
    held_gpus = previous_gpus(request)
    main = main_pass_budgets(request, order, credited, speed, split=split, node_slots=node_slots, held=held_gpus,
                             slack=timeline_slack if split == "timeline" else split_slack,
                             completion_weight=completion_weight, keep_rounds=KEEP_ROUNDS)
    budgets = {job_id: dict(got) for job_id, got in main.gpus.items()}
    placements: list[Placement] = []
    explain: dict[str, dict[str, object]] = {}
    limit = len(cluster.nodes)
    states = [_Job(job=job, held=held_gpus.get(job.job_id, {})) for job in order]
    for share, split_only in ((price_share, True), (0.0, False)):   # priced pass, then back-fill
        for _, state in _pass_order(states, split_only) if split_only else ():   # warm copies first
            placements += _keep_warm(state, free, budgets[state.job.job_id], main.copy_sizes.get(state.job.job_id, {}),
                                     credited, round_s, cost, limit)
        for pos, state in _pass_order(states, split_only):
            job = state.job
            while len(state.rates) < limit:
                allowed = budgets[job.job_id] if split_only else None
                pick = _best_group(state, free, credited, best, pos, round_s, cost, share, top[job.job_id], allowed,
                                   main.copy_sizes.get(job.job_id))
                if pick is None:
                    break
                (node_id, gpu_type), k, rate, lost = pick
                gpus = free.take(node_id, gpu_type, k, prefer=state.held.get((node_id, gpu_type), ()))
                if allowed is not None:
                    allowed[gpu_type] -= k
                placements.append(state.place(node_id, gpus, rate, lost))
    for pos, state in enumerate(states):
        if state.rates:
            explain[state.job.job_id] = {"source": "fork-plan", "order": pos,
                                         "forked_copies": len(state.rates) - 1,
                                         "expected_steps": state.steps(round_s, cost)}
    placed = {p.job_id for p in placements}
    waiting = []
    for job in jobs:
        if job.job_id in placed:
            continue
        if speed[job.job_id] <= EPS:
            waiting.append(Wait(job_id=job.job_id, code=WaitCode.INFEASIBLE,
                                detail="no GPU type of the cluster gives it a positive rate"))
        else:
            waiting.append(Wait(job_id=job.job_id, code=WaitCode.PRIORITY,
                                detail="the GPUs went to jobs ahead of it (weighted shortest remaining first)"))
        explain.setdefault(job.job_id, {})["source"] = "waiting"
    return Plan(placements=tuple(placements), waiting=tuple(waiting), explain=explain, state=main.state)


def _pass_order(states: list[_Job], budgeted: bool) -> list[tuple[int, _Job]]:
    """(position in Smith's order, job) in the order a pass visits them. The budgeted pass
    realizes the LP's GPUs per type, which the jobs can all take in any order but one: a
    copy holds at most W GPUs of a node and a job one copy per node, so a narrow job needs
    a GPU on many nodes where a wide one can take its share anywhere, in copies of any size
    up to W. Narrowest first, then Smith's order; gang-heavy trace, seed 1: a 4-GPU job
    ahead in Smith's order took two GPUs of each of three nodes, and the single-GPU job on
    the critical path found room on three nodes of the six its budget could use."""
    ranked = list(enumerate(states))
    return sorted(ranked, key=lambda ps: (ps[1].job.workers, ps[0])) if budgeted else ranked


def _keep_warm(state: _Job, free: FreeGroups, allowed: dict[str, int], copy_sizes: Mapping[str, int],
               credited: Credited, round_s: float, cost: CopyCost, limit: int) -> list[Placement]:
    """Before any job of the budgeted pass adds a copy, the copies of ``state``'s job that stay
    where they ran (module docstring, rule 3, *Moves*): each held copy whose GPUs are all
    idle, that its budget of the type covers, at least the size the LP planned there, and
    that trains the job at least as much this round as a copy of the planned size that
    restarts; only where a move costs (``restart_s`` > 0). Takes its GPUs and budget."""
    job, kept = state.job, list[Placement]()
    if job.restart_s <= 0:
        return kept
    for (node_id, gpu_type), gpus in sorted(state.held.items(), key=lambda g: free.order[g[0][0]]):
        planned = min(copy_sizes.get(gpu_type, 0), job.workers)
        if (not planned or len(state.rates) >= limit or len(gpus) < planned
                or allowed.get(gpu_type, 0) < len(gpus) or not free.has(node_id, gpu_type, gpus)):
            continue
        rate = credited(job, gpu_type, len(gpus))
        moved = credited(job, gpu_type, planned) / planned * len(gpus) * max(0.0, round_s - job.restart_s)
        if rate * round_s < moved - EPS or state.one_more(round_s, cost)(rate, 0.0) - state.steps(round_s, cost) <= EPS:
            continue
        allowed[gpu_type] -= len(gpus)
        kept.append(state.place(node_id, free.take(node_id, gpu_type, len(gpus), prefer=gpus), rate, 0.0))
    return kept


def _spread_size(job: JobState, gpu_type: str, k: int, planned: int, credited: Credited) -> int:
    """The size of a budgeted copy of up to ``k`` GPUs when the job's copies of the type are
    to be ``planned`` GPUs each (module docstring, rule 3): that size where it earns more per
    GPU than ``k``, else ``k``."""
    small = min(k, max(1, planned))
    if small < k and credited(job, gpu_type, small) / small > credited(job, gpu_type, k) / k + EPS:
        return small
    return k


def _best_group(state: _Job, free: FreeGroups, credited: Credited, best: dict[str, list[float]],
                pos: int, round_s: float, cost: CopyCost,
                price_share: float, top: float,
                allowed: dict[str, int] | None = None,
                copy_sizes: Mapping[str, int] | None = None) -> tuple[tuple[str, str], int, float, float] | None:
    """(group, GPUs, credited rate, seconds it restarts) of the job's best next copy, or None
    if none gains. A copy is warm (restarts 0 s, else ``JobState.restart_s``) on exactly
    the GPUs a copy of the job held last round; so on such a group the copy that keeps them
    is a candidate beside the rule's k, and what a move costs is weighed, in the gain and
    in the value per GPU-second trained."""
    job = state.job
    now = state.steps(round_s, cost)
    plus = state.one_more(round_s, cost)
    found, found_score, found_at = None, 0.0, (2, 0)
    spread_k: dict[tuple[str, int], int] = {}    # (type, k) -> its spread size, worked out once a call
    for node_id, gpu_type, idle in free.candidates(state.nodes, allowed, state.held):
        kept = state.held.get((node_id, gpu_type), ())
        budget = allowed[gpu_type] if allowed is not None else idle
        k = min(job.workers, idle, budget)
        if allowed is not None and k > 1:
            if (gpu_type, k) not in spread_k:
                planned = (copy_sizes or {}).get(gpu_type)
                if planned is None:     # the LP did not say: the budget spread over the free nodes
                    planned = -(-budget // max(1, free.nodes_with_idle(gpu_type, state.nodes, budget)))
                spread_k[(gpu_type, k)] = _spread_size(job, gpu_type, k, planned, credited)
            k = spread_k[(gpu_type, k)]
        rate = credited(job, gpu_type, k)
        sizes = []
        if rate > EPS:
            gain = plus(rate, job.restart_s) - now
            # the fewest GPUs of the group that still reach that gain
            while k > 1:
                smaller = credited(job, gpu_type, k - 1)
                if plus(smaller, job.restart_s) - now < gain - EPS:
                    break
                k, rate = k - 1, smaller
            sizes.append(k)
        if (job.restart_s > 0 and len(kept) not in sizes and len(kept) <= min(job.workers, budget)
                and free.has(node_id, gpu_type, kept)):
            sizes.append(len(kept))     # the warm copy: the very GPUs it held, all idle
        # Of the group's sizes, the one that trains the job most, a restart's loss spread over
        # the rounds the job has left at that rate (a move is paid once, then kept); ties: the
        # first (the rule's k).
        pick = None
        for size in sizes:
            rate = credited(job, gpu_type, size)
            if rate <= EPS:
                continue
            lost = 0.0 if len(kept) == size and free.has(node_id, gpu_type, kept) else job.restart_s
            # (free.take takes exactly these GPUs then: ``prefer``)
            spread = lost / max(1.0, job.remaining / max(plus(rate, 0.0), EPS)) if lost > 0 else 0.0
            worth = plus(rate, spread) if len(sizes) > 1 else 0.0    # one size: nothing to weigh
            if pick is None or worth > pick[0] + EPS:
                pick = (worth, size, rate, lost, spread)
        if pick is None:
            continue
        _, k, rate, lost, spread = pick
        gain = plus(rate, lost) - now
        price = price_share * best[gpu_type][pos] if price_share > 0 else 0.0
        score = rate * max(0.0, 1.0 - spread / round_s) / (k * top) - price
        # ties: where a copy ran last round (another group would restart it), then cluster order
        at = (0 if (node_id, gpu_type) in state.held else 1, free.order[node_id])
        if gain <= EPS or score <= -EPS:
            continue
        if (found is None or score > found_score + EPS
                or (score >= found_score - EPS and at < found_at)):
            found, found_score, found_at = ((node_id, gpu_type), k, rate, lost), score, at
    return found
