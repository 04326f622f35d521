"""How many GPUs of each type every queue may hold this round: quotas, borrowing, fair share.

Pure integer arithmetic over the round's capacity, the queues in force and the jobs; the
rules and their guarantees are stated in :mod:`services.scheduler.core.queues`, which
turns these counts into concrete GPUs and runs the policy on them. Terms:

* ``capacity[r]``: GPUs of type r in the round's cluster.
* A queue's *nominal* quota, scaled down type by type (largest remainders, ties by queue
  name) where the quotas of a type add up to more than the cluster has (nodes down).
* *Demand*: the GPUs (the jobs' W, summed) of the queue's visible jobs that can run on the
  cluster at all (with ``one_type``: on W GPUs of one type).
* *Cover* (:func:`shortfall`): the queue's jobs take their W GPUs from a set of GPUs, each
  only of types it runs on (rate > 0), fastest first; within a priority class the job with
  the fewest types it runs on first (the usual greedy for matching, so a flexible job does
  not take the V100 a V100-only job needs), then queue order. What the jobs lack after it
  is their *shortfall*. For a policy that runs a job on one type only (``one_type``: all but
  Hadar and HadarE), a job takes its W from one type: the first of its types, fastest
  first, that still has W; failing that, what is left of the type with the most (the
  fastest among equals), and it is short the rest *of that type only*, so what it borrows
  completes one type. Counting across types would entitle a gang of 4 to 2 V100s + 2 K80s,
  borrow nothing, and leave it waiting beside idle V100s under every one-type policy.
* *Guaranteed*: the part of the nominal quota the queue's jobs use in the cover of it: the
  whole quota when the demand reaches it and its jobs run on every type; never a GPU its
  jobs cannot run on (that one is idle, and lent).
* *Borrowed*: idle GPUs (nobody's guaranteed share) lent to queues whose jobs have a
  shortfall, one at a time to the queue whose fair-share standing is lowest, within its
  borrowing limit, of a type its first short job runs on (its fastest idle one). Counting
  GPUs alone is not enough: a queue whose quota is K80s and whose jobs run only on V100s
  covers its demand in number and would wait beside an idle V100.
* *Spare*: with ``spare=True`` (a policy that forks: its copies use more than W), what is
  still idle goes, by the same order, to queues with any job, on the types their jobs run
  best on (``affinity``). Otherwise no job could use it, and it is nobody's.
* *Standing*: ``(usage + GPUs given this round x round_s) / weight``; usage is normalized
  GPU-seconds decayed with the half-life (:func:`decayed`, :func:`charge`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from services.scheduler.core.policy import JobState
from shared.wire.queues import QueueConfig, QueueSpec

__all__ = ["Rate", "Entitlement", "scaled_quotas", "affinity", "shortfall", "entitlements", "decayed", "charge"]

Rate = Callable[[JobState, str], float]   # a job's steps/s on a type at its W (0: cannot run there)


@dataclass(frozen=True, kw_only=True)
class Entitlement:
    """What one queue may hold this round: ``gpus[r]`` of each type, of which ``borrowed``
    are beyond its (scaled) nominal quota; ``lent``: GPUs of its quota it left to others;
    ``demand``: its visible jobs' W, summed."""

    gpus: Mapping[str, int]
    nominal: Mapping[str, int]
    borrowed: int
    lent: int
    demand: int

    @property
    def total(self) -> int:
        return sum(self.gpus.values())


