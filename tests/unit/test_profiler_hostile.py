"""The profiler survives hostile Progress and failing handlers (issue 12): no infinite or
absurd rate is ever published, and a handler error dead-letters the event instead of
ending the consumer."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from services.profiler.service import ProfilerConfig, ProfilerService
from services.profiler.state import MAX_RATE, ProfilerState
from shared.bus import MemoryBus
from shared.clock import FakeClock
from shared.wire.events import DeadLetter, JobSpec, JobSubmitted, Progress
from shared.wire.topics import DEADLETTER, JOBS, THROUGHPUT

T0 = 1_700_000_000.0
SPEC = JobSpec(job_id="j1", user="u", model="resnet", dataset="digits", batch_size=32, workers=1, iterations=100)


def progress(ts: float, steps: int, samples_per_s: float = 0.0) -> Progress:
    return Progress(ts=ts, source="agent", job_id="j1", round=0, copy=0, node_id="n1", gpu_type="t4", workers=1,
                    steps_round=steps, steps_total=steps, samples_per_s=samples_per_s, loss=0.5)


def test_timestamps_a_denormal_apart_give_no_sample():
    state = ProfilerState()
    state.add_job(SPEC)
    state.observe(progress(0.0, 0))
    assert state.observe(progress(5e-324, 100)) is None
    assert state.rate("j1", "t4", 1) is None


def test_an_absurd_samples_per_second_is_not_a_rate():
    state = ProfilerState()
    state.add_job(SPEC)
    assert state.observe(progress(T0, 0, samples_per_s=1e308)) is None
    assert state.observe(progress(T0 + 1, 10**15)) is None     # 10^15 steps in a second
    update = state.observe(progress(T0 + 2, 10**15 + 40))
    assert update is not None and math.isfinite(update.rate) and 0 < update.rate <= MAX_RATE


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_handler_error_dead_letters_the_event_and_the_consumer_goes_on():
    bus = MemoryBus(clock=FakeClock(T0))
    await bus.start()
    calls = []

    def estimator(spec: JobSpec) -> dict[str, float]:
        calls.append(spec.job_id)
        if spec.job_id == "bad":
            raise ZeroDivisionError("estimator bug")
        return {"t4": 2.0}

    service = ProfilerService(bus=bus, config=ProfilerConfig(group="prof"), clock=FakeClock(T0), estimator=estimator)
    await service.start()
    try:
        bad = JobSubmitted(ts=T0, source="cli", job=dataclasses.replace(SPEC, job_id="bad"), submitted_at=T0)
        await bus.publish(bad)
        await bus.publish(progress(0.0, 0))
        await bus.publish(progress(5e-324, 100))
        await bus.publish(JobSubmitted(ts=T0, source="cli", job=SPEC, submitted_at=T0))

        async def estimated() -> bool:
            return any([d.event.job_id == "j1" async for d in bus.read(THROUGHPUT)])
        await _until(estimated)
        assert service.health()["ok"]
        letters = [d.event async for d in bus.read(DEADLETTER)]
        assert len(letters) == 1 and isinstance(letters[0], DeadLetter)
        assert letters[0].topic == JOBS and "ZeroDivisionError" in letters[0].reason
        assert service.registry.get_sample_value("hadar_profiler_events_rejected_total") == 1
    finally:
        await service.stop()
        await bus.stop()


class HostileProgress(RuleBasedStateMachine):
    """Progress reports in any order with extreme values: observe never raises, and every
    rate it decides to publish is finite, positive and at most MAX_RATE."""

    def __init__(self) -> None:
        super().__init__()
        self.state = ProfilerState()
        self.state.add_job(SPEC)

    @rule(ts=st.floats(min_value=0, max_value=2e9, allow_nan=False) | st.sampled_from([0.0, 5e-324, T0]),
          steps=st.integers(0, 2**63 - 1), samples=st.floats(min_value=0, max_value=1e308, allow_nan=False),
          round_=st.integers(0, 3), copy=st.integers(0, 2))
    def report(self, ts, steps, samples, round_, copy):
        p = Progress(ts=ts, source="agent", job_id="j1", round=round_, copy=copy, node_id="n1", gpu_type="t4",
                     workers=1, steps_round=steps, steps_total=steps, samples_per_s=samples, loss=0.5)
        update = self.state.observe(p)
        if update is not None:
            assert math.isfinite(update.rate) and 0 <= update.rate <= MAX_RATE

    @invariant()
    def smoothed_rates_are_sane(self):
        rate = self.state.rate("j1", "t4", 1)
        assert rate is None or (math.isfinite(rate) and 0 <= rate <= MAX_RATE)


TestHostileProgress = HostileProgress.TestCase
TestHostileProgress.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
