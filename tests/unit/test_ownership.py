"""Only a job's owner may cancel it (shared/domain/ownership.py), in every consumer that acts
on a cancellation: the scheduler's state, the tracker's state, the profiler service (the
agent's admission: tests/unit/test_agent_admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.profiler.service import ProfilerConfig, ProfilerService
from services.scheduler.live.state import SchedulerState
from services.tracker.state import TrackerState
from shared.bus import MemoryBus
from shared.bus.rejection import Rejected
from shared.clock import FakeClock
from shared.domain.ownership import cancel_refusal
from shared.wire.events import DeadLetter, JobCancelled, JobSpec, JobSubmitted
from shared.wire.topics import DEADLETTER

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


async def test_the_profiler_refuses_another_users_cancellation_and_keeps_the_job() -> None:
    bus = MemoryBus(clock=FakeClock(1.0))
    await bus.start()
    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(1.0),
                              estimator=lambda spec: {"t4": 1.0}, sizer=lambda spec: (1000, 2))
    await service.start()
    try:
        await bus.publish(submitted())
        await bus.publish(cancel("bob"))
        for _ in range(300):
            letters = [d.event async for d in bus.read(DEADLETTER) if isinstance(d.event, DeadLetter)]
            if letters:
                break
            await asyncio.sleep(0.01)
        assert len(letters) == 1 and "'bob' may not cancel job 'j1'" in letters[0].reason
        assert service.state.spec("j1") == SPEC
        await bus.publish(cancel("alice"))
        for _ in range(300):
            if service.state.spec("j1") is None:
                break
            await asyncio.sleep(0.01)
        assert service.state.spec("j1") is None
    finally:
        await service.stop()
        await bus.stop()