def scaled_quotas(queues: Sequence[QueueSpec], capacity: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """Each queue's quota per type, scaled down where the quotas of a type exceed the
    capacity: floor of the proportional share, then one each by largest remainder (ties by
    queue name). Types the cluster lacks give nothing."""
    out: dict[str, dict[str, int]] = {q.name: {} for q in queues}
    for gpu_type, have in capacity.items():
        asked = {q.name: q.quota.get(gpu_type, 0) for q in queues if q.quota.get(gpu_type, 0) > 0}
        total = sum(asked.values())
        if total <= have:
            for name, n in asked.items():
                out[name][gpu_type] = n
            continue
        exact = {name: n * have / total for name, n in asked.items()}
        given = {name: math.floor(x) for name, x in exact.items()}
        left = have - sum(given.values())
        for name in sorted(asked, key=lambda n: (-(exact[n] - given[n]), n))[:left]:
            given[name] += 1
        for name, n in given.items():
            if n:
                out[name][gpu_type] = n
    return out


def affinity(jobs: Sequence[JobState], types: Sequence[str], rate: Rate) -> dict[str, float]:
    """How well a queue's jobs use each type: the sum over its jobs of their rate on the type
    relative to their best type (1 for a job's best type, 0 where it cannot run)."""
    out = dict.fromkeys(types, 0.0)
    for job in jobs:
        rates = {t: rate(job, t) for t in types}
        best = max(rates.values(), default=0.0)
        if best > 0:
            for t, r in rates.items():
                out[t] += r / best
    return out


def _preferred(types: Mapping[str, float], available: Mapping[str, int]) -> str | None:
    """The available type (count > 0) with the highest affinity (ties: the name)."""
    candidates = [t for t, n in available.items() if n > 0]
    return min(candidates, key=lambda t: (-types.get(t, 0.0), t)) if candidates else None


@dataclass(kw_only=True)
class _Short:
    """A job the cover left short: the types it runs on, fastest first, and the GPUs it lacks."""

    runs_on: tuple[str, ...]
    lacks: int


def shortfall(jobs: Sequence[JobState], gpus: Mapping[str, int], rate: Rate,
              types: Sequence[str], *, one_type: bool = False) -> tuple[dict[str, int], list[_Short]]:
    """The cover of ``jobs`` by ``gpus`` (module docstring): the GPUs of each type the jobs
    take, and the jobs left short, in the order the cover took them; ``one_type``: each job's
    GPUs all of one type."""
    runs_on = {}
    for job in jobs:
        if job.job_type not in runs_on:
            speeds = {t: rate(job, t) for t in types}
            runs_on[job.job_type] = tuple(sorted((t for t in types if speeds[t] > 0), key=lambda t: (-speeds[t], t)))
    left = dict(gpus)
    taken: dict[str, int] = {}
    short: list[_Short] = []
    order = sorted(range(len(jobs)), key=lambda i: (-jobs[i].priority_class, len(runs_on[jobs[i].job_type]), i))
    for i in order:
        job, need = jobs[i], jobs[i].workers
        kinds = runs_on[job.job_type]
        if not kinds:
            continue
        if one_type:   # the first type with all W left, else the one with the most (fastest on ties)
            one = next((t for t in kinds if left.get(t, 0) >= need), None) or max(
                kinds, key=lambda t: (left.get(t, 0), -kinds.index(t)))
            kinds = (one,)
        for t in kinds:
            take = min(need, left.get(t, 0))
            if take:
                left[t] -= take
                taken[t] = taken.get(t, 0) + take
                need -= take
        if need:
            short.append(_Short(runs_on=kinds, lacks=need))
    return taken, short


def entitlements(config: QueueConfig, capacity: Mapping[str, int], jobs: Mapping[str, Sequence[JobState]],
                 rate: Rate, *, usage: Mapping[str, float], round_s: float,
                 spare: bool = False, one_type: bool = False) -> dict[str, Entitlement]:
    """Every queue's entitlement for the round (module docstring). ``jobs``: each queue's
    visible jobs; ``usage``: decayed normalized GPU-seconds by queue; ``spare``: lend what
    no job needs too; ``one_type``: the policy runs each job on one GPU type."""
    types = sorted(capacity)
    nominal = scaled_quotas(config.queues, capacity)
    prefs = {q.name: affinity(jobs.get(q.name, ()), types, rate) for q in config.queues}

    def can_run(job: JobState) -> bool:   # on the cluster at all: with one_type, W GPUs of one type it runs on
        return any(rate(job, t) > 0 and (not one_type or capacity[t] >= job.workers) for t in types)

    runnable = {q.name: [j for j in jobs.get(q.name, ()) if can_run(j)] for q in config.queues}
    demand = {name: sum(j.workers for j in js) for name, js in runnable.items()}
    gpus: dict[str, dict[str, int]] = {}
    short: dict[str, list[_Short]] = {}
    for q in config.queues:
        gpus[q.name], short[q.name] = shortfall(runnable[q.name], nominal[q.name], rate, types, one_type=one_type)
    idle = {t: capacity[t] - sum(g.get(t, 0) for g in gpus.values()) for t in types}
    extra = dict.fromkeys(gpus, 0)
    weight = {q.name: q.weight for q in config.queues}
    limit = {q.name: math.inf if q.borrowing_limit is None else q.borrowing_limit for q in config.queues}

    held = {name: sum(g.values()) for name, g in gpus.items()}
    left = sum(idle.values())

    def standing(name: str) -> tuple[float, str]:
        return ((usage.get(name, 0.0) + held[name] * round_s) / weight[name], name)

    def give(name: str, gpu_type: str) -> None:
        nonlocal left
        gpus[name][gpu_type] = gpus[name].get(gpu_type, 0) + 1
        idle[gpu_type] -= 1
        extra[name] += 1
        held[name] += 1
        left -= 1

    def first_short(name: str) -> _Short | None:
        """The queue's first short job with an idle type it runs on; jobs with none are
        dropped for good (idle GPUs only get fewer while lending)."""
        pending = short[name]
        while pending and not any(idle[t] > 0 for t in pending[0].runs_on):
            pending.pop(0)
        return pending[0] if pending else None

    # One GPU at a time to the taker with the lowest standing. A queue's standing changes only
    # when it is given one, and a queue that stops being a taker never becomes one again (its
    # borrowing only grows, idle GPUs only get fewer), so a heap of (standing, name) with each
    # queue once, dropping one found not to take, picks what a min over the takers would.
    heap = [standing(name) for name in gpus]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, name = heapq.heappop(heap)
        head = first_short(name) if extra[name] < limit[name] else None
        if head is None:
            continue
        give(name, next(t for t in head.runs_on if idle[t] > 0))
        head.lacks -= 1
        if head.lacks == 0:
            short[name].pop(0)
        heapq.heappush(heap, standing(name))
    heap = [standing(name) for name in gpus if extra[name] < limit[name] and jobs.get(name)] if spare else []
    heapq.heapify(heap)
    while left > 0 and heap:
        _, name = heapq.heappop(heap)
        t = _preferred(prefs[name], idle)
        assert t is not None
        give(name, t)
        if extra[name] < limit[name]:
            heapq.heappush(heap, standing(name))
    lent_out = {n: max(0, sum(nominal[n].values()) - (sum(gpus[n].values()) - extra[n])) for n in gpus}
    return {n: Entitlement(gpus={t: c for t, c in sorted(gpus[n].items()) if c}, nominal=nominal[n],
                           borrowed=extra[n], lent=lent_out[n], demand=demand[n]) for n in gpus}


def decayed(usage: Mapping[str, float], elapsed_s: float, half_life_s: float) -> dict[str, float]:
    """``usage`` after ``elapsed_s`` of halving every ``half_life_s``."""
    factor = 0.5 ** (max(elapsed_s, 0.0) / half_life_s)
    return {q: u * factor for q, u in usage.items()}


def charge(job: JobState, gpu_type: str, gpus: int, seconds: float, rate: Rate, types: Sequence[str]) -> float:
    """Normalized GPU-seconds of ``gpus`` GPUs of ``gpu_type`` held ``seconds`` by ``job``:
    each second weighs the job's rate on the type over its rate on its best type (a job 10x
    slower on a K80 than on a V100 is charged 0.1 of a second per K80 second); a job with no
    known rate is charged plain GPU-seconds."""
    best = max((rate(job, t) for t in types), default=0.0)
    relative = rate(job, gpu_type) / best if best > 0 else 1.0
    return gpus * seconds * relative
