"""A simulated job and what one round does to it: its progress, its record, its charges.

``LiveJob`` is the simulator's mutable book of one job; ``advance`` runs it for one round as
the round's copies (``services.scheduler.sim.simulator``'s semantics: each copy trains from
its start charge to the round's end less the job's tail, credited in job steps), and
``move_cost`` is what the run's charges make a move cost it (``JobState.restart_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.core.policy import JobState
from services.scheduler.sim.charges import Charges
from services.scheduler.sim.traces import TraceJob
from shared.domain.progress import credited_steps

__all__ = ["CopyRun", "JobRecord", "LiveJob", "advance", "finish_time", "move_cost"]

DONE_EPS = 1e-9  # steps: a job this close to its total is complete (float sums of rate x time)


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    job_id: str
    job_type: str
    workers: int
    total_steps: int
    priority: float
    arrival_s: float
    first_start_s: float | None   # start of the first round it was placed in
    completion_s: float | None    # None: not completed
    steps_done: float
    gpu_s: float                  # GPU-seconds held
    rounds_run: int
    last_wait: str | None = None  # "code: detail" of the last round the policy left it waiting


class LiveJob:
    """Mutable per-job progress; ``state()`` caches the JobState until the job changes."""

    __slots__ = (
        "_state",
        "attained_gpu_s",
        "completion_s",
        "first_start_s",
        "last_wait",
        "model_bytes",
        "restart_s",
        "rounds_run",
        "steps_done",
        "trace",
    )

    def __init__(self, trace: TraceJob, model_bytes: int, restart_s: float) -> None:
        self.trace = trace
        self.model_bytes = model_bytes
        self.restart_s = restart_s
        self.steps_done = 0.0
        self.attained_gpu_s = 0.0
        self.rounds_run = 0
        self.first_start_s: float | None = None
        self.completion_s: float | None = None
        self.last_wait: str | None = None
        self._state: JobState | None = None

    def state(self) -> JobState:
        if self._state is None:
            t = self.trace
            self._state = JobState(
                job_id=t.job_id, job_type=t.job_type, workers=t.workers, total_steps=t.total_steps,
                steps_done=self.steps_done, arrival_s=t.arrival_s, priority=t.priority,
                attained_gpu_s=self.attained_gpu_s, model_bytes=self.model_bytes, restart_s=self.restart_s,
                queue=t.queue, user=t.user,
                priority_class=t.priority_class)
        return self._state

    @property
    def remaining(self) -> float:
        return max(0.0, self.trace.total_steps - self.steps_done)

    def account(self, copy_types: Sequence[Sequence[str]], held: float, now: float) -> None:
        """Book a round in which copies on GPUs of ``copy_types`` held them ``held`` seconds."""
        for types in copy_types:
            self.attained_gpu_s += held * len(types)
        self.rounds_run += 1
        if self.first_start_s is None:
            self.first_start_s = now
        self._state = None

    def record(self) -> JobRecord:
        t = self.trace
        return JobRecord(job_id=t.job_id, job_type=t.job_type, workers=t.workers, total_steps=t.total_steps,
                         priority=t.priority, arrival_s=t.arrival_s, first_start_s=self.first_start_s,
                         completion_s=self.completion_s, steps_done=self.steps_done,
                         gpu_s=self.attained_gpu_s, rounds_run=self.rounds_run, last_wait=self.last_wait)


def move_cost(charges: Charges, job_type: str, model_bytes: int) -> float:
    """``JobState.restart_s``: what the run's charges take from a cold one-GPU copy of a job
    that has a model, over a warm one (a move's cost, as the policy is told it)."""
    cold = charges.copy(job_type, model_bytes, ranks_per_node=(1,), cold=True, has_model=True)
    warm = charges.copy(job_type, model_bytes, ranks_per_node=(1,), cold=False, has_model=True)
    return max(0.0, sum(cold) - sum(warm))


def finish_time(segments: Sequence[tuple[float, float]], remaining: float) -> float:
    """Earliest T with sum over (rate, start) of rate * max(0, T - start) >= remaining."""
    points = sorted((start, rate) for rate, start in segments if rate > 0)
    acc_rate = acc_steps = 0.0
    t = points[0][0]
    for start, rate in points:
        gain = acc_rate * (start - t)
        if acc_rate > 0 and acc_steps + gain >= remaining:
            return t + (remaining - acc_steps) / acc_rate
        acc_steps += gain
        t = start
        acc_rate += rate
    return t + (remaining - acc_steps) / acc_rate


CopyRun = tuple[float, int, tuple[int, ...], bool]   # (own rate, workers, ranks per node, cold)


def advance(job: LiveJob, copies: Sequence[CopyRun], *, now: float, round_s: float,
             charges: Charges) -> tuple[float, float, list[float]]:
    """Progress ``job`` by one round run as ``copies``.

    Returns (job steps credited, seconds its GPUs are held, each copy's own steps).
    """
    job_type, size, has_model = job.trace.job_type, job.model_bytes, job.rounds_run > 0
    consolidation = charges.consolidation(job_type, size, copies=len(copies), has_model=has_model)
    lost = [charges.copy(job_type, size, ranks_per_node=nodes, cold=cold, has_model=has_model)
            for _, _, nodes, cold in copies]
    tail = max(end for _, end in lost) + consolidation   # the copies' ends are equal: one checkpoint size
    train_end = max(0.0, round_s - tail)
    starts = [min(start, train_end) for start, _ in lost]
    credit = [credited_steps(rate, copy_workers=k, job_workers=job.trace.workers) for rate, k, _, _ in copies]
    capacity = sum(c * (train_end - start) for c, start in zip(credit, starts))
    remaining = job.remaining
    if capacity > 0 and capacity >= remaining - DONE_EPS:
        t = finish_time(list(zip(credit, starts)), remaining)
        own = [rate * max(0.0, min(t, train_end) - start) for (rate, _, _, _), start in zip(copies, starts)]
        job.steps_done = float(job.trace.total_steps)
        job.completion_s = now + min(round_s, t + tail)
        return remaining, min(round_s, t + tail), own
    job.steps_done += capacity
    return capacity, round_s, [rate * (train_end - start) for (rate, _, _, _), start in zip(copies, starts)]
