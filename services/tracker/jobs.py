"""One job as the tracker keeps it: its open rounds and what it has consolidated so far.

Mutable records owned by :class:`~services.tracker.state.TrackerState`, which decides what
goes into them; what they compute from themselves (a round's work, the job's live steps,
its completion) lives here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.tracker.acceptance import CopyPlacement
from services.tracker.due import DueCompletion, DueRound, FinishedCopy, RollbackTarget
from services.tracker.rollback import MODELS_REMEMBERED, ROLLBACK_AFTER_ROUNDS
from shared.domain.deadline import copies_given_up_at
from shared.domain.layout import model_owner
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
    start_from: str | None = None                               # the model its copies start from

    def place(self, e: Assignment) -> None:
        """Add one Assignment of this round (a copy spanning nodes has one per node)."""
        self.deadline = max(self.deadline, e.deadline)
        self.start_from = self.start_from or e.start_from
        known = self.copies.get(e.copy)
        self.copies[e.copy] = CopyPlacement(
            nodes=frozenset({e.node_id, *(known.nodes if known else ())}),
            reporters=frozenset({*(known.reporters if known else ()), *((e.node_id,) if 0 in e.ranks else ())}),
            budget=max(e.step_budget, known.budget if known else 0),
            # A world size above W would be credited more than the job: never, whatever an
            # Assignment says (the scheduler's check_plan keeps it <= W anyway).
            workers=min(max(e.world_size, known.workers if known else 1), e.job.workers))

    def work(self, job_id: str, number: int, *, placed: bool, now: float, timeout_s: float,
             prior_worker_steps: int, job_workers: int, spec: JobSpec | None = None,
             rollback: RollbackTarget | None = None) -> DueRound | None:
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
            prior_worker_steps=prior_worker_steps, job_workers=job_workers, timed_out=not all_in, spec=spec,
            start_from=self.start_from, rollback=rollback)

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
    # What a rollback needs (services/tracker/rollback.py), all derived from the events:
    models: dict[str, int] = field(default_factory=dict)   # recent models -> the job's worker-steps in them
    trained_from: str | None = None     # the latest model copies started from and added steps to
    progressed: bool = False            # the latest model added steps (it is no rollback)
    barren: int = 0                     # rounds since the latest model that ran and left no replica

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

    def adopt(self, key: str, *, worker_steps: int, start_from: str | None, total_steps: int) -> None:
        """Make ``key`` the job's model: credit its round's ``worker_steps``, or, for a rollback
        (``total_steps`` below the job's: an honest model never has fewer), take the job's
        steps back to ``total_steps``."""
        if total_steps < self.consolidated_steps:
            exact = self.models.get(self.trained_from or "", -1)
            self.consolidated_worker_steps = (exact if exact // self.workers == total_steps
                                              else total_steps * self.workers)
            self.progressed = False
        else:
            if worker_steps > 0 and start_from is not None and start_from in self.models:
                self.trained_from = start_from
            self.credit(worker_steps)
            self.progressed = worker_steps > 0
        self.model_key, self.barren = key, 0
        self.models.pop(key, None)
        self.models[key] = self.consolidated_worker_steps
        while len(self.models) > MODELS_REMEMBERED:
            self.models.pop(next(iter(self.models)))

    def rollback_target(self) -> RollbackTarget | None:
        """What the job's next round rolls back to if it too leaves no usable replica: its
        last model that trained, after ``ROLLBACK_AFTER_ROUNDS - 1`` such rounds in a row
        since a model that added steps and is not that one; else None."""
        if (self.barren + 1 < ROLLBACK_AFTER_ROUNDS or not self.progressed or self.trained_from is None
                or self.trained_from == self.model_key or self.trained_from not in self.models):
            return None
        return RollbackTarget(key=self.trained_from, worker_steps=self.models[self.trained_from])

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
                              submitted_at=submitted, owner=model_owner(self.spec.user))


@snapshot_type("tracker.FinishedJob", formerly="services.tracker.jobs.FinishedJob")
@dataclass(frozen=True, kw_only=True)
class FinishedJob:
    """What is left of a completed or cancelled job: that it finished, and its steps."""

    completed: bool
    steps: int
