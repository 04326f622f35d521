"""Where a restarted scheduler continues (services/scheduler/live/recovery.py), without a bus."""

from __future__ import annotations

from services.scheduler.core.policy import Placement, Plan
from services.scheduler.live.recovery import resume
from services.scheduler.live.snapshot import SchedulerSnapshot
from services.scheduler.live.state import SchedulerState
from services.scheduler.policies import PolicyChoice

HADAR = PolicyChoice(name="hadar")
PLAN = Plan(placements=(Placement(job_id="j", copy=0, node_id="n", gpus=(0,)),))


def _body(choice: PolicyChoice, *, next_round: int = 7) -> SchedulerSnapshot:
    return SchedulerSnapshot(state=SchedulerState(), previous=PLAN, previous_key=choice.key, next_round=next_round)


def test_a_first_start_records_nothing_and_carries_nothing() -> None:
    resumed = resume([], state=SchedulerState(), body=None, configured=HADAR)
    assert resumed.next_round is None and resumed.previous is None and resumed.rederived == 0
    assert resumed.policy_changed_from is None


def test_a_snapshot_with_nothing_after_it_continues_where_it_stopped_with_its_plan() -> None:
    resumed = resume([], state=SchedulerState(), body=_body(HADAR), configured=HADAR)
    assert (resumed.next_round, resumed.previous, resumed.policy_changed_from) == (7, PLAN, None)


def test_another_policy_or_options_continue_the_numbering_but_not_the_plan() -> None:
    for configured in (PolicyChoice(name="gavel"), PolicyChoice(name="hadar", options={"critical": False})):
        resumed = resume([], state=SchedulerState(), body=_body(HADAR), configured=configured)
        assert resumed.next_round == 7 and resumed.previous is None
        assert resumed.policy_changed_from is not None
