"""The one deadline rule (shared/domain/deadline.py) and both services calling it (issue 13 item 6).

The scheduler used to give up on a round ``consolidation_wait_s`` (60 s) after its end
while the tracker waited ``finish_timeout_s`` (120 s) past the deadline for a missing copy,
so the next round started from the older model and the late round's work was retrained.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.config import SchedulerConfig
from services.tracker.config import TrackerConfig
from shared.domain.deadline import (
    CONSOLIDATION_WAIT_S,
    LATE_COPY_S,
    copies_given_up_at,
    next_round_gives_up_at,
)

waits = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(deadline=st.floats(min_value=0, max_value=1e10), late=waits, wait=waits)
def test_scheduler_never_gives_up_before_the_tracker(deadline, late, wait):
    tracker = copies_given_up_at(deadline, late_copy_s=late)
    scheduler = next_round_gives_up_at(deadline, late_copy_s=late, consolidation_wait_s=wait)
    assert tracker >= deadline
    assert scheduler >= tracker
    assert scheduler == pytest.approx(deadline + late + wait)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_bad_waits_are_refused(bad):
    with pytest.raises(ValueError, match="late_copy_s"):
        copies_given_up_at(0.0, late_copy_s=bad)
    with pytest.raises(ValueError, match="consolidation_wait_s"):
        next_round_gives_up_at(0.0, late_copy_s=1.0, consolidation_wait_s=bad)


def test_both_services_default_to_the_same_late_copy_wait():
    """Both configs carry the rule's inputs with the same defaults: out of the box the
    scheduler waits for every round the tracker may still decide."""
    scheduler, tracker = SchedulerConfig(), TrackerConfig()
    assert scheduler.late_copy_s == tracker.finish_timeout_s == LATE_COPY_S
    assert scheduler.consolidation_wait_s == CONSOLIDATION_WAIT_S
    assert next_round_gives_up_at(100.0, late_copy_s=scheduler.late_copy_s,
                                  consolidation_wait_s=scheduler.consolidation_wait_s) \
        > copies_given_up_at(100.0, late_copy_s=tracker.finish_timeout_s)


def test_scheduler_waits_for_a_late_round_as_long_as_the_tracker_may_decide_it():
    """Round 0 ends at t0 + 10; a copy is missing. The tracker decides the round at
    t0 + 10 + late_copy_s, so the scheduler must still be waiting then, and give up only
    ``consolidation_wait_s`` later -- counted from the round's deadline, not from when the
    scheduler happened to wake."""
    import asyncio

    from services.scheduler.live.service import SchedulerService
    from shared.bus import MemoryBus
    from shared.clock import FakeClock
    from shared.wire.events import GpuInfo, JobSpec, JobSubmitted, NodeRegistered

    clock = FakeClock()
    t0 = clock.time()
    config = SchedulerConfig(policy="yarn-cs", round_s=10, heartbeat_s=1000, late_copy_s=40,
                             consolidation_wait_s=20)

    async def scenario() -> tuple[float, float, float]:
        bus = MemoryBus()
        await bus.start()
        service = SchedulerService(bus=bus, config=config, clock=clock, run_rounds=False)
        service.state.apply(NodeRegistered(ts=t0, source="agent", node_id="n1",
                                           gpus=(GpuInfo(index=0, type="v100"),)))
        spec = JobSpec(job_id="j1", user="u", model="resnet", dataset="digits", batch_size=32, workers=1,
                       iterations=100)
        service.state.apply(JobSubmitted(ts=t0, source="cli", job=spec, submitted_at=t0))
        await service.plan_round()
        return (service.wait_left(0, now=t0 + 10), service.wait_left(0, now=t0 + 10 + 40),
                service.wait_left(0, now=t0 + 10 + 60))

    at_deadline, at_tracker_give_up, after = asyncio.run(scenario())
    assert at_deadline == pytest.approx(60)
    assert at_tracker_give_up == pytest.approx(20)
    assert after == 0
