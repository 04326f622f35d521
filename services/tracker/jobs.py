"""One job as the tracker keeps it: its open rounds and what it has consolidated so far.

Mutable records owned by :class:`~services.tracker.state.TrackerState`, which decides what
goes into them; what they compute from themselves (a round's work, the job's live steps,
its completion) lives here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.tracker.acceptance import CopyPlacement
from services.tracker.due import DueCompletion, DueRound, FinishedCopy
from shared.domain.deadline import copies_given_up_at
from shared.persistence.codec import snapshot_type
from shared.wire.events import Assignment, JobSpec

__all__ = ["RoundRecord", "JobRecord", "FinishedJob"]


@snapshot_type("tracker.RoundRecord", formerly="services.tracker.jobs.RoundRecord")
@dataclass(kw_only=True)
class RoundRecord:
    """An open round of one job: its placed copies, their accepted reports, its deadline."""

    deadline: float
    copies: dict[int, CopyPlacement] = field(default_factory=dict)
    finished: dict[int, FinishedCopy] = field(default_factory=dict)
    progress: dict[int, int] = field(default_factory=dict)     # copy -> largest steps_round

    def place(self, e: Assignment) -> None:
        """Add one Assignment of this round (a copy spanning nodes has one per node)."""
        self.deadline = max(self.deadline, e.deadline)
        known = self.copies.get(e.copy)
        self.copies[e.copy] = CopyPlacement(
            nodes=frozenset({e.node_id, *(known.nodes if known else ())}),
            reporters=frozenset({*(known.reporters if known else ()), *((e.node_id,) if 0 in e.ranks else ())}),
            budget=max(e.step_budget, known.budget if known else 0),
            # A world size above W would be credited more than the job: never, whatever an
            # Assignment says (the scheduler's check_plan keeps it <= W anyway).
            workers=min(max(e.world_size, known.workers if known else 1), e.job.workers))

    def work(self, job_id: str, number: int, *, placed: bool, now: float, timeout_s: float,
             prior_worker_steps: int, job_workers: int, spec: JobSpec | None = None) -> DueRound | None:
        """This round as work, if it is due: every copy in (``placed``: all its Assignments
        read), or once its missing copies are given up on (``shared.domain.deadline``: ``timeout_s``
        past its deadline)."""
        all_in = placed and self.copies.keys() <= self.finished.keys()
        if not (all_in or now >= copies_given_up_at(self.deadline, late_copy_s=timeout_s)):
            return None
        finished = [self.finished[c] for c in sorted(self.finished)]
        return DueRound(
            job_id=job_id, round=number,
            usable=tuple(f for f in finished if f.status != "failed" and f.checkpoint),
            failed=tuple(f for f in finished if f.status == "failed" or not f.checkpoint),
            missing=tuple(sorted(self.copies.keys() - self.finished.keys())),
            prior_worker_steps=prior_worker_steps, job_workers=job_workers, timed_out=not all_in, spec=spec)

    def worker_steps(self, copies: Iterable[tuple[int, int]]) -> int:
        """Worker-steps of ``(copy, steps)`` of this round's placed copies: steps x workers."""
        return sum(steps * self.copies[copy].workers for copy, steps in copies)

    def live_worker_steps(self) -> int:
        """Worker-steps the copies report so far (failed copies' work is lost)."""
        live = 0
        for copy in self.progress.keys() | self.finished.keys():
            finished = self.finished.get(copy)
            if finished is not None and finished.status == "failed":
                continue  # a failed copy's work is lost
            placement = self.copies.get(copy)
            live += max(self.progress.get(copy, 0), finished.steps if finished else 0) * (
                placement.workers if placement is not None else 1)
        return live


@snapshot_type("tracker.JobRecord", formerly="services.tracker.jobs.JobRecord")
@dataclass(kw_only=True)
class JobRecord:
    """A job not finished: every round up to ``floor`` is decided and forgotten; ``rounds``
    holds the open ones. Progress is kept exactly, as integer worker-steps
    (``shared.domain.progress``); job steps are derived from them."""

    first_seen: float
    spec: JobSpec | None = None
    submitted_at: float | None = None
    rounds: dict[int, RoundRecord] = field(default_factory=dict)
    floor: int = -1
    consolidated_worker_steps: int = 0
    model_key: str | None = None        # the latest consolidated model
    completion_given_up: bool = False

    @property
    def workers(self) -> int:
        """The job's W (1 until its spec is known; a copy is placed with its spec)."""
        return self.spec.workers if self.spec is not None else 1

    def credit(self, worker_steps: int) -> None:
        """Add a decided round's worker-steps, clipped to the job's ``W x iterations`` (a job
        is never credited more than it asked for; docs/architecture.md "Work accounting")."""
        total = self.consolidated_worker_steps + worker_steps
        if self.spec is not None:
            total = min(total, max(self.consolidated_worker_steps, self.spec.workers * self.spec.iterations))
        self.consolidated_worker_steps = total

    @property
    def consolidated_steps(self) -> int:
        """Job steps consolidated: ``consolidated_worker_steps // W``."""
        return self.consolidated_worker_steps // self.workers

    def live_steps(self) -> int:
        """Job steps consolidated plus what copies report in rounds still open."""
        live = self.consolidated_worker_steps + sum(rnd.live_worker_steps() for rnd in self.rounds.values())
        return live // self.workers

    def completion(self, job_id: str) -> DueCompletion | None:
        """The job's completion, once its consolidated steps reach its iterations
        (worker-steps reach W x iterations)."""
        if (self.spec is None or self.model_key is None or self.completion_given_up
                or self.consolidated_steps < self.spec.iterations):
            return None
        submitted = self.submitted_at if self.submitted_at is not None else self.first_seen
        return DueCompletion(job_id=job_id, model_key=self.model_key, total_steps=self.consolidated_steps,
                              submitted_at=submitted)


@snapshot_type("tracker.FinishedJob", formerly="services.tracker.jobs.FinishedJob")
@dataclass(frozen=True, kw_only=True)
class FinishedJob:
    """What is left of a completed or cancelled job: that it finished, and its steps."""

    completed: bool
    steps: int
