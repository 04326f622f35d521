"""What the tracker accepts from the bus: the rules, their bounds and the reasons it refuses.

Pure functions over an event and what the tracker knows of the copy or round it names;
:class:`~services.tracker.state.TrackerState` applies them. The placements
(RoundStarted, Assignment: the scheduler's decisions) are what everything else is checked
against; every other event is a claim.

Rules (a refusal's reason label in brackets):

* **Round lead.** No Assignment, report or announcement may name a round more than
  :data:`ROUND_LEAD` past the latest round the tracker knows (the highest round of any
  RoundStarted or accepted Assignment), so a forged far-future round can neither be held
  nor freeze a job [future_round]. Two rounds of lead: an Assignment or report of round
  r+1 may be read before RoundStarted r+1 (another partition), never two rounds ahead of
  what the scheduler started. RoundStarted itself is the scheduler's and is not bounded.
* **CopyFinished** (:func:`report_problem`): its checkpoint is exactly
  ``checkpoint_key(job, round, copy, node=<the reporting node>)`` (or absent when it failed) [bad_key]; it comes from
  a node the copy was assigned to -- for ``ok``/``preempted``, a node hosting rank 0,
  which alone writes the checkpoint; a failure from any of the copy's nodes [wrong_node];
  its steps are at most the copy's ``step_budget`` [over_budget]; and the copy was
  assigned at all [unassigned].
* **Progress**: like a CopyFinished, from rank 0's node (the only one reporting progress).
  It is never held: one whose copy is not placed yet is refused [unassigned]; progress is
  advisory and the next report carries the larger count anyway.
* **ModelConsolidated** (:func:`announcement_problem`): its key is ``model_key(job,
  round)`` [bad_key]; it weighs at least one copy, each once, every weight finite in
  [0, 1], summing to 1 within :data:`WEIGHT_TOLERANCE` [bad_weights]; every copy was
  assigned in that round [unassigned] and reports at most its budget [over_budget].
* **JobCompleted**: its key is ``final_key(job)`` [bad_key]; the job is known
  [unassigned], has a consolidated model, its consolidated steps reach its iterations
  and equal the event's total [inconsistent].
* A report held for its Assignment that cannot be held (the buffer is full) [overflow].
* **JobCancelled**: it names no user or the job's owner (:mod:`shared.domain.ownership`) [not_owner].
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from shared.domain.layout import checkpoint_key, final_key, model_key
from shared.persistence.codec import snapshot_type
from shared.wire.events import (
    CopyFinished,
    Event,
    JobCompleted,
    ModelConsolidated,
    Progress,
)

__all__ = [
    "RefusalReason", "REFUSAL_REASONS", "ROUND_LEAD", "WEIGHT_TOLERANCE", "Problem", "Refusal",
    "CopyPlacement", "report_problem", "announcement_problem", "completion_problem",
]

RefusalReason = Literal["bad_key", "unassigned", "wrong_node", "over_budget", "future_round", "bad_weights",
                        "inconsistent", "overflow", "not_owner"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = get_args(RefusalReason)
ROUND_LEAD = 2
WEIGHT_TOLERANCE = 1e-6


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Why an event is refused: a label from :data:`REFUSAL_REASONS` and a one-line detail."""

    reason: RefusalReason
    detail: str


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """A refused event, with the ``origin`` it was applied with (opaque to the state)."""

    event: Event
    reason: RefusalReason
    detail: str
    origin: object = None


@snapshot_type("tracker.CopyPlacement", formerly="services.tracker.acceptance.CopyPlacement")
@dataclass(frozen=True, kw_only=True)
class CopyPlacement:
    """What the Assignments of one copy in one round say: its nodes, the nodes hosting
    rank 0 (one, unless the placements themselves disagree), its step budget and its
    ``workers`` (world size k, at most the job's W): one of its steps is k worker-steps."""

    nodes: frozenset[str]
    reporters: frozenset[str]
    budget: int
    workers: int = 1


