"""Hadar's committed schedule of one job: the DP's choice on concrete rows, priced and valued.

``build_commitment`` turns a ``hadar/dp.Choice`` (an option and the slots to run in) into a
``hadar/ledger.Commitment``: the rows from ``hadar/dp.pick_gpus`` (the same rows in every
slot with ``sticky``, else the cheapest rows slot by slot), the steps expected per round
at ``ThroughputModel.placement_rate`` of the concrete placement (never below the option's
planned rate, so expected progress is not overestimated), cut at the round the job
completes (its last round credits only what remains). Its utility: the DP's when it
completes when the DP said, else u(completion) for the actual last round, or for a
schedule that does not finish inside the horizon u(H + rounds still needed at its last
rate) x the share of the work it does (the DP's prorated partial value). Its cost: the
summed price of every committed GPU at its slot, at the ledger's prices when built.

``slot_index`` / ``next_round`` read a commitment's rounds. Pure functions: nothing here
changes the ledger (the caller commits).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from services.scheduler.core.policy import JobState, PlanRequest
from services.scheduler.core.throughput import Part
from services.scheduler.policies.hadar.dp import Choice, pick_gpus
from services.scheduler.policies.hadar.ledger import Commitment, Ledger, RowLayout
from services.scheduler.policies.hadar.profile import JobProfile


def build_commitment(*, job: JobState, profile: JobProfile, choice: Choice,
                     utility_at: Callable[[np.ndarray], np.ndarray], ledger: Ledger, request: PlanRequest, horizon: int,
                     sticky: bool, types: np.ndarray | None = None,
                     held: tuple[np.ndarray, np.ndarray] | None = None) -> Commitment | None:
    """``choice`` committed on rows of ``ledger`` (None when its GPUs are not free), on rows
    of ``types`` only (bool per GPU type) if given, on ``held`` (rows, GPUs on each: where
    the job ran last round) if the option may run there (``dp.pick_gpus``)."""
    option = profile.options[choice.option]
    got = pick_gpus(ledger, profile, choice.option, choice.slots, sticky=sticky, types=types, keep=held)
    if got is None:
        return None
    rows, counts, same_rows = got
    layout = ledger.layout
    if same_rows:
        rate = request.throughput.placement_rate(job.job_type, parts(layout, rows, counts[0]))
        per_round = np.full(choice.slots.size, rate * request.round_s)
    else:
        rates: dict[bytes, float] = {}
        per_round = np.empty(choice.slots.size)
        for i in range(choice.slots.size):
            key = counts[i].tobytes()
            if key not in rates:
                rates[key] = request.throughput.placement_rate(job.job_type, parts(layout, rows, counts[i]))
            per_round[i] = rates[key] * request.round_s
    done = np.cumsum(per_round)
    slots = choice.slots
    finishes = bool(done[-1] >= job.remaining - 1e-9)
    if finishes:
        keep = int(np.searchsorted(done, job.remaining - 1e-9)) + 1
        slots, counts, per_round = slots[:keep], counts[:keep], per_round[:keep].copy()
        per_round[-1] = job.remaining - (done[keep - 2] if keep >= 2 else 0.0)
        if choice.finishes and keep == choice.slots.size:   # completes when the DP said
            utility = choice.utility
        else:
            utility = float(utility_at(np.array([slots[-1] + 1.0]))[0])
    else:
        rest = math.ceil((job.remaining - done[-1]) / per_round[-1])
        share = done[-1] / job.remaining
        utility = float(utility_at(np.array([float(horizon + rest)]))[0]) * share
    cost = float((ledger.type_price[np.ix_(layout.row_type[rows], slots)].T * counts).sum())
    return Commitment(job_id=job.job_id, rounds=slots + request.round, rows=rows, counts=counts,
                      steps=per_round, base_done=job.steps_done, finishes=finishes, signature=profile.signature,
                      option=option.label, utility=utility, cost=cost)


def parts(layout: RowLayout, rows: np.ndarray, counts: np.ndarray) -> list[Part]:
    """The placement of ``counts`` GPUs on ``rows`` as throughput-model parts (node, type, n)."""
    keys = layout.keys
    return [Part(keys[r][0], keys[r][1], int(c)) for r, c in zip(rows.tolist(), counts.tolist()) if c > 0]


def slot_index(c: Commitment, round_: int) -> int | None:
    """Index in ``c.rounds`` of ``round_``, or None if the schedule does not run then."""
    i = int(np.searchsorted(c.rounds, round_))
    return i if i < c.rounds.size and c.rounds[i] == round_ else None


def next_round(c: Commitment, round_: int) -> int:
    """The first round >= ``round_`` the schedule runs in (-1: none)."""
    later = c.rounds[c.rounds >= round_]
    return int(later[0]) if later.size else -1
