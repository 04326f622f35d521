"""What :class:`~services.tracker.state.TrackerState` hands the service: work that is due."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FinishedCopy", "RoundWork", "CompletionWork"]


@dataclass(frozen=True, kw_only=True)
class FinishedCopy:
    """An accepted CopyFinished: from a node the copy was placed on, its checkpoint (if any)
    at the copy's own key, ``steps <= budget`` (the copy's step budget)."""

    copy: int
    node_id: str
    status: str
    steps: int
    budget: int
    checkpoint: str | None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class RoundWork:
    """A round to consolidate now.

    ``usable``: finished copies with a checkpoint (status ok or preempted); ``failed``:
    copies that reported failure; ``missing``: assigned copies that never reported.
    ``prior_steps``: the job's consolidated steps before this round.
    """

    job_id: str
    round: int
    usable: tuple[FinishedCopy, ...]
    failed: tuple[FinishedCopy, ...]
    missing: tuple[int, ...]
    prior_steps: int
    timed_out: bool


@dataclass(frozen=True, kw_only=True)
class CompletionWork:
    job_id: str
    model_key: str
    total_steps: int
    submitted_at: float