def key_problem(event: CopyFinished) -> Problem | None:
    """A checkpoint that is not the copy's own key (checked before anything else: a key
    is wrong whatever the placements turn out to be)."""
    expected = checkpoint_key(event.job_id, event.round, event.copy, node=event.node_id)
    if event.checkpoint is not None and event.checkpoint != expected:
        return Problem(reason="bad_key", detail=f"checkpoint {event.checkpoint[:120]!r} is not {expected!r}")
    return None


def report_problem(event: CopyFinished | Progress, placement: CopyPlacement) -> Problem | None:
    """Why a report of a placed copy is refused, or None; see the module rules."""
    if isinstance(event, CopyFinished):
        problem = key_problem(event)
        if problem is not None:
            return problem
    from_any_node = isinstance(event, CopyFinished) and event.status == "failed"
    allowed = placement.nodes if from_any_node else placement.reporters
    if event.node_id not in allowed:
        role = "its nodes" if from_any_node else "the node of its rank 0"
        return Problem(reason="wrong_node", detail=f"copy {event.copy} reported by {event.node_id!r}, not by "
                                                   f"{role} {sorted(allowed)}")
    if event.steps_round > placement.budget:
        return Problem(reason="over_budget", detail=f"copy {event.copy} claims {event.steps_round} steps, "
                                                    f"over its budget of {placement.budget}")
    return None


def future_problem(round_: int, latest: int) -> Problem | None:
    if round_ > latest + ROUND_LEAD:
        return Problem(reason="future_round", detail=f"round {round_} is more than {ROUND_LEAD} past the "
                                                     f"latest round known ({latest})")
    return None


def announcement_problem(event: ModelConsolidated, placements: Mapping[int, CopyPlacement] | None
                         ) -> Problem | None:
    """Why a round model's announcement is refused, or None. ``placements``: the round's
    placed copies (None: the tracker knows no placement of the job in that round)."""
    expected = model_key(event.job_id, event.round)
    if event.key != expected:
        return Problem(reason="bad_key", detail=f"key {event.key[:120]!r} is not {expected!r}")
    problem = weights_problem(event)
    if problem is not None:
        return problem
    if placements is None:
        return Problem(reason="unassigned", detail=f"job {event.job_id!r} has no placement in round {event.round}")
    for weighed in event.copies:
        placement = placements.get(weighed.copy)
        if placement is None:
            return Problem(reason="unassigned", detail=f"copy {weighed.copy} was not placed in round {event.round}")
        if weighed.steps > placement.budget:
            return Problem(reason="over_budget", detail=f"copy {weighed.copy} weighed with {weighed.steps} steps, "
                                                        f"over its budget of {placement.budget}")
    return None


def weights_problem(event: ModelConsolidated) -> Problem | None:
    copies = [c.copy for c in event.copies]
    if not copies:
        return Problem(reason="bad_weights", detail="no copy weighed")
    if len(set(copies)) != len(copies):
        return Problem(reason="bad_weights", detail=f"a copy weighed twice: {copies[:16]}")
    weights = [c.weight for c in event.copies]
    if not all(math.isfinite(w) and 0.0 <= w <= 1.0 for w in weights):
        return Problem(reason="bad_weights", detail=f"a weight outside [0, 1]: {weights[:16]}")
    total = math.fsum(weights)
    if abs(total - 1.0) > WEIGHT_TOLERANCE:
        return Problem(reason="bad_weights", detail=f"weights sum to {total!r}, not 1")
    return None


def completion_problem(event: JobCompleted, *, known: bool, iterations: int | None, has_model: bool,
                       consolidated_steps: int) -> Problem | None:
    """Why a job's completion is refused, or None; see the module rules."""
    expected = final_key(event.job_id)
    if event.final_key != expected:
        return Problem(reason="bad_key", detail=f"final key {event.final_key[:120]!r} is not {expected!r}")
    if not known:
        return Problem(reason="unassigned", detail=f"job {event.job_id!r} is not known")
    if iterations is None or not has_model or consolidated_steps < iterations:
        return Problem(reason="inconsistent", detail=f"job has {consolidated_steps} consolidated steps of "
                                                     f"{iterations} iterations (model: {has_model})")
    if event.total_steps != consolidated_steps:
        return Problem(reason="inconsistent", detail=f"total_steps {event.total_steps} is not the job's "
                                                     f"{consolidated_steps} consolidated steps")
    return None
