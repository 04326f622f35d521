"""Hadar's whole gangs of a round: which of the LP's gangs run now, and on which GPUs.

``hadar/timeline`` solves the time-indexed LP and takes its slice of this round; here that
slice's gangs (W >= 2) are rounded to whole gangs, before the single-GPU jobs get the GPUs
left (``timeline._single_gpus``). Two ways, the same dues (``gang_dues``):

* ``whole_gangs`` (the default): one gang at a time, by due then Smith's order, each named
  only by the GPU types it may use;
* ``seated_gangs`` (Hadar's ``seat_gangs``, where every class is one job): the due gangs
  seated together by one MIP on the cluster's rows (``hadar/seats``), each on exactly the
  GPUs its seat names, which its planning then takes (``Hadar._materialize``). Pooled
  classes (above POOL_ABOVE jobs), or a MIP not solved, fall back to ``whole_gangs``.

Also ``tight_singles``: the GPUs either way must leave to the tight single-GPU jobs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.scheduler.core.policy import JobState
from services.scheduler.policies.hadar.profile import JobProfile
from services.scheduler.policies.hadar.seats import Seat, SeatAsk, seat_gangs
from services.scheduler.policies.lp.model import WorkLp
from services.scheduler.policies.lp.timeline import SHARE_EPS

CREDIT_CAP = 1.0     # a gang's rounding credit, in rounds (``whole_gangs``): no wind-up while it cannot fit


@dataclass(frozen=True, kw_only=True)
class GangDues:
    """The rounding's view of this round's gangs (``whole_gangs``): ``wanted`` (-due, Smith
    rank, group index, gangs of the group to run) for each group with due > 0, ``budget``
    (GPUs: sum of W max(due, 0)) and each lone gang's due (``due_of``)."""

    wanted: list[tuple[float, int, int, int]]
    budget: float
    due_of: dict[str, float]

    def carried(self, ran: set[str]) -> dict[str, float]:
        """Each lone gang's credit for the next round: its due less 1 if it ran, capped."""
        return {job_id: float(np.clip(due - (job_id in ran), -CREDIT_CAP, CREDIT_CAP))
                for job_id, due in self.due_of.items()}


def gang_dues(groups: Sequence[Sequence[JobState]], share: np.ndarray, smith: np.ndarray, *, rounds: np.ndarray,
              tight: np.ndarray, credit: Mapping[str, float]) -> GangDues:
    """Each gang's due this round (``whole_gangs``)."""
    wanted, budget, due_of = [], 0.0, {}
    for c, group in enumerate(groups):
        width = group[0].workers
        units = float(share[c].sum()) / width
        if width < 2:
            continue
        if len(group) == 1:
            job_id = group[0].job_id
            due = min(1.0, units / max(min(1.0, float(rounds[c])), 1e-9)) + credit.get(job_id, 0.0)
            due = max(due, 1.0) if tight[c] else due
            due_of[job_id], runs = due, 1
            budget += width * max(due, 0.0)
        else:
            due, runs = units / len(group), math.floor(units + 0.5)
            budget += width * units
        if due > SHARE_EPS:
            wanted.append((-due, int(smith[c]), c, runs))
    return GangDues(wanted=wanted, budget=budget, due_of=due_of)


def tight_singles(groups: Sequence[Sequence[JobState]], share: np.ndarray, rates: np.ndarray, tight: np.ndarray,
                   free: np.ndarray) -> np.ndarray:
    """GPUs per type a gang rounded onto another option than the LP's must leave for the
    tight single-GPU jobs: one of the type the LP's slice gives each (its fastest if none),
    while any is free. On the gang-heavy trace of README "Known limits" (seed 2) an 8-GPU
    gang due its turn, its K80s held by another gang, took every P100 and V100 left, the
    job that sets E among them, every fourth round: E slid 20 rounds."""
    held = np.zeros_like(free)
    for c, group in enumerate(groups):
        if tight[c] and group[0].workers == 1:
            r = int(np.argmax(share[c])) if share[c].max() > SHARE_EPS else int(np.argmax(rates[c]))
            if free[r] - held[r] >= 1:
                held[r] += 1
    return held


