"""Where a restarted scheduler continues, as a pure function of what it read at start.

At start the scheduler reads its topics -- from the offsets its newest valid snapshot
covers, or from the beginning -- and calls :func:`resume` with that log, the state it
starts from (the snapshot's, or empty) and the snapshot's body. :func:`resume` folds the
log into the state and re-derives every recorded round after the snapshot with the
settings that round recorded (:func:`services.scheduler.live.rerun.rerun`), so a restart ends
with the same state and the same carried plan as a scheduler that never stopped.

Guarantees:

* Rounds out of sequence (a forged or duplicated RoundStarted) are reported and change
  neither the next round number nor the carried plan.
* The last plan is carried into the next round only when the configured policy and
  options equal those the last round recorded; otherwise the change is reported and the
  next round is planned afresh (a policy's carried state means nothing to another policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.scheduler.core.policy import Plan
from services.scheduler.live.rerun import LoggedEvent, rerun
from services.scheduler.live.snapshot import SchedulerSnapshot
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice

__all__ = ["Resumed", "resume"]


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """What :func:`resume` decided. ``next_round`` is None when nothing was recorded (a
    first start). ``policy_changed_from`` describes the recorded policy when the configured
    one differs from it (None otherwise)."""

    next_round: int | None
    previous: Plan | None
    rederived: int
    differing_rounds: tuple[int, ...]
    out_of_sequence: tuple[int, ...]
    policy_changed_from: str | None


def resume(log: Sequence[LoggedEvent], *, state: SchedulerState, body: SchedulerSnapshot | None,
           configured: PolicyChoice) -> Resumed:
    """Fold ``log`` into ``state`` (in place) re-deriving the rounds after ``body``."""
    checks = list(rerun(log, state=state, first_round=body.next_round if body else None,
                        previous=body.previous if body else None,
                        previous_key=body.previous_key if body else None))
    ignored = tuple(c.round for c in checks if not c.in_sequence)
    checks = [c for c in checks if c.in_sequence]
    differing = tuple(c.round for c in checks if not c.matches)
    if checks:
        last = checks[-1]
        next_round: int | None = last.round + 1
        recorded_key = last.settings.choice.key if last.settings is not None else None
        plan = last.plan
        described = last.settings.choice.describe() if last.settings is not None else last.error
    elif body is not None:
        next_round, recorded_key, plan, described = body.next_round, body.previous_key, body.previous, \
            str(body.previous_key)
    else:
        return Resumed(next_round=None, previous=None, rederived=0, differing_rounds=(),
                       out_of_sequence=ignored, policy_changed_from=None)
    carried = recorded_key is not None and recorded_key == configured.key
    return Resumed(next_round=next_round, previous=plan if carried else None, rederived=len(checks),
                   differing_rounds=differing, out_of_sequence=ignored,
                   policy_changed_from=None if carried else described)
