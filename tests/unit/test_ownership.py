"""Only a job's owner may cancel it (shared/domain/ownership.py), in every consumer that acts
on a cancellation: the scheduler's state, the tracker's state, the profiler (the agent's
admission: tests/unit/test_agent_admission.py)."""

from __future__ import annotations

import pytest

from services.scheduler.live.state import SchedulerState
from services.tracker.state import TrackerState
from shared.bus.rejection import Rejected
from shared.domain.ownership import cancel_refusal
from shared.wire.events import JobCancelled, JobSpec, JobSubmitted

SPEC = JobSpec(job_id="j1", user="alice", model="resnet", dataset="digits", batch_size=8, workers=1, iterations=10)


def cancel(user: str) -> JobCancelled:
    return JobCancelled(ts=2.0, source="cli", job_id="j1", user=user)


def submitted() -> JobSubmitted:
    return JobSubmitted(ts=1.0, source="cli", job=SPEC, submitted_at=1.0)


@pytest.mark.parametrize(("user", "owner", "refused"), [
    ("alice", "alice", False), ("", "alice", False), ("bob", None, False), ("bob", "alice", True)])
def test_only_another_named_user_is_refused(user: str, owner: str | None, refused: bool) -> None:
    reason = cancel_refusal(cancel(user), owner)
    assert (reason is not None) == refused
    if refused:
        assert reason == "user 'bob' may not cancel job 'j1' of user 'alice'"


def test_the_scheduler_refuses_another_users_cancellation_and_keeps_the_job() -> None:
    state = SchedulerState()
    state.apply(submitted())
    with pytest.raises(Rejected, match="'bob' may not cancel"):
        state.apply(cancel("bob"))
    assert not state.jobs["j1"].cancelled
    state.apply(cancel("alice"))
    assert state.jobs["j1"].cancelled


def test_the_tracker_refuses_another_users_cancellation_and_keeps_the_job() -> None:
    state = TrackerState()
    state.apply(submitted())
    assert state.apply(cancel("bob"), origin="o") is False
    (refusal,) = state.drain_refusals()
    assert (refusal.reason, refusal.origin) == ("not_owner", "o") and "'bob' may not cancel" in refusal.detail
    assert state.apply(cancel("alice")) is True
