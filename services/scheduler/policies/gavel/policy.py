"""Gavel (Narayanan et al., OSDI'20): heterogeneity-aware LP allocation, realised in rounds.

``Gavel`` uses ``max_min_fairness_perf``, ``GavelMakespan`` ``min_total_duration_perf`` and
``GavelThroughput`` ``max_sum_throughput_perf`` (all in lp.py; the last is what Sia's simulator
runs as "Gavel"; ``GavelThroughputSia`` is it with the options below set as Sia runs it). All
share the round mechanism of Gavel's ``scheduler/scheduler.py`` (commit c4fa400, the one our
throughput table comes from), which this module mirrors:

* Time-so-far (``_job_time_so_far`` / ``_worker_time_so_far``): every job starts with
  ``round_s / 2`` on each type (``add_job``). After a round, a job that ran on type t adds
  the seconds it ran -- the whole round, or until it finished (``_done_callback``: the
  execution time is steps / throughput) -- to its own time and to the type's total. We
  count this from our own previous plan (kept in ``Plan.state``), not from the driver.
* Reset and LP (``_update_priorities`` + ``_reset_time_run_so_far``): when the set of
  active jobs (or the cluster) changed since the allocation was computed, and either no
  allocation exists yet or at least ``min_reset_interval_s`` (Gavel's
  ``minimum_time_between_allocation_resets``, default 1920 s) passed since the last reset,
  each job's deficit on each type grows by ``X_old * (time since reset) - (time received
  since reset)``, every time-so-far is set back to ``round_s / 2`` (the type's total to the
  sum of those), and the LP is solved again for the current jobs. Between resets the
  allocation stays as it was. Additionally (deviation) a reset is allowed whenever the
  previous round placed nothing, so jobs arriving on an idle cluster are not held back.
* Priorities (``_update_priorities``): for job j and type t, with
  ``f = job_time[j][t] / worker_time[t]``: 0 if ``X[j][t] = 0`` or the job cannot run on
  t; else ``X[j][t] / f`` if f > 0; else ``X[j][t] * 1e9``.
* Selection (``_schedule_jobs_on_workers_helper``, no global queue): types in the fixed
  order ``type_order`` (Gavel: v100, p100, k80, not shuffled for *_perf policies; other
  types follow, fastest first by the jobs' mean relative speed, then name). For each
  type, jobs in descending (priority, deficit, allocation) order (ties: arrival, job id);
  a job is taken if it is not yet scheduled, can run on the type, and W <= GPUs of the
  type left. Jobs with zero allocation on a type still take leftover GPUs there (this is
  what makes Gavel work-conserving).
* Options for Sia's variant of this mechanism (its ``sia-simulator/gavel.py``):
  ``global_queue`` sorts every (job, type) pair in one queue instead of type by type;
  ``reset_books=False`` never folds time received into deficits nor restarts the clocks
  (Sia's never reset), with ``min_reset_interval_s=0`` the LP is solved whenever the active
  jobs change, as Sia solves it every round; ``sequential_placement`` assigns GPUs as Sia does
  (``gang.sequential_gangs``) instead of by best fit.
* Placement (``_schedule_jobs_on_workers`` / ``_assign_workers_to_job``): a job keeps last
  round's GPUs when it stays on the same type (lease extension); others go largest first
  on as few nodes as possible (gang.assign_gangs).

Deviation: a job that arrived after the last reset has no allocation. Gavel gives it
priority 0, lets it use up GPUs in the selection above, and then drops it when assigning
workers (so those GPUs idle). Here it waits (PRIORITY, "no allocation yet") and takes no
GPUs. Jobs with no usable type are INFEASIBLE and never enter the LP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.core.policy import (
    JobState,
    Plan,
    PlanRequest,
    PolicyState,
    Wait,
    WaitCode,
    previous_state,
)
from services.scheduler.policies.gang import (
    GangRequest,
    assign_gangs,
    infeasible_detail,
    previous_gangs,
    sequential_gangs,
    usable_types,
)
from services.scheduler.policies.gavel.lp import max_min_fairness, max_sum_throughput, min_total_duration
from shared.persistence.codec import snapshot_type

GAVEL_TYPE_ORDER = ("v100", "p100", "k80")
SIA_TYPE_ORDER = ("t4", "a100", "rtx2080ti")   # Sia's cluster order: aws, dgx-ext, rtx
DEFAULT_MIN_RESET_INTERVAL_S = 1920.0
NEW_JOB_PRIORITY = 1e9


@snapshot_type("policy.gavel.Running", formerly="services.scheduler.policies.gavel.Running")
@dataclass(frozen=True, kw_only=True)
class Running:
    gpu_type: str
    run_left_s: float  # remaining steps / rate when placed: a finishing job's run time


@snapshot_type("policy.gavel.GavelState", formerly="services.scheduler.policies.gavel.GavelState")
@dataclass(frozen=True, kw_only=True)
class GavelState(PolicyState):
    policy: str
    now_s: float
    last_reset_s: float | None
    lp_jobs: frozenset[str]
    lp_cluster: tuple[tuple[str, int], ...]
    allocation: Mapping[str, Mapping[str, float]]
    job_time_s: Mapping[str, Mapping[str, float]]
    worker_time_s: Mapping[str, float]
    deficits: Mapping[str, Mapping[str, float]]
    running: Mapping[str, Running] = field(default_factory=dict)
    lp_info: Mapping[str, float] = field(default_factory=dict)


class _GavelRounds:
    """Gavel's round mechanism; subclasses supply the allocation LP."""

    name = "gavel-base"

    def __init__(self, *, min_reset_interval_s: float = DEFAULT_MIN_RESET_INTERVAL_S,
                 type_order: Sequence[str] = GAVEL_TYPE_ORDER, global_queue: bool = False,
                 reset_books: bool = True, sequential_placement: bool = False) -> None:
        if min_reset_interval_s < 0:
            raise ValueError(f"min_reset_interval_s must be >= 0: {min_reset_interval_s}")
        self.min_reset_interval_s = float(min_reset_interval_s)
        self.type_order = tuple(type_order)
        self.global_queue = bool(global_queue)
        self.reset_books = bool(reset_books)
        self.sequential_placement = bool(sequential_placement)

    def allocate(self, jobs: Sequence[JobState], rates: np.ndarray,
                 gpus: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        raise NotImplementedError

    def _types_in_order(self, types: Sequence[str], rates: dict[str, dict[str, float]]) -> list[str]:
        listed = [t for t in self.type_order if t in types]
        speed = dict.fromkeys(types, 0.0)
        for per_type in rates.values():
            best = max(per_type.values())
            for t, r in per_type.items():
                speed[t] += r / best
        others = sorted((t for t in types if t not in listed), key=lambda t: (-speed[t], t))
        return listed + others

    def _queue(self, cands: Sequence[JobState], types: Sequence[str], priority: Mapping[str, Mapping[str, float]],
               books: _Books, allocation: Mapping[str, Mapping[str, float]]) -> list[tuple[JobState, str]]:
        """(job, type) in the order selection considers them: type by type (Gavel), or one
        queue over every (job, type) (``global_queue``, as Sia's gavel.py); within either, by
        priority, deficit and allocation, descending, ties by type order then arrival."""
        def key(entry: tuple[JobState, str]) -> tuple[float, float, float]:
            job, t = entry
            return (-priority[job.job_id][t], -books.deficits[job.job_id][t], -allocation[job.job_id].get(t, 0.0))

        ranked = [j for j in cands if j.job_id in priority]
        if self.global_queue:
            return sorted(((j, t) for t in types for j in ranked), key=key)
        return [entry for t in types for entry in sorted(((j, t) for j in ranked), key=key)]

    def plan(self, request: PlanRequest) -> Plan:
        """One Gavel round: the LP's time fractions, realised by priority (module docstring).

        Input: the request and, from ``request.previous``, copy-0 placements and a
        ``GavelState`` written by this same variant (time received per job and type,
        deficits, the allocation and when it was computed). Any other state means empty
        books, as for a first round.

        Output: copy 0 of each chosen job on exactly W GPUs of one type; every other
        active job waits, INFEASIBLE when no type can run it, else PRIORITY; the updated
        ``GavelState``; per job the allocation, priorities, deficits and LP figures in
        ``explain``.

        Guarantees: no type is given more GPUs than it has; a job that stays on its type
        keeps last round's GPUs; no waiting job that has an allocation fits on the GPUs a
        usable type has left (work-conserving). The allocation changes only at a reset,
        never between. Deterministic: ties go by arrival, then job id.

        Cost: with m jobs and n types, a reset round solves the allocation LP(s) over
        m x n variables (``allocate``); every round then sorts the jobs once per type,
        O(n m log m), and places the gangs.
        """
        prev = previous_state(request, GavelState)
        if prev is not None and prev.policy != self.name:   # the other Gavel variant's books
            prev = None
        counts = request.cluster.gpus_by_type
        types = list(counts)
        usable = {j.job_id: usable_types(request, j) for j in request.jobs}
        cands = sorted((j for j in request.jobs if usable[j.job_id]), key=lambda j: (j.arrival_s, j.job_id))
        rates = {j.job_id: {t: request.throughput.rate(j.job_type, t, j.workers) if t in usable[j.job_id]
                            else 0.0 for t in types} for j in cands}

        books = _Books.after_round(prev, request, rates)
        allocation = dict(prev.allocation) if prev else {}
        last_reset = prev.last_reset_s if prev else None
        lp_jobs = prev.lp_jobs if prev else frozenset()
        lp_cluster = prev.lp_cluster if prev else ()
        lp_info = dict(prev.lp_info) if prev else {}
        cluster_key = tuple(counts.items())
        changed = prev is None or frozenset(rates) != lp_jobs or cluster_key != lp_cluster
        # Gavel's _update_priorities treats a last reset at t=0 as "never reset" (0 doubles as
        # the unset value), so after a reset at t=0 any change resets again; mirrored on purpose.
        may_reset = (prev is None or last_reset is None or last_reset == 0.0 or not prev.running
                     or request.now_s - last_reset >= self.min_reset_interval_s)
        if changed and may_reset:
            if self.reset_books:
                books.reset(allocation, request.now_s - last_reset if last_reset is not None else 0.0)
            matrix = np.array([[rates[j.job_id][t] for t in types] for j in cands])
            matrix = matrix.reshape(len(cands), len(types))
            x, lp_info = self.allocate(cands, matrix, np.array([counts[t] for t in types], dtype=float))
            allocation = {j.job_id: {t: float(x[i, k]) + 0.0 for k, t in enumerate(types)}
                          for i, j in enumerate(cands)}
            last_reset, lp_jobs, lp_cluster = request.now_s, frozenset(rates), cluster_key

        priority = books.priorities(allocation, rates)
        # Selection (Gavel's _schedule_jobs_on_workers_helper).
        left = dict(counts)
        chosen: dict[str, str] = {}
        requests: list[GangRequest] = []
        for job, t in self._queue(cands, self._types_in_order(types, rates), priority, books, allocation):
            if left[t] == 0 or job.job_id in chosen or rates[job.job_id][t] <= 0.0 or job.workers > left[t]:
                continue
            chosen[job.job_id] = t
            left[t] -= job.workers
            requests.append(GangRequest(job_id=job.job_id, gpu_type=t, workers=job.workers))
        place = sequential_gangs if self.sequential_placement else assign_gangs
        gangs = place(request.cluster, requests, previous_gangs(request.previous))

        waiting: list[Wait] = []
        explain: dict[str, dict[str, object]] = {}
        for job in request.jobs:
            jid = job.job_id
            info: dict[str, object] = {"placed_on": chosen.get(jid)}
            explain[jid] = info
            if jid not in rates:
                waiting.append(Wait(job_id=jid, code=WaitCode.INFEASIBLE,
                                    detail=infeasible_detail(request, job)))
                continue
            alloc = allocation.get(jid)
            info["allocation"] = {t: round(alloc.get(t, 0.0), 4) for t in types} if alloc is not None else None
            info["priority"] = {t: round(p, 4) for t, p in priority[jid].items()} if jid in priority else None
            info["deficit"] = {t: round(d, 1) for t, d in books.deficits[jid].items()}
            info["lp_reset_s"] = last_reset
            info.update(lp_info)
            if jid in chosen:
                continue
            if alloc is None:
                detail = (f"no allocation yet: arrived after the LP of t={last_reset}s; "
                          f"recomputed once {self.min_reset_interval_s:g}s have passed")
            else:
                shown = ", ".join(f"{t} x={alloc.get(t, 0.0):.2f} prio={priority[jid][t]:.3g} left={left[t]}"
                                  for t in usable[jid])
                detail = f"needs {job.workers} GPUs of one type; higher priorities first: {shown}"
            waiting.append(Wait(job_id=jid, code=WaitCode.PRIORITY, detail=detail))

        remaining = {j.job_id: j.remaining for j in request.jobs}
        running = {r.job_id: Running(gpu_type=r.gpu_type,
                                     run_left_s=remaining[r.job_id] / rates[r.job_id][r.gpu_type])
                   for r in requests}
        state = GavelState(policy=self.name, now_s=request.now_s, last_reset_s=last_reset, lp_jobs=lp_jobs,
                           lp_cluster=lp_cluster, allocation=allocation, job_time_s=books.job_time,
                           worker_time_s=books.worker_time, deficits=books.deficits, running=running,
                           lp_info=lp_info)
        placements = tuple(p for r in requests for p in gangs[r.job_id])
        return Plan(placements=placements, waiting=tuple(waiting), state=state, explain=explain)


class _Books:
    """This round's working copy of Gavel's per-job, per-type time accounting."""

    def __init__(self, half_round_s: float, job_time: dict[str, dict[str, float]],
                 worker_time: dict[str, float], deficits: dict[str, dict[str, float]]) -> None:
        self.half = half_round_s
        self.job_time, self.worker_time, self.deficits = job_time, worker_time, deficits

    @classmethod
    def after_round(cls, prev: GavelState | None, request: PlanRequest,
                    rates: Mapping[str, Mapping[str, float]]) -> _Books:
        """Books with the round that just ended counted in (Gavel's _done_callback) and
        jobs / types added at round_s / 2 (add_job, _register_worker_callback)."""
        half = request.round_s / 2.0
        job_time = {j: dict(v) for j, v in prev.job_time_s.items()} if prev else {}
        worker_time = dict(prev.worker_time_s) if prev else {}
        deficits = {j: dict(v) for j, v in prev.deficits.items()} if prev else {}
        if prev is not None:
            active = {j.job_id for j in request.jobs}
            elapsed = min(max(0.0, request.now_s - prev.now_s), request.round_s)
            for job_id, run in prev.running.items():
                if job_id in job_time:  # a job that finished ran until it finished
                    ran = elapsed if job_id in active else min(elapsed, run.run_left_s)
                    job_time[job_id][run.gpu_type] = job_time[job_id].get(run.gpu_type, half) + ran
                    worker_time[run.gpu_type] = worker_time.get(run.gpu_type, 0.0) + ran
        job_time = {j: v for j, v in job_time.items() if j in rates}
        deficits = {j: v for j, v in deficits.items() if j in rates}
        for job_id, per_type in rates.items():
            for t in per_type:
                job_time.setdefault(job_id, {}).setdefault(t, half)
                deficits.setdefault(job_id, {}).setdefault(t, 0.0)
                worker_time.setdefault(t, 0.0)
        return cls(half, job_time, worker_time, deficits)

    def reset(self, old_allocation: Mapping[str, Mapping[str, float]], since_reset_s: float) -> None:
        """Gavel's _reset_time_run_so_far: fold the period into deficits, restart the clocks."""
        for t in self.worker_time:
            self.worker_time[t] = 0.0
            for job_id, per_type in self.job_time.items():
                received = per_type.get(t, self.half) - self.half
                should = old_allocation.get(job_id, {}).get(t, 0.0) * since_reset_s
                self.deficits[job_id][t] = self.deficits[job_id].get(t, 0.0) + should - received
                per_type[t] = self.half
                self.worker_time[t] += self.half

    def priorities(self, allocation: Mapping[str, Mapping[str, float]],
                   rates: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
        """Gavel's _update_priorities, for the jobs that have an allocation."""
        out: dict[str, dict[str, float]] = {}
        for job_id, per_type in rates.items():
            if job_id not in allocation:
                continue
            out[job_id] = {}
            for t, rate in per_type.items():
                x_jt = allocation[job_id].get(t, 0.0)
                frac = self.job_time[job_id][t] / self.worker_time[t] if self.worker_time[t] > 0 else 0.0
                if x_jt <= 0.0 or rate <= 0.0:
                    out[job_id][t] = 0.0
                elif frac > 0.0:
                    out[job_id][t] = x_jt / frac
                else:
                    out[job_id][t] = x_jt * NEW_JOB_PRIORITY
        return out


class Gavel(_GavelRounds):
    """max_min_fairness_perf: maximise the minimum normalised, priority-weighted throughput."""

    name = "gavel"

    def allocate(self, jobs: Sequence[JobState], rates: np.ndarray,
                 gpus: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        sf = np.array([j.workers for j in jobs], dtype=float)
        weights = np.array([j.priority for j in jobs], dtype=float)  # > 0, checked by JobSpec
        return max_min_fairness(rates, sf, weights, gpus), {}


class GavelMakespan(_GavelRounds):
    """min_total_duration_perf: the allocation that finishes all active jobs soonest."""

    name = "gavel-makespan"

    def allocate(self, jobs: Sequence[JobState], rates: np.ndarray,
                 gpus: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        sf = np.array([j.workers for j in jobs], dtype=float)
        remaining = np.array([j.remaining for j in jobs], dtype=float)
        x, makespan = min_total_duration(rates, sf, remaining, gpus)
        return x, {"lp_makespan_s": round(float(makespan), 1)}


class GavelThroughput(_GavelRounds):
    """max_sum_throughput_perf: the allocation with the most total steps/s (Sia's Gavel baseline)."""

    name = "gavel-throughput"

    def allocate(self, jobs: Sequence[JobState], rates: np.ndarray,
                 gpus: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        sf = np.array([j.workers for j in jobs], dtype=float)
        return max_sum_throughput(rates, sf, gpus), {}


class GavelThroughputSia(GavelThroughput):
    """max_sum_throughput_perf driven as Sia's simulator drives it (``sia-simulator/gavel.py``).

    GavelThroughput with the options of the module docstring set to Sia's: the LP whenever the
    active jobs change (``min_reset_interval_s=0``), one queue over every (job, type), books
    never reset, GPUs by Sia's sequential pointer, and Sia's cluster order (t4, a100,
    rtx2080ti; other types after them). What benchmarks/sia_philly.py checks against Sia's
    published Gavel figures.
    """

    name = "gavel-throughput-sia"

    def __init__(self, *, min_reset_interval_s: float = 0.0, type_order: Sequence[str] = SIA_TYPE_ORDER,
                 global_queue: bool = True, reset_books: bool = False, sequential_placement: bool = True) -> None:
        super().__init__(min_reset_interval_s=min_reset_interval_s, type_order=type_order,
                         global_queue=global_queue, reset_books=reset_books,
                         sequential_placement=sequential_placement)
