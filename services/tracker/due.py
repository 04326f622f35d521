"""What :class:`~services.tracker.state.TrackerState` hands the service: work that is due."""

from __future__ import annotations

from dataclasses import dataclass

from shared.persistence.codec import snapshot_type
from shared.wire.events import JobSpec

__all__ = ["FinishedCopy", "DueRound", "DueCompletion", "RollbackTarget"]


@snapshot_type("tracker.FinishedCopy", formerly="services.tracker.work.FinishedCopy")
@dataclass(frozen=True, kw_only=True)
class FinishedCopy:
    """An accepted CopyFinished: from a node the copy was placed on, its checkpoint (if any)
    at the copy's own key, ``steps <= budget`` (the copy's step budget), on ``workers``
    (k <= W) GPUs: its steps are worth ``steps * workers`` worker-steps."""

    copy: int
    node_id: str
    status: str
    steps: int
    budget: int
    checkpoint: str | None
    reason: str = ""
    workers: int = 1


@dataclass(frozen=True, kw_only=True)
class RollbackTarget:
    """The job's last model that trained (``key``) and the job's exact worker-steps in it:
    what a round without a usable replica rolls back to (:mod:`services.tracker.rollback`)."""

    key: str
    worker_steps: int


@dataclass(frozen=True, kw_only=True)
class DueRound:
    """A round to consolidate now.

    ``usable``: finished copies with a checkpoint (status ok or preempted); ``failed``:
    copies that reported failure; ``missing``: assigned copies that never reported.
    ``prior_worker_steps``: the job's consolidated worker-steps before this round (exact);
    ``job_workers``: its W, so ``prior_steps`` (job steps) is ``prior_worker_steps // W``.
    ``spec``: the job as submitted, when known (what the model file says it is; the credit
    limit ``W x iterations``). ``start_from``: the model the round's copies started from
    (their Assignments'; None: from seed), against which the replicas are screened.
    ``rollback``: set when this round, left without a usable replica, is to roll the job
    back (:mod:`services.tracker.rollback`).
    """

    job_id: str
    round: int
    usable: tuple[FinishedCopy, ...]
    failed: tuple[FinishedCopy, ...]
    missing: tuple[int, ...]
    prior_worker_steps: int
    job_workers: int
    timed_out: bool
    spec: JobSpec | None = None
    start_from: str | None = None
    rollback: RollbackTarget | None = None

    @property
    def limit_worker_steps(self) -> int | None:
        """The most worker-steps the job may be credited, ``W x iterations``, if known."""
        return None if self.spec is None else self.spec.workers * self.spec.iterations

    @property
    def prior_steps(self) -> int:
        return self.prior_worker_steps // self.job_workers


@dataclass(frozen=True, kw_only=True)
class DueCompletion:
    job_id: str
    model_key: str
    total_steps: int
    submitted_at: float
    owner: str | None   # who may read the final model (shared.domain.layout.model_owner)