def in_turn(group: Sequence[JobState]) -> list[JobState]:
    """A class's jobs in Smith's order (least remaining work per unit of priority first)."""
    return sorted(group, key=lambda j: (j.remaining / max(j.priority, 1e-9), j.arrival_s, j.job_id))


def whole_gangs(lp: WorkLp, groups: Sequence[Sequence[JobState]], dues: GangDues, share: np.ndarray,
                spread_now: np.ndarray, rates: np.ndarray, free: np.ndarray, *, keep: np.ndarray,
                ) -> tuple[list[tuple[bool, str, set[int]]], dict[str, float]]:
    """The gangs (W >= 2) to run now, each on all its W GPUs, as (whether it spans nodes,
    job id, the types it may use), and the gangs' credit for the next round; takes their
    GPUs off ``free``.

    The LP runs gang c for ``units`` = its GPUs now / W of this round (a class: that many of
    its gangs). A gang's *fill* is that part of what it can use this round (``units`` over
    the part of a round it still needs, at most 1, so one about to finish is not starved by
    its sliver; 1 when it has less than a round of laxity to E). Rounding carries its error
    from round to round: a gang's *due* is its fill plus its credit, the fill it was given
    and did not run before (negative: it ran beyond it), kept within +-CREDIT_CAP. Gangs go
    by due, then Smith's order, each while the GPUs taken stay within half a gang of
    sum W max(due, 0) (so of gangs that may not overlap and split the round in the LP, one
    runs) and W GPUs it can use are free. So over rounds a gang runs about the part of the
    time the LP gives it; rounded alone each round, a gang the LP ran half of every round
    ran in every round and left the jobs beside it nothing. Pooled classes (above POOL_ABOVE
    jobs) round ``units`` and carry no credit.

    Which GPUs: one option per gang (``_gang_options``: those the LP runs now first), the
    first whose GPUs (``_take_gang``) fit in what the LP leaves to the jobs not yet placed,
    else the first whose GPUs are free but for ``keep`` (GPUs per type: the tight single-GPU
    jobs'): rounding a gang up to W GPUs of one option should not drop a job the LP runs
    now if another option avoids it, and never the job that sets E. ``dues``: ``gang_dues``."""
    budget = dues.budget
    out: list[tuple[bool, str, set[int]]] = []
    taken = 0.0
    pending = share.sum(axis=0)             # GPUs of each type the LP gives jobs not yet placed
    for _, _, c, runs in sorted(dues.wanted):
        width = groups[c][0].workers
        options = _gang_options(lp, c, share[c], spread_now)
        pending -= share[c]
        for job in in_turn(groups[c])[:runs]:
            if taken + width > budget + width / 2.0:
                break
            # an option within what the LP leaves to the others first: rounded up, it
            # displaces no job the LP runs now; else one that leaves the tight jobs' GPUs
            found = next(((column, take) for column, take in _takes(width, options, rates[c], free)
                          if np.all(take <= free - pending + 1e-6)), None)
            if found is None:
                found = next(_takes(width, options, rates[c], free - keep), None)
            if found is None:
                continue
            column, take = found
            free -= take
            taken += width
            out.append((column >= 0, job.job_id, {int(r) for r in np.flatnonzero(take > 0)}))
    return out, dues.carried({job_id for _, job_id, _ in out})


def _takes(width: int, options: Sequence[tuple[int, np.ndarray, np.ndarray]], rates: np.ndarray,
           free: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(option, its GPUs per type) of each option of a gang whose W GPUs ``free`` holds, in
    turn, each worked out only when asked for."""
    for column, now, usable in options:
        take = _take_gang(width, now, usable, rates, free, one_node=column < 0)
        if take is not None:
            yield column, take


def _gang_options(lp: WorkLp, c: int, share: np.ndarray,
                  spread_now: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Gang c's options as (spread column, or -1 for one node; its GPUs of each type the LP
    holds now; the types it may use): those the LP runs now first, most GPUs first, then by
    rate. A node option is one type; one placement over several of the LP's columns would
    run at the slowest one's rate."""
    mine = np.flatnonzero(lp.spread_job == c)
    spread_held = spread_now[mine].sum(axis=0) if mine.size else np.zeros_like(share)
    on_node = np.clip(share - spread_held, 0.0, None)
    ranked = []
    for r in np.flatnonzero(lp.rho[c] > 0):
        only = np.zeros(share.size, dtype=bool)
        only[r] = True
        ranked.append((float(on_node[r]), float(lp.rho[c, r]), -1, np.where(only, on_node, 0.0), only))
    for s in mine:
        ranked.append((float(spread_now[s].sum()), float(lp.spread_rate[s]), int(s), spread_now[s],
                       lp.spread_cap[s] > 0))
    ranked.sort(key=lambda o: (-o[0] if o[0] > SHARE_EPS else 0.0, -o[1]))
    return [(column, now, usable) for _, _, column, now, usable in ranked]


def _take_gang(width: int, now: np.ndarray, usable: np.ndarray, rates: np.ndarray, free: np.ndarray, *,
               one_node: bool) -> np.ndarray | None:
    """W GPUs per type for one gang on one option, or None if they are not free: one node
    option takes W of its type; a spread column the LP's mix of its types (scaled to W),
    then its slowest types."""
    if one_node:
        r = int(np.flatnonzero(usable)[0])
        if free[r] < width:
            return None
        take = np.zeros_like(free)
        take[r] = width
        return take
    given = float(now.sum())
    mix = now * (width / given) if given > SHARE_EPS else np.zeros_like(free)
    take = np.where(usable, np.minimum(free, np.floor(mix + 1e-6)), 0.0)
    order = np.lexsort((rates, -(mix - take)))
    for r in order[usable[order]]:
        take[r] += min(free[r] - take[r], width - take.sum())
    return take if take.sum() >= width else None


@dataclass(frozen=True, kw_only=True)
class SeatContext:
    """What seating the gangs needs beyond the LP: the cluster's rows (type index and GPUs
    of each), each job's profile, where each job ran last round (rows, GPUs on each) and the
    round's length."""

    row_type: np.ndarray
    row_cap: np.ndarray
    profiles: Mapping[str, JobProfile]
    held: Mapping[str, tuple[np.ndarray, np.ndarray]]
    round_s: float


def seated_gangs(groups: Sequence[Sequence[JobState]], dues: GangDues, share: np.ndarray, free: np.ndarray, *,
                 keep: np.ndarray, context: SeatContext) -> tuple[list[Seat], dict[str, float]] | None:
    """The due gangs seated together (``hadar/seats``), in the order of their dues, and the
    gangs' credit for the next round; takes their GPUs off ``free``. None where a due class
    pools several jobs or the MIP is not solved (the caller then uses ``whole_gangs``)."""
    if any(len(groups[c]) > 1 for _, _, c, _ in dues.wanted):
        return None
    singles = [c for c, group in enumerate(groups) if group[0].workers == 1]
    singles_now = share[singles].sum(axis=0) if singles else np.zeros(free.size)
    asks = []
    for due, rank, c, _ in sorted(dues.wanted):
        job = groups[c][0]
        asks.append(SeatAsk(job_id=job.job_id, width=job.workers, due=-due, rank=rank / len(groups),
                            options=context.profiles[job.job_id].options, now=share[c],
                            held=context.held.get(job.job_id), restart_share=job.restart_s / context.round_s,
                            per_worker=context.profiles[job.job_id].per_worker))
    seats = seat_gangs(asks, row_type=context.row_type, row_cap=context.row_cap, reserved=keep,
                       singles_now=singles_now, budget=dues.budget)
    if seats is None:
        return None
    ordered = [seats[a.job_id] for a in asks if a.job_id in seats]
    for seat in ordered:
        free -= np.bincount(context.row_type[seat.rows], weights=seat.counts, minlength=free.size)
    return ordered, dues.carried(set(seats))
